# Start a PostgreSQL cluster listening on 127.0.0.1 only, and export AUTOTUNE_TEST_POSTGRES for the tests.
start_postgres() {
  local version
  version=$(ls /usr/lib/postgresql | sort -V | tail -n1)
  local bin="/usr/lib/postgresql/${version}/bin"
  local data="${TMPDIR:-/tmp}/autotune-ci-pg"
  # A cluster left by an earlier run on this machine holds the port: stop it before starting afresh.
  if [ -f "$data/postmaster.pid" ]; then
    su postgres -c "$bin/pg_ctl -D '$data' -m immediate -w stop" >/dev/null 2>&1 || true
  fi
  rm -rf "$data"
  mkdir -p "$data"
  chown postgres "$data"
  su postgres -c "$bin/initdb -D '$data' -A trust -U postgres >/dev/null"
  su postgres -c "$bin/pg_ctl -D '$data' -o \"-c listen_addresses=127.0.0.1 -c port=55432 -k '$data'\" -l '$data/log' -w start >/dev/null"
  export AUTOTUNE_TEST_POSTGRES="postgresql+psycopg2://postgres@127.0.0.1:55432/postgres"
}
