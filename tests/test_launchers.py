"""The Launcher contract, run over every entry of ``autotune.launch.LAUNCHERS`` on the simulated engine.

Adding a launcher ``<name>``: besides its module and its ``LAUNCHERS`` entry, write ``tests/launchcase_<name>.py``
(this file needs no edit; it finds the case modules by the glob ``tests/launchcase_*.py``). The module exposes

    @contextlib.contextmanager
    def case(tmp_path: Path) -> Iterator[launchcase.CaseEnv]: ...

yielding a ``CaseEnv`` (``tests/launchcase.py``): ``launcher`` (the instance under test), ``python`` (the
interpreter where the server runs), ``env`` (put into every ``LaunchSpec``; must carry ``AUTOTUNE_SIM_DEVICE_DIR``
as the server sees it), ``device_dir`` (that registry as this process sees it), ``work`` (logs and run files),
``host`` and ``skip`` (why it cannot run here, e.g. a missing ``sbatch``; None to run). Set up whatever the
launcher needs (a fake CLI on PATH, a cluster's partition) before the ``yield`` and tear it down after; the case
runs once per test. The tests below start ``CaseEnv.sim_argv(port)``: the simulator with a tiny startup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from launchcase import CaseEnv
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from autotune.config.sections import LAUNCHER_KINDS
from autotune.harness.engines.sim import SimGpuReader
from autotune.launch import LAUNCHERS, LaunchSpec, ServerExited
from autotune.launch.base import PortTaken, ServerRecord
from autotune.launch.ports import free_port, port_is_free
from autotune.sim import device
from autotune.sim.logs import READY

pytestmark = pytest.mark.timeout(120)
CASE_NAMES = sorted(p.stem.removeprefix("launchcase_") for p in Path(__file__).parent.glob("launchcase_*.py"))


@contextlib.contextmanager
def _case(name: str, tmp_path: Path) -> Iterator[CaseEnv]:
    module = importlib.import_module(f"launchcase_{name}")
    with module.case(tmp_path) as env:
        if env.skip:
            pytest.skip(f"{name}: {env.skip}")
        yield env


def _spec(env: CaseEnv, *extra: str, gpus: tuple[int, ...] = (0,), label: str = "server") -> LaunchSpec:
    port = free_port(env.host)
    return LaunchSpec(
        argv=env.sim_argv(port, *extra),
        port=port,
        host=env.host,
        env=dict(env.env),
        gpus=gpus,
        log_path=env.work / f"{label}.log",
        run_dir=env.work / "runs",
        shm_dir=env.work / "shm",
        name=f"autotune-test-{label}-{port}",
    )


def test_every_launcher_has_a_case_module_and_a_config_name():
    assert set(LAUNCHERS) <= set(CASE_NAMES), f"write tests/launchcase_<name>.py for {set(LAUNCHERS) - set(CASE_NAMES)}"
    assert set(LAUNCHER_KINDS) == set(LAUNCHERS)  # config sits below launch/, so it keeps the names itself
    for name, cls in LAUNCHERS.items():
        assert cls.name == name


def test_a_spec_refuses_a_shell_string(tmp_path):
    with pytest.raises(TypeError, match="never a shell string"):
        LaunchSpec(argv="python -m autotune.sim", port=1, log_path=tmp_path / "l")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_start_ready_stop_leaves_nothing(name, tmp_path):
    with _case(name, tmp_path) as env:
        spec = _spec(env)
        reader = SimGpuReader(0, str(env.device_dir))
        server = env.launcher.start(spec, gpu_reader=reader)
        try:
            server.wait_ready(60)
            assert server.alive and server.poll() is None
            assert server.base_url == f"http://{env.host}:{spec.port}"
            with httpx.Client(timeout=5, trust_env=False) as client:
                assert client.get(f"{server.base_url}/health").status_code == 200
            text = server.log_text()
            assert "Load weight begin" in text and READY in text, text[-2000:]
            assert READY in server.log_tail(5) or "Load weight" in server.log_tail(40)
            assert device.read(0, env.device_dir).used_mib > 1000  # the simulated GPU 0 is held
        finally:
            code = server.stop(grace_s=5.0, release_timeout_s=30.0)
        assert isinstance(code, int)
        assert not server.alive and server.poll() is not None
        assert port_is_free(env.host, spec.port)
        assert device.read(0, env.device_dir).used_mib == 0  # stop waited until the memory was released
        assert server.teardown_error is None
        assert server.stop(grace_s=1.0) in (code, None)  # a second stop is harmless


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_a_server_that_fails_at_startup_raises_server_exited(name, tmp_path):
    with _case(name, tmp_path) as env:
        spec = _spec(env, "--no-such-flag", label="bad")
        server = env.launcher.start(spec)
        try:
            with pytest.raises(ServerExited) as info:
                server.wait_ready(60)
            assert info.value.exit_code not in (None, 0)
            assert "--no-such-flag" in info.value.log_tail, info.value.log_tail
            assert not server.alive and server.poll() == info.value.exit_code
        finally:
            code = server.stop(grace_s=1.0, release_timeout_s=10.0)  # stopping a dead server is fine
        assert code in (info.value.exit_code, None)
        assert port_is_free(env.host, spec.port)


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_the_specs_gpus_select_the_simulated_device(name, tmp_path):
    with _case(name, tmp_path) as env:
        spec = _spec(env, gpus=(1,), label="gpu1")
        server = env.launcher.start(spec, gpu_reader=SimGpuReader(1, str(env.device_dir)))
        try:
            server.wait_ready(60)
            with httpx.Client(timeout=5, trust_env=False) as client:
                assert client.get(f"{server.base_url}/sim/gpu").json()["index"] == 1
            assert device.read(1, env.device_dir).used_mib > 1000
            assert device.read(0, env.device_dir).used_mib == 0
        finally:
            server.stop(grace_s=5.0, release_timeout_s=30.0)
        deadline = time.monotonic() + 5
        while device.read(1, env.device_dir).used_mib > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert device.read(1, env.device_dir).used_mib == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_a_detached_server_is_found_again_by_its_record_and_stopped(name, tmp_path):
    """What a fleet's later command does: the handle's record, as JSON, is all it has to find the server again."""
    with _case(name, tmp_path) as env:
        spec = dataclasses.replace(_spec(env, label="kept"), detach=True)
        server = env.launcher.start(spec)
        try:
            server.wait_ready(60)
            record = server.record()
            server.release()
            stored = json.loads(json.dumps(record.to_dict()))
            assert stored["launcher"] == name and stored["port"] == spec.port and stored["launch_id"]
            again = env.launcher.attach(ServerRecord.from_dict(stored))
            assert again.alive and again.record() == record
            again.stop(grace_s=5.0, release_timeout_s=30.0)
            assert not again.alive and again.teardown_error is None
            assert port_is_free(env.host, spec.port)
            assert not env.launcher.attach(record).alive  # the record of a stopped server finds nothing
        finally:
            server.stop(grace_s=1.0, release_timeout_s=10.0)


def test_a_local_record_whose_pid_now_runs_another_process_is_not_that_server(tmp_path):
    """A reused pid: the record's start time differs, so attach finds no server and its stop signals nothing."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record = ServerRecord(
            launcher="local",
            launch_id="x",
            host="127.0.0.1",
            port=free_port(),
            log_path=str(tmp_path / "l.log"),
            pid=other.pid,
            create_time=1.0,
            run_dir=str(tmp_path),
        )
        handle = LAUNCHERS["local"]().attach(record)
        assert not handle.alive
        handle.stop(grace_s=0.1, release_timeout_s=1.0)
        assert other.poll() is None  # never signalled
    finally:
        other.kill()
        other.wait()


