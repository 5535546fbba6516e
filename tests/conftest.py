"""Suite-wide setup: each test process's own simulated GPUs, ports and caches; no leaked threads.

The suite runs in several processes at once (pytest-xdist). Each gets its own simulated-GPU registry (servers of
two workers on one registry would see each other's memory), its own port range (two workers binding port 0 can be
handed the same port between one's pick and its server's bind) and its own flag-table cache. A port range is a
slot held by a file lock for the process's life, so two test sessions on one host never share one either. Everything a
test
starts inherits them through the environment.

A leaked watcher thread is invisible to the test that leaks it and slows every test after it (a worker shares one
process): a rollout that left one ``shm-sampler`` per detached server once made later timing tests fail.
"""

from __future__ import annotations

import fcntl
import functools
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

PORTS_PER_WORKER = 300
FIRST_PORT = 20000  # below the kernel's ephemeral range (32768+), which outgoing connections draw from
PORT_SLOTS = (32768 - FIRST_PORT) // PORTS_PER_WORKER

# The CI's single-node Slurm cluster has four device-less GPUs: its tests run on one worker, one job set at a time.
SLURM_FILES = {"test_launch_slurm.py", "test_slurm_sweep.py", "test_fleet_slurm.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    for item in items:  # a Slurm test elsewhere says so in its name or its parameters ([slurm])
        if item.path.name in SLURM_FILES or "slurm" in item.name.lower():
            item.add_marker(pytest.mark.xdist_group("slurm"))
    # The workers take tests from one queue in this order: the long ones (``slow``) first, so the run does not end
    # with one worker on a two-minute sweep while the others idle (longest first: the classic bound for list
    # scheduling). A stable sort: within each kind, the files' order.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def worker_index() -> int:
    """0 for ``gw0`` (or a run without xdist), 1 for ``gw1``, …"""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


_HELD: list = []  # the open lock file of this process's port slot


@functools.cache
def port_slot() -> int:
    """The first port slot no other test process on this host holds; held (its lock file open) until this process
    exits, when the kernel drops the lock."""
    for offset in range(PORT_SLOTS):
        slot = (worker_index() + offset) % PORT_SLOTS
        handle = open(Path(tempfile.gettempdir()) / f"autotune-test-ports-{slot}.lock", "a")  # noqa: SIM115 (held)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        _HELD.append(handle)
        return slot
    raise RuntimeError(f"all {PORT_SLOTS} test port slots are held by other test processes on this host")


@pytest.fixture(scope="session", autouse=True)
def own_devices_ports_and_caches(tmp_path_factory):
    low = FIRST_PORT + port_slot() * PORTS_PER_WORKER
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path_factory.mktemp("sim-devices")))
        mp.setenv("AUTOTUNE_PORT_RANGE", f"{low}-{low + PORTS_PER_WORKER - 1}")
        mp.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")  # a model id the tests name is never fetched from the Hub
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf-cache")))
        yield


OURS = ("shm-sampler", "gpu-monitor", "autotune-heartbeat", "autotune-watch-listen")


def _ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in OURS and t.is_alive()}


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = _ours()
    yield
    deadline = time.monotonic() + 2.0  # a thread told to stop ends within its polling interval
    while (left := _ours() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads left running after the test: {sorted(t.name for t in left)}"


@pytest.fixture(autouse=True)
def fleet_base_port(monkeypatch) -> int:
    """Where ``apply`` starts handing out ports in every test: ten ports free now in this process's own range, in
    place of 30000, which any server on the host (another worker's fleet, another run's) may hold or take between
    one test's ``apply`` and its ``fleet up``; a test can then name the ports a new fleet's servers and router get."""
    from autotune.deploy import ports
    from autotune.launch.ports import port_is_free, port_range

    low, high = port_range()  # set for the session above
    for base in range(high - 9, low - 1, -10):  # from the top: free_port takes turns through the whole range
        if all(port_is_free("127.0.0.1", p) for p in range(base, base + 10)):
            monkeypatch.setattr(ports, "DEFAULT_BASE_PORT", base)
            return base
    pytest.fail(f"no ten free ports in {low}-{high}")
