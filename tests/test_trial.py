"""End-to-end trials against the simulated SGLang server on loopback: every outcome, and a clean slate after each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from simserver import sim_command

from autotune.config import Timeouts
from autotune.harness.engines import make_engine
from autotune.harness.engines.sim import SimGpuReader
from autotune.harness.setup import TrialHooks, TrialSetup
from autotune.harness.trial import run_trial
from autotune.harness.workload import PromptSample, WorkloadSpec
from autotune.launch.process import free_port, port_is_free, stop_process_group
from autotune.progress import PhaseInfo
from autotune.results import TrialResult

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
GPU = 2  # a device index of the simulated GPU only these tests use


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    (tmp_path / "shm").mkdir()
    return tmp_path


def sim(tmp_path: Path, **extra):
    options = {"startup_s": 0.3, "release_s": 0.3, "shm": str(tmp_path / "shm"), **extra}
    return make_engine("sim", model_path="qwen3.6-27b", sim_gpu="b200", sim_options=options)


def spec(**kw) -> WorkloadSpec:
    base = dict(prompts=PROMPTS, sample_size=60, warmup_s=1.0, measure_s=2.5)
    return WorkloadSpec(**{**base, **kw})


# For tests of how a server is started, not of what it measures: eight prompts (a first prefill that fits a loaded
# host's second, not the sample's 16K tokens at once) and a window cap that waits for the first tokens.
PLUMBING = spec(sample_size=8, warmup_s=0.3, measure_s=1.0, measure_max_s=6.0)


def trial(
    tmp_path,
    config,
    *,
    engine=None,
    name="t",
    hook=None,
    workload=None,
    timeouts=None,
    stop_event=None,
    launcher="local",
) -> tuple[TrialResult, list]:
    phases: list = []

    def on_phase(name: str, info: dict) -> None:
        phases.append((name, info))
        if hook is not None:
            hook(name, info)

    setup = TrialSetup(
        engine=engine or sim(tmp_path),
        workload=workload or spec(),
        gpu_index=GPU,
        run_dir=tmp_path / "runs",
        shm_dir=tmp_path / "shm",
        launcher=launcher,
        timeouts=timeouts or Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    result = run_trial(
        setup, config, trial_dir=tmp_path / name, hooks=TrialHooks(on_phase=on_phase, stop_event=stop_event)
    )
    assert_clean(tmp_path, result, phases)
    return result, phases


def assert_clean(tmp_path: Path, result: TrialResult, phases: list) -> None:
    """After any trial: no server process, port free, simulated GPU released, no pid file, no shm leftovers."""
    starting = next(info for name, info in phases if name == "starting")
    assert all(set(info) <= PhaseInfo.__optional_keys__ for _, info in phases)  # the keys the display may read
    pid = next((info["pid"] for name, info in phases if name == "warmup"), None)
    if pid is not None:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert port_is_free("127.0.0.1", starting["port"])
    assert SimGpuReader(GPU).read().used_gib < 0.1
    assert not list((tmp_path / "runs").glob("server-*.json"))
    assert not list((tmp_path / "shm").iterdir())
    saved = json.loads((Path(result.trial_dir) / "result.json").read_text())
    assert TrialResult.from_dict(saved) == result


def test_good_config_matches_the_simulators_prediction(env):
    from autotune.sim.evaluate import SimWorkload, evaluate

    config = {"speculative_algorithm": "NEXTN", "max_mamba_cache_size": 80}  # the seed's MTP config: R = 16
    result, phases = trial(env, config, workload=spec(concurrency=32))
    assert result.status == "ok", result.reason
    assert 2.0 < result.metrics.accept_length < 4.0  # server-side, MTP with D=4
    assert [n for n, _ in phases if n != "measuring"] == ["starting", "warmup", "stopping"]
    assert any(n == "measuring" and "tok_s" in i for n, i in phases)
    assert result.capacity.max_running_requests == 16 and result.capacity.mamba_slots == 80
    assert result.gpu.peak_used_gib > 100 and result.gpu.samples > 5
    assert result.modelled_startup_s > 60  # the startup a real GPU would pay, reported by the server
    assert set(result.durations_s) == {"startup", "warmup", "measure", "teardown"}
    assert (Path(result.trial_dir) / "records.jsonl").stat().st_size > 0
    sample = PromptSample.load(PROMPTS, 60)
    predicted = evaluate(
        config,
        SimWorkload(prompts=[r.as_text() for r in sample.rows], concurrency=32, warmup_s=1.0, measure_s=2.5),
        model="qwen3.6-27b",
        gpu="b200",
    )
    assert predicted.status == "ok"
    print(f"measured {result.metrics.output_tok_s:.1f} tok/s, predicted {predicted.metrics.output_tok_s:.1f} tok/s")
    assert result.metrics.output_tok_s == pytest.approx(predicted.metrics.output_tok_s, rel=0.10)


def test_bad_flag_is_bad_args_before_launch(env):
    result = run_trial(
        TrialSetup(engine=sim(env), workload=spec(), run_dir=env / "runs"),
        {"mamba_scheduler_strategy": "extra_buffer"},
        trial_dir=env / "bad",
    )
    assert result.status == "bad_args"
    assert "--mamba-radix-cache-strategy" in result.reason
    assert not (env / "bad" / "server.log").exists()  # nothing was launched


def test_bad_combination_rejected_by_the_server_is_bad_args(env):
    result, _ = trial(env, {"mamba_radix_cache_strategy": "no_buffer", "page_size": 64})
    assert result.status == "bad_args"
    assert result.exit_code == 1
    assert result.reason.startswith("ValueError: --mamba-radix-cache-strategy no_buffer")


def test_startup_oom_is_classified_from_sglangs_line(env):
    # startup_s 1: the dying server holds its /dev/shm files long enough to be seen holding them (SGLang: ~20 s)
    result, _ = trial(env, {"mem_fraction_static": 0.287}, engine=sim(env, startup_s=1.0))
    assert result.status == "startup_oom"
    assert "Not enough GPU memory for hybrid" in result.reason
    assert result.exit_code in (137, -9)
    assert result.metrics is None and "Not enough GPU memory" in result.log_tail


def test_runtime_oom_during_the_replay(env):
    config = {"mem_fraction_static": 0.95, "chunked_prefill_size": 32768, "cuda_graph_backend_prefill": "disabled"}
    # Activations for a prefill chunk above ~17k tokens do not fit this config: one 25k-token prompt is enough.
    long = env / "long.jsonl"
    long.write_text(json.dumps({"prompt": "lorem ipsum " * 8_500}) + "\n")
    result, _ = trial(env, config, workload=spec(prompts=long, concurrency=2))
    assert result.status == "runtime_oom"
    assert "CUDA out of memory" in result.reason


def test_server_killed_mid_measure_is_a_crash_with_log_tail(env):
    pids: dict = {}

    def hook(name, info):
        if name == "warmup":
            pids["pid"] = info["pid"]
        if name == "measuring" and "killed" not in pids:
            os.kill(pids["pid"], signal.SIGKILL)
            pids["killed"] = True

    result, _ = trial(env, {"max_running_requests": 8}, workload=spec(measure_s=20), hook=hook)
    assert pids.get("killed")
    assert result.status == "crash"
    assert result.exit_code == -signal.SIGKILL
    assert "fired up and ready to roll" in result.log_tail
    assert result.durations_s["measure"] < 10  # noticed at once, not at window end


def test_startup_timeout(env):
    result, _ = trial(
        env, {}, engine=sim(env, startup_s=60), timeouts=Timeouts(startup_s=1.0, teardown_s=10, grace_s=2)
    )
    assert result.status == "timeout"
    assert "not ready after 1 s" in result.reason


def test_stop_event_interrupts_cleanly(env):
    stop = threading.Event()
    t0 = time.monotonic()
    result, _ = trial(
        env,
        {"max_running_requests": 8},
        workload=spec(measure_s=30),
        stop_event=stop,
        hook=lambda name, info: stop.set() if name == "measuring" else None,
    )
    assert result.status == "interrupted"
    assert time.monotonic() - t0 < 20


HARNESS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from autotune.harness.engines import make_engine
    from autotune.harness.setup import TrialHooks, TrialSetup
    from autotune.harness.trial import run_trial
    from autotune.harness.workload import WorkloadSpec
    tmp = Path(sys.argv[1])
    eng = make_engine("sim", model_path="qwen3.6-27b", sim_options={"startup_s": 0.3, "release_s": 0.3, "shm": str(tmp
    / "shm")})
    def phase(name, info):
        if name == "warmup":
            print("PID", info["pid"], flush=True)
    work = WorkloadSpec(prompts=Path(sys.argv[2]), sample_size=20, warmup_s=60, measure_s=60)
    setup = TrialSetup(engine=eng, workload=work, gpu_index=3, run_dir=tmp / "runs", shm_dir=tmp / "shm")
    run_trial(setup, {"max_running_requests": 8}, trial_dir=tmp / "h", hooks=TrialHooks(on_phase=phase))
    """
)