def test_a_port_another_process_takes_while_the_server_loads_is_never_its_readiness(tmp_path):
    """A port free at the pick and taken before the bind (a real model loads for minutes first): the other
    process's /health must not pass for this server's, or every figure measured there would be the other's."""
    with _case("local", tmp_path) as env:
        spec = _spec(env, "--sim-startup-s", "30", label="late")  # binds after its startup, as SGLang does
        server = env.launcher.start(spec)
        other = uvicorn.Server(
            uvicorn.Config(
                Starlette(routes=[Route("/health", lambda request: PlainTextResponse(""))]),
                host=env.host,
                port=spec.port,
                log_level="error",
                lifespan="off",
            )
        )
        thread = threading.Thread(target=other.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while not other.started and time.monotonic() < deadline:
                time.sleep(0.02)
            # said while the server still loads: after its 30 s startup it would have failed to bind and exited
            with pytest.raises(PortTaken, match=f"{spec.port} answers /health but no process of this server"):
                server.wait_ready(60)
            assert server.alive and "bind" not in server.log_text()
        finally:
            server.stop(grace_s=1.0, release_timeout_s=10.0)
            other.should_exit = True
            thread.join(10)
        assert not server.alive


def test_the_local_launcher_selects_gpus_by_environment():
    launcher = LAUNCHERS["local"]()
    assert launcher.device_env((2, 0)) == {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert launcher.device_env(()) == {}  # a CPU server: no CUDA variables at all


def test_the_study_file_names_its_launcher_and_an_unknown_one_is_one_line(tmp_path):
    from test_config import GOOD, write

    from autotune.config import load_config
    from autotune.errors import ConfigError

    assert load_config(write(tmp_path, GOOD)).engine.launcher == "local"
    path = write(tmp_path, GOOD.replace('kind = "sim"', 'kind = "sim"\nlauncher = "k8s"'))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: engine.launcher: unknown launcher 'k8s' (use one of: ")
    assert info.value.key == "engine.launcher"
