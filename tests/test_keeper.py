"""The fleet's keeper on simulated servers behind the real router: a killed server is taken out of the router,
restarted and put back with no request of the job lost; a crash loop ends the restarts; a process that is not the
fleet's on a dead server's port never gets a request; ``fleet down`` stops the keeper first; ``watch`` says when a
server is down. The first tests need neither the router nor a server."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from test_router import Load, needs_router, routed_fleet, run_cli, stop_all

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fleet_faults import Foreign, cut_streams, failures, kill  # noqa: E402

from autotune.cli import cli
from autotune.deploy import keeper, keeperproc, router
from autotune.deploy.fleet import load_fleet, write_fleet
from autotune.deploy.fleetfile import KeeperSection
from autotune.deploy.fleetlog import FleetLog
from autotune.deploy.rolloutlog import locked
from autotune.errors import FleetError

FAST = KeeperSection(interval_s=0.2, backoff_s=[0.2], crash_limit=3, unresponsive_s=5.0)


@pytest.fixture(autouse=True)
def sim_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))


# -- no server ------------------------------------------------------------------------------------------
def test_the_fleets_lock_names_its_holder_to_whoever_waits_in_vain(tmp_path):
    fleet = load_fleet(routed_fleet(tmp_path, n=2))
    with locked(fleet, holder="the fleet's keeper"):
        with pytest.raises(FleetError, match=r"the fleet's keeper \(pid \d+\) holds .*fleet.toml.*run this again"):
            with locked(fleet, holder="a rollout", wait_s=0.2):
                pass
    with locked(fleet, holder="a rollout"):  # let go: the next one takes it at once
        pass


def test_the_keeper_section_defaults_and_refuses_a_negative_backoff(tmp_path):
    fleet = load_fleet(routed_fleet(tmp_path, n=2))
    assert fleet.keeper.keep and fleet.keeper.crash_limit == 3 and fleet.keeper.backoff_s == [5.0, 30.0, 120.0]
    with pytest.raises(ValueError, match="backoff_s: seconds are 0 or more"):
        KeeperSection(backoff_s=[1.0, -2.0])


def test_a_keeper_with_nothing_of_the_fleet_running_exits_and_says_so(tmp_path, monkeypatch):
    path = routed_fleet(tmp_path, n=2)
    write_fleet(load_fleet(path).model_copy(update={"keeper": FAST}), path)
    monkeypatch.setattr(keeper, "IDLE_LIMIT_S", 0.5)
    done = threading.Thread(target=keeper.Keeper(path).run, daemon=True)
    done.start()
    done.join(timeout=20)
    assert not done.is_alive()
    last = events(path)[-1]
    assert last["event"] == "keeper_stop" and "nothing of the fleet has run for 0.5 s" in last["line"]


# -- the real router ------------------------------------------------------------------------------------
def events(path: Path, kind: str | None = None, server: str | None = None) -> list[dict]:
    return [
        e
        for e in FleetLog.of(load_fleet(path)).events()
        if (kind is None or e["event"] == kind) and (server is None or e.get("server") == server)
    ]


def wait_event(path: Path, kind: str, server: str | None = None, *, count: int = 1, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while len(found := events(path, kind, server)) < count:
        assert time.monotonic() < deadline, f"no {kind} event after {timeout_s} s: {events(path)}"
        time.sleep(0.05)
    return found[count - 1]


def server_pid(path: Path, name: str) -> int:
    fleet = load_fleet(path)
    return int(fleet.resolve(fleet.server(name).pid).read_text().split()[0])


def lost(done: list[dict], kills: list[tuple[float, float]]) -> list[dict]:
    """Failed requests other than streams a kill cut (``fleet_faults.cut_streams``): the fleet's fault."""
    cut = cut_streams(done, kills)
    return [r for r in done if not r["ok"] and r not in cut]


def listed(record: router.Record) -> set[str]:
    return {w["url"] for w in router.workers(record)}


