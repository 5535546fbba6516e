"""Device memory at a server's stop: teardown waits until the reader shows the memory back at its pre-start level,
so the next server sizes its pools from truly free memory (a driver frees asynchronously)."""

from __future__ import annotations

import dataclasses
import time

from autotune.launch.base import GpuReading, MemoryReader

MIB_PER_GIB = 1024.0


def used_mib(reader: MemoryReader) -> float | None:
    used = reader.read().used_gib
    return None if used is None else used * MIB_PER_GIB


def wait_released(
    reader: MemoryReader,
    baseline_used_mib: float | None,
    timeout_s: float,
    *,
    tolerance_mib: float = 128.0,
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
    free memory (the one that OOMs first decides headroom) and every device under ``devices``. It names no processes:
    the tenancy check reads
    each device on its own (``harness.tenancy.check_engine_gpus``)."""

    def __init__(self, readers: dict[int, MemoryReader]):
        if not readers:
            raise ValueError("a group reader needs at least one device")
        self.readers = dict(readers)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(self.readers)

    def read(self) -> GpuReading:
        devices = [dataclasses.replace(reader.read(), index=index) for index, reader in self.readers.items()]
        worst = dataclasses.replace(min(devices, key=lambda d: d.free_gib), index=None)
        if len(devices) == 1:
            return worst
        util = [d.util_pct for d in devices if d.util_pct is not None]
        power = [d.power_w for d in devices if d.power_w is not None]
        return dataclasses.replace(
            worst,
            devices=tuple(devices),
            util_pct=sum(util) / len(util) if util else None,
            power_w=sum(power) if power else None,
        )  # the server's draw: all its GPUs

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
