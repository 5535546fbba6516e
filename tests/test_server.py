"""ServerProcess lifecycle against a tiny fake server: readiness, exits, bounded stop, release, /dev/shm, orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from autotune.errors import ServerError
from autotune.harness.gpu import GpuReading, HostMemoryReader
from autotune.launch.process import (
    ServerExited,
    ServerProcess,
    ServerStartTimeout,
    cleanup_orphans,
    free_port,
    port_is_free,
    stop_process_group,
)

pytestmark = pytest.mark.timeout(60)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, mmap, os, secrets, signal, subprocess, sys, threading, time
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--exit-after", type=float, default=None); p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--shm", default=None); p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--child", action="store_true"); p.add_argument("--term-marker", default=None)
    a = p.parse_args()
    start = time.monotonic()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    held = []
    def make(name, size=4096):  # SGLang-shaped, no pid in the name, held open like SGLang holds it
        fd = os.open(os.path.join(a.shm, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"\\0" * size); held.append(fd)
        return os.path.join(a.shm, name)
    sem = None
    if a.shm:
        make(f"sglang_loads_{secrets.token_hex(6)}_{secrets.token_hex(4)}.shm")
        make(f"deepspeed_allreduce_buffer_0_127.0.0.1_{a.port + 321}_0")
        sem = make(f"sem.mp-{secrets.token_hex(4)}")
        if a.child:
            os.close(held.pop())  # only the child maps the semaphore
        else:
            maps = [mmap.mmap(held[-1], 4096)]; os.close(held.pop())  # held by a mapping only, like sem_open
    if a.child:  # a scheduler-like child in the same process group: ignores SIGTERM, notes if it ever got one
        code = ("import mmap,os,signal,sys,time\\n"
                "def on_term(*_):\\n"
                "    if sys.argv[1]: open(sys.argv[1], 'w').write('got SIGTERM')\\n"
                "signal.signal(signal.SIGTERM, on_term)\\n"
                "if sys.argv[2]:\\n"
                "    fd = os.open(sys.argv[2], os.O_RDWR); m = mmap.mmap(fd, 4096); os.close(fd)\\n"
                "print('child up', flush=True)\\n"
                "while True: time.sleep(600)\\n")
        child = subprocess.Popen([sys.executable, "-c", code, a.term_marker or "", sem or ""], stdout=subprocess.PIPE)
        child.stdout.readline()
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
    return ServerProcess(
        argv, port=port, log_path=tmp_path / "server.log", run_dir=tmp_path / "runs", shm_dir=tmp_path / "shm", **kw
    )


def _group_pids(pgid: int) -> list[int]:
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _shm_names(shm) -> list[str]:
    return sorted(p.name for p in shm.iterdir())


def test_start_ready_stop_leaves_nothing(tmp_path, fake):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sglang_loads_old.shm").write_text("before")  # existed before the start: not ours
    port = free_port()
    marker = tmp_path / "child-got-sigterm"
    argv = fake(port, "--ready-after", "0.3", "--shm", str(shm), "--child", "--term-marker", str(marker))
    server = _server(tmp_path, argv, port, gpu_index=1, env={"CUDA_VISIBLE_DEVICES": "1"})
    server.start()
    assert (tmp_path / "runs" / f"server-{server.pid}.json").exists()
    # Files created while ours runs that nobody in its group holds, with live pids' digits in their names:
    # one held open by this (foreign) process, one naming the server's own pid. Neither is the server's.
    foreign = shm / f"sglang_loads_{os.getpid():012d}_{server.pid:08d}.shm"
    holder = open(foreign, "w")
    lookalike = shm / f"sglang_loads_{server.pid:012d}_00000000.shm"
    lookalike.write_text("nobody's")
    try:
        server.wait_ready(10)
        assert server.alive and os.getpgid(server.pid) == server.pid  # its own process group
        assert len(_group_pids(server.pid)) == 2  # the server and its child
        assert psutil.Process(server.pid).environ()["CUDA_VISIBLE_DEVICES"] == "1"
        made = sorted(set(_shm_names(shm)) - {"sglang_loads_old.shm", foreign.name, lookalike.name})
        assert len(made) == 3
        pgid = server.pid
        code = server.stop(grace_s=5, release_timeout_s=5)
    finally:
        holder.close()
    assert code == -signal.SIGTERM
    assert not marker.exists()  # SIGTERM went to the launcher alone; the child got only the group's SIGKILL
    assert _group_pids(pgid) == []  # the SIGTERM-ignoring child was SIGKILLed with the group
    assert port_is_free("127.0.0.1", port)
    assert _shm_names(shm) == sorted(["sglang_loads_old.shm", foreign.name, lookalike.name])
    assert sorted(server.removed_shm) == made  # the semaphore only the child mapped included
    assert server.unattributed_shm == sorted([foreign.name, lookalike.name])  # left, and said so
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
            return GpuReading(used_gib=1.0, total_gib=80.0)
        self.held_since = self.held_since or time.monotonic()
        held = time.monotonic() - self.held_since < self.release_after_s
        return GpuReading(used_gib=60.0 if held else 1.0, total_gib=80.0)

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


HARNESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from autotune.launch.process import ServerProcess
    argv, port, tmp = sys.argv[1:-2], int(sys.argv[-2]), Path(sys.argv[-1])
    s = ServerProcess(argv, port=port, log_path=tmp / "orphan.log", run_dir=tmp / "runs", shm_dir=tmp / "shm")
    s.start(); s.wait_ready(20)
    print("READY", s.pid, flush=True)
    time.sleep(600)
    """
)


