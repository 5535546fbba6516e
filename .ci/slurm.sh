# Start a single-node Slurm cluster on this host (munge, slurmctld, slurmd; no systemd) and export
# AUTOTUNE_TEST_SLURM=1 for the tests. Rerunning stops what an earlier run started and starts afresh.
#
# The node is this host with its real CPUs and memory, in partition `debug` (jobs may share CPUs: test servers
# are small); it also declares four GPUs backed by empty files, so `sbatch --gres=gpu:N` schedules on a machine
# without any. Slurm sets no CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS for them: the Slurm launcher then selects the
# spec's GPUs itself.
# No slurmdbd: finished jobs stay visible to `scontrol show job` for MinJobAge seconds, which is where the
# launcher reads a job's exit code when `sacct` has no accounting to read.
SLURM_CI_DIR="${SLURM_CI_DIR:-/var/lib/autotune-ci-slurm}"

# Running and not a zombie (an init that reaps nothing leaves exited daemons as zombies, which kill -0 still finds).
_slurm_running() {
  [ -r "/proc/$1/stat" ] && ! awk '{ sub(/^[0-9]+ \(.*\) /, ""); exit ($1 == "Z" ? 0 : 1) }' "/proc/$1/stat"
}

_slurm_stop_pidfile() {
  local file="$1" pid i
  [ -f "$file" ] || return 0
  pid=$(cat "$file" 2>/dev/null || true)
  if [ -n "$pid" ] && _slurm_running "$pid"; then
    kill "$pid" 2>/dev/null || true
    for i in $(seq 50); do _slurm_running "$pid" || break; sleep 0.1; done
    _slurm_running "$pid" && kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

stop_slurm() {
  # Jobs first (their steps outlive slurmd), then the daemons, each by its own pid file.
  if [ -f "$SLURM_CI_DIR/slurmctld.pid" ] && command -v scancel >/dev/null 2>&1; then
    timeout 5 scancel --full --user=root >/dev/null 2>&1 || true
    sleep 0.5
  fi
  _slurm_stop_pidfile "$SLURM_CI_DIR/slurmd.pid"
  _slurm_stop_pidfile "$SLURM_CI_DIR/slurmctld.pid"
  if [ -S /run/munge/munge.socket.2 ]; then
    runuser -u munge -- /usr/sbin/munged --stop >/dev/null 2>&1 || true  # the daemon bound to the socket
  fi
  _slurm_stop_pidfile /run/munge/munged.pid
}

_slurm_write_conf() {
  local host cpus mem
  host=$(uname -n)
  host=${host%%.*}  # slurmd's own short name (hostname -s, without needing the hostname package)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
  mkdir -p /etc/slurm
  cat >/etc/slurm/slurm.conf <<EOF
# Written by autotune's .ci/slurm.sh: a single-node test cluster.
ClusterName=autotune-ci
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=${SLURM_CI_DIR}/state
SlurmdSpoolDir=${SLURM_CI_DIR}/spool
SlurmctldPidFile=${SLURM_CI_DIR}/slurmctld.pid
SlurmdPidFile=${SLURM_CI_DIR}/slurmd.pid
SlurmctldLogFile=${SLURM_CI_DIR}/slurmctld.log
SlurmdLogFile=${SLURM_CI_DIR}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=600
KillWait=5
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
GresTypes=gpu
NodeName=${host} CPUs=${cpus} RealMemory=${mem} Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE OverSubscribe=FORCE:8 State=UP
EOF
  # Slurm 22.05 counts no GPU without File= (the node drains: "gres/gpu count reported lower than configured"),
  # so the four GPUs are empty regular files: with task/none nothing is bound, but Slurm sets the job's
  # CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS from their numbers.
  mkdir -p "$SLURM_CI_DIR/dev"
  touch "$SLURM_CI_DIR"/dev/nvidia{0,1,2,3}
  cat >/etc/slurm/gres.conf <<EOF
NodeName=${host} Name=gpu File=${SLURM_CI_DIR}/dev/nvidia[0-3]
EOF
}

start_slurm() {
  stop_slurm
  # munge: a key (Debian's package makes one; a bare machine may not have it) and its socket directory.
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force >/dev/null
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged

  rm -rf "$SLURM_CI_DIR"
  mkdir -p "$SLURM_CI_DIR/state" "$SLURM_CI_DIR/spool"
  _slurm_write_conf
  slurmctld
  slurmd

  local i
  for i in $(seq 100); do
    case "$(sinfo -h -N -o %T 2>/dev/null)" in
      idle*|mix*|alloc*) break ;;
      drain*|inval*) break ;;  # srun below fails at once and prints why
    esac
    sleep 0.2
  done
  if ! timeout 20 srun --immediate=10 -N1 -n1 hostname >/dev/null; then
    echo "slurm: srun -N1 -n1 hostname failed; logs in $SLURM_CI_DIR" >&2
    tail -n 20 "$SLURM_CI_DIR/slurmctld.log" "$SLURM_CI_DIR/slurmd.log" >&2 || true
    return 1
  fi
  export AUTOTUNE_TEST_SLURM=1
}
