"""Engine contract suite, run over both engines on real SGLang 0.5.23 output (tests/data/recorded/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fakesglang import make_fake_sglang

from autotune.cli.measure import measure
from autotune.cli.sweep import sweep
from autotune.cli.worker import worker
from autotune.config.sections import ENGINE_KINDS
from autotune.errors import ConfigError
from autotune.harness.engines import ENGINES, EngineSettings, SGLangEngine, SimEngine, logparse, make_engine
from autotune.harness.engines.sim import sim_argv

RECORDED = Path(__file__).parent / "data" / "recorded"


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


@pytest.fixture(params=sorted(ENGINES))
def engine(request, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    return make_engine(request.param, model_path="qwen3.6-27b")


# -- classification on real logs ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "code", "kind", "phrase"),
    [
        ("llama-mem-fraction-1e-5.exit137.log", 137, "startup_oom", "Loaded weights leave no GPU memory"),
        ("qwen3next-mamba2-too-small.exit137.log", 137, "startup_oom", "too small to serve any requests"),
        ("qwen3next-mem-fraction-1e-5.exit137.log", -9, "startup_oom", "Not enough GPU memory for hybrid"),
        ("qwen3next-startup-serve-sigterm.log", 0, None, None),
        ("qwen3next-mamba16-capped-to-5.log", 0, None, None),
        ("llama-startup-serve-sigterm.log", None, None, None),
    ],
)
def test_classify_recorded_logs(name, code, kind, phrase):
    text = recorded(name)
    assert logparse.classify(text, code) == kind
    line = logparse.failure_line(text, code)
    if phrase is None:
        assert line is None
    else:
        assert phrase in line
        assert line.startswith(("ValueError:", "RuntimeError:"))  # the exception line, not a traceback frame


def test_bad_args_from_argparse_and_from_resolution():
    argparse_err = (
        "usage: launch_server.py [-h] ...\n"
        "launch_server.py: error: unrecognized arguments: --mamba-scheduler-strategy extra_buffer\n"
    )
    assert logparse.classify(argparse_err, 2) == "bad_args"
    assert "unrecognized arguments" in logparse.failure_line(argparse_err, 2)
    resolve_err = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
        "ValueError: --mamba-radix-cache-strategy extra_buffer needs mamba state\n"
    )
    assert logparse.classify(resolve_err, 1) == "bad_args"
    assert logparse.failure_line(resolve_err, 1).startswith("ValueError: --mamba-radix-cache-strategy")


def test_cuda_oom_before_and_after_ready():
    head = recorded("qwen3next-startup-serve-sigterm.log").split(logparse.READY_LINE)[0]
    capture = head + "[2026-11-29 08:02:26] Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert logparse.classify(capture, 137) == "startup_oom"
    assert "Capture cuda graph failed" in logparse.failure_line(capture, 137)
    serving = (
        head
        + logparse.READY_LINE
        + "\n[2026-11-29 08:03:00] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB\n"
    )
    assert logparse.classify(serving, -9) == "runtime_oom"
    assert logparse.failure_line(serving, -9).startswith("torch.OutOfMemoryError")


def test_crash_without_a_phrase():
    text = recorded("qwen3next-startup-serve-sigterm.log")
    assert logparse.classify(text, -9) == "crash"
    assert logparse.classify(text, None) is None  # still running: nothing to classify


def test_a_rank_without_a_device_is_a_crash_named_by_its_ordinal_line():
    """A GPU group smaller than tp × pp: the first rank past CUDA_VISIBLE_DEVICES dies in ``set_device``. The
    launch's fault, not the config's (never ``bad_args``, never an OOM), even when SGLang's parent adds its own
    exception after it."""
    from autotune.sim import logs

    head = recorded("llama-startup-serve-sigterm.log").split("Load weight begin")[0].rsplit("\n", 1)[0]
    trace = logs.invalid_device_ordinal()[0]
    text = (
        f"{head}\n[2026-11-29 08:00:57 TP1] {trace}"
        "[2026-11-29 08:00:57] Rank 1 scheduler is dead. Please check if there are relevant logs.\n"
        "[2026-11-29 08:00:57] RuntimeError: Initialization failed. Please see the error messages above.\n"
    )
    for code in (137, -9, 1):
        assert logparse.classify(text, code) == "crash"
        assert logparse.failure_line(text, code) == "RuntimeError: CUDA error: invalid device ordinal"


# -- capacity ---------------------------------------------------------------------------------------------
def test_capacity_from_log_alone():
    cap = logparse.capacity(recorded("qwen3next-mamba16-capped-to-5.log"), None)
    assert cap.max_running_requests == 5
    assert cap.kv_tokens == 1796728
    assert cap.mamba_slots == 16
    assert cap.context_len == 2048 and cap.chunked_prefill_size == 4096
    assert cap.kv_gib == pytest.approx(0.86)
    assert cap.available_gib == pytest.approx(17.42)
    assert cap.weights_gib == pytest.approx(0.01)


def test_capacity_prefers_server_info_internal_states():
    info = json.loads(recorded("qwen3next-server_info.json"))
    cap = logparse.capacity(recorded("qwen3next-startup-serve-sigterm.log"), info)
    assert cap.max_running_requests == 1481
    assert cap.mamba_slots == 4443
    assert cap.kv_tokens == 1985628
    assert cap.mem_fraction_static == pytest.approx(0.1)
    assert cap.kv_gib == pytest.approx(0.947)
    assert cap.available_gib == pytest.approx(16.705)
    assert logparse.startup_seconds(info) == pytest.approx(13.664, abs=1e-3)


def test_capacity_of_dense_model_has_no_mamba():
    cap = logparse.capacity(recorded("llama-startup-serve-sigterm.log"), None)
    assert cap.mamba_slots is None and cap.mamba_gib is None
    assert cap.max_running_requests == 4096 and cap.kv_tokens == 4282560


def test_speculative_mamba_line_sums_intermediates():
    line = (
        "[2026-01-01 00:00:00] Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 0.36GB, "
        "ssm_state size: 11.39GB intermediate_ssm_state_cache size: 9.56GB "
        "intermediate_conv_window_cache size: 0.05GB\n"
    )
    cap = logparse.capacity(line)
    assert cap.mamba_slots == 80
    assert cap.mamba_gib == pytest.approx(0.36 + 11.39 + 9.56 + 0.05)


# -- launch command and validation -------------------------------------------------------------------------
def test_argv_is_a_list_with_harness_flags(engine):
    argv = engine.argv({"max_mamba_cache_size": 200, "disable_radix_cache": True}, port=4321)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    assert argv[argv.index("--port") + 1] == "4321"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--max-mamba-cache-size") + 1] == "200"
    assert "--disable-radix-cache" in argv
    assert "CUDA_VISIBLE_DEVICES" not in engine.env()  # which GPU is the launcher's (launch.local)


def test_check_rejects_renamed_flag_with_did_you_mean(engine, monkeypatch):
    with pytest.raises(ConfigError, match="use --mamba-radix-cache-strategy"):
        engine.check({"mamba_scheduler_strategy": "extra_buffer"})
    with pytest.raises(ConfigError, match="set by the harness"):
        engine.check({"port": 1})
    assert engine.check({"max-mamba-cache-size": "200"}) == {"max_mamba_cache_size": 200}


def test_unknown_engine_names_the_kinds():
    with pytest.raises(ConfigError, match="sglang, sim"):
        make_engine("vllm", model_path="m")


def test_sim_engine_launches_the_simulator_with_its_options():
    eng = SimEngine(
        model_path="qwen3.6-27b", sim_gpu="h200", sim_options={"startup_s": 0.3, "shm": True, "noise": False}
    )
    argv = eng.argv({}, port=1234)
    assert argv[1:3] == ["-m", "autotune.sim"]
    assert argv[argv.index("--sim-gpu") + 1] == "h200"
    assert sim_argv({"sim_startup_s": 0.3, "shm": True, "noise": False}) == ["--sim-startup-s", "0.3", "--sim-shm"]
    assert eng.shm_dir == Path("/dev/shm")  # teardown cleans where the simulator writes
    assert SimEngine(sim_options={"shm": "/tmp/x"}).shm_dir == Path("/tmp/x")
    assert SimEngine().shm_dir is None


def test_sglang_cpu_device_sets_backend_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    eng = SGLangEngine(model_path="/m", device="cpu", python=sys.executable)
    argv = eng.argv({}, port=1)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--device") + 1] == "cpu"
    assert eng.env() == {"SGLANG_USE_CPU_ENGINE": "1"}


def test_engine_env_is_its_own_extras_and_no_device_selection(engine):
    """Device selection moved to the launcher (``launch.local.LocalLauncher.device_env``); the engine keeps only
    what its study file's ``env`` says."""
    forced = make_engine(engine.name, model_path="qwen3.6-27b", env={"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "X": "1"})
    assert forced.env() == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "X": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in engine.env() and "CUDA_DEVICE_ORDER" not in engine.env()


def test_preflight_refuses_an_interpreter_without_sglang(tmp_path):
    from autotune.errors import EngineError

    eng = SGLangEngine(model_path="/m", python=sys.executable, cache_dir=tmp_path)
    if eng.sglang_version() is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(EngineError, match="sglang is not importable"):
        eng.preflight()
    SGLangEngine(
        model_path="/m", python=str(make_fake_sglang(tmp_path / "fake").python), cache_dir=tmp_path
    ).preflight()
    SimEngine().preflight()
    with pytest.raises(EngineError, match="not found"):
        SGLangEngine(model_path="/m", python=str(tmp_path / "no-python")).preflight()


# -- the registry: one module and one entry per engine ----------------------------------------------------------
def test_the_registry_is_what_study_files_are_checked_against():
    assert set(ENGINES) == set(ENGINE_KINDS)  # config cannot import the harness, so it keeps the names and traits
    assert all(ENGINE_KINDS[name].simulated == cls.simulated for name, cls in ENGINES.items())


def test_only_the_sglang_engine_offers_its_installed_flags_and_version():
    from autotune.harness.engines.base import InstalledSGLang, Predictor

    sglang, sim = make_engine("sglang", model_path="qwen3.6-27b"), make_engine("sim", model_path="qwen3.6-27b")
    assert isinstance(sglang, InstalledSGLang) and not isinstance(sglang, Predictor)
    assert isinstance(sim, Predictor) and not isinstance(sim, InstalledSGLang)


def meets_the_contract(kind: str) -> None:
    """What every engine must do, whatever it launches: built from the shared settings by name, an argv of
    strings, a typed config from ``check``, the fields the harness reads, and its kind's traits in config."""
    eng = make_engine(kind, model_path="qwen3.6-27b")
    assert eng.name == kind == ENGINES[kind].name
    argv = eng.argv({}, port=4321)
    assert isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
    assert isinstance(eng.check({}), dict)
    assert eng.model_path == "qwen3.6-27b" and eng.device in ("cuda", "cpu")
    assert ENGINE_KINDS[kind].simulated is ENGINES[kind].simulated
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in eng.env().items())
    assert isinstance(eng.shm_dir, Path | None)


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_every_registered_engine_meets_the_contract(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    meets_the_contract(kind)


def test_make_engine_hands_each_engine_the_settings_it_reads():
    sim = make_engine("sim", model_path="qwen3.6-27b", sim_gpu="h200", sim_options={"noise": 0.1}, device="cpu")
    assert isinstance(sim, SimEngine) and (sim.sim_gpu, sim.sim_options) == ("h200", {"noise": 0.1})
    real = make_engine("sglang", model_path="/m", python="/py", env={"X": "1"}, sim_gpu="h200", device="cpu")
    assert isinstance(real, SGLangEngine) and (real.device, real.python, real.extra_env) == ("cpu", "/py", {"X": "1"})
    with pytest.raises(TypeError):  # a misspelt setting is a bug, not a silently ignored value
        make_engine("sim", model_path="m", sim_gpus="h200")


def test_a_new_engine_is_one_registry_entry(monkeypatch):
    class EchoEngine:
        name = "echo"

        def __init__(self, settings: EngineSettings):
            self.settings = settings

        @classmethod
        def from_settings(cls, settings: EngineSettings) -> EchoEngine:
            return cls(settings)

    monkeypatch.setitem(ENGINES, "echo", EchoEngine)
    eng = make_engine("echo", model_path="m", device="cpu")
    assert isinstance(eng, EchoEngine) and eng.settings == EngineSettings(model_path="m", device="cpu")
    with pytest.raises(ConfigError, match="echo, sglang, sim"):
        make_engine("vllm", model_path="m")


def test_engine_options_offer_the_registered_names():
    for command in (sweep, worker):
        option = next(p for p in command.params if p.name == "engine")
        assert list(option.type.choices) == sorted(ENGINES)
    option = next(p for p in measure.params if p.name == "engine_name")  # checked by make_engine: one line, exit 1
    assert all(kind in option.help for kind in ENGINES)
