"""`autotune apply` carries the study's engine into what it writes: interpreter, device, environment and model,
and `autotune fleet up` starts exactly that. The GPU list is given (command line or fleet file), never assumed;
env values that look like secrets are read from the environment at launch, never written or printed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import psutil
import pytest
from click.testing import CliRunner
from test_apply import make_study, result

from autotune.cli import cli, main
from autotune.config import load_config
from autotune.deploy.apply import load_winner, winner_from_yaml, write_artifacts
from autotune.deploy.fleet import Fleet, FleetServer, load_fleet, up, write_fleet
from autotune.errors import ConfigError, FleetError
from autotune.launch.process import free_port
from autotune.redaction import env_for_files, looks_secret, redact_env, resolve_env
from autotune.sglang.envs import ENV_PREFIX

TOKEN = "hf_" + "Zq8rT2vLm9Kx4Wn7Pb3Yc6Hd1"  # shaped like a Hugging Face token
CONFIG = {"mem_fraction_static": 0.85, "max_mamba_cache_size": 120, "speculative_algorithm": "EAGLE"}
SKIP = "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK"
FAST_SIM = ["--sim-startup-s", "0.1", "--sim-warmup-s", "0.05", "--sim-release-s", "0.2"]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def interpreter(tmp_path: Path, name: str = "study-python") -> Path:
    """The study's interpreter: this Python behind a wrapper that leaves a mark, so its use can be seen."""
    path = tmp_path / "venv" / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/usr/bin/env bash\ntouch "{path}.used"\nexec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(0o755)
    return path


def fake_sglang(tmp_path: Path) -> Path:
    """An interpreter whose ``-m sglang.launch_server`` is the simulator (which takes SGLang's flags, --device
    included); anything else runs this Python, which has no sglang, so the engine uses the bundled flag table."""
    path = tmp_path / "sgl" / "bin" / "python"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == "-m" && "$2" == "sglang.launch_server" ]]; then\n'
        "  shift 2\n"
        f'  exec {shlex.quote(sys.executable)} -m autotune.sim "$@" {" ".join(FAST_SIM)}\n'
        "fi\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    path.chmod(0o755)
    return path


