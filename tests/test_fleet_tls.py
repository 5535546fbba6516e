"""Only the fleet's servers get the job's requests: a fleet whose servers prove themselves with its own CA
(``deploy.fleettls``) behind the real router, no keeper; a process that takes a dead server's port at once, with
a certificate of its own or none, is sent nothing while the other servers serve on."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import httpx
import pytest
from test_router import Load, needs_router, routed_fleet, run_cli, stop_all

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fleet_faults import Foreign, cut_streams, kill, other_certificate  # noqa: E402

from autotune import tls
from autotune.deploy import fleettls, router
from autotune.deploy.fleet import Fleet, FleetServer, load_fleet, status, write_fleet
from autotune.launch.process import port_is_free
from autotune.launch.stopping import wait_until


@pytest.fixture(autouse=True)
def sim_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))


def tls_fleet(tmp_path: Path, n: int = 2) -> Path:
    path = routed_fleet(tmp_path, n=n)
    fleet = load_fleet(path)
    servers = [s.model_copy(update={"tls": True}) for s in fleet.servers]
    return write_fleet(fleet.model_copy(update={"servers": servers}), path)


def test_a_server_certificate_names_its_addresses_and_keys_are_the_users_alone(tmp_path):
    fleet = load_fleet(tls_fleet(tmp_path))
    s0 = fleet.servers[0]
    assert s0.url.startswith("https://127.0.0.1:") and fleettls.names(s0) == ["127.0.0.1", "localhost"]
    files = fleettls.server_files(fleet, s0)
    for key in (files.key, fleettls.folder(fleet) / "ca.key"):
        assert key.stat().st_mode & 0o077 == 0
    assert fleettls.folder(fleet).stat().st_mode & 0o077 == 0
    first = files.cert.read_bytes()
    assert fleettls.server_files(fleet, s0).cert.read_bytes() == first  # reused while its names and CA stand
    bound = s0.model_copy(update={"bind": "10.1.2.3"})
    assert fleettls.names(bound) == ["127.0.0.1", "localhost", "10.1.2.3"]
    assert fleettls.server_files(fleet, bound).cert.read_bytes() != first  # another address: issued again
    stale = fleettls.server_files(fleet, s0).cert.read_bytes()
    for name in ("ca.pem", "ca.key"):  # a new CA of the same name: what the old one signed is issued again
        (fleettls.folder(fleet) / name).unlink()
    assert fleettls.server_files(fleet, s0).cert.read_bytes() != stale
    remote = FleetServer(
        name="r", host="ops@gpu-box", gpus=[1], port=30001, bind="0.0.0.0", config="x", log="l", pid="p", tls=True
    )
    with pytest.raises(ValueError, match="tls needs the fleet's certificate on that host"):
        Fleet(engine="sim", model="m", servers=[remote])


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("foreign_tls", [True, False], ids=["foreign-https", "foreign-http"])
def test_a_process_on_a_dead_servers_port_is_sent_nothing_before_anything_notices(tmp_path, foreign_tls):
    path = tls_fleet(tmp_path)
    try:
        out = run_cli("fleet", "up", "--no-keeper", "--fleet", str(path), "--timeout", "60")
        assert "started: s0, s1" in out
        fleet = load_fleet(path)
        record = router.running(fleet)
        assert record is not None and "--ca-cert-paths" in record.argv
        s1 = fleet.server("s1")
        assert {w["url"] for w in router.workers(record)} == {s.url for s in fleet.servers}
        with pytest.raises(httpx.ConnectError):  # a client without the fleet's CA cannot talk to its servers
            httpx.get(f"{s1.url}/health", timeout=5, verify=httpx.create_ssl_context())
        assert httpx.get(f"{s1.url}/health", timeout=5, verify=tls.context()).status_code == 200
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=16, max_tokens=16)
        load.wait_for(20)
        kills = [kill(path, "s1")]
        assert wait_until(lambda: port_is_free("127.0.0.1", s1.port), 30.0)  # the dead process lets go of it
        foreign = Foreign(s1.port, tls=other_certificate(tmp_path, s1.port) if foreign_tls else None)
        try:
            load.wait_for(len(load.records()) + 60)
            assert foreign.counts["requests"] == 0
            assert s1.url in {w["url"] for w in router.workers(record)}  # nothing took it out: no keeper ran
            row = {r.name: r for r in status(load_fleet(path))}["s1"]
            assert not row.healthy and not row.running
        finally:
            foreign.close()
        done = load.stop()
        cut = cut_streams(done, kills)
        failed = [r for r in done if not r["ok"] and r not in cut]
        # requests the router tried on s1's port before its health check gave up on it fail at the handshake and
        # are the job's to retry (a keeper takes the server out within a second); none reached the foreign server
        assert len(failed) <= len(done) * 0.05, (len(failed), len(done), failed[:3])
        print(f"{len(done)} requests, {len(cut)} cut by the kill, {len(failed)} failed at the handshake")
    finally:
        stop_all(path)


def test_one_process_trusts_two_fleets_whose_folders_share_a_name(tmp_path):
    """OpenSSL finds an issuer by its name: two fleets in folders both called ``deploy`` once had CAs of one name, and
    a process that trusted both (a test worker, a ``watch`` of two fleets) refused the second fleet's servers."""
    import socket
    import ssl
    import threading

    def fleet_in(root: Path) -> Fleet:
        (root / "deploy").mkdir(parents=True)
        server = FleetServer(
            name="s0",
            host="localhost",
            gpus=[0],
            port=1,
            bind="127.0.0.1",
            config="x",
            log="l",
            pid="run/s0.pid",
            tls=True,
        )
        return load_fleet(write_fleet(Fleet(engine="sim", model="m", servers=[server]), root / "deploy" / "fleet.toml"))

    first, second = fleet_in(tmp_path / "a"), fleet_in(tmp_path / "b")
    files = [fleettls.server_files(f, f.servers[0]) for f in (first, second)]
    client = ssl.create_default_context()
    for fleet in (first, second):  # both trusted, as tls.trust does for every fleet file a process reads
        client.load_verify_locations(cafile=str(fleettls.ca_file(fleet)))
    for served in files:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(served.cert, served.key)
        with socket.create_server(("127.0.0.1", 0)) as listening:
            port = listening.getsockname()[1]

            def accept(listening=listening, server=server):
                conn, _ = listening.accept()
                with contextlib.suppress(OSError), server.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.recv(1)

            thread = threading.Thread(target=accept, daemon=True)
            thread.start()
            with socket.create_connection(("127.0.0.1", port)) as raw:
                with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls_conn:  # verifies, or raises
                    assert tls_conn.version() is not None
            thread.join(5)