def _orphan(tmp_path, fake, port):
    """A harness that started a fake server and was then SIGKILLed: (the orphan's pid, the names it made)."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    before = set(_shm_names(shm))
    argv = fake(port, "--shm", str(shm))
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, *argv, str(port), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = harness.stdout.readline().split()
        assert line[0] == "READY"
        orphan = int(line[1])
        made = sorted(set(_shm_names(shm)) - before)
        record = tmp_path / "runs" / f"server-{orphan}.json"
        deadline = time.monotonic() + 10
        while sorted(json.loads(record.read_text())["shm_owned"]) != made:  # recorded as they are attributed
            assert time.monotonic() < deadline, record.read_text()
            time.sleep(0.05)
    finally:
        dogs = [c for c in psutil.Process(harness.pid).children() if "autotune.launch.watchdog" in c.cmdline()]
        for dog in dogs:
            dog.kill()  # the first line of defence gone too: only the pid file is left
        harness.kill()
        harness.wait(10)
        psutil.wait_procs(dogs, timeout=10)
    assert len(made) == 3 and psutil.pid_exists(orphan)  # the server outlived its harness (own session)
    return orphan, made


def test_orphan_of_a_killed_harness_is_cleaned_and_nothing_else(tmp_path, fake):
    port = free_port()
    lookalike = subprocess.Popen(fake(free_port()), start_new_session=True)  # same cmdline shape, not ours
    try:
        orphan, made = _orphan(tmp_path, fake, port)
        unheld = tmp_path / "shm" / f"sem.mp-{orphan}"  # new since the start, the orphan's pid, held by nobody
        unheld.write_text("")
        # a stale pid file pointing at the look-alike (recycled pid): start time/cmdline do not match
        stale = tmp_path / "runs" / f"server-{lookalike.pid}.json"
        stale.write_text(
            json.dumps({"pid": lookalike.pid, "create_time": 1.0, "cmdline": ["other"], "harness_pid": 999999999})
        )
        killed = cleanup_orphans(tmp_path / "runs")
        assert killed == [orphan]
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert lookalike.poll() is None  # the look-alike survived
        assert not list((tmp_path / "runs").glob("server-*.json"))
        assert _shm_names(tmp_path / "shm") == [unheld.name]  # exactly the orphan's files went
        assert port_is_free("127.0.0.1", port)
    finally:
        stop_process_group(lookalike.pid, grace_s=1)
        lookalike.wait(5)


def test_orphan_already_dead_is_cleaned_from_its_record(tmp_path, fake):
    """Harness and server both SIGKILLed: nothing holds the files any more; the pid file's names decide."""
    port = free_port()
    orphan, made = _orphan(tmp_path, fake, port)
    os.killpg(orphan, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _group_pids(orphan) and time.monotonic() < deadline:
        time.sleep(0.02)
    later = tmp_path / "shm" / f"sglang_loads_{orphan:012d}_00000000.shm"  # appeared after it died
    later.write_text("")
    assert cleanup_orphans(tmp_path / "runs") == []  # nothing left to kill
    assert _shm_names(tmp_path / "shm") == [later.name]
    assert not list((tmp_path / "runs").glob("server-*.json"))


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


def _samplers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shm-sampler"]


def test_stop_process_group_stops_a_detached_server(tmp_path, fake):
    port = free_port()
    server = _server(tmp_path, fake(port, "--child"), port, detach=True)
    before = _samplers()
    with server:
        server.wait_ready(10)
        assert len(_samplers()) == len(before) + 1
    assert server.alive  # detached: leaving the block does not stop it (a fleet's server)
    assert _samplers() == before  # ...but this process stops watching it (a rollout starts many)
    assert stop_process_group(server.pid, grace_s=2) == -signal.SIGTERM
    assert _group_pids(server.pid) == []
    assert port_is_free("127.0.0.1", port)
    assert cleanup_orphans(tmp_path / "runs") == []  # nothing to kill, and the stale pid file goes
    assert not list((tmp_path / "runs").glob("server-*.json"))


def test_the_shm_sampler_ends_with_its_server_group(tmp_path, fake):
    port = free_port()
    server = _server(tmp_path, fake(port, "--child"), port)
    before = _samplers()
    server.start()
    try:
        server.wait_ready(10)
        sampler = next(t for t in _samplers() if t not in before)
        os.killpg(server.pid, signal.SIGKILL)  # the server dies under the harness, which has not called stop yet
        sampler.join(5)
        assert not sampler.is_alive()  # a dead group holds nothing: the thread stopped looking by itself
    finally:
        server.stop(grace_s=1, release_timeout_s=5)
    assert _samplers() == before


HOG = "import time; x = b'\\1' * (1 << 30); print('held', flush=True); time.sleep(120)"


def test_cpu_teardown_ignores_other_processes_memory(tmp_path, fake):
    """SGLang's CPU backend: teardown measures the server's own tree, so 1 GiB allocated elsewhere delays nothing."""
    shm = tmp_path / "shm"
    shm.mkdir()
    reader = HostMemoryReader()
    port = free_port()
    server = _server(tmp_path, fake(port, "--shm", str(shm), "--child"), port, gpu_reader=reader)
    server.start()
    server.wait_ready(10)
    own = reader.read().used_gib * 1024
    assert 4 < own < 512  # two small Pythons and their files (MiB), not the host's used memory
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "held"
        assert reader.read().used_gib * 1024 < own + 64  # the hog is not the server's
        t0 = time.monotonic()
        server.stop(grace_s=5, release_timeout_s=10)
        assert time.monotonic() - t0 < 3
        assert server.teardown_error is None and len(server.removed_shm) == 3
        assert reader.read().used_gib == 0  # the tree is gone and its files removed
        # a server that already died at startup (SGLang's OOM exit) is torn down at once, hog or not
        port = free_port()
        dead = _server(
            tmp_path,
            fake(port, "--ready-after", "100", "--exit-after", "0.2", "--exit-code", "137"),
            port,
            gpu_reader=HostMemoryReader(),
        )
        dead.start()
        with pytest.raises(ServerExited):
            dead.wait_ready(10)
        t0 = time.monotonic()
        dead.stop(grace_s=5, release_timeout_s=10)
        assert time.monotonic() - t0 < 2 and dead.teardown_error is None
    finally:
        hog.kill()
        hog.wait(10)
