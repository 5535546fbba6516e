"""Device memory at a server's stop: teardown waits until the reader shows the memory back at its pre-start level,
so the next server sizes its pools from truly free memory (a driver frees asynchronously)."""

from __future__ import annotations

import time
from typing import Any

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


class GroupReader:
    """The devices of one server that spans several GPUs, read as one: ``read`` reports the device with the least
    free memory (the one that OOMs first decides headroom) and every device under ``devices``. It names no processes: the tenancy check reads
    each device on its own (``harness.tenancy.check_engine_gpus``)."""

    def __init__(self, readers: dict[int, MemoryReader]):
        if not readers:
            raise ValueError("a group reader needs at least one device")
        self.readers = dict(readers)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(self.readers)

    def read(self) -> dict[str, Any]:
        devices: list[dict[str, Any]] = []
        for index, reader in self.readers.items():
            devices.append({"index": index, **reader.read()})
        worst = min(devices, key=_free_gib)
        out: dict[str, Any] = {k: v for k, v in worst.items() if k != "index"}
        if len(devices) > 1:
            out["devices"] = devices
            util = [float(d["util_pct"]) for d in devices if d.get("util_pct") is not None]
            power = [float(d["power_w"]) for d in devices if d.get("power_w") is not None]
            out["util_pct"] = sum(util) / len(util) if util else None
            out["power_w"] = sum(power) if power else None  # the server's draw: all its GPUs
        return out

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def _free_gib(reading: dict[str, Any]) -> float:
    used, total = reading.get("used_gib"), reading.get("total_gib")
    if used is None:
        return float("inf")
    return (total or 0.0) - used  # no total known: the most used is the fullest
