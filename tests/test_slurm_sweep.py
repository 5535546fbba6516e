"""``autotune sweep`` through Slurm on the real cluster (CI: single-node, ``.ci/slurm.sh``) and the simulated
engine: every trial's server a batch job; two workers as Slurm jobs sharing one study; a trial whose job is
``scancel``'d from outside is interrupted, run again, and the study still finishes. ``squeue`` is empty after each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
from launchcase_slurm import empty_queue, queue, slurm_missing
from optuna.trial import TrialState
from tinystudy import write_tiny_study

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster():
    why = slurm_missing()
    if why:
        pytest.skip(why)
    with empty_queue():
        yield


def _study(tmp_path: Path, name: str, trials: int, *, launcher: bool = True, measure_s: float = 1.0) -> Path:
    path = write_tiny_study(tmp_path, name=name, trials=trials, top_k=0, measure_s=measure_s, warmup_s=0.5)
    if launcher:
        path.write_text(path.read_text().replace('kind = "sim"', 'kind = "sim"\nlauncher = "slurm"'))
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}  # jobs inherit it (--export=ALL)


def _sweep(path: Path, *args: str, env: dict[str, str], timeout: float = 100) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _trials(path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{path.with_suffix('.db')}")
    return study.get_trials(deepcopy=False)


class QueueWatch:
    """Every job id ``squeue`` showed during the sweep (this checkout's only), polled in a thread."""

    def __init__(self, on_running=None):
        self.seen: list[str] = []
        self.on_running = on_running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in queue():
                job_id, _, state = line.split()
                if job_id not in self.seen:
                    self.seen.append(job_id)
                if self.on_running is not None and state == "RUNNING":
                    self.on_running(job_id, self.seen.index(job_id))
            time.sleep(0.1)

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.slow
def test_the_tiny_study_sweeps_with_every_server_a_slurm_job(cluster, tmp_path):
    path = _study(tmp_path, "slurmy", trials=3)
    with QueueWatch() as watch:
        done = _sweep(path, env=_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    trials = _trials(path, "slurmy")
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"]
    assert len(ok) == 3, [(t.number, t.state, t.user_attrs.get("status"), t.user_attrs.get("reason")) for t in trials]
    scripts = sorted(p.name for p in tmp_path.rglob("*.sbatch"))
    assert len(scripts) >= 3 and len(watch.seen) >= 3, (scripts, watch.seen)  # one batch job per launched server
    for trial in ok:  # each trial's server log is the job's --output file
        log = Path(trial.user_attrs["log_path"]).read_text()
        assert "fired up and ready to roll" in log
    assert queue() == []


@pytest.mark.slow
def test_two_workers_as_slurm_jobs_share_one_study(cluster, tmp_path):
    path = _study(tmp_path, "pair", trials=4, launcher=False)  # the --launcher option alone puts it on Slurm
    path.write_text(
        path.read_text().replace("step = 80", "step = 16").replace("step = 0.02", "step = 0.01")
    )  # few repeats
    with QueueWatch() as watch:
        done = _sweep(path, "--gpus", "0,1", "--launcher", "slurm", env=_env(tmp_path))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    trials = _trials(path, "pair")
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) >= 4 and all(
        t.user_attrs.get("status") in ("ok", "repeat", "duplicate") for t in finished
    )  # a repeat is told its figure, never launched
    launched = [t for t in finished if t.user_attrs.get("status") == "ok"]  # a repeat or duplicate ran nowhere
    assert {str(t.user_attrs.get("gpu")).rpartition(":")[2] for t in launched} == {"0", "1"}  # host:gpu, both
    workers = sorted(tmp_path.rglob("workers/gpu-*.log"))
    assert [p.name for p in workers] == ["gpu-0.log", "gpu-1.log"]
    assert "worker is Slurm job" in done.stdout + done.stderr
    assert len(watch.seen) >= 2  # the two worker jobs (their servers run inside their allocations)
    assert queue() == []


@pytest.mark.slow
def test_workers_n_on_slurm_each_ask_for_a_servers_gpus_and_run_on_their_allocation(cluster, tmp_path):
    path = _study(tmp_path, "pairs", trials=4, launcher=False)
    path.write_text(
        path.read_text()
        .replace("[engine.fixed]\n", "[engine.fixed]\ntp_size = 2\n")
        .replace("step = 80", "step = 16")
        .replace("step = 0.02", "step = 0.01")
    )  # 55 configs: few repeats
    with QueueWatch() as watch:
        done = _sweep(path, "--workers", "2", "--launcher", "slurm", env=_env(tmp_path))
    out = done.stdout + done.stderr
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert out.count("asking for 2 GPUs") == 2  # each worker job: --gres=gpu:2
    scripts = sorted(p.name for p in tmp_path.rglob("workers/*.sbatch"))
    assert scripts == ["worker-0.sbatch", "worker-1.sbatch"]
    assert all("--slurm-gpus" in (tmp_path / "pairs" / "runs" / "workers" / s).read_text() for s in scripts)
    finished = [t for t in _trials(path, "pairs") if t.state == TrialState.COMPLETE]
    assert len(finished) >= 4 and all(
        t.user_attrs.get("status") in ("ok", "repeat", "duplicate") for t in finished
    )  # a repeat is told its figure, never launched
    launched = [t for t in finished if t.user_attrs.get("status") == "ok"]  # a repeat or duplicate has no GPUs
    groups = {tuple(t.user_attrs["result"]["gpus"]) for t in launched}
    assert groups == {(0, 1), (2, 3)}, groups  # Slurm gave the two jobs disjoint pairs; each ran its servers there
    assert all(t.values[0] == pytest.approx(t.user_attrs["result"]["metrics"]["output_tok_s"] / 2) for t in launched)
    assert len(watch.seen) >= 2
    assert queue() == []
    assert not list((tmp_path / "devices").rglob("*.json"))  # every GPU released


def test_workers_without_the_slurm_launcher_is_one_line(tmp_path):
    path = _study(tmp_path, "local", trials=1, launcher=False)
    done = _sweep(path, "--workers", "2", env=_env(tmp_path))
    assert done.returncode == 1 and "--workers needs the slurm launcher" in done.stderr
    assert done.stderr.count("Error:") == 1 and not (tmp_path / "local.db").exists()


@pytest.mark.slow
def test_a_trial_whose_job_is_scancelled_from_outside_runs_again_and_the_study_finishes(cluster, tmp_path):
    cancelled: list[str] = []

    def cancel_second(job_id: str, index: int) -> None:
        if index == 1 and not cancelled:
            time.sleep(1.5)  # startup 0.2 s, warm-up 0.5 s: inside the measured window
            subprocess.run(["scancel", job_id], check=True)  # plain scancel: Slurm records CANCELLED
            cancelled.append(job_id)

    path = _study(tmp_path, "cancelled", trials=3, measure_s=4.0)
    with QueueWatch(on_running=cancel_second):
        done = _sweep(path, env=_env(tmp_path))
    assert cancelled, "the second trial's job was never seen running"
    assert done.returncode == 0, done.stderr[-3000:]
    trials = _trials(path, "cancelled")
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(ok) == 3, [(t.number, t.state, t.user_attrs.get("status"), t.user_attrs.get("reason")) for t in trials]
    assert len(failed) == 1 and failed[0].user_attrs["status"] == "interrupted"
    assert cancelled[0] in failed[0].user_attrs["reason"] and "CANCELLED" in failed[0].user_attrs["reason"]
    assert any(t.params == failed[0].params and t.number > failed[0].number for t in ok)  # its config ran again
    assert queue() == []


def test_ctrl_c_reaches_the_slurm_workers_as_sigint_and_leaves_no_job(cluster, tmp_path):
    path = _study(tmp_path, "stopped", trials=6, measure_s=30.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path), "--gpus", "0,1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(tmp_path),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both workers' first servers are up: each is mid-trial
            logs = [p.read_text() for p in tmp_path.rglob("server.log")]
            if sum("fired up and ready to roll" in text for text in logs) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the two workers' servers never came up")
        assert len(queue()) == 2  # the two worker jobs; their servers run inside them
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    trials = _trials(path, "stopped")
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    stopped = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert len(stopped) == 2, [(t.number, t.state, t.user_attrs.get("status")) for t in trials]
    assert queue() == []
