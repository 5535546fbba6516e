"""A server ended from outside the study (a Slurm job someone else ``scancel``'d) is an interruption the study runs
again, not a crash of the config: the launcher's handle says so with ``cancelled`` and ``reason``. No Slurm here:
a fake handle for the start, and a real sim server killed mid-window whose local handle is marked cancelled."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from autotune.config import Timeouts
from autotune.harness.engines import make_engine
from autotune.harness.setup import TrialHooks, TrialSetup
from autotune.harness.trial import run_trial
from autotune.harness.workload import WorkloadSpec
from autotune.launch import ServerExited
from autotune.launch.local import LocalLauncher

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
GPU = 6  # a simulated device index only these tests use
REASON = "Slurm job 42 CANCELLED by 1001 (ExitCode 0:15)"
TIMEOUTS = Timeouts(startup_s=30, teardown_s=10, grace_s=3)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    return tmp_path


def _engine():
    return make_engine(
        "sim",
        model_path="qwen3.6-27b",
        sim_gpu="b200",
        sim_options={"startup_s": 0.2, "release_s": 0.2, "warmup_s": 0.1},
    )


class _GoneBeforeReady:
    """A handle whose job ended while starting; ``cancelled`` as the launcher reports it."""

    base_url, port, pid, exit_code, teardown_error, alive = "http://127.0.0.1:9", 9, None, -15, None, False

    def __init__(self, cancelled: bool):
        self.cancelled, self.reason, self.stopped = cancelled, REASON if cancelled else None, False

    def poll(self):
        return -15

    def log_text(self):
        return "starting\n"

    def log_tail(self, lines=40):
        return "starting\n"

    def wait_ready(self, timeout_s, *, stop_event=None):
        raise ServerExited(-15, "starting\n")

    def stop(self, grace_s=10.0, release_timeout_s=30.0):
        self.stopped = True
        return -15


class _FakeLauncher:
    name = "fake"

    def __init__(self, handle):
        self.handle = handle

    def start(self, spec, *, gpu_reader=None):
        return self.handle

    def device_env(self, gpus):
        return {}

    def memory_reader(self, gpus, local):
        return local(gpus)


def _work(**kw) -> WorkloadSpec:
    return WorkloadSpec(
        **{**dict(prompts=PROMPTS, sample_size=8, warmup_s=0.2, measure_s=0.5, concurrency=4, max_tokens=64), **kw}
    )


@pytest.mark.parametrize("cancelled", [True, False])
def test_a_server_cancelled_while_starting_is_interrupted_and_any_other_exit_a_crash(env, cancelled):
    handle = _GoneBeforeReady(cancelled)
    setup = TrialSetup(
        engine=_engine(),
        workload=_work(),
        gpu_index=GPU,
        run_dir=env / "runs",
        timeouts=TIMEOUTS,
        launcher=_FakeLauncher(handle),
    )
    result = run_trial(setup, {}, trial_dir=env / "t")
    assert handle.stopped  # stopped (and released) whatever the outcome
    if cancelled:
        assert result.status == "interrupted"
        assert "cancelled outside the study; it runs again" in result.reason and REASON in result.reason
    else:
        assert result.status == "crash" and "cancelled" not in (result.reason or "")
    assert result.exit_code == -15


@pytest.mark.timeout(90)
def test_a_server_cancelled_while_measuring_is_interrupted_not_a_crash(env):
    handles: list = []

    class Cancelling(LocalLauncher):
        def start(self, spec, *, gpu_reader=None):
            handles.append(super().start(spec, gpu_reader=gpu_reader))
            return handles[-1]

    def on_phase(name, info):  # someone else ends the job mid-window; the launcher learns it was a cancel
        if name == "measuring" and not getattr(handles[0], "cancelled", False):
            handles[0].cancelled, handles[0].reason = True, REASON
            os.killpg(handles[0].pid, signal.SIGKILL)

    setup = TrialSetup(
        engine=_engine(),
        workload=_work(measure_s=20),
        gpu_index=GPU,
        run_dir=env / "runs",
        timeouts=TIMEOUTS,
        launcher=Cancelling(),
    )
    result = run_trial(setup, {"max_running_requests": 8}, trial_dir=env / "t", hooks=TrialHooks(on_phase=on_phase))
    assert handles and handles[0].cancelled
    assert result.status == "interrupted", (result.status, result.reason)
    assert result.reason == f"the server was cancelled outside the study; it runs again ({REASON})"
    assert result.exit_code == -signal.SIGKILL and result.durations_s["measure"] < 10
