"""A fleet on Slurm: ``fleet.toml``'s launcher, written by ``apply`` from the study, and — on the real single-node
cluster (``.ci/slurm.sh``) — ``fleet up``/``status``/``down`` and a rolling apply with each server a batch job.

The cluster tests are skipped without ``sbatch`` unless ``AUTOTUNE_REQUIRE_ALL=1`` (CI), and each asserts that the
queue holds none of its jobs afterwards (they are cancelled and the test fails otherwise).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from launchcase_slurm import slurm_missing
from test_apply import make_study, result
from test_fleet import FAST, OLD, write_yaml
from test_rollout import NEW, HealthPoller

from autotune.cli import cli
from autotune.deploy import rollout
from autotune.deploy.apply import load_winner, write_artifacts
from autotune.deploy.fleet import (
    Fleet,
    FleetServer,
    down,
    healthy,
    load_fleet,
    read_record,
    record_path,
    status,
    up,
    write_fleet,
)
from autotune.deploy.sglang_yaml import read_config_file
from autotune.errors import FleetError
from autotune.launch.ports import port_is_free
from autotune.launch.process import free_port

TIMING = rollout.Timing(grace_s=5.0, startup_timeout_s=90.0, release_timeout_s=15.0)  # bounds, not expectations


# -- the fleet file's launcher (no cluster needed) ----------------------------------------------------------
def test_fleet_file_records_and_checks_its_launcher(tmp_path):
    server = FleetServer(name="s0", gpus=[0], port=30000, config="x.yaml", log="l", pid="run/s0.pid")
    fleet = Fleet(engine="sim", model="m", launcher="slurm", launcher_settings={"partition": "gpu"}, servers=[server])
    path = write_fleet(fleet, tmp_path / "fleet.toml")
    again = load_fleet(path)
    assert (again.launcher, again.launcher_settings) == ("slurm", {"partition": "gpu"})
    assert (
        load_fleet(write_fleet(Fleet(engine="sim", model="m", servers=[server]), tmp_path / "f2.toml")).launcher
        == "local"
    )
    for bad, message in (
        ('launcher = "kubernetes"', "unknown launcher 'kubernetes'"),
        ('launcher = "slurm"\nlauncher_settings = { partiton = "gpu" }', "partiton"),
        ('launcher_settings = { partition = "gpu" }', "takes no launcher_settings"),
    ):
        text = (
            path.read_text().replace('launcher = "slurm"\n', "").replace('[launcher_settings]\npartition = "gpu"\n', "")
        )
        (tmp_path / "bad.toml").write_text(bad + "\n" + text)
        with pytest.raises(FleetError, match=message):
            load_fleet(tmp_path / "bad.toml")


def test_apply_writes_the_studys_launcher_and_its_table(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    settings = {
        "engine": {"kind": "sim", "model": "qwen3.6-27b", "sim_gpu": "b200", "launcher": "slurm"},
        "launcher": {
            "slurm": {"partition": "debug", "account": None, "time": "01:00:00", "extra_args": []},
            "container": {"runtime": "docker"},
        },
    }
    make_study(url, trials=[(result(OLD, 100.0), "baseline")], settings=settings)
    write_artifacts(load_winner(url), tmp_path / "out", gpus=[0, 1])
    fleet = load_fleet(tmp_path / "out" / "fleet.toml")
    assert fleet.launcher == "slurm" and fleet.launcher_settings == {"partition": "debug", "time": "01:00:00"}
    # a local study laid out on that fleet file keeps its launcher
    url2 = f"sqlite:///{tmp_path / 'local.db'}"
    make_study(url2, trials=[(result(OLD, 100.0), "baseline")])
    write_artifacts(load_winner(url2), tmp_path / "again", layout=fleet)
    assert load_fleet(tmp_path / "again" / "fleet.toml").launcher == "slurm"


# -- on the real cluster ------------------------------------------------------------------------------------
def our_jobs(token: str) -> list[tuple[str, str, str]]:
    """(id, name, state) of the queued jobs whose name carries this test's token."""
    done = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=30, check=True)
    rows = [tuple(line.split()) for line in done.stdout.splitlines() if line.strip()]
    return [row for row in rows if len(row) == 3 and token in row[1]]  # type: ignore[misc]


