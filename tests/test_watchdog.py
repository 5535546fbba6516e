"""A trial server never outlives its harness: SIGKILL the harness, the watchdog takes the server along."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from simserver import sim_command

from autotune.launch.process import ServerProcess, free_port
from autotune.launch.watchdog import start_ticks, stop_server
from autotune.sim import device

pytestmark = pytest.mark.timeout(60)

HARNESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from autotune.launch.process import ServerProcess
    tmp, port, detach, argv = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "detach", sys.argv[4:]
    s = ServerProcess(argv, port=port, log_path=tmp / "server.log", run_dir=tmp / "runs", shm_dir=tmp / "shm",
                      detach=detach, watchdog_grace_s=2.0)
    s.start(); s.wait_ready(30)
    print("READY", s.pid, flush=True)
    time.sleep(600)
    """
)


def _sim_argv(port: int, shm) -> list[str]:
    return sim_command(port, startup_s=0.3, release_s=0.2, shm=shm)


def _harness(tmp_path, argv, port, *, detach: bool = False):
    """A harness process that started ``argv`` through ServerProcess: (the process, the server's pid)."""
    env = {**os.environ, device.ENV_DIR: str(tmp_path / "devices")}
    proc = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path), str(port), "detach" if detach else "attach", *argv],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline().split()
    assert line and line[0] == "READY", (tmp_path / "server.log").read_text()[-2000:]
    return proc, int(line[1])


def _group(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def test_sigkilled_harness_takes_its_sim_server_and_gpu_memory_along(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    port = free_port()
    harness, pid = _harness(tmp_path, _sim_argv(port, shm), port)
    try:
        assert device.read(0, tmp_path / "devices").used_mib > 1000  # the simulated GPU is held
        record = tmp_path / "runs" / f"server-{pid}.json"
        deadline = time.monotonic() + 10
        while len(json.loads(record.read_text())["shm_owned"]) < 4:  # attributed as they appear
            assert time.monotonic() < deadline, record.read_text()
            time.sleep(0.05)
    finally:
        harness.kill()
        harness.wait(10)
    t0 = time.monotonic()
    while (_group(pid) or device.read(0, tmp_path / "devices").used_mib > 0) and time.monotonic() - t0 < 8:
        time.sleep(0.05)
    assert not _group(pid), "the server outlived its SIGKILLed harness"
    assert device.read(0, tmp_path / "devices").used_mib == 0
    deadline = time.monotonic() + 5
    while record.exists() and time.monotonic() < deadline:  # the watchdog cleans up, then drops the pid file
        time.sleep(0.05)
    assert not record.exists()
    assert sorted(p.name for p in shm.iterdir()) == []  # its load segment, buffer and semaphores
    assert "[autotune watchdog] harness gone; stopped server" in (tmp_path / "server.log").read_text()


def test_a_stopped_server_stands_its_watchdog_down(tmp_path):
    port = free_port()
    server = ServerProcess(
        _sim_argv(port, tmp_path / "shm"),
        port=port,
        log_path=tmp_path / "s.log",
        run_dir=tmp_path / "runs",
        shm_dir=tmp_path / "shm",
        env={device.ENV_DIR: str(tmp_path / "devices")},
    )
    with server:
        server.wait_ready(30)
        dogs = [c for c in psutil.Process().children() if "autotune.launch.watchdog" in c.cmdline()]
        assert len(dogs) == 1 and os.getsid(dogs[0].pid) == dogs[0].pid  # its own session: no Ctrl-C reaches it
    assert not dogs[0].is_running() or dogs[0].status() == psutil.STATUS_ZOMBIE
    assert "[autotune watchdog]" not in (tmp_path / "s.log").read_text()  # it did nothing


def test_a_detached_server_outlives_its_harness(tmp_path):
    port = free_port()
    harness, pid = _harness(tmp_path, _sim_argv(port, tmp_path / "shm"), port, detach=True)
    harness.kill()
    harness.wait(10)
    try:
        time.sleep(1.5)
        assert _group(pid), "a detached (fleet) server must stay up"
    finally:
        os.killpg(pid, signal.SIGKILL)


def test_the_watchdog_leaves_a_reused_pid_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        start = start_ticks(other.pid)
        assert start is not None
        assert stop_server(other.pid, start + 1, grace_s=0.1) is False  # another process under that pid
        assert other.poll() is None
        assert stop_server(other.pid, start, grace_s=0.5) is True
        assert other.wait(5) == -signal.SIGTERM
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