def test_next_run_removes_the_orphan_of_a_killed_harness(env):
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(env), str(PROMPTS)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(env / "devices")},
    )
    lookalike_port = free_port()
    lookalike = subprocess.Popen(  # an unrelated sim server with the same kind of command line, not in any pid file
        sim_command(lookalike_port, startup_s=0.3),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "4"},
    )
    try:
        line = harness.stdout.readline().split()
        assert line and line[0] == "PID", line
        orphan = int(line[1])
        harness.send_signal(signal.SIGKILL)
        harness.wait(10)
        assert psutil.pid_exists(orphan)
        assert len(list((env / "runs").glob("server-*.json"))) == 1
        result, _ = trial(env, {"max_running_requests": 8}, workload=spec(measure_s=1.0), name="next")
        assert result.status == "ok"
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert lookalike.poll() is None  # the unrelated server survived
        deadline = time.monotonic() + 10
        while SimGpuReader(3).read().used_gib > 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert SimGpuReader(3).read().used_gib < 0.5  # the orphan's GPU memory came back
    finally:
        harness.kill()
        stop_process_group(lookalike.pid, grace_s=2)


def test_the_trial_starts_its_server_through_the_named_launcher(env):
    """One way to start a server: the trial hands its launcher a spec (the engine's argv and env, the GPU) and
    never builds a process itself; an unknown launcher name is a setup error, raised before any launch."""
    from autotune.errors import ConfigError
    from autotune.launch.local import LocalLauncher

    seen = []

    class Spy(LocalLauncher):
        def start(self, spec, *, gpu_reader=None):
            seen.append(spec)
            return super().start(spec, gpu_reader=gpu_reader)

    result, _ = trial(env, {}, launcher=Spy(), workload=PLUMBING)
    # one launch, or two where a loaded host made the first window untrusted and the trial measured it again
    assert result.status == "ok" and len(seen) in (1, 2)
    for launched in seen:  # every launch went through the launcher
        assert launched.gpus == (GPU,) and "CUDA_VISIBLE_DEVICES" not in launched.env  # the launcher picks the GPU
        assert isinstance(launched.argv, list) and launched.argv[1:3] == ["-m", "autotune.sim"]
    with pytest.raises(ConfigError, match="unknown launcher 'nowhere'"):
        run_trial(TrialSetup(engine=sim(env), workload=spec(), launcher="nowhere"), {}, trial_dir=env / "x")


