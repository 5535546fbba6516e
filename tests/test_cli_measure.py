"""``autotune measure``: bad input is one line and exit 1 before any server starts; one real trial prints JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.cli.measure import load_config_file
from autotune.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(["measure", *args])
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.fixture
def quiet_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_error_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    for needle in needles:
        assert needle in lines[0]


def test_unknown_flag_is_one_line_before_any_server(capsys, quiet_env):
    code, _, err = run(
        capsys, "--set", "mamba-scheduler-strategy=extra_buffer", "--prompts", str(PROMPTS), "--out", "t"
    )
    assert code == 1
    _one_error_line(err, "--mamba-scheduler-strategy", "--mamba-radix-cache-strategy")
    assert not (quiet_env / "t").exists() and not (quiet_env / "runs").exists()


def test_unknown_engine(capsys, quiet_env):
    code, _, err = run(capsys, "--engine", "vllm")
    assert code == 1
    _one_error_line(err, "vllm", "sglang, sim")


def test_missing_prompts_file(capsys, quiet_env):
    code, _, err = run(capsys, "--prompts", str(quiet_env / "nope.jsonl"))
    assert code == 1
    _one_error_line(err, "nope.jsonl", "not found", "--prompts")


def test_default_prompts_found_beside_the_package(capsys, quiet_env):
    # cwd has no examples/ here; the shipped sample is found next to the package, so only the bad flag fails
    code, _, err = run(capsys, "--set", "no-such-flag=1")
    assert code == 1
    _one_error_line(err, "--no-such-flag")


def test_bad_jsonl_line_names_file_and_line(capsys, quiet_env):
    bad = quiet_env / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    code, _, err = run(capsys, "--prompts", str(bad))
    assert code == 1
    _one_error_line(err, f"{bad}:2", "not valid JSON")


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "c.toml",
            "max-mamba-cache-size = 200\ndisable-radix-cache = true\n",
            {"max-mamba-cache-size": 200, "disable-radix-cache": True},
        ),
        ("c.yaml", "max_running_requests: 8\n", {"max_running_requests": 8}),
        ("c.json", '{"flags": {"mem_fraction_static": 0.8}}', {"mem_fraction_static": 0.8}),
    ],
)
def test_config_files(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    assert load_config_file(path) == expected


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [("c.toml", "x = [", "cannot parse"), ("c.ini", "x=1", "unsupported"), ("c.yaml", "- 1\n", "mapping")],
)
def test_bad_config_files_name_the_file(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_config_file(path)
    assert str(path) in str(info.value)


@pytest.mark.slow
def test_measure_prints_the_trial_result_as_json(capsys, quiet_env):
    cfg = quiet_env / "flags.yaml"
    cfg.write_text("max-running-requests: 8\n")
    shm = quiet_env / "shm"
    shm.mkdir()
    code, out, _ = run(
        capsys,
        "--engine",
        "sim",
        "--config",
        str(cfg),
        "--set",
        "mem-fraction-static=0.85",
        "--prompts",
        str(PROMPTS),
        "--sample",
        "40",
        "--warmup",
        "1",
        "--window",
        "2",
        "--json",
        "--out",
        str(quiet_env / "trial"),
        "--gpu-index",
        "6",
        "--sim-opt",
        "startup_s=0.3",
        "--sim-opt",
        "release_s=0.3",
        "--sim-opt",
        f"shm={shm}",
    )
    assert code == 0
    data = json.loads(out)
    assert data["status"] == "ok"
    assert data["config"] == {"max_running_requests": 8, "mem_fraction_static": 0.85}
    assert data["capacity"]["max_running_requests"] == 8
    assert data["metrics"]["output_tok_s"] > 0 and data["metrics"]["concurrency"] == 16
    assert set(data["metrics"]["itl_ms"]) == {"p50", "p90", "p99", "mean"}
    assert "accept_length" in data["metrics"] and data["gpu"]["peak_used_gib"] > 0
    assert set(data["durations_s"]) == {"startup", "warmup", "measure", "teardown"}
    assert (quiet_env / "trial" / "result.json").exists() and not list(shm.iterdir())


def test_sglang_engine_without_sglang_is_one_line(capsys, quiet_env):
    import subprocess
    import sys

    has_sglang = subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0
    if has_sglang:
        pytest.skip("sglang is installed here")
    code, _, err = run(capsys, "--engine", "sglang", "--model", "/models/x", "--prompts", str(PROMPTS), "--out", "t")
    assert code == 1
    _one_error_line(err, "sglang is not importable", "--python")
    assert not (quiet_env / "t").exists()


def test_a_cpu_server_gets_no_cuda_devices_and_measure_names_no_gpu(capsys, quiet_env, monkeypatch):
    """SGLang's CPU backend (here the simulator behind an interpreter that records its environment)."""
    import shlex
    import sys

    from fakesglang import make_fake_sglang

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(quiet_env / "cache"))
    fake = make_fake_sglang(quiet_env / "fake")  # importable sglang (its version and flags), no server
    seen = quiet_env / "cuda-visible-devices"
    python = quiet_env / "bin" / "python"
    python.parent.mkdir()
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == "-m" && "$2" == "sglang.launch_server" ]]; then\n'
        f'  echo "${{CUDA_VISIBLE_DEVICES-unset}}" > {shlex.quote(str(seen))}; shift 2\n'
        f'  exec {shlex.quote(sys.executable)} -m autotune.sim "$@" --sim-startup-s 0.2 --sim-release-s 0.2\n'
        "fi\n"
        f'exec {shlex.quote(str(fake.python))} "$@"\n'
    )
    python.chmod(0o755)
    code, out, err = run(
        capsys,
        "--engine",
        "sglang",
        "--device",
        "cpu",
        "--python",
        str(python),
        "--model",
        "qwen3.6-27b",
        "--prompts",
        str(PROMPTS),
        "--sample",
        "8",
        "--warmup",
        "0.5",
        "--window",
        "1",
        "--out",
        str(quiet_env / "trial"),
    )
    assert code is None or code == 0, out + err
    assert seen.read_text().strip() == "unset"  # the trial's launch set no CUDA_VISIBLE_DEVICES
    assert "GPU peak used" not in out and "modelled startup" not in out
    assert "host memory peak" in out
    import json

    record = json.loads((quiet_env / "trial" / "result.json").read_text())  # the record holds no GPU key either
    assert record["device"] == "cpu" and not {"modelled_startup_s", "gpu", "gpus", "gpu_index"} & set(record)
    assert record["host"]["peak_used_gib"] > 0 and record["host"]["total_gib"] > 0
    assert not {"peak_power_w", "per_gpu"} & set(record["host"])


