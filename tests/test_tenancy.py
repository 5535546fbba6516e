"""A trial starts only on a GPU it can have: the pre-launch check, the sweep stopping on a tenant, and the planner
learning nothing from a launch (or an OOM) that shared the device."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState
from simserver import sim_server
from test_study import PlannerRunner, write_study
from tinystudy import write_tiny_study

from autotune.config import load_config
from autotune.errors import GpuBusyError
from autotune.harness.engines.sim import SimGpuReader
from autotune.harness.gpu import GpuReading
from autotune.harness.tenancy import check_engine_gpu, check_free, occupancy
from autotune.results import TrialResult
from autotune.search.correction import CorrectedFeasibility, replay
from autotune.search.scaleout.workers import run_workers
from autotune.search.study import Sweep, run_study
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim import device

TOTAL_MIB = 183_359.0  # a simulated B200


@pytest.fixture
def sleeper():
    """A live process to stand in for a tenant (the registry only needs its pid to be alive)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def hold(tmp_path, pid: int, gib: float, *, release_s: float = 0.3) -> None:
    device.register(
        0,
        pid=pid,
        gpu_name="b200",
        total_mib=TOTAL_MIB,
        used_mib=gib * 1024,
        release_s=release_s,
        directory=tmp_path / "devices",
    )


def reader(tmp_path) -> SimGpuReader:
    return SimGpuReader(0, str(tmp_path / "devices"))


# --- the check -----------------------------------------------------------------------------------------------
def test_a_live_tenant_is_named_with_its_pid_command_and_gib(tmp_path, sleeper):
    hold(tmp_path, sleeper.pid, 150.0)
    with pytest.raises(GpuBusyError) as info:
        check_free(reader(tmp_path), 0)
    line = str(info.value)
    assert "\n" not in line and line.startswith("GPU 0 is busy: 150.0 GiB of 179.1 GiB")
    assert f"pid {sleeper.pid}" in line and "time.sleep(60)" in line and "busy_gpu" in line
    assert info.value.gpu == 0 and info.value.held_gib == pytest.approx(150.0)


def test_memory_under_the_idle_floor_and_the_studys_own_pids_are_not_tenants(tmp_path, sleeper):
    hold(tmp_path, sleeper.pid, 1.2)  # under max(1 GiB, 1 % of 179 GiB)
    seen = check_free(reader(tmp_path), 0)
    assert seen is not None and not seen.busy and seen.others_gib == pytest.approx(1.2)
    hold(tmp_path, sleeper.pid, 150.0)
    assert not occupancy(reader(tmp_path), 0, own_pids=[sleeper.pid]).busy
    assert occupancy(reader(tmp_path), 0).busy


def test_a_just_stopped_server_is_waited_for_not_called_a_tenant(tmp_path):
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=10)
    hold(tmp_path, done.pid, 150.0, release_s=0.5)  # exited; the "driver" frees it 0.5 s after the death is seen
    started = time.monotonic()
    seen = check_free(reader(tmp_path), 0)
    assert seen is not None and not seen.busy and seen.releasing_gib == 0
    assert 0.3 < time.monotonic() - started < 5
    hold(tmp_path, done.pid, 150.0, release_s=60)  # never freed within the bound: it counts
    with pytest.raises(GpuBusyError, match="exited processes not yet freed"):
        check_free(reader(tmp_path), 0, release_wait_s=0.3)


def test_wait_mode_launches_once_the_tenant_leaves_and_gives_up_after_its_bound(tmp_path, sleeper):
    hold(tmp_path, sleeper.pid, 150.0, release_s=0.1)
    with pytest.raises(GpuBusyError, match=r"\(waited 1 s\)"):
        check_free(reader(tmp_path), 0, mode="wait", wait_s=1.0, poll_s=0.2)
    said: list[str] = []
    killer = subprocess.Popen([sys.executable, "-c", f"import os,time; time.sleep(0.6); os.kill({sleeper.pid}, 9)"])
    seen = check_free(reader(tmp_path), 0, mode="wait", wait_s=20.0, poll_s=0.2, on_wait=said.append)
    killer.wait(timeout=10)
    assert seen is not None and not seen.busy
    assert len(said) == 1 and said[0].startswith("waiting up to 20 s for GPU 0")