def test_a_trial_runs_through_the_ssh_launcher_on_a_loopback_transport(env):
    """The same trial over SSH: the launcher's shell lines run by ``bash -c`` here (what sshd would do on the host);
    measured ok, then nothing left serving and the simulated GPU released."""
    from launchcase_ssh import Loopback

    from autotune.launch.ssh import SshLauncher

    transport = Loopback()
    launcher = SshLauncher(host="127.0.0.1", remote_dir=str(env / "remote"), transport=transport)
    setup = TrialSetup(
        engine=sim(env),
        workload=PLUMBING,
        gpu_index=GPU,
        run_dir=env / "runs",
        launcher=launcher,
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    phases: list = []
    result = run_trial(setup, {}, trial_dir=env / "ssh", hooks=TrialHooks(on_phase=lambda n, i: phases.append((n, i))))
    assert result.status == "ok" and result.output_tok_s and result.output_tok_s > 0, result.reason
    starting = next(info for name, info in phases if name == "starting")
    assert port_is_free("127.0.0.1", starting["port"])
    assert SimGpuReader(GPU).read().used_gib < 0.1
    assert any("setsid" in command or "kill" in command for _, command in transport.commands)
    assert "fired up and ready to roll" in (env / "ssh" / "server.log").read_text()  # the host's log, read back
