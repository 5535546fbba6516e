"""Device memory at a server's stop: teardown waits until the reader shows the memory back at its pre-start level,
so the next server sizes its pools from truly free memory (a driver frees asynchronously)."""

from __future__ import annotations

import time

from autotune.launch.base import MemoryReader

MIB_PER_GIB = 1024.0


def used_mib(reader: MemoryReader) -> float | None:
    used = reader.read().get("used_gib")
    return None if used is None else used * MIB_PER_GIB


def wait_released(
    reader: MemoryReader, baseline_used_mib: float | None, timeout_s: float, *, tolerance_mib: float = 128.0,
    poll_s: float = 0.1,
) -> bool:
    """Poll until used memory is back within ``tolerance_mib`` of the pre-start baseline; False on timeout."""
    if baseline_used_mib is None:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        current = used_mib(reader)
        if current is None or current <= baseline_used_mib + tolerance_mib:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