class FakeNvml:
    """NVML's view: memory used, and compute processes some of which another container hides."""

    def __init__(self, used_gib: float, procs: list[dict]):
        self.used_gib, self.procs = used_gib, procs

    def read(self):
        return GpuReading(used_gib=self.used_gib, total_gib=139.8)

    def processes(self):
        return self.procs

    def close(self):
        pass


def test_nvml_memory_no_visible_process_holds_is_a_tenant_too():
    occ = occupancy(FakeNvml(60.0, [{"pid": os.getpid(), "used_gib": 20.0, "exited": False}]), 3)
    assert occ.busy and occ.held_gib == pytest.approx(60.0)
    assert "not attributed to a visible process" in occ.line() and f"pid {os.getpid()}" in occ.line()
    assert not occupancy(FakeNvml(0.4, []), 3).busy  # the driver's idle reserve


def test_a_cpu_server_is_not_checked():
    class CpuEngine:
        device = "cpu"

        def gpu_reader(self, index):
            raise AssertionError("a CPU server has no GPU to read")

    assert check_engine_gpu(CpuEngine(), 0) is None


# --- the sweep ---------------------------------------------------------------------------------------------
def test_sweep_next_to_a_simulated_server_stops_before_the_search(tmp_path):
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    path = write_tiny_study(tmp_path, name="tiny", trials=3)
    with sim_server(tmp_path, [], env):  # another server on GPU 0 of the same registry holds most of it
        holder = [p["pid"] for p in device.read(0, tmp_path / "devices").processes]
        done = subprocess.run(
            [sys.executable, "-m", "autotune", "sweep", "--config", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("Error: GPU 0 is busy") and "Traceback" not in done.stderr
    assert f"pid {holder[0]}" in errors[0] and "autotune.sim" in errors[0]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    trials = study.get_trials()
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.COMPLETE)]
    assert not [k for t in trials for k in t.user_attrs if k.startswith("planner_")]  # no correction learnt
    assert not (tmp_path / "tiny" / "trials").exists()  # no server was launched


class TenantArrives(PlannerRunner):
    """The planner's outcomes; after the first launch another process takes the GPU."""

    def __init__(self, tmp_path, pid: int):
        super().__init__()
        self.tmp_path, self.pid = tmp_path, pid

    def __call__(self, config, number):
        result = super().__call__(config, number)
        hold(self.tmp_path, self.pid, 120.0)
        return result


def test_a_tenant_arriving_mid_study_stops_it_and_the_trial_runs_again_later(tmp_path, sleeper):
    cfg = load_config(write_study(tmp_path, trials=4))
    runner = TenantArrives(tmp_path, sleeper.pid)
    with pytest.raises(GpuBusyError, match="GPU 0 is busy"):
        run_study(cfg, runner=runner, device_check=lambda: check_free(reader(tmp_path), 0))
    assert len(runner.calls) == 1  # the second trial was not launched
    study = optuna.load_study(study_name="t", storage=cfg.storage_url)
    first, second = study.trials[0], study.trials[1]
    assert first.user_attrs["result"]["measurement"]["device_at_launch"]["held_gib"] == 0
    assert second.state == TrialState.FAIL and second.user_attrs["status"] == "interrupted"
    assert "GPU 0 is busy" in second.user_attrs["reason"]
    assert [t.user_attrs.get("requeued_from") for t in study.trials if t.state == TrialState.WAITING] == [1]
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]