@contextlib.contextmanager
def slurm_servers(tmp_path: Path, *, config: dict, group: int = 1) -> Iterator[tuple[Path, str]]:
    """Two simulated servers (``group`` GPUs each) with ``launcher = "slurm"``; afterwards none of their jobs may
    be queued."""
    skip = slurm_missing()
    if skip:
        pytest.skip(skip)
    token = secrets.token_hex(3)
    name = write_yaml(tmp_path / "old.yaml", config)
    servers = [
        FleetServer(
            name=f"t{token}-{i}",
            gpus=list(range(i * group, (i + 1) * group)),
            port=free_port(),
            config=name,
            log=f"logs/s{i}.log",
            pid=f"run/s{i}.pid",
            sim_options=FAST,
        )
        for i in range(2)
    ]
    path = write_fleet(
        Fleet(engine="sim", model="qwen3.6-27b", sim_gpu="b200", launcher="slurm", servers=servers),
        tmp_path / "fleet.toml",
    )
    assert our_jobs(token) == []
    try:
        yield path, token
    finally:
        try:
            down(load_fleet(path), grace_s=2.0)
        finally:
            left = our_jobs(token)
            if left:
                subprocess.run(["scancel", "--full", "--signal=KILL", *[j[0] for j in left]], check=False)
                subprocess.run(["scancel", *[j[0] for j in left]], check=False)
                deadline = time.monotonic() + 15
                while our_jobs(token) and time.monotonic() < deadline:
                    time.sleep(0.2)
            assert left == [], f"jobs left in squeue after the test: {left}"


@pytest.fixture
def slurm_fleet(tmp_path, monkeypatch):
    """Two simulated single-GPU servers with ``launcher = "slurm"``."""
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))  # exported into the jobs
    with slurm_servers(tmp_path, config=OLD) as made:
        yield made


