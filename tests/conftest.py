"""Suite-wide guard: no test leaves a thread of ours running in the test process.

A leaked watcher thread is invisible to the test that leaks it and slows every test after it (the suite shares one
process): a rollout that left one ``shm-sampler`` per detached server once made later timing tests fail.
"""
from __future__ import annotations

import threading
import time

import pytest

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