class TenantOom(PlannerRunner):
    """What SGLang logs when a tenant leaves 17.8 GiB of a B200: an OOM loading the weights."""

    def __call__(self, config, number):
        self.calls.append((number, dict(config)))
        return TrialResult(
            status="startup_oom",
            config=config,
            reason="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB while "
            "loading weights (56.58 GiB of weights, 17.81 GiB free).",
        )


def test_an_oom_far_below_the_idle_free_memory_is_the_tenants_and_teaches_the_planner_nothing(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    sweep = Sweep(cfg, runner=TenantOom())
    with pytest.raises(GpuBusyError, match="another process held the GPU"):
        sweep.run()
    sweep.close()
    assert not sweep.feasibility.learned
    baseline = sweep.study.trials[0]
    assert baseline.user_attrs["status"] == "interrupted" and baseline.user_attrs["tenant_oom"] is True
    assert "17.81 GiB free where the idle device has 178.56 GiB" in baseline.user_attrs["reason"]
    assert not [k for k in baseline.user_attrs if k.startswith("planner_")]


# --- the planner ---------------------------------------------------------------------------------------------
def _planner() -> CorrectedFeasibility:
    return CorrectedFeasibility(load_model("qwen3.6-27b"), load_gpu("b200"))


def test_the_planner_learns_nothing_from_a_launch_that_shared_the_gpu():
    config = {
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 1,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 4,
        "max_mamba_cache_size": 80,
    }
    oom = TrialResult(status="runtime_oom", config=config, reason="CUDA out of memory")
    shared = TrialResult.from_dict(
        {**oom.to_dict(), "measurement": {"device_at_launch": {"gpu": 0, "held_gib": 40.0, "floor_gib": 1.79}}}
    )
    alone = TrialResult.from_dict(
        {**oom.to_dict(), "measurement": {"device_at_launch": {"gpu": 0, "held_gib": 0.3, "floor_gib": 1.79}}}
    )
    planner = _planner()
    assert planner.learn_trial(config, shared) == {} and not planner.learned
    assert "planner_oom_headroom_gib" in planner.learn_trial(config, alone) and planner.learned

    class Stored:  # a finished trial as a resumed study replays it
        def __init__(self, number, result):
            self.number, self.state = number, TrialState.COMPLETE
            self.user_attrs = {"result": result.to_dict()}

    resumed = _planner()
    replay(resumed, [Stored(0, shared)])
    assert not resumed.learned


@pytest.mark.slow
def test_each_worker_checks_its_own_gpu(tmp_path, sleeper, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    device.register(
        1,
        pid=sleeper.pid,
        gpu_name="b200",
        total_mib=TOTAL_MIB,
        used_mib=100 * 1024,
        release_s=0.2,
        directory=tmp_path / "devices",
    )  # a tenant on GPU 1 only
    cfg = load_config(write_tiny_study(tmp_path, name="scale", trials=2, warmup_s=0.3))
    lines: list[str] = []
    codes = run_workers(cfg, [0, 1], echo=lines.append)
    assert codes[0] == 0 and codes[1] == 1, "\n".join(lines)
    busy = [line for line in lines if line.startswith("gpu1 | Error: ")]
    assert len(busy) == 1 and "GPU 1 is busy" in busy[0] and f"pid {sleeper.pid}" in busy[0]
    study = optuna.load_study(study_name="scale", storage=cfg.storage_url)
    assert {t.user_attrs.get("gpu", "").split(":")[-1] for t in study.trials if t.state == TrialState.COMPLETE} == {"0"}


class _FakePynvml:
    """The few NVML calls the reader makes, as nvidia-ml-py names them: a 140 GiB board a tenant holds 90 GiB of."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM = 1

    def __init__(self, tenant_pid: int):
        self.tenant_pid = tenant_pid

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Mem", (), {"used": 90.5 * 2**30, "total": 140 * 2**30})()

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [type("Proc", (), {"pid": self.tenant_pid, "usedGpuMemory": 90 * 2**30})()]

    def nvmlDeviceGetUtilizationRates(self, handle, *rest):
        raise self.NVMLError("not supported")

    nvmlDeviceGetPowerUsage = nvmlDeviceGetClockInfo = nvmlDeviceGetUtilizationRates


def test_a_real_gpus_compute_processes_name_the_tenant(monkeypatch, sleeper):
    from autotune.harness.gpu import NvmlReader

    monkeypatch.setitem(sys.modules, "pynvml", _FakePynvml(sleeper.pid))
    reader = NvmlReader(2)
    assert reader.processes() == [{"pid": sleeper.pid, "exited": False, "used_gib": 90.0}]
    with pytest.raises(GpuBusyError, match=rf"GPU 2 is busy: 90\.0 GiB of 140\.0 GiB .*pid {sleeper.pid}"):
        check_free(reader, 2)


def test_busy_gpu_wait_comes_from_the_study_file_and_a_bad_value_is_refused(tmp_path, sleeper, monkeypatch):
    from autotune.errors import ConfigError

    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    hold(tmp_path, sleeper.pid, 150.0)
    path = write_tiny_study(tmp_path, name="tiny", trials=2)
    path.write_text(path.read_text().replace("[engine]\n", '[engine]\nbusy_gpu = "wait"\nbusy_wait_s = 0.5\n'))
    sweep = Sweep(load_config(path))
    try:
        with pytest.raises(GpuBusyError, match=r"\(waited 0.5 s\)"):  # the harness's own check, in wait mode
            sweep.run()
    finally:
        sweep.close()
    path.write_text(path.read_text().replace('busy_gpu = "wait"', 'busy_gpu = "maybe"'))
    with pytest.raises(ConfigError, match="busy_gpu"):
        load_config(path)


def test_a_given_runners_launches_read_the_device_before_each_launch(tmp_path, sleeper):
    """``GivenRunner``: what a sweep wraps a given runner in; a tenant arriving between runs stops it before the next
    launch, for plain runs and repeats alike, and what each launch saw is its ``device_at_launch``."""
    from autotune.search.runner import GivenRunner

    launched: list[tuple[int, int | None]] = []

    class Plain:
        def __call__(self, config, number):
            launched.append((number, None))
            return TrialResult(status="ok", config=config)

    given = GivenRunner(Plain(), lambda: check_free(reader(tmp_path), 0))
    assert given({}, 1).measurement.device_at_launch["held_gib"] == 0
    given.repeat({}, 1, 2)  # a runner without its own ``repeat`` gets the trial's number
    hold(tmp_path, sleeper.pid, 120.0)
    with pytest.raises(GpuBusyError):
        given.repeat({}, 1, 3)
    with pytest.raises(GpuBusyError):
        given.start()
    assert launched == [(1, None), (1, None)]


def test_a_holders_command_line_never_shows_its_credentials():
    from autotune.redaction import redact_argv

    argv = [
        "-m",
        "sglang.launch_server",
        "--api-key",
        "s3cret-value",
        "--port",
        "30000",
        "--hf-token=hf_abcdefghijklmn",
        "--enable-metrics",
        "--model-path",
        "Qwen/Qwen3.6-27B",
    ]
    shown = redact_argv(argv)
    assert "s3cret-value" not in shown and "--hf-token=***" in shown and "hf_abcdefghijklmn" not in " ".join(shown)
    assert shown[shown.index("--api-key") + 1] == "***" and shown[-3:] == [
        "--enable-metrics",
        "--model-path",
        "Qwen/Qwen3.6-27B",
    ]
    assert len(shown) == len(argv)


def test_the_busy_line_redacts_a_tenants_api_key(tmp_path):
    secret = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--api-key", "s3cret-value"])
    try:
        hold(tmp_path, secret.pid, 150.0)
        with pytest.raises(GpuBusyError) as info:
            check_free(reader(tmp_path), 0)
    finally:
        secret.kill()
        secret.wait(timeout=10)
    assert f"pid {secret.pid}" in str(info.value) and "s3cret-value" not in str(info.value)