@pytest.mark.timeout(300)
def test_fleet_up_status_rolling_apply_down_on_slurm(slurm_fleet):
    path, token = slurm_fleet
    fleet = load_fleet(path)
    runner = CliRunner()

    done = runner.invoke(cli, ["fleet", "up", "--fleet", str(path), "--timeout", "90"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    jobs = our_jobs(token)
    assert sorted((name, state) for _, name, state in jobs) == [
        (f"autotune-fleet-t{token}-0", "RUNNING"),
        (f"autotune-fleet-t{token}-1", "RUNNING"),
    ]
    assert all(healthy(s) for s in fleet.servers)
    recorded = {read_record(fleet, s).job_id for s in fleet.servers}
    assert recorded == {job_id for job_id, _, _ in jobs}
    assert not any(fleet.resolve(s.pid).exists() for s in fleet.servers)  # no local process stands for a job

    again = runner.invoke(cli, ["fleet", "up", "--fleet", str(path)], catch_exceptions=False)
    assert "all servers already running" in again.output and len(our_jobs(token)) == 2

    shown = runner.invoke(cli, ["fleet", "status", "--fleet", str(path), "--json"], catch_exceptions=False)
    rows = json.loads(shown.output)
    assert [(r["state"], r["launcher"]) for r in rows] == [("healthy", "slurm")] * 2
    assert {r["job"] for r in rows} == recorded

    with HealthPoller([s.url for s in fleet.servers]) as poller:
        report = rollout.start(path, NEW, expect=rollout.Expectation(), canary=None, timing=TIMING)
    assert report.verified == [s.name for s in fleet.servers] and report.failed is None
    assert poller.samples > 10 and poller.minimum >= 1  # the N-1 floor, counted in servers
    after = load_fleet(path)
    assert all(read_config_file(after.resolve(s.config))["max_mamba_cache_size"] == 200 for s in after.servers)
    assert [r.state for r in status(after)] == ["healthy", "healthy"] and all(r.drift == [] for r in status(after))
    moved = {read_record(after, s).job_id for s in after.servers}
    assert moved.isdisjoint(recorded) and {j[0] for j in our_jobs(token)} == moved  # each restart: a new job

    stopped = runner.invoke(cli, ["fleet", "down", "--fleet", str(path), "--grace", "5"], catch_exceptions=False)
    assert stopped.exit_code == 0 and "stopped:" in stopped.output, stopped.output
    assert our_jobs(token) == []
    assert all(port_is_free(s.bind, s.port) for s in after.servers)
    assert not any(record_path(after, s).exists() for s in after.servers)
    assert [r.state for r in status(after)] == ["down", "down"]


@pytest.mark.timeout(60)
def test_a_slurm_server_that_cannot_start_leaves_no_job(slurm_fleet):
    path, token = slurm_fleet
    fleet = load_fleet(path)
    bad = fleet.model_copy(update={"servers": [fleet.servers[0].model_copy(update={"extra_args": ["--no-such-flag"]})]})
    with pytest.raises(FleetError, match="did not start"):
        up(bad, timeout_s=20)
    assert our_jobs(token) == [] and read_record(bad, bad.servers[0]) is None


def job_gpus(job_id: str) -> int | None:
    """The GPUs per node the job asked Slurm for (``scontrol show job``'s ``TresPerNode=gres:gpu:2``, or
    ``gres/gpu=2`` in older versions), None without any."""
    done = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=True
    )
    found = re.search(r"gres[:/]gpu[:=](\d+)", done.stdout)
    return int(found.group(1)) if found else None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fleet_of_tp2_servers_on_slurm_asks_two_gpus_per_job(tmp_path, monkeypatch):
    """Each TP=2 server is one job of ``--gres=gpu:2``; it sees two GPUs, holds both, and a rolling apply replaces
    one job at a time; after ``down`` no job is left and every GPU is free."""
    from autotune.sim import device

    devices = tmp_path / "devices"
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(devices))
    with slurm_servers(tmp_path, config={**OLD, "tp_size": 2}, group=2) as (path, token):
        fleet = load_fleet(path)
        assert [s.gpus for s in fleet.servers] == [[0, 1], [2, 3]]
        assert sorted(up(fleet, timeout_s=120)) == [s.name for s in fleet.servers]
        jobs = {read_record(fleet, s).job_id for s in fleet.servers}
        assert {j[0] for j in our_jobs(token)} == jobs
        assert [job_gpus(job) for job in jobs] == [2, 2]
        assert all(device.read(gpu, devices).used_mib > 1000 for gpu in range(4))
        owners = [[p["pid"] for p in device.read(gpu, devices).processes] for gpu in range(4)]
        assert owners[0] == owners[1] != owners[2] == owners[3] and len(owners[0]) == 1  # one server per pair

        shown = CliRunner().invoke(cli, ["fleet", "status", "--fleet", str(path), "--json"], catch_exceptions=False)
        assert [(r["gpus"], r["state"]) for r in json.loads(shown.output)] == [([0, 1], "healthy"), ([2, 3], "healthy")]
        with HealthPoller([s.url for s in fleet.servers]) as poller:
            report = rollout.start(
                path, {**NEW, "tp_size": 2}, expect=rollout.Expectation(), canary=None, timing=TIMING
            )
        assert report.verified == [s.name for s in fleet.servers] and poller.minimum >= 1
        moved = {read_record(fleet, s).job_id for s in fleet.servers}
        assert moved.isdisjoint(jobs) and [job_gpus(job) for job in moved] == [2, 2]

        assert sorted(down(load_fleet(path), grace_s=5.0)) == sorted(s.name for s in fleet.servers)
        assert our_jobs(token) == []
        assert all(device.read(gpu, devices).used_mib == 0 for gpu in range(4))
