"""The memory of another host's GPUs, read over the ``ssh`` launcher's transport with ``nvidia-smi``: one call per
reading for the whole group, a failure a ``GpuError`` the monitor counts, and no new attempt for ``RETRY_S`` after
one. docs/engines-and-launchers.md ("Another host over SSH").
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import NoReturn, TypedDict

from autotune.errors import AutotuneError, GpuError
from autotune.launch.base import GpuReading
from autotune.launch.memory import MIB_PER_GIB, GroupReader

# (command, timeout_s) -> (exit code, stdout, stderr): the launcher's transport, bound to its host.
Call = Callable[[str, float], tuple[int, str, str]]
GPU_FIELDS = ("index", "memory.used", "memory.total", "utilization.gpu", "power.draw", "clocks.sm")
APP_FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")  # the name last: it is the one that may hold ", "
CSV = "--format=csv,noheader,nounits"
READ_TIMEOUT_S = 5.0  # a sample that takes longer is a failed one, not a stalled monitor
RETRY_S = 2.0
APPS_MARK = "--apps--"


def gpu_query(gpus: tuple[int, ...]) -> str:
    """The one shell line that reads every GPU of the group."""
    return shlex.join(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", CSV, "-i", _ids(gpus)])


def apps_query(gpus: tuple[int, ...]) -> str:
    """The one shell line that names the compute processes on the group's GPUs (uuids first, to map them back)."""
    ids = _ids(gpus)
    uuids = shlex.join(["nvidia-smi", "--query-gpu=index,uuid", CSV, "-i", ids])
    apps = shlex.join(["nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}", CSV, "-i", ids])
    return f"{uuids} && echo {APPS_MARK} && {apps}"


def _ids(gpus: tuple[int, ...]) -> str:
    return ",".join(str(int(g)) for g in gpus)


def value(text: str) -> float | None:
    """One CSV field as a number; None for ``[N/A]``, ``[Not Supported]``, ``N/A`` and anything not numeric."""
    text = text.strip()
    if not text or text.startswith("[") or text.upper() == "N/A":
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_gpus(text: str) -> dict[int, GpuReading]:
    """``--query-gpu`` lines → index → reading (memory in GiB). Lines of another shape are skipped."""
    out: dict[int, GpuReading] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(GPU_FIELDS) or not parts[0].isdigit():
            continue
        used, total, util, power, clock = (value(p) for p in parts[1:])
        out[int(parts[0])] = GpuReading(
            used_gib=None if used is None else used / MIB_PER_GIB,
            total_gib=None if total is None else total / MIB_PER_GIB,
            util_pct=util,
            power_w=power,
            sm_clock_mhz=clock,
        )
    return out


class RemoteProcess(TypedDict):
    """A compute process ``nvidia-smi`` lists: its GPU (None: a GPU not in the index list), host pid, GiB (None
    where the driver does not say), ``exited`` (always False: only live processes are listed) and name. Read as
    the harness's ``DeviceProcess`` (the same keys, and two more)."""

    gpu: int | None
    pid: int
    exited: bool
    used_gib: float | None
    name: str


def parse_apps(text: str) -> list[RemoteProcess]:
    """``apps_query`` output → ``[{"gpu", "pid", "used_gib", "exited", "name"}]`` (``nvidia-smi`` lists only live
    processes: ``exited`` is always False; ``used_gib`` None where the driver does not say)."""
    head, _, apps = text.partition(APPS_MARK)
    index_of: dict[str, int] = {}
    for line in head.splitlines():
        index, _, uuid = (p.strip() for p in line.partition(","))
        if index.isdigit() and uuid:
            index_of[uuid] = int(index)
    out: list[RemoteProcess] = []
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",", len(APP_FIELDS) - 1)]
        if len(parts) != len(APP_FIELDS) or not parts[1].isdigit():
            continue
        used = value(parts[2])
        out.append(
            RemoteProcess(
                gpu=index_of.get(parts[0]),
                pid=int(parts[1]),
                exited=False,
                used_gib=None if used is None else used / MIB_PER_GIB,
                name=parts[3],
            )
        )
    return out


class _Fixed:
    """One device's reading, already taken: lets ``GroupReader`` combine a group read in one call."""

    def __init__(self, reading: GpuReading):
        self.reading = reading

    def read(self) -> GpuReading:
        return self.reading

    def close(self) -> None:
        pass


class RemoteGpuReader:
    """``gpus`` on ``host``, read through ``call``: one GPU's reading, or a group's as ``GroupReader`` gives it
    (the fullest GPU, every GPU under ``devices``). ``processes()`` names the compute processes on them (their pids
    are the host's, ``name`` is what ``nvidia-smi`` calls them)."""

    def __init__(
        self,
        call: Call,
        gpus: tuple[int, ...],
        *,
        host: str,
        timeout_s: float = READ_TIMEOUT_S,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not gpus:
            raise ValueError("a remote GPU reader needs at least one GPU")
        self.call, self.gpus, self.host = call, tuple(int(g) for g in gpus), host
        self.timeout_s, self.retry_s, self._clock = timeout_s, retry_s, clock
        self.calls = 0  # transport calls made (one per reading)
        self._failed_at: float | None = None
        self._failure = ""

    def read(self) -> GpuReading:
        devices = parse_gpus(self._ask(gpu_query(self.gpus)))
        missing = [g for g in self.gpus if g not in devices]
        if missing:
            self._fail(f"nvidia-smi on {self.host} shows no GPU {', '.join(map(str, missing))}")
        if len(self.gpus) == 1:
            return devices[self.gpus[0]]
        return GroupReader({g: _Fixed(devices[g]) for g in self.gpus}).read()

    def processes(self) -> list[RemoteProcess]:
        return [p for p in parse_apps(self._ask(apps_query(self.gpus))) if p["gpu"] in (None, *self.gpus)]

    def close(self) -> None:
        pass

    def _ask(self, command: str) -> str:
        if self._failed_at is not None and self._clock() - self._failed_at < self.retry_s:
            raise GpuError(self._failure)
        self.calls += 1
        try:
            code, out, err = self.call(command, self.timeout_s)
        except (AutotuneError, OSError, TimeoutError) as exc:  # the transport's own failure (no connection)
            self._fail(f"cannot read the GPUs of {self.host}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a transport's timeout (subprocess, asyncio) is a failed reading
            self._fail(f"cannot read the GPUs of {self.host}: {exc.__class__.__name__}: {exc}")
        if code != 0:
            self._fail(f"nvidia-smi on {self.host} failed (exit {code}): {(err or out).strip()[:200]}")
        self._failed_at = None
        return out

    def _fail(self, message: str) -> NoReturn:
        self._failed_at, self._failure = self._clock(), message
        raise GpuError(message)


class NoReading:
    """The reader of a server without GPUs on another host: this host's host-memory reader would measure the wrong
    machine, so it reports nothing (every value None) and nothing waits on it."""

    def read(self) -> GpuReading:
        return GpuReading()

    def close(self) -> None:
        pass
