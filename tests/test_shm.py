"""/dev/shm ownership: a file is a server's only when it appeared during its life AND its group held it (or it names
the server's port). Real SGLang's names carry no pid, so digits in a name prove nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from simserver import sim_command

from autotune.launch.process import ServerExited, ServerProcess, free_port
from autotune.launch.procgroup import group_pids, held_files, memory_bytes
from autotune.launch.shm import ShmOwnership, named_port, snapshot
from autotune.sim import device

pytestmark = pytest.mark.timeout(90)

HOLDER = (
    "import mmap, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); os.write(fd, b'x' * 4096)\n"
    "m = mmap.mmap(fd, 4096); os.close(fd)\n"  # held by a mapping only, like a POSIX semaphore
    "print('held', flush=True); time.sleep(120)\n"
)


def _hold(path, *, new_session: bool) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True, start_new_session=new_session
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)
    proc.stdout.close()


def test_named_port_reads_sglangs_cpu_all_reduce_buffer():
    assert named_port("deepspeed_allreduce_buffer_0_127.0.0.1_31500_0") == 31500
    assert named_port("deepspeed_allreduce_buffer_1000_10.0.0.7_29500_3") == 29500
    assert named_port("sglang_loads_0123456789ab_127001ff.shm") is None
    assert named_port("sem.mp-31500abc") is None


def test_held_files_and_group_pids_through_proc(tmp_path):
    group = _hold(tmp_path / "sem.mp-abc12345", new_session=True)
    try:
        assert group_pids(group.pid) == {group.pid}
        held = held_files([group.pid], tmp_path)
        assert held == {"sem.mp-abc12345": (tmp_path / "sem.mp-abc12345").stat().st_ino}
        assert held_files([os.getpid()], tmp_path) == {}
        assert memory_bytes(group.pid) > 1024 * 1024  # a Python's own pages
    finally:
        _stop(group)
    assert group_pids(group.pid) == set()


def test_ownership_needs_new_and_held_or_named_after_the_port(tmp_path):
    (tmp_path / "sglang_loads_old.shm").write_text("")
    own = ShmOwnership(tmp_path, snapshot(tmp_path), ports={31500})
    mine = _hold(tmp_path / "sem.mp-k2x93001", new_session=True)  # "the server's group"
    other = _hold(tmp_path / f"sglang_loads_{mine.pid:012d}_00000000.shm", new_session=True)  # another server
    try:
        (tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_31500_0").write_text("")  # the server's port
        (tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_31999_0").write_text("")  # someone else's port
        (tmp_path / "unrelated_app").write_text("")
        assert own.observe(group_pids(mine.pid)) is True
        assert sorted(own.owned) == ["deepspeed_allreduce_buffer_0_127.0.0.1_31500_0", "sem.mp-k2x93001"]
        assert own.observe(group_pids(mine.pid)) is False  # nothing new
    finally:
        _stop(mine)
        _stop(other)
    removed, left = own.remove()
    assert removed == ["deepspeed_allreduce_buffer_0_127.0.0.1_31500_0", "sem.mp-k2x93001"]
    assert left == ["deepspeed_allreduce_buffer_0_127.0.0.1_31999_0", f"sglang_loads_{mine.pid:012d}_00000000.shm"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["sglang_loads_old.shm", "unrelated_app", *left])


def test_a_file_replaced_under_the_same_name_is_not_removed(tmp_path):
    own = ShmOwnership(tmp_path, set())
    proc = _hold(tmp_path / "sem.mp-aaaaaaaa", new_session=True)
    try:
        assert own.observe(group_pids(proc.pid))
    finally:
        _stop(proc)
    (tmp_path / "incoming").write_text("another server's, same name")
    os.replace(tmp_path / "incoming", tmp_path / "sem.mp-aaaaaaaa")
    assert own.remove() == ([], ["sem.mp-aaaaaaaa"])
    assert (tmp_path / "sem.mp-aaaaaaaa").exists()


# -- two simulated servers writing SGLang's real-shaped names into one directory ---------------------------
def _sim_argv(port: int, shm, *extra: str, startup_s: float = 0.3) -> list[str]:
    return sim_command(port, *extra, startup_s=startup_s, warmup_s=0, release_s=0.1, shm=shm)


def _wait_healthy(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the independent server died"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("the independent server never became healthy")


@pytest.mark.slow
def test_two_independent_servers_each_keep_their_own_files(tmp_path, monkeypatch):
    monkeypatch.setenv(device.ENV_DIR, str(tmp_path / "devices"))
    shm = tmp_path / "shm"
    shm.mkdir()

    def names() -> set[str]:
        return {p.name for p in shm.iterdir()}

    def trial_server(port: int, *extra: str, startup_s: float = 0.3, gpu: int = 0) -> ServerProcess:
        return ServerProcess(
            _sim_argv(port, shm, *extra, startup_s=startup_s),
            port=port,
            gpu_index=gpu,
            log_path=tmp_path / f"{port}.log",
            run_dir=tmp_path / "runs",
            shm_dir=shm,
        )

    x = trial_server(free_port())
    x.start()
    x.wait_ready(30)
    x_files = names()
    assert len(x_files) == 4  # loads segment, all-reduce buffer, two semaphores
    y_port = free_port()  # a production server started on its own while the trial's server runs
    y = subprocess.Popen(
        _sim_argv(y_port, shm),
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(y_port, y)
        y_files = names() - x_files
        assert len(y_files) == 4
        x.stop(grace_s=5, release_timeout_s=10)
        assert names() == y_files  # X's left-behind files went (its semaphores it unlinked itself); Y's stayed
        assert len(x.removed_shm) == 2 and set(x.removed_shm) <= x_files
        assert x.unattributed_shm == sorted(y_files)

        # A trial whose server is SIGKILLed at startup (SGLang's OOM exit) leaves semaphores: they are removed.
        z = trial_server(free_port(), "--max-mamba-cache-size", "2", startup_s=1.0, gpu=2)
        z.start()
        with pytest.raises(ServerExited) as info:
            z.wait_ready(30)
        assert info.value.exit_code in (137, -9)
        z_files = names() - y_files
        assert len([n for n in z_files if n.startswith("sem.mp-")]) == 2
        z.stop(grace_s=5, release_timeout_s=10)
        assert sorted(z.removed_shm) == sorted(z_files)
        assert names() == y_files and y.poll() is None
    finally:
        y.kill()
        y.wait(10)


SEM_OPEN = (  # glibc's sem_open(O_CREAT): map a temporary sem.XXXXXX, link it to the name, unlink the temporary
    "import mmap, os, sys, tempfile, time\n"
    "fd, tmp = tempfile.mkstemp(prefix='sem.', dir=sys.argv[1]); os.write(fd, b'\\0' * 32)\n"
    "m = mmap.mmap(fd, 32); os.close(fd); os.link(tmp, os.path.join(sys.argv[1], sys.argv[2])); os.unlink(tmp)\n"
    "print('held', flush=True); time.sleep(120)\n"
)


def _sem_open(directory, name) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SEM_OPEN, str(directory), name],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_real_multiprocessing_semaphore_is_mapped_only_under_a_deleted_name():
    """What makes SGLang's sem.mp-* files invisible by name (checked in /proc of a real server): the creator maps
    glibc's temporary; only the inode ties the mapping to the semaphore's file."""
    import _multiprocessing

    from autotune.launch.procgroup import held_inodes

    name = f"/mp-autotune-test-{os.getpid()}"
    sem = _multiprocessing.SemLock(1, 1, 1, name, False)  # a semaphore, unlinked by us (no resource tracker)
    try:
        path = f"/dev/shm/sem.{name[1:]}"
        ino = os.stat(path).st_ino
        assert os.path.basename(path) not in held_files([os.getpid()], "/dev/shm")
        assert ino in held_inodes([os.getpid()], "/dev/shm")
    finally:
        _multiprocessing.sem_unlink(name)
        del sem


def test_a_semaphore_its_group_mapped_under_a_temporary_name_is_owned(tmp_path):
    proc = _sem_open(tmp_path, "sem.mp-abcd_123")
    try:
        own = ShmOwnership(tmp_path, set())
        assert "sem.mp-abcd_123" not in held_files(group_pids(proc.pid), tmp_path)  # by name, nothing proves it
        assert own.observe(group_pids(proc.pid)) and sorted(own.owned) == ["sem.mp-abcd_123"]
    finally:
        _stop(proc)


def test_release_semaphores_takes_new_unheld_ones_and_never_a_neighbours(tmp_path):
    from autotune.launch.shm import release_semaphores

    (tmp_path / "sem.mp-before00").write_bytes(b"\0" * 32)  # there before the trial: never ours
    before = snapshot(tmp_path)
    neighbour = _sem_open(tmp_path, "sem.mp-neighbr1")  # created during the trial by a live neighbour
    try:
        (tmp_path / "sem.mp-leaked00").write_bytes(b"\0" * 32)  # its creator died unseen: nobody holds it
        (tmp_path / "sglang_loads_000000000000_00000000.shm").write_bytes(b"\0")  # not a semaphore: no proof
        assert release_semaphores(tmp_path, before) == ["sem.mp-leaked00"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "sem.mp-before00",
            "sem.mp-neighbr1",
            "sglang_loads_000000000000_00000000.shm",
        ]
    finally:
        _stop(neighbour)


def test_a_stopped_server_removes_the_unheld_semaphores_of_its_life_and_keeps_a_live_neighbours(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    port = free_port()
    script = (
        "import http.server, sys\n"
        "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.BaseHTTPRequestHandler)"
        ".serve_forever()\n"
    )
    server = ServerProcess(
        [sys.executable, "-c", script, str(port)],
        port=port,
        log_path=tmp_path / "s.log",
        run_dir=tmp_path / "runs",
        shm_dir=shm,
    )
    server.start()
    neighbour = None
    try:
        (shm / "sem.mp-ourgone0").write_bytes(b"\0" * 32)  # a semaphore whose holder (the server's) died unseen
        neighbour = _sem_open(shm, "sem.mp-neighbr2")
    finally:
        server.stop(grace_s=2, release_timeout_s=5)
        try:
            assert "sem.mp-ourgone0" in server.removed_shm
            assert server.unattributed_shm == ["sem.mp-neighbr2"]
            assert sorted(p.name for p in shm.iterdir()) == ["sem.mp-neighbr2"]
        finally:
            if neighbour is not None:
                _stop(neighbour)
