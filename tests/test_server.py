"""ServerProcess lifecycle against a tiny fake server: readiness, exits, bounded stop, release, /dev/shm, orphans."""

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

from autotune.errors import ServerError
from autotune.server import (
    ServerExited,
    ServerProcess,
    ServerStartTimeout,
    cleanup_orphans,
    free_port,
    port_is_free,
    remove_new_shm,
    stop_process_group,
)

pytestmark = pytest.mark.timeout(60)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, os, signal, subprocess, sys, threading, time
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--exit-after", type=float, default=None); p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--shm", default=None); p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    start = time.monotonic()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.child:  # a scheduler-like child in the same process group
        subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    if a.shm:
        open(os.path.join(a.shm, f"sglang_loads_{os.getpid()}.shm"), "w").write("x")
        open(os.path.join(a.shm, "sem.mp-k2xq"), "w").write("x")
    print("Load weight end. elapsed=0.01 s", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = time.monotonic() - start >= a.ready_after
            self.send_response(200 if ok else 503); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args): pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), H)
    if a.exit_after is not None:
        def boom():
            time.sleep(a.exit_after); print("RuntimeError: boom", flush=True); os._exit(a.exit_code)
        threading.Thread(target=boom, daemon=True).start()
    print("The server is fired up and ready to roll!", flush=True)
    srv.serve_forever()
    """
)


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def argv(port: int, *extra: str) -> list[str]:
        return [sys.executable, str(script), "--port", str(port), *extra]

    return argv


def _server(tmp_path, argv, port, **kw) -> ServerProcess:
    return ServerProcess(argv, port=port, log_path=tmp_path / "server.log", run_dir=tmp_path / "runs", shm_dir=tmp_path / "shm", **kw)


def _group_pids(pgid: int) -> list[int]:
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def test_start_ready_stop_leaves_nothing(tmp_path, fake):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sglang_loads_old.shm").write_text("before")  # existed before the start: not ours
    port = free_port()
    server = _server(tmp_path, fake(port, "--ready-after", "0.3", "--shm", str(shm), "--child"), port, gpu_index=1)
    server.start()
    assert (tmp_path / "runs" / f"server-{server.pid}.json").exists()
    # a live foreign process's file created while ours runs: carries a live pid that is not ours
    foreign = shm / f"sglang_loads_{os.getppid()}.shm"
    foreign.write_text("other")
    server.wait_ready(10)
    assert server.alive and os.getpgid(server.pid) == server.pid  # its own process group
    assert len(_group_pids(server.pid)) == 2  # the server and its child
    assert psutil.Process(server.pid).environ()["CUDA_VISIBLE_DEVICES"] == "1"
    pgid = server.pid
    code = server.stop(grace_s=5, release_timeout_s=5)
    assert code == -signal.SIGTERM
    assert _group_pids(pgid) == []  # the SIGTERM-ignoring child was SIGKILLed with the group
    assert port_is_free("127.0.0.1", port)
    assert sorted(p.name for p in shm.iterdir()) == sorted(["sglang_loads_old.shm", foreign.name])
    assert sorted(server.removed_shm) == sorted([f"sglang_loads_{pgid}.shm", "sem.mp-k2xq"])
    assert not list((tmp_path / "runs").glob("server-*.json"))
    assert server.teardown_error is None
    assert "fired up" in server.log_text()


def test_exit_during_startup_ends_the_wait_at_once(tmp_path, fake):
    port = free_port()
    server = _server(tmp_path, fake(port, "--ready-after", "100", "--exit-after", "0.3", "--exit-code", "137"), port)
    with server:
        t0 = time.monotonic()
        with pytest.raises(ServerExited) as info:
            server.wait_ready(30)
        assert time.monotonic() - t0 < 10
    assert info.value.exit_code == 137
    assert "RuntimeError: boom" in info.value.log_tail


def test_startup_timeout(tmp_path, fake):
    port = free_port()
    with _server(tmp_path, fake(port, "--ready-after", "100"), port) as server:
        with pytest.raises(ServerStartTimeout):
            server.wait_ready(0.5)
    assert not server.alive


def test_sigterm_ignored_escalates_to_sigkill_within_grace(tmp_path, fake):
    port = free_port()
    server = _server(tmp_path, fake(port, "--ignore-term"), port)
    server.start()
    server.wait_ready(10)
    t0 = time.monotonic()
    assert server.stop(grace_s=0.5, release_timeout_s=5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 5
    assert not server.alive


class SlowRelease:
    """A GPU reader: the baseline read shows 1 GiB; later reads show 60 GiB until ``release_after_s`` has passed."""

    def __init__(self, release_after_s: float):
        self.release_after_s, self.reads, self.held_since = release_after_s, 0, None

    def read(self):
        self.reads += 1
        if self.reads == 1:
            return {"used_gib": 1.0, "total_gib": 80.0}
        self.held_since = self.held_since or time.monotonic()
        held = time.monotonic() - self.held_since < self.release_after_s
        return {"used_gib": 60.0 if held else 1.0, "total_gib": 80.0}

    def close(self):
        pass


def test_stop_waits_for_gpu_release_and_reports_a_timeout(tmp_path, fake):
    port = free_port()
    server = _server(tmp_path, fake(port), port, gpu_reader=SlowRelease(1.0))
    server.start()
    server.wait_ready(10)
    t0 = time.monotonic()
    server.stop(grace_s=2, release_timeout_s=10)
    assert 0.5 <= time.monotonic() - t0 < 8
    assert server.teardown_error is None
    port = free_port()
    stuck = _server(tmp_path, fake(port), port, gpu_reader=SlowRelease(1000))
    stuck.start()
    stuck.wait_ready(10)
    t0 = time.monotonic()
    stuck.stop(grace_s=2, release_timeout_s=0.5)
    assert time.monotonic() - t0 < 5  # bounded, not a hang
    assert "GPU memory not released" in stuck.teardown_error


def test_argv_must_be_a_list_and_port_must_be_free(tmp_path, fake):
    with pytest.raises(TypeError):
        ServerProcess("python -m x", port=1, log_path=tmp_path / "l")
    port = free_port()
    with _server(tmp_path, fake(port), port) as first:
        first.wait_ready(10)
        with pytest.raises(ServerError, match="busy"):
            _server(tmp_path, fake(port), port).start()


def test_remove_new_shm_only_touches_sglang_names(tmp_path):
    (tmp_path / "sglang_a").write_text("")
    before = {"sglang_a"}
    live = f"sglang_loads_{os.getpid()}.shm"  # a live process that is not this server
    for name in ("sglang_b", "deepspeed_allreduce_buffer_7", "sem.mp-zz", "unrelated_app", live):
        (tmp_path / name).write_text("")
    removed = remove_new_shm(tmp_path, before, own_pids=set())
    # the live foreign pid's file stays; so do pre-existing and non-SGLang names
    assert sorted(removed) == ["deepspeed_allreduce_buffer_7", "sem.mp-zz", "sglang_b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["sglang_a", live, "unrelated_app"])
    assert remove_new_shm(tmp_path, before, own_pids={os.getpid()}) == [live]  # ours once the pid is ours


HARNESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from autotune.server import ServerProcess
    argv, port, tmp = sys.argv[1:-2], int(sys.argv[-2]), Path(sys.argv[-1])
    s = ServerProcess(argv, port=port, log_path=tmp / "orphan.log", run_dir=tmp / "runs", shm_dir=tmp / "shm")
    s.start(); s.wait_ready(20)
    print("READY", s.pid, flush=True)
    time.sleep(600)
    """
)


