"""The container launcher: its ``docker run`` line against SGLang's documented one, and its lifecycle (start, ready,
stop, gone; a server that fails at startup) on the fake docker CLI (``tests/fakedocker.py``) with the sim engine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchcase_container import case, fake_runtime
from simserver import sim_command

from autotune.errors import ServerError
from autotune.harness.engines.sglang import SGLangEngine
from autotune.harness.engines.sim import SimGpuReader
from autotune.launch import LAUNCHERS, LaunchSpec, ServerExited
from autotune.launch.container import ContainerLauncher, inside_argv
from autotune.launch.ports import free_port, port_is_free

pytestmark = pytest.mark.timeout(90)

SECRET = "hf_AbCdEfGhIjKlMnOpQrStUv123456"
# SGLang's documented line (docs/get_started/install.md, "Method 3: Using docker"), one element per entry.
DOCUMENTED = [
    "docker",
    "run",
    "--gpus",
    "all",
    "--shm-size",
    "32g",
    "-p",
    "30000:30000",
    "-v",
    "~/.cache/huggingface:/root/.cache/huggingface",
    "--env",
    "HF_TOKEN=<secret>",
    "--ipc=host",
    "lmsysorg/sglang:latest",
    "python3",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "meta-llama/Llama-3.1-8B-Instruct",
    "--host",
    "0.0.0.0",
    "--port",
    "30000",
]


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def b200_spec(tmp_path: Path) -> LaunchSpec:
    engine = SGLangEngine(
        model_path="meta-llama/Llama-3.1-8B-Instruct", python=sys.executable
    )  # a host path: python3 inside
    argv = engine.argv({"mem_fraction_static": 0.85}, port=30000)
    return LaunchSpec(
        argv=argv,
        port=30000,
        log_path=tmp_path / "server.log",
        gpus=(3,),
        name="autotune-trial-7",
        env={"HF_TOKEN": SECRET, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"},
    )


def test_the_b200_command_is_sglangs_documented_docker_run_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", "/models/hf")
    launcher = ContainerLauncher()
    argv, hidden = launcher.command(b200_spec(tmp_path), "autotune-trial-7")
    image = argv.index("lmsysorg/sglang:latest")
    head, inside = argv[:image], argv[image + 1 :]

    def value(flag: str) -> list[str]:
        return [head[i + 1] for i, a in enumerate(head) if a == flag]

    assert head[:3] == ["docker", "run", "-d"] and value("--name") == ["autotune-trial-7"]
    # documented → ours, element by element
    assert value("--gpus") == ["device=3"]  # --gpus all → the trial's GPU only
    assert value("--shm-size") == ["32g"]  # --shm-size 32g; --ipc=host is the opt-in alternative (below)
    assert value("-p") == ["127.0.0.1:30000:30000"]  # -p 30000:30000, published on loopback only
    assert value("-v") == ["/models/hf:/root/.cache/huggingface"]  # the HF cache mount, from $HF_HOME
    assert "HF_TOKEN" in value("-e") and hidden == {"HF_TOKEN": SECRET}  # --env HF_TOKEN=… by name
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in value("-e")
    assert not any(v.startswith("CUDA_VISIBLE_DEVICES") for v in value("-e"))  # inside, GPUs are 0..n-1
    assert (
        inside[: DOCUMENTED.index("--host") - DOCUMENTED.index("python3")]
        == DOCUMENTED[DOCUMENTED.index("python3") : DOCUMENTED.index("--host")]
    )
    assert inside[inside.index("--host") + 1] == "0.0.0.0" and inside[inside.index("--port") + 1] == "30000"
    assert inside[inside.index("--mem-fraction-static") + 1] == "0.85"
    assert all(SECRET not in a for a in argv)
    monkeypatch.setenv("WANDB_API_KEY", "w-123")
    ref = dataclasses.replace(b200_spec(tmp_path), env={"WANDB_API_KEY": "${WANDB_API_KEY}"})
    ref_argv, ref_hidden = launcher.command(ref, "n")
    assert value("-e") and "WANDB_API_KEY" in ref_argv and ref_hidden["WANDB_API_KEY"] == "w-123"
    host_ipc = ContainerLauncher(ipc="host").command(b200_spec(tmp_path), "n")[0]
    assert "--ipc=host" in host_ipc and "--shm-size" not in host_ipc


def test_gpu_selection_for_docker_and_podman_and_the_host_flag():
    assert ContainerLauncher().gpu_args((1, 2)) == ["--gpus", '"device=1,2"']
    assert ContainerLauncher(runtime="/usr/bin/podman").gpu_args((1, 2)) == [
        "--device",
        "nvidia.com/gpu=1",
        "--device",
        "nvidia.com/gpu=2",
    ]
    assert ContainerLauncher().gpu_args(()) == [] and ContainerLauncher().device_env((0, 1)) == {}
    assert inside_argv(["/x/python", "-m", "s", "--host=127.0.0.1"], python="python3") == [
        "python3",
        "-m",
        "s",
        "--host=0.0.0.0",
    ]
    assert inside_argv(["srv", "--port", "1"], python="python3")[-2:] == ["--host", "0.0.0.0"]
    assert LAUNCHERS["container"] is ContainerLauncher


def test_a_missing_runtime_is_one_line(tmp_path):
    with pytest.raises(ServerError, match="container runtime 'no-such-docker' not found") as err:
        ContainerLauncher(runtime="no-such-docker").start(b200_spec(tmp_path))
    assert "\n" not in str(err.value)


def sim_spec(tmp_path: Path, port: int, gpu: int) -> LaunchSpec:
    argv = sim_command(port, startup_s=0.3, release_s=0.2)
    env = {"AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices"), "HF_TOKEN": SECRET}
    return LaunchSpec(argv=argv, port=port, log_path=tmp_path / "trial" / "server.log", env=env, gpus=(5,))


def test_start_ready_stop_gone_with_the_sim_engine(tmp_path):
    port = free_port()
    reader = SimGpuReader(5, directory=str(tmp_path / "devices"))
    with case(tmp_path) as env:
        launcher, state = env.launcher, tmp_path / "fakedocker"
        server = launcher.start(sim_spec(tmp_path, port, 5), gpu_reader=reader)
        try:
            server.wait_ready(30)
            assert server.alive and server.poll() is None
            assert reader.read().used_gib > 1  # the sim registered on host GPU 5, chosen by --gpus device=5
            inside = json.loads((state / "containers" / server.name / "state.json").read_text())
            assert inside["env"]["HF_TOKEN"] == SECRET  # reached the container by name
            assert "ready to roll" in server.log_text()
            asked = sum(c[0] == "inspect" for c in calls(state))
            assert all(server.alive for _ in range(50))  # the replay's event loop asks this often
            assert sum(c[0] == "inspect" for c in calls(state)) - asked <= 1
        finally:
            code = server.stop(grace_s=3)
    run = next(c for c in calls(state) if c[0] == "run")
    assert all(SECRET not in arg for c in calls(state) for arg in c)
    assert run[run.index("--gpus") + 1] == "device=5" and f"127.0.0.1:{port}:{port}" in run
    assert ["stop", "-t", "3", server.name] in calls(state)
    assert server.teardown_error is None and code is not None and server.exit_code == code
    assert port_is_free("127.0.0.1", port)
    assert reader.read().used_gib < 0.2  # released
    assert not (state / "containers" / server.name).exists() and not server.alive
    assert "ready to roll" in (tmp_path / "trial" / "server.log").read_text()  # the log outlives the container


def test_a_server_that_fails_at_startup_is_server_exited_with_its_log_tail(tmp_path):
    port = free_port()
    crash = [sys.executable, "-c", "import sys; print('RuntimeError: CUDA out of memory', flush=True); sys.exit(3)"]
    spec = LaunchSpec(argv=crash, port=port, log_path=tmp_path / "server.log", name="autotune-crash")
    with case(tmp_path) as env:
        server = env.launcher.start(spec)
        with pytest.raises(ServerExited) as err:
            server.wait_ready(20)
        assert err.value.exit_code == 3 and "CUDA out of memory" in err.value.log_tail
        assert server.stop(grace_s=1) == 3 and server.teardown_error is None
        gone = subprocess.run(["docker", "ps", "-a"], capture_output=True, text=True, check=True)
        assert "autotune-crash" not in gone.stdout


def test_a_name_in_use_is_refused_and_the_container_holding_it_left_alone(tmp_path):
    port = free_port()
    spec = LaunchSpec(
        argv=[sys.executable, "-c", "import time; time.sleep(30)"],
        port=port,
        log_path=tmp_path / "server.log",
        name="autotune-dup",
    )
    with fake_runtime(tmp_path):
        launcher = ContainerLauncher(python=sys.executable, mounts=[])
        first = launcher.start(spec)
        try:
            with pytest.raises(ServerError, match="'autotune-dup' already exists"):
                launcher.start(spec)
            assert first.alive
        finally:
            first.stop(grace_s=1)


HARNESS = """
import sys, time
from pathlib import Path
from autotune.launch import LaunchSpec
from autotune.launch.container import ContainerLauncher
work = Path(sys.argv[1])
spec = LaunchSpec(argv=[sys.executable, "-c", "import time; time.sleep(120)"], port=int(sys.argv[2]),
                  log_path=work / "server.log", run_dir=work / "runs", name="autotune-orphan")
ContainerLauncher(python=sys.executable, mounts=[], watchdog_grace_s=5).start(spec)
print("started", flush=True)
time.sleep(120)
"""


def test_a_trials_container_does_not_outlive_its_harness_killed_by_sigkill(tmp_path):
    with fake_runtime(tmp_path) as state:
        harness = subprocess.Popen(
            [sys.executable, "-c", HARNESS, str(tmp_path), str(free_port())], stdout=subprocess.PIPE, text=True
        )
        try:
            assert harness.stdout is not None and harness.stdout.readline().strip() == "started"
            box = state / "containers" / "autotune-orphan"
            pid = json.loads((box / "state.json").read_text())["pid"]
            assert Path(f"/proc/{pid}").exists()
        finally:
            harness.kill()
            harness.wait(timeout=10)
        deadline = time.monotonic() + 20
        while box.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not box.exists(), "the container outlived its harness"
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
        assert "harness gone; removing container autotune-orphan" in (tmp_path / "server.log").read_text()