def study_settings(tmp_path: Path, engine: str) -> dict:
    """``StudyConfig.to_dict()`` of a study file whose [engine] table names an interpreter, a device and env."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    path = tmp_path / "cpu-study.toml"
    path.write_text(f'[engine]\n{engine}\n[workload]\nprompts = "prompts.jsonl"\n')
    return load_config(path).to_dict()


def study_url(tmp_path: Path, settings: dict) -> str:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    make_study(url, trials=[(result(CONFIG, 1500.0), "search")], settings=settings)
    return url


def every_file(out: Path) -> str:
    return "".join(p.read_text() for p in sorted(out.iterdir()) if p.is_file())


def starts(script: str) -> list[list[str]]:
    return [
        shlex.split(line)[1:]
        for line in script.splitlines()
        if line.startswith("start ") and "sglang_router" not in line
    ]


def wait_healthy(port: int, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, log.read_text()[-2000:] if log.exists() else "no log"
        time.sleep(0.1)


def kill_pid_files(out: Path) -> None:
    for pid_file in out.glob("run/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)


# ---------------------------------------------------------------- the simulated engine on a CPU device


@pytest.mark.slow
def test_cpu_study_launcher_and_fleet_carry_its_engine(tmp_path, monkeypatch):
    python = interpreter(tmp_path)
    settings = study_settings(
        tmp_path,
        f'kind = "sim"\nmodel = "qwen3.6-27b"\npython = "{python}"\n'
        'device = "cpu"\nenv = {AUTOTUNE_STUDY_MARK = "cpu study", '
        f'HF_TOKEN = "{TOKEN}"}}\n'
        "sim_options = {startup_s = 0.1, warmup_s = 0.05, release_s = 0.2}",
    )
    url, out, port = study_url(tmp_path, settings), tmp_path / "deploy", free_port()
    res = CliRunner().invoke(
        cli,
        ["apply", "--storage", url, "--out", str(out), "--gpus", "0", "--allow-unstressed", "--base-port", str(port)],
    )
    assert res.exit_code == 0, res.output
    assert "HF_TOKEN looks like a secret" in res.output and TOKEN not in res.output
    assert TOKEN not in every_file(out)  # launcher, fleet file, provenance, YAML: none holds the value

    script = (out / "launch_fleet.sh").read_text()
    subprocess.run(["bash", "-n", str(out / "launch_fleet.sh")], check=True, timeout=10)
    assert "export AUTOTUNE_STUDY_MARK='cpu study'" in script
    assert ': "${HF_TOKEN:?' in script and 'export HF_TOKEN="${HF_TOKEN}"' in script
    ((log, pid, gpu, *argv),) = starts(script)
    assert (log, pid, gpu) == ("logs/cpu0.log", "run/cpu0.pid", "")  # the host's memory, as on SGLang's CPU backend
    assert argv[:3] == [str(python), "-m", "autotune.sim"]  # the study's interpreter, not a bare `python`
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--model-path") + 1] == "qwen3.6-27b"
    assert argv[argv.index("--sim-startup-s") + 1] == "0.1"

    fleet = load_fleet(out / "fleet.toml")
    assert (fleet.engine, fleet.device, fleet.python, fleet.model) == ("sim", "cpu", str(python), "qwen3.6-27b")
    assert fleet.env == {"AUTOTUNE_STUDY_MARK": "cpu study", "HF_TOKEN": "${HF_TOKEN}"}
    assert [(s.name, s.gpu, s.port) for s in fleet.servers] == [("cpu0", None, port)]

    # The secret is not set here: fleet up says which variable is missing and starts nothing.
    with pytest.raises(SystemExit) as exit_info:
        main(["fleet", "up", "--fleet", str(out / "fleet.toml"), "--timeout", "30"])
    assert exit_info.value.code == 1
    assert not list(out.glob("run/*.pid"))

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    try:
        res = CliRunner().invoke(cli, ["fleet", "up", "--fleet", str(out / "fleet.toml"), "--timeout", "30"])
        assert res.exit_code == 0 and "started: cpu0" in res.output, res.output
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
        assert info["device"] == "cpu" and info["mem_fraction_static"] == 0.85
        proc = psutil.Process(int((out / "run/cpu0.pid").read_text()))
        environ = proc.environ()
        assert environ["AUTOTUNE_STUDY_MARK"] == "cpu study" and environ["HF_TOKEN"] == TOKEN
        assert Path(f"{python}.used").exists()  # started through the study's interpreter
        assert TOKEN not in (out / "logs/cpu0.log").read_text()
        res = CliRunner().invoke(cli, ["fleet", "down", "--fleet", str(out / "fleet.toml"), "--grace", "5"])
        assert res.exit_code == 0 and "stopped: cpu0" in res.output
    finally:
        kill_pid_files(out)


# ---------------------------------------------------------------- the real engine's launch, on SGLang's CPU backend


@pytest.mark.slow
def test_sglang_cpu_study_runs_on_the_cpu_backend_from_fleet_up_and_the_launcher(tmp_path):
    python = fake_sglang(tmp_path)
    settings = study_settings(
        tmp_path,
        f'kind = "sglang"\nmodel = "qwen3.6-27b"\npython = "{python}"\ndevice = "cpu"\nenv = {{OMP_NUM_THREADS = "2"}}',
    )
    url, out, port = study_url(tmp_path, settings), tmp_path / "deploy", free_port()
    winner = load_winner(url)
    assert (winner.engine, winner.device, winner.python, winner.gpu) == ("sglang", "cpu", str(python), "CPU")
    write_artifacts(winner, out, gpus=[3], base_port=port)
    script = (out / "launch_fleet.sh").read_text()
    assert "export SGLANG_USE_CPU_ENGINE=1" in script and "export OMP_NUM_THREADS=2" in script
    ((log, pid, gpu, *argv),) = starts(script)
    assert gpu == ""  # CUDA_VISIBLE_DEVICES is left alone on the CPU backend
    assert argv[:3] == [str(python), "-m", "sglang.launch_server"] and argv[-2:] == ["--device", "cpu"]

    def check_running(pid_file: Path) -> None:
        proc = psutil.Process(int(pid_file.read_text()))
        environ, cmdline = proc.environ(), proc.cmdline()
        assert environ.get("SGLANG_USE_CPU_ENGINE") == "1" and environ.get("OMP_NUM_THREADS") == "2"
        assert "CUDA_VISIBLE_DEVICES" not in environ
        assert cmdline[cmdline.index("--device") + 1] == "cpu"
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
        assert info["device"] == "cpu" and info["mem_fraction_static"] == 0.85

    fleet = load_fleet(out / "fleet.toml")
    try:
        assert up(fleet, timeout_s=30) == ["cpu3"]
        wait_healthy(port, out / "logs/cpu3.log")
        check_running(out / "run/cpu3.pid")
        started = time.monotonic()
        res = CliRunner().invoke(cli, ["fleet", "down", "--fleet", str(out / "fleet.toml"), "--grace", "5"])
        assert res.exit_code == 0 and "stopped: cpu3" in res.output
        assert time.monotonic() - started < 20  # host RAM is not a GPU: no wait for it to drain to zero

        # The simulator stands in for SGLang here and keeps its simulated device busy for its release delay after
        # it exits; a script started within it would plan against the old server's memory (a race, not the fleet).
        from autotune.sim import device

        deadline = time.monotonic() + 5
        while device.read(0).used_mib > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["bash", str(out / "launch_fleet.sh")], check=True, timeout=20, capture_output=True)
        wait_healthy(port, out / "logs/cpu3.log")
        check_running(out / "run/cpu3.pid")
    finally:
        kill_pid_files(out)


@pytest.mark.slow
def test_sglang_engine_servers_get_the_winners_environment_lever(tmp_path):
    """The real engine's launch path (``sglang.launch_server`` through the study's interpreter) hands the winner's
    ``[space.env]`` lever to the server process, and the server runs with it: the stand-in reads it as 0.5.23 does
    (``environ.py`` L1637), so its running cap is 80 slots at ratio 4, not 5 (``kv_cache_configurator.py`` L3066)."""
    python = fake_sglang(tmp_path)
    settings = study_settings(tmp_path, f'kind = "sglang"\nmodel = "qwen3.6-27b"\npython = "{python}"\ndevice = "cpu"')
    config = {**CONFIG, "max_mamba_cache_size": 80, f"{ENV_PREFIX}{SKIP}": True}
    url = f"sqlite:///{tmp_path / 'study.db'}"
    make_study(url, trials=[(result(config, 1500.0), "search")], settings=settings)
    out, port = tmp_path / "deploy", free_port()
    write_artifacts(load_winner(url), out, gpus=[0], base_port=port)
    ((log, pid, gpu, *argv),) = starts((out / "launch_fleet.sh").read_text())
    assert argv[:2] == ["env", f"{SKIP}=1"] and argv[2:5] == [str(python), "-m", "sglang.launch_server"]
    fleet = load_fleet(out / "fleet.toml")
    try:
        assert up(fleet, timeout_s=30) == ["cpu0"]
        wait_healthy(port, out / "logs/cpu0.log")
        assert psutil.Process(int((out / "run/cpu0.pid").read_text())).environ().get(SKIP) == "1"
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 80 // 4  # the scheduler's cap
    finally:
        kill_pid_files(out)


# ---------------------------------------------------------------- no hidden GPU list


def test_no_gpu_list_is_an_error_naming_the_option(tmp_path, capsys):
    url, out = study_url(tmp_path, study_settings(tmp_path, 'kind = "sim"\nmodel = "qwen3.6-27b"')), tmp_path / "o"
    with pytest.raises(SystemExit) as exit_info:
        main(["apply", "--storage", url, "--out", str(out), "--allow-unstressed"])
    assert exit_info.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("Error: --gpus: no GPUs given") and "--fleet" in line
    assert not out.exists()
    with pytest.raises(ConfigError, match="--gpus"):
        write_artifacts(load_winner(url), out, gpus=[])


def test_gpus_come_from_a_fleet_file(tmp_path):
    url = study_url(tmp_path, study_settings(tmp_path, 'kind = "sim"\nmodel = "qwen3.6-27b"\nsim_gpu = "h200"'))
    servers = [
        FleetServer(name=f"box{g}", gpu=g, port=31000 + g, config="old.yaml", log=f"l/{g}", pid=f"p/{g}")
        for g in (2, 5)
    ]
    servers.append(
        FleetServer(
            name="far",
            host="ops@gpu-box",
            gpu=1,
            port=32000,
            bind="0.0.0.0",
            config="old.yaml",
            log="l/far",
            pid="p/far",
        )
    )
    old = write_fleet(Fleet(engine="sglang", model="m", servers=servers), tmp_path / "old" / "fleet.toml")
    out = tmp_path / "new"
    # "far" listens beyond loopback on another host, where autotune places no keys: refused in one line ...
    with pytest.raises(ConfigError, match=r"beyond loopback \(server far binds 0.0.0.0\) without keys.*--insecure"):
        write_artifacts(load_winner(url), out, layout=load_fleet(old))
    assert not (out / "fleet.toml").exists()
    # ... unless told --insecure, which it says
    res = CliRunner().invoke(
        cli, ["apply", "--storage", url, "--out", str(out), "--fleet", str(old), "--allow-unstressed", "--insecure"]
    )
    assert res.exit_code == 0, res.output
    assert "insecure: server far binds 0.0.0.0, without keys" in res.output
    fleet = load_fleet(out / "fleet.toml")
    assert [(s.name, s.host, s.gpu, s.port, s.config) for s in fleet.servers] == [
        ("box2", "localhost", 2, 31002, "sglang.yaml"),
        ("box5", "localhost", 5, 31005, "sglang.yaml"),
        ("far", "ops@gpu-box", 1, 32000, "sglang.yaml"),
    ]
    assert (fleet.engine, fleet.sim_gpu) == ("sim", "h200")  # the study's engine, not the old file's
    script = (out / "launch_fleet.sh").read_text()
    assert [s[:3] for s in starts(script)] == [["l/2", "p/2", "2"], ["l/5", "p/5", "5"]]
    assert "#   far on ops@gpu-box" in script  # another host's server: fleet up starts it, not this script
    res = CliRunner().invoke(
        cli,
        [
            "apply",
            "--storage",
            url,
            "--out",
            str(out),
            "--fleet",
            str(old),
            "--gpus",
            "0",
            "--allow-unstressed",
            "--insecure",
        ],
    )
    assert res.exit_code == 2 and "not both" in res.output


def test_cuda_study_pins_each_server_to_its_gpu(tmp_path):
    settings = study_settings(tmp_path, 'kind = "sglang"\nmodel = "/models/Qwen3.6-27B"\nsim_gpu = "h200"')
    winner = load_winner(study_url(tmp_path, settings))
    assert winner.gpu == "GPU (planner profile h200)"  # a real GPU, not the simulator's default b200
    write_artifacts(winner, tmp_path / "out", gpus=[0, 1], python="/venv/bin/python")
    ((_, _, gpu0, *argv), (_, _, gpu1, *_)) = starts((tmp_path / "out" / "launch_fleet.sh").read_text())
    assert (gpu0, gpu1) == ("0", "1") and argv[0] == "/venv/bin/python" and "--device" not in argv


# ---------------------------------------------------------------- secrets


def test_what_looks_like_a_secret():
    assert looks_secret("HF_TOKEN", "anything") and looks_secret("WANDB_API_KEY", "x")
    assert looks_secret("EXTRA", TOKEN) and looks_secret("EXTRA", "sk-" + "a1B2c3D4e5F6g7H8")
    assert looks_secret("EXTRA", "0123456789abcdef0123456789abcdef")
    for name, value in [
        ("SGLANG_USE_CPU_ENGINE", "1"),
        ("HF_HOME", "/data/hf"),
        ("OMP_NUM_THREADS", "8"),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("HF_TOKEN", "${HF_TOKEN}"),
        ("SGLANG_BACKEND", "flashinfer_trtllm_backend_v2"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ]:
        assert not looks_secret(name, value), name
    env = {"HF_TOKEN": TOKEN, "OMP_NUM_THREADS": "8"}
    assert redact_env(env) == {"HF_TOKEN": "***", "OMP_NUM_THREADS": "8"}
    assert env_for_files(env) == {"HF_TOKEN": "${HF_TOKEN}", "OMP_NUM_THREADS": "8"}
    assert resolve_env(env_for_files(env), {"HF_TOKEN": TOKEN}) == env
    with pytest.raises(ConfigError, match=r"env.HF_TOKEN: .*does not set HF_TOKEN \(export HF_TOKEN=") as info:
        resolve_env(env_for_files(env), {})
    assert TOKEN not in str(info.value)


def test_a_fleet_file_holding_a_secret_value_is_refused_without_echoing_it(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(
        f'engine = "sim"\nmodel = "m"\nenv = {{MY_SECRET = "${{MY_SECRET}}", HF_TOKEN = "{TOKEN}"}}\n'
        '[[servers]]\nname = "a"\ngpu = 0\nport = 30000\nconfig = "c.yaml"\nlog = "l"\npid = "p"\n'
    )
    with pytest.raises(FleetError, match=r'env.HF_TOKEN: looks like a secret.*HF_TOKEN = "\$\{HF_TOKEN\}"') as info:
        load_fleet(path)
    assert TOKEN not in str(info.value)
    path.write_text(path.read_text().replace(TOKEN, "${HF_TOKEN}"))
    assert load_fleet(path).env == {"MY_SECRET": "${MY_SECRET}", "HF_TOKEN": "${HF_TOKEN}"}  # references are fine


def test_provenance_records_the_engine_without_secret_values(tmp_path):
    import json

    settings = study_settings(
        tmp_path,
        f'kind = "sglang"\nmodel = "/m"\npython = "/opt/sgl/bin/python"\n'
        f'device = "cpu"\nenv = {{HF_TOKEN = "{TOKEN}", OMP_NUM_THREADS = "2"}}',
    )
    write_artifacts(load_winner(study_url(tmp_path, settings)), tmp_path / "out", gpus=[0])
    prov = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert (prov["engine"], prov["device"], prov["python"], prov["gpu"]) == (
        "sglang",
        "cpu",
        "/opt/sgl/bin/python",
        "CPU",
    )
    assert prov["env"] == {"HF_TOKEN": "${HF_TOKEN}", "OMP_NUM_THREADS": "2"}
    fleet_raw = tomllib.loads((tmp_path / "out" / "fleet.toml").read_text())
    assert fleet_raw["device"] == "cpu" and fleet_raw["python"] == "/opt/sgl/bin/python"
    again = winner_from_yaml(tmp_path / "out" / "sglang.yaml")  # deploying the YAML keeps the study's engine
    assert (again.engine, again.device, again.python, again.gpu) == ("sglang", "cpu", "/opt/sgl/bin/python", "CPU")
    assert again.env == {"HF_TOKEN": "${HF_TOKEN}", "OMP_NUM_THREADS": "2"}


def test_a_cpu_study_fleet_file_names_no_gpu_and_no_simulated_gpu(tmp_path):
    python = fake_sglang(tmp_path)
    settings = study_settings(tmp_path, f'kind = "sglang"\nmodel = "qwen3.6-27b"\npython = "{python}"\ndevice = "cpu"')
    winner = load_winner(study_url(tmp_path, settings))
    assert winner.sim_gpu is None
    out = tmp_path / "deploy"
    write_artifacts(winner, out, gpus=[0, 1], base_port=31000)
    doc = tomllib.loads((out / "fleet.toml").read_text())
    assert "sim_gpu" not in doc and doc["device"] == "cpu"
    assert [(s["name"], "gpu" in s) for s in doc["servers"]] == [("cpu0", False), ("cpu1", False)]
    fleet = load_fleet(out / "fleet.toml")
    assert [s.gpu for s in fleet.servers] == [None, None] and fleet.servers[0].where == "port 31000"
    with pytest.raises(Exception, match="has no gpu"):  # a GPU fleet's server must name its GPU
        Fleet(engine="sglang", model="m", servers=[FleetServer(name="a", port=1, config="c", log="l", pid="p")])
