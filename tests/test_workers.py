"""Scale-out: workers on simulated GPUs share one study (PostgreSQL, journal file), survive a killed worker,
and report per GPU. Trials are tiny (0.2 s startup, 1 s windows) so each end-to-end test takes seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState
from test_storage import postgres_db  # noqa: F401  (the fixture: a fresh database per test)
from tinystudy import write_tiny_study

from autotune.config import load_config
from autotune.errors import ConfigError, StorageError, StudyError
from autotune.launch.groups import parse_gpus
from autotune.results import Metrics, Percentiles, TrialResult
from autotune.search.scaleout.workers import WorkerSweep, on_gpu, run_workers, start_workers
from autotune.search.seeding import NOT_LAUNCHED
from autotune.search.views.gpus import gains, gpu_frame, gpu_spread, per_gpu_frame, render_gpus

# Launches three workers share: within the tiny study's ten distinct configs (a measured one is never relaunched).
TARGET = 6


def study_file(tmp_path: Path, *, trials: int, measure_s: float = 1.0) -> Path:
    return write_tiny_study(tmp_path, name="scale", trials=trials, measure_s=measure_s, warmup_s=0.3)


@pytest.fixture
def sim_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.setenv("AUTOTUNE_HEARTBEAT_S", "2")  # a 6 s grace: short, yet no live worker misses it


# --- pure functions ---------------------------------------------------------------------------------------
def test_gpu_list_parses_and_rejects_repeats_and_words():
    assert parse_gpus("0, 1,3") == [0, 1, 3]
    with pytest.raises(ConfigError, match="repeats a GPU"):
        parse_gpus("0,1,0")
    with pytest.raises(ConfigError, match="0,1,2,3"):
        parse_gpus("gpu0")


def _ok(tok_s: float) -> dict:
    p = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)
    metrics = Metrics(output_tok_s=tok_s, request_s=1.0, ttft_ms=p, itl_ms=p, e2e_ms=p)
    return TrialResult(status="ok", config={}, metrics=metrics).to_dict()


def _trial(gpu: str, role: str, tok_s: float | None, status: str = "ok") -> optuna.trial.FrozenTrial:
    result = _ok(tok_s) if tok_s is not None else TrialResult(status=status, config={}).to_dict()
    return optuna.trial.create_trial(
        state=TrialState.COMPLETE,
        value=tok_s or 0.0,
        user_attrs={"gpu": gpu, "role": role, "status": status, "result": result},
    )


def test_per_gpu_frame_normalises_by_each_gpus_own_baseline():
    study = optuna.create_study(direction="maximize")
    for t in (
        _trial("n:0", "baseline", 2000),
        _trial("n:1", "baseline", 1600),  # GPU 1 is 20 % slower
        _trial("n:0", "search", 2200),
        _trial("n:1", "search", 2000),  # raw: GPU 0's looks best
        _trial("n:1", "search", None, "startup_oom"),
        _trial("n:2", "search", 1900),
    ):
        study.add_trial(t)
    frame = gpu_frame(study)
    assert frame.gain.tolist()[:4] == pytest.approx([1.0, 1.0, 1.1, 1.25])
    assert frame.gain.isna().tolist()[4:] == [True, True]  # an OOM, and a GPU with no baseline yet
    per = per_gpu_frame(study).set_index("gpu")
    assert per.loc["n:0", "best_trial"] == 2 and per.loc["n:1", "best_gain_trial"] == 3
    assert per.loc["n:1", "best_gain"] == pytest.approx(1.25)  # the real winner, on the slow GPU
    assert per.loc["n:1", "trials"] == 3 and per.loc["n:1", "ok"] == 2
    assert per.loc["n:1", "vs_median"] == pytest.approx(1600 / 1800)
    assert gpu_spread(study) == pytest.approx(400 / 1800)
    assert gains(study) == {}  # GPU n:2 served a trial but has no baseline: rank by raw tok/s
    calibrated = optuna.create_study(direction="maximize")
    for t in study.get_trials()[:4]:
        calibrated.add_trial(t)
    assert gains(calibrated) == pytest.approx({0: 1.0, 1: 1.0, 2: 1.1, 3: 1.25})
    single = optuna.create_study(direction="maximize")
    single.add_trial(study.get_trials()[0])
    assert gains(single) == {}


def test_confirmation_takes_contenders_by_gain_when_swept_on_several_gpus():
    from autotune.search.confirm import contenders

    study = optuna.create_study(direction="maximize")
    for k, t in enumerate(
        (
            _trial("n:0", "baseline", 2000),
            _trial("n:1", "baseline", 1600),
            _trial("n:0", "search", 2200),
            _trial("n:1", "search", 2000),
        )
    ):
        t.user_attrs["launch_key"] = f"config {k}"
        study.add_trial(t)
    top, baseline, _ = contenders(study, 1)
    assert [t.number for t in top] == [3] and baseline.number == 0  # 1.25× on the slow GPU beats 1.1×


def test_render_gpus_names_each_gpu_its_calibration_and_best_gain():
    study = optuna.create_study(direction="maximize")
    for t in (
        _trial("n:0", "baseline", 2000),
        _trial("n:1", "baseline", 1600),
        _trial("n:1", "search", 2000),
        _trial("n:2", "search", 1900),
    ):
        study.add_trial(t)
    text = render_gpus(study)
    assert "baselines spread 22.2%" in text
    assert "n:1: 2 trials, baseline 1,600 tok/s (0.89× median); best gain trial 2: 1.25×" in text
    assert "n:2: 1 trials, no baseline" in text


def test_bad_storage_fails_before_any_worker_or_server_starts(tmp_path, sim_env):
    cfg = load_config(study_file(tmp_path, trials=2), storage="postgresql+psycopg2://tuner:s3cret@127.0.0.1:1/x")
    with pytest.raises(StorageError) as info:
        start_workers(cfg, [0, 1])
    assert "tuner:***@127.0.0.1:1/x" in str(info.value) and "s3cret" not in str(info.value)
    assert not (tmp_path / "scale" / "runs").exists() and not (tmp_path / "devices").exists()


def test_workers_on_other_gpus_share_the_study_but_one_gpu_takes_one_sweep(tmp_path):
    cfg = load_config(study_file(tmp_path, trials=2))

    def never(config, number):
        raise AssertionError("no trial runs here")

    first, other = (WorkerSweep(on_gpu(cfg, g, None), runner=never) for g in (0, 1))
    try:
        first.prepare()
        other.prepare()  # GPU 1 joins the study GPU 0 is sweeping
        with pytest.raises(StudyError, match="being swept on GPU 0"):
            WorkerSweep(on_gpu(cfg, 0, None), runner=never).prepare()
    finally:
        first.close()
        other.close()


@pytest.mark.slow
def test_worker_command_errors_are_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "worker", "--config", str(tmp_path / "none.toml"), "--gpu", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "study file not found" in done.stderr


def test_the_worker_command_runs_through_the_cli_but_is_not_listed():
    from click.testing import CliRunner

    from autotune.cli import cli

    shown = CliRunner().invoke(cli, ["--help"])
    assert shown.exit_code == 0 and "sweep" in shown.output and "worker" not in shown.output
    usage = CliRunner().invoke(cli, ["worker", "--help"])
    assert usage.exit_code == 0 and "--slurm-gpus" in usage.output


# --- end to end -------------------------------------------------------------------------------------------
def _intervals_overlap(spans: list[tuple[datetime, datetime]]) -> bool:
    spans = sorted(spans)
    return any(nxt[0] < cur[1] for cur, nxt in zip(spans, spans[1:], strict=False))


def check_shared_study(cfg, gpus: list[int], target: int) -> list[optuna.trial.FrozenTrial]:
    """Every trial ran once, on one GPU, never overlapping another on that GPU; the baseline ran once."""
    from autotune.search.objective import open_study

    trials = open_study(cfg, create=False).get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs["status"] not in NOT_LAUNCHED]
    assert len(done) == target  # the budget counts launches: a config the planner skips is not one
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len({t.number for t in done}) == target
    trial_dirs = [t.user_attrs["result"]["trial_dir"] for t in done]
    assert len(set(trial_dirs)) == target  # no trial was run twice into one directory
    by_gpu: dict[str, list] = {}
    for t in done:
        assert t.user_attrs["result"]["gpu_index"] == t.user_attrs["worker"]["gpu"]
        by_gpu.setdefault(t.user_attrs["gpu"], []).append((t.datetime_start, t.datetime_complete))
    assert sorted(label.rsplit(":", 1)[1] for label in by_gpu) == sorted(map(str, gpus))
    for label, spans in by_gpu.items():
        assert not _intervals_overlap(spans), f"two trials overlapped on {label}"
    baselines = [t.user_attrs["gpu"] for t in done if t.user_attrs["role"] == "baseline"]
    assert len(baselines) == 1  # once per study, on whichever worker claimed it
    per = per_gpu_frame(open_study(cfg, create=False))
    assert per.baseline_tok_s.notna().sum() == 1 and per.ok.sum() == sum(t.user_attrs["status"] == "ok" for t in done)
    return trials


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_three_workers_share_a_postgres_study(tmp_path, sim_env, postgres_db):  # noqa: F811
    cfg = load_config(study_file(tmp_path, trials=TARGET), storage=postgres_db)
    lines: list[str] = []
    codes = run_workers(cfg, [0, 1, 2], echo=lines.append)
    assert codes == {0: 0, 1: 0, 2: 0}, "\n".join(lines)
    check_shared_study(cfg, [0, 1, 2], TARGET)
    assert {line.split(" |")[0] for line in lines if "] trial " in line} == {"gpu0", "gpu1", "gpu2"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_three_workers_share_a_journal_file_study(tmp_path, sim_env):
    url = f"journal://{tmp_path / 'scale.log'}"
    cfg = load_config(study_file(tmp_path, trials=TARGET), storage=url)
    lines: list[str] = []
    codes = run_workers(cfg, [0, 1, 2], echo=lines.append)
    assert codes == {0: 0, 1: 0, 2: 0}, "\n".join(lines)
    trials = check_shared_study(cfg, [0, 1, 2], TARGET)
    from autotune.report.page import open_study as report_study

    assert len(report_study(None, url).get_trials()) == len(trials)  # the report reads a journal too


def _server_pid(run_dir: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        for pid_file in run_dir.glob("server-*.json"):
            try:
                return json.loads(pid_file.read_text())["pid"]
            except (OSError, ValueError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no server started in {run_dir}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_killed_mid_trial_is_retried_by_another_and_its_server_removed(tmp_path, sim_env):
    cfg = load_config(study_file(tmp_path, trials=4, measure_s=1.5))
    lines: list[str] = []
    workers = start_workers(cfg, [0, 1], echo=lines.append)
    try:
        server = _server_pid(tmp_path / "scale" / "runs" / "gpu-1", time.monotonic() + 60)
        os.kill(workers.procs[1].pid, signal.SIGKILL)  # the worker, not its server: that one is orphaned
    finally:
        codes = workers.wait(timeout_s=150)
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, "\n".join(lines)
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    from autotune.search.objective import open_study

    trials = open_study(cfg, create=False).get_trials()
    [killed] = [t for t in trials if t.state == TrialState.FAIL]
    assert killed.user_attrs["gpu"].endswith(":1") and killed.user_attrs["status"] == "interrupted"
    [retry] = [t for t in trials if t.user_attrs.get("requeued_from") == killed.number]
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["gpu"].endswith(":0")
    assert retry.user_attrs["config"] == killed.user_attrs["config"]
    assert sum(t.state == TrialState.COMPLETE and t.user_attrs["status"] not in NOT_LAUNCHED for t in trials) == 4
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def _cli(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices"), "AUTOTUNE_HEARTBEAT_S": "2"}
    return subprocess.Popen(
        [sys.executable, "-m", "autotune", "sweep", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sweep_gpus_runs_one_worker_per_gpu_then_reports_per_gpu(tmp_path):
    path = study_file(tmp_path, trials=4)
    proc = _cli(tmp_path, "--config", str(path), "--gpus", "0,1")
    out, _ = proc.communicate(timeout=110)
    assert proc.returncode == 0, out
    assert "gpu0 | " in out and "gpu1 | " in out
    assert "per GPU (configs compare by tok/s per GPU" in out  # the baseline ran once, on one of the two
    cfg = load_config(path)
    check_shared_study(cfg, [0, 1], 4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_is_forwarded_every_server_stops_and_trials_are_interrupted(tmp_path):
    path = study_file(tmp_path, trials=6, measure_s=30.0)
    proc = _cli(tmp_path, "--config", str(path), "--gpus", "0,1")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        servers = [_server_pid(tmp_path / "scale" / "runs" / f"gpu-{g}", deadline) for g in (0, 1)]
        while sum("measuring" in line for line in lines) < 2:  # both mid-window
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # Ctrl-C reaches the supervisor only: it forwards it
        assert proc.wait(timeout=60) == 130, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in servers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    from autotune.search.objective import open_study

    trials = open_study(load_config(path), create=False).get_trials()
    stopped = [t for t in trials if t.state == TrialState.FAIL]
    assert len(stopped) == 2 and {t.user_attrs["status"] for t in stopped} == {"interrupted"}
    assert len([t for t in trials if t.state == TrialState.WAITING]) == 2  # queued again for the resume
