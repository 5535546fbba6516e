"""Tune in place: ``sweep --borrow`` lends one server of a running fleet (simulated servers behind the real router,
with its keeper) to a study and gives it back; nothing else moves meanwhile, and a SIGKILLed sweep's server comes
back through the keeper. The job's load runs through the router the whole time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_keeper import FAST, events, kept_fleet, listed, wait_event
from test_router import Load, needs_router, routed_fleet, run_cli
from tinystudy import write_tiny_study

from autotune.cli import cli
from autotune.deploy import rollout
from autotune.deploy.fleet import load_fleet, write_fleet
from autotune.deploy.lease import borrow
from autotune.deploy.leasefile import current
from autotune.errors import FleetError


@pytest.fixture(autouse=True)
def sim_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))


def test_only_a_serving_local_server_is_lent_and_nothing_is_written_otherwise(tmp_path):
    path = routed_fleet(tmp_path, n=2)
    with pytest.raises(FleetError, match="server s1 is not serving .*lend a serving one"):
        borrow(path, "s1", "tune")
    write_fleet(load_fleet(path).model_copy(update={"launcher": "slurm"}), path)
    with pytest.raises(FleetError, match="through the slurm launcher: only this host's local servers are lent"):
        borrow(path, "s1", "tune")
    assert current(load_fleet(path)) is None and not events(path)


def borrowing_sweep(tmp_path: Path, fleet: Path, server: str, trials: int = 2) -> subprocess.Popen[str]:
    (tmp_path / "study").mkdir(exist_ok=True)
    study = write_tiny_study(tmp_path / "study", name="inplace", trials=trials)
    return subprocess.Popen(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(study), "--borrow", server, "--fleet", str(fleet)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": os.environ["AUTOTUNE_SIM_DEVICE_DIR"]},
    )


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_study_on_a_lent_server_gives_it_back_and_nothing_else_moves_meanwhile(tmp_path):
    with kept_fleet(tmp_path) as (path, record):
        s1 = load_fleet(path).server("s1")
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=16, max_tokens=16)
        load.wait_for(20)
        sweep = borrowing_sweep(tmp_path, path, "s1")
        try:
            lent = wait_event(path, "lent", "s1", timeout_s=60.0)
            assert "2 of 3 servers serve the job meanwhile" in lent["line"]
            assert s1.url not in listed(record)
            status = run_cli("fleet", "status", "--fleet", str(path))
            assert "lent" in status and "lease: s1 lent to study inplace since" in status and "2 of 3" in status
            with pytest.raises(FleetError, match="s1 lent to study inplace .*: a rollback waits until it is back"):
                rollout.rollback(path)
            with pytest.raises(FleetError, match="a second lease waits until it is back"):
                borrow(path, "s2", "another")
            watched = CliRunner().invoke(cli, ["watch", "--fleet", str(path), "--once"])
            assert watched.exit_code != 2 and "s1 lent to study inplace" in watched.output, watched.output
            time.sleep(1.0)  # five of the keeper's looks: the lent server is not restarted
            assert not events(path, "restarted", "s1") and not events(path, "exited", "s1")
            out, _ = sweep.communicate(timeout=180)
        finally:
            if sweep.poll() is None:
                sweep.kill()
        assert sweep.returncode == 0, out
        assert "lending s1 (gpu 1, port" in out and "the job runs on 2 of 3 servers until the study ends" in out
        assert "s1: back from study inplace (the study ended)" in out and "the job ran on 2 of 3 servers for" in out
        assert current(load_fleet(path)) is None and s1.url in listed(record)
        load.wait_for(len(load.records()) + 20)
        done = load.stop()
        assert done and all(r["ok"] for r in done), [r for r in done if not r["ok"]][:3]


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_sweeps_server_is_given_back_by_the_keeper(tmp_path):
    with kept_fleet(tmp_path, FAST) as (path, record):
        s2 = load_fleet(path).server("s2")
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=16, max_tokens=16)
        load.wait_for(20)
        sweep = borrowing_sweep(tmp_path, path, "s2", trials=6)
        try:
            wait_event(path, "lent", "s2", timeout_s=60.0)
            time.sleep(1.0)  # the study's first server is on the lent GPU
        finally:
            sweep.send_signal(signal.SIGKILL)
            sweep.wait(timeout=30)
        killed = time.monotonic()
        back = wait_event(path, "returned", "s2", timeout_s=90.0)
        assert "(its sweep is gone)" in back["line"] and "back in the router" in back["line"]
        assert time.monotonic() - killed < 60.0
        assert current(load_fleet(path)) is None and s2.url in listed(record)
        load.wait_for(len(load.records()) + 20)
        done = load.stop()
        assert done and all(r["ok"] for r in done), [r for r in done if not r["ok"]][:3]