def test_orphan_of_a_killed_harness_is_cleaned_and_nothing_else(tmp_path, fake):
    (tmp_path / "shm").mkdir()
    port = free_port()
    argv = fake(port, "--shm", str(tmp_path / "shm"))
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, *argv, str(port), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    lookalike = subprocess.Popen(fake(free_port()), start_new_session=True)  # same cmdline shape, not ours
    try:
        line = harness.stdout.readline().split()
        assert line[0] == "READY"
        orphan = int(line[1])
        harness.kill()
        harness.wait(10)
        assert psutil.pid_exists(orphan)  # the server outlived its harness (own session)
        # a stale pid file pointing at the look-alike (recycled pid): start time/cmdline do not match
        stale = tmp_path / "runs" / f"server-{lookalike.pid}.json"
        stale.write_text(json.dumps({"pid": lookalike.pid, "create_time": 1.0, "cmdline": ["other"], "harness_pid": 999999999}))
        killed = cleanup_orphans(tmp_path / "runs")
        assert killed == [orphan]
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert lookalike.poll() is None  # the look-alike survived
        assert not list((tmp_path / "runs").glob("server-*.json"))
        assert not (tmp_path / "shm" / f"sglang_loads_{orphan}.shm").exists()
        assert port_is_free("127.0.0.1", port)
    finally:
        harness.kill()
        stop_process_group(lookalike.pid, grace_s=1)
        lookalike.wait(5)


def test_cleanup_leaves_servers_of_a_live_harness_and_detached_ones(tmp_path, fake):
    port = free_port()
    with _server(tmp_path, fake(port), port) as live:
        live.wait_ready(10)
        assert cleanup_orphans(tmp_path / "runs") == []  # this process (its harness) is alive
        assert live.alive
    port = free_port()
    detached = _server(tmp_path, fake(port), port, detach=True)
    detached.start()
    try:
        record = json.loads((tmp_path / "runs" / f"server-{detached.pid}.json").read_text())
        record["harness_pid"] = 999999999  # pretend its launcher is gone: a fleet server must survive anyway
        (tmp_path / "runs" / f"server-{detached.pid}.json").write_text(json.dumps(record))
        assert cleanup_orphans(tmp_path / "runs") == []
        assert detached.alive
    finally:
        detached.stop(grace_s=1, release_timeout_s=5)


def test_stop_process_group_stops_a_detached_server(tmp_path, fake):
    port = free_port()
    server = _server(tmp_path, fake(port, "--child"), port, detach=True)
    with server:
        server.wait_ready(10)
    assert server.alive  # detached: leaving the block does not stop it (a fleet's server)
    assert stop_process_group(server.pid, grace_s=2) == -signal.SIGTERM
    assert _group_pids(server.pid) == []
    assert port_is_free("127.0.0.1", port)
    assert cleanup_orphans(tmp_path / "runs") == []  # nothing to kill, and the stale pid file goes
    assert not list((tmp_path / "runs").glob("server-*.json"))