@contextmanager
def kept_fleet(tmp_path: Path, keeper: KeeperSection = FAST) -> Iterator[tuple[Path, router.Record]]:
    """Three simulated servers behind the router with a fast keeper, brought up by ``fleet up``; all stopped after."""
    path = routed_fleet(tmp_path)
    write_fleet(load_fleet(path).model_copy(update={"keeper": keeper}), path)
    try:
        out = run_cli("fleet", "up", "--fleet", str(path), "--timeout", "60")
        assert "keeper: pid" in out
        record = router.running(load_fleet(path))
        assert record is not None
        yield path, record
    finally:
        stop_all(path)


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_server_killed_under_load_is_restarted_and_readmitted_losing_no_request(tmp_path):
    with kept_fleet(tmp_path) as (path, record):
        fleet = load_fleet(path)
        s1 = fleet.server("s1")
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=24, max_tokens=16)
        load.wait_for(30)
        # the server's last words are a CUDA OOM while it served: its death is read from its log
        with open(fleet.resolve(s1.log), "a") as log:
            log.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB\n")
        old = server_pid(path, "s1")
        kills = [kill(path, "s1")]
        died = wait_event(path, "exited", "s1")
        assert died["cause"] == "runtime_oom" and "the config's worst case failed in production" in died["line"]
        assert f"autotune apply --rollback --fleet {path}" in died["line"] and "out of the router" in died["line"]
        back = wait_event(path, "restarted", "s1")
        assert "back in the router" in back["line"] and back["capacity"]["max_running_requests"] == 24
        assert server_pid(path, "s1") != old and s1.url in listed(record)
        done_before = len(load.records())
        load.wait_for(done_before + 30)  # the job goes on over all three
        done = load.stop()
        assert done and not lost(done, kills), lost(done, kills)[:3]
        assert {r["url"] for r in done} == {record.url}
        text = run_cli("fleet", "status", "--fleet", str(path))
        assert "keeper: running (pid" in text and "s1: exited (runtime_oom" in text and "s1: serving again" in text

        # a server stopped on purpose stays stopped; watch says a third of the fleet is not serving
        run_cli("fleet", "down", "--fleet", str(path), "--server", "s2")
        time.sleep(1.0)  # five of the keeper's looks
        assert not events(path, "exited", "s2") and load_fleet(path).server("s2").url not in listed(record)
        watched = CliRunner().invoke(cli, ["watch", "--fleet", str(path), "--once"])
        assert watched.exit_code == 2, watched.output
        assert "s2 (localhost, port" in watched.output and "down, not serving" in watched.output

        # fleet down stops the keeper first, and returns once it has exited
        kept = keeperproc.running(load_fleet(path))
        assert kept is not None
        out = run_cli("fleet", "down", "--fleet", str(path))
        assert "keeper stopped" in out and not kept.alive() and keeperproc.read_record(load_fleet(path)) is None
        assert events(path, "keeper_stop")


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_crash_loop_ends_the_restarts_with_one_line_and_the_job_loses_nothing(tmp_path):
    with kept_fleet(tmp_path, FAST.model_copy(update={"crash_limit": 2, "crash_window_s": 120.0})) as (path, record):
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=16, max_tokens=16)
        load.wait_for(20)
        kills = []
        for death in (1, 2, 3):
            wait_event(path, "restarted", "s0", count=death - 1) if death > 1 else None
            kills.append(kill(path, "s0"))
            wait_event(path, "exited", "s0", count=death)
        gave_up = wait_event(path, "gave_up", "s0")
        assert "died 3 times in 120 s" in gave_up["line"] and "crash loop" in gave_up["line"]
        assert f"autotune fleet up --server s0 --fleet {path}" in gave_up["line"]
        time.sleep(1.0)
        assert len(events(path, "restarted", "s0")) == 2 and load_fleet(path).server("s0").url not in listed(record)
        load.wait_for(len(load.records()) + 20)
        done = load.stop()
        assert not lost(done, kills), lost(done, kills)[:3]


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_foreign_server_on_a_dead_servers_port_is_sent_nothing_and_the_server_returns_once_it_is_free(tmp_path):
    # the restart waits 5 s: the foreign server binds the port well before it, however loaded the host
    with kept_fleet(tmp_path, FAST.model_copy(update={"backoff_s": [5.0]})) as (path, record):
        s1 = load_fleet(path).server("s1")
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=16, max_tokens=16)
        load.wait_for(20)
        kills = [kill(path, "s1")]
        wait_event(path, "exited", "s1")
        assert s1.url not in listed(record)
        foreign = Foreign(s1.port)  # another tenant binds the free port before the restart
        try:
            said = wait_event(path, "foreign", "s1")
            assert f"port {s1.port} is held by a process that is not this fleet's" in said["line"]
            load.wait_for(len(load.records()) + 40)
            assert foreign.counts["requests"] == 0 and s1.url not in listed(record)
            assert "foreign" in run_cli("fleet", "status", "--fleet", str(path))
        finally:
            foreign.close()
        wait_event(path, "restarted", "s1")
        assert s1.url in listed(record)
        done = load.stop()
        assert not lost(done, kills), lost(done, kills)[:3]


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_keeper_per_fleet_and_a_rollout_waits_for_the_keepers_look(tmp_path):
    with kept_fleet(tmp_path) as (path, _):
        kept = keeperproc.running(load_fleet(path))
        assert kept is not None and psutil.pid_exists(kept.pid)
        second = CliRunner().invoke(cli, ["fleet", "keep", "--fleet", str(path)])
        assert isinstance(second.exception, FleetError)
        assert f"a keeper of {path} already runs (pid {kept.pid})" in str(second.exception)
        # the keeper holds the lock for moments each look: a rollout's lock waits them out
        for _ in range(20):
            with locked(load_fleet(path), holder="a rollout", wait_s=5.0):
                pass
        # a router that dies is started again on the fleet's serving servers (the job's one URL)
        first = router.running(load_fleet(path))
        assert first is not None
        os.killpg(first.pid, signal.SIGKILL)
        said = wait_event(path, "restarted")
        assert said["line"].startswith("the router exited: started again (pid") and "on 3 serving" in said["line"]
        again = router.running(load_fleet(path))
        assert again is not None and again.pid != first.pid and again.url == first.url
        assert len([w for w in router.workers(again) if w["is_healthy"]]) == 3


def test_the_fault_benchmark_counts_streams_cut_by_a_kill_apart_from_every_other_failure(monkeypatch):
    records = [
        {"ok": False, "endpoint": "/generate stream", "start": 9.0, "end": 10.5},  # cut by the kill at 10
        {"ok": False, "endpoint": "/generate", "start": 9.0, "end": 10.5},  # not a stream: the router's to keep
        {"ok": False, "endpoint": "/v1/completions stream", "start": 11.0, "end": 11.5},  # after the kill
        {"ok": True, "endpoint": "/generate stream", "start": 9.0, "end": 12.0},
    ]
    assert failures(records, [(10.0, 10.001)]) == (1, 2)
