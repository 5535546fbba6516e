"""GPU readings during a trial: a sampling monitor and two readers (NVML, host memory); the simulated GPU's
reader is the sim engine's (``harness.engines.sim.SimGpuReader``).

The monitor runs in a thread so the replay's event loop never blocks on a driver call; ``wait_released`` (the
launcher's, ``launch.memory``) is how teardown knows the next server will size its pools from truly free memory.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import psutil

from autotune.errors import GpuError
from autotune.launch.base import GpuReading
from autotune.launch.memory import MIB_PER_GIB, used_mib, wait_released
from autotune.launch.procgroup import memory_bytes
from autotune.results import DevicePeak, GpuPeaks

if TYPE_CHECKING:
    from autotune.harness.engines.base import DeviceProcess, GpuReader

__all__ = ["MIB_PER_GIB", "GpuMonitor", "GpuReading", "HostMemoryReader", "NvmlReader", "used_mib", "wait_released"]


class NvmlReader:
    """A real GPU through NVML (nvidia-ml-py, imported only when a real run needs it)."""

    def __init__(self, index: int = 0):
        try:
            import pynvml  # heavy, and needs a driver: only a real GPU run loads it
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a declared dependency
            raise GpuError("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from exc
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            raise GpuError(
                f"cannot read GPU {index} through NVML ({exc}); install the NVIDIA driver, "
                "or use --engine sim / SGLang's CPU backend"
            ) from exc
        self._nvml = pynvml
        self.index = index

    def read(self) -> GpuReading:
        nv, handle = self._nvml, self._handle
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        return GpuReading(
            used_gib=mem.used / 2**30,
            total_gib=mem.total / 2**30,
            util_pct=self._optional(lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)),
            power_w=self._optional(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            sm_clock_mhz=self._optional(lambda: float(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM))),
        )

    def describe(self) -> tuple[str, int, tuple[int, int] | None]:
        """(name, total MiB, CUDA compute capability): what picks the planner's GPU profile on a real run."""
        nv, handle = self._nvml, self._handle
        name = nv.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        total_mib = int(nv.nvmlDeviceGetMemoryInfo(handle).total // 2**20)
        try:
            major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
            return name, total_mib, (int(major), int(minor))
        except nv.NVMLError:
            return name, total_mib, None

    def _optional(self, call: Callable[[], float]) -> float | None:
        try:
            return call()
        except self._nvml.NVMLError:  # some boards do not report power or clocks
            return None

    def processes(self) -> list[DeviceProcess]:
        """The device's compute processes (pid, GiB held; None where the driver does not say): who else is on it."""
        nv = self._nvml
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except nv.NVMLError:
            return []
        return [
            {
                "pid": int(p.pid),
                "exited": False,
                "used_gib": None if p.usedGpuMemory is None else p.usedGpuMemory / 2**30,
            }
            for p in procs
        ]

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class HostMemoryReader:
    """Host RAM held by one server (SGLang's CPU backend): its process group's PSS plus its /dev/shm files.

    Not the machine's used memory: another process allocating RAM must neither hold a teardown nor count as this
    server's peak. ``launch.process.ServerProcess`` calls ``track`` once the server runs; before that it reads the
    whole host.
    """

    def __init__(self) -> None:
        self._pids: Callable[[], Iterable[int]] | None = None
        self._files_bytes: Callable[[], int] = lambda: 0

    def track(self, pids: Callable[[], Iterable[int]], files_bytes: Callable[[], int]) -> None:
        """Measure the processes ``pids()`` returns and ``files_bytes()`` of shared-memory files from now on."""
        self._pids, self._files_bytes = pids, files_bytes

    def read(self) -> GpuReading:
        vm = psutil.virtual_memory()
        if self._pids is None:
            used = vm.total - vm.available
        else:
            used = sum(memory_bytes(pid) for pid in self._pids()) + self._files_bytes()
        return GpuReading(
            used_gib=used / 2**30,
            total_gib=vm.total / 2**30,
            util_pct=psutil.cpu_percent(interval=None),
        )

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reading the monitor took, at ``t`` (monotonic seconds); a group's carries each GPU's (``devices``)."""

    t: float
    reading: GpuReading


class GpuMonitor:
    """Samples a reader every ``interval_s`` in a thread while the ``with`` block runs."""

    def __init__(self, reader: GpuReader, interval_s: float = 0.2):
        self.reader, self.interval_s = reader, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def __enter__(self) -> GpuMonitor:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 10 * self.interval_s))
        self._sample()  # one reading at the end, so even a short block has one

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self) -> None:
        try:
            reading = self.reader.read()
        except Exception:  # noqa: BLE001 - a failed reading must not end the trial; it is counted
            self.errors += 1
            return
        self.samples.append(Sample(time.monotonic(), reading))

    def peaks(self) -> GpuPeaks:
        def values(key: str) -> list[float]:
            return [v for v in (getattr(s.reading, key) for s in self.samples) if v is not None]

        used, total = values("used_gib"), values("total_gib")
        util, power = values("util_pct"), values("power_w")
        per_gpu = self._per_gpu()
        if per_gpu:  # a group: the fullest GPU's peak and headroom, not one instant's least-free device
            worst = min(per_gpu, key=lambda d: d.headroom_gib if d.headroom_gib is not None else float("inf"))
            peak, tot = worst.peak_used_gib, worst.total_gib
        else:
            peak = max(used) if used else None
            tot = max(total) if total else None
        return GpuPeaks(
            peak_used_gib=round(peak, 3) if peak is not None else None,
            total_gib=round(tot, 3) if tot is not None else None,
            headroom_gib=round(tot - peak, 3) if peak is not None and tot is not None else None,
            mean_util_pct=round(sum(util) / len(util), 2) if util else None,
            peak_power_w=max(power) if power else None,
            samples=len(self.samples),
            per_gpu=per_gpu or None,
        )

    def _per_gpu(self) -> tuple[DevicePeak, ...]:
        """Each GPU's own peak, when the reader is a group's (``launch.memory.GroupReader`` readings)."""
        by_index: dict[int, list[GpuReading]] = {}
        for sample in self.samples:
            for dev in sample.reading.devices:
                if dev.index is not None:
                    by_index.setdefault(dev.index, []).append(dev)
        out = []
        for index, devs in sorted(by_index.items()):
            used = [d.used_gib for d in devs if d.used_gib is not None]
            total = [d.total_gib for d in devs if d.total_gib is not None]
            peak, tot = (max(used) if used else None), (max(total) if total else None)
            out.append(
                DevicePeak(
                    index=index,
                    peak_used_gib=None if peak is None else round(peak, 3),
                    total_gib=None if tot is None else round(tot, 3),
                    headroom_gib=None if peak is None or tot is None else round(tot - peak, 3),
                )
            )
        return tuple(out)