def test_measure_on_a_gpu_another_process_holds_is_one_line_and_starts_nothing(capsys, quiet_env):
    import subprocess
    import sys

    from autotune.sim import device

    tenant = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        device.register(
            0,
            pid=tenant.pid,
            gpu_name="b200",
            total_mib=183_359.0,
            used_mib=150 * 1024.0,
            release_s=0.1,
            directory=quiet_env / "devices",
        )
        code, _, err = run(capsys, "--prompts", str(PROMPTS), "--out", "t")
    finally:
        tenant.kill()
        tenant.wait(timeout=10)
    assert code == 1
    _one_error_line(err, "GPU 0 is busy", f"pid {tenant.pid}")
    assert not (quiet_env / "t").exists()  # no server was started


def test_ctrl_c_stops_the_server_and_reports_the_trial_interrupted(quiet_env):
    """One SIGINT: the trial stops its server cleanly and the result says so (exit 3); no server outlives it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    out = quiet_env / "trial"
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(quiet_env / "devices")}
    argv = [sys.executable, "-m", "autotune", "measure", "--engine", "sim", "--prompts", str(PROMPTS), "--sample", "8"]
    argv += ["--warmup", "1", "--window", "120", "--json", "--out", str(out), "--sim-opt", "startup_s=0.2"]
    proc = subprocess.Popen(argv, cwd=quiet_env, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 50
        while not list(out.glob("*.pid")) and not (out / "server.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # past the server's start, into the trial's window
        servers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=50)
    finally:
        proc.kill()
    assert proc.returncode == 3, stderr[-2000:]
    assert json.loads(stdout)["status"] == "interrupted"
    assert servers and not [p for p in servers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_a_workload_value_the_record_refuses_names_measures_option(tmp_path):
    """The options build the study's own workload record; what it refuses is one error naming the option."""
    from autotune.cli.measure import workload_of
    from autotune.errors import WorkloadError

    with pytest.raises(WorkloadError, match="^--target-half-width: .*less than 1") as info:
        workload_of(prompts=PROMPTS, target_half_width=1.5)
    assert info.value.key == "--target-half-width"
    spec = workload_of(prompts=PROMPTS, measure_s=2.0)
    assert spec.option("measure_s") == "--window" and spec.option("sample_size") == "--sample"
