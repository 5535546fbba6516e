"""The simulated GPU registry: memory visible while a process runs, after it dies for release_s, then freed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from autotune.sim import device


def _wait(predicate, timeout: float = 5.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def test_register_update_read(tmp_path):
    device.register(
        0, pid=os.getpid(), gpu_name="b200", total_mib=1000, used_mib=100, release_s=1.0, directory=tmp_path
    )
    r = device.read(0, tmp_path)
    assert (r.used_mib, r.total_mib, r.free_mib) == (100, 1000, 900)
    device.update(0, os.getpid(), used_mib=400, util_pct=90, directory=tmp_path)
    r = device.read(0, tmp_path)
    assert (r.used_mib, r.util_pct) == (400, 90)
    assert [p["pid"] for p in r.processes] == [os.getpid()]
    # Other indices are separate devices.
    assert device.read(1, tmp_path).total_mib is None and device.read(1, tmp_path).used_mib == 0


def test_clean_exit_keeps_memory_for_release_s(tmp_path):
    device.register(
        2, pid=os.getpid(), gpu_name="h200", total_mib=1000, used_mib=300, release_s=0.3, directory=tmp_path
    )
    device.mark_exited(2, os.getpid(), directory=tmp_path)
    assert device.read(2, tmp_path).used_mib == 300  # still held right after exit
    assert _wait(lambda: device.read(2, tmp_path).used_mib == 0, timeout=3)
    assert not list((tmp_path / "2").glob("*.json"))
    assert device.read(2, tmp_path).total_mib == 1000  # the device still knows its size


def test_dead_process_counts_until_release_after_first_seen(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)  # reaped: the pid no longer exists
    device.register(0, pid=proc.pid, gpu_name="b200", total_mib=1000, used_mib=250, release_s=0.4, directory=tmp_path)
    first = device.read(0, tmp_path)
    assert first.used_mib == 250  # the reader notices the death and starts the release clock
    assert first.processes[0]["exited_at"] is not None
    assert _wait(lambda: device.read(0, tmp_path).used_mib == 0, timeout=3)


def test_others_used_excludes_self(tmp_path):
    device.register(0, pid=os.getpid(), gpu_name="b200", total_mib=1000, used_mib=100, release_s=1, directory=tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        device.register(
            0, pid=sleeper.pid, gpu_name="b200", total_mib=1000, used_mib=600, release_s=1, directory=tmp_path
        )
        assert device.others_used_mib(0, os.getpid(), tmp_path) == 600
        assert device.read(0, tmp_path).used_mib == 700
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def test_concurrent_writers_and_readers_never_see_torn_records(tmp_path):
    device.register(0, pid=os.getpid(), gpu_name="b200", total_mib=10_000, used_mib=0, release_s=1, directory=tmp_path)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            for i in range(300):
                device.update(0, os.getpid(), used_mib=float(i % 50), directory=tmp_path)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    readings = 0
    while not stop.is_set():
        r = device.read(0, tmp_path)
        assert 0 <= r.used_mib < 50 and r.total_mib == 10_000
        readings += 1
    thread.join(timeout=10)
    assert not errors and readings > 0
    assert not list((tmp_path / "0").glob(".*.tmp"))  # no temp file left behind


def test_default_directory_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv(device.ENV_DIR, str(tmp_path / "devs"))
    assert device.device_dir(3) == tmp_path / "devs" / "3"
    monkeypatch.delenv(device.ENV_DIR)
    assert device.device_dir(0).name == "0" and "autotune-sim-devices" in str(device.device_dir(0))


@pytest.mark.parametrize(
    ("env", "index"), [({}, 0), ({"CUDA_VISIBLE_DEVICES": "3,1"}, 3), ({"CUDA_VISIBLE_DEVICES": "GPU-uuid"}, 0)]
)
def test_visible_index(env, index):
    assert device.visible_index(env) == index
