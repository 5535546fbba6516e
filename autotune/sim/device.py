"""The simulated GPU: a per-index memory registry shared across processes, the simulator's "driver".

Each sim server registers ``<dir>/<index>/<pid>.json`` with the memory it holds, on every GPU of its group (a
TP × PP group holds the same share on each). A reader sums the live
registrations. A registration whose process has died keeps counting until ``release_s`` after its death was
first observed (by ``mark_exited`` or by a reader noticing the pid is gone), because a real driver frees memory
asynchronously and the next server sizes its pools from *free* memory. Writers replace files atomically, so
concurrent readers never see half a record.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import psutil

ENV_DIR = "AUTOTUNE_SIM_DEVICE_DIR"
DEVICE_FILE = "device.info"  # not *.json: never mistaken for a process record
# The host's memory (SGLang's CPU backend, ``--device cpu``): one device every server on the host shares, whatever
# GPUs it was given; a process's memory is back the moment it exits (no driver frees it later).
HOST = -1


class ProcessRecord(TypedDict):
    """``<index>/<pid>.json``: what one registered process holds, and since when it is gone (None: alive)."""

    pid: int
    create_time: float | None  # the process's start, so a reused pid reads as dead
    gpu_name: str
    total_mib: float
    used_mib: float
    util_pct: float
    release_s: float
    exited_at: float | None
    updated_at: float


class DeviceRecord(TypedDict):
    """``<index>/device.info``: the device's own record, which outlives every process."""

    gpu_name: str
    total_mib: float


class GpuReading(TypedDict):
    """``/sim/gpu``'s reading of one GPU of a server's group."""

    index: int
    used_mib: float
    total_mib: float | None
    free_mib: float | None
    util_pct: float
    processes: list[ProcessRecord]


class GroupReading(GpuReading):
    """``/sim/gpu``: the first GPU's reading at the top level, every GPU of the group in ``devices``."""

    devices: list[GpuReading]


@dataclass(frozen=True, kw_only=True)
class DeviceReading:
    """One reading of one simulated device, like an NVML memory + utilisation query."""

    used_mib: float
    total_mib: float | None  # the last registered total; None only if nothing ever registered on this index
    util_pct: float
    processes: list[ProcessRecord] = field(default_factory=list)

    @property
    def free_mib(self) -> float | None:
        return None if self.total_mib is None else max(0.0, self.total_mib - self.used_mib)


def device_dir(index: int, directory: str | os.PathLike[str] | None = None) -> Path:
    """The folder of GPU ``index`` (``host`` for ``HOST``): under ``directory`` or ``$AUTOTUNE_SIM_DEVICE_DIR`` or
    ``<tmp>/autotune-sim-devices``."""
    base = directory or os.environ.get(ENV_DIR) or Path(tempfile.gettempdir()) / "autotune-sim-devices"
    return Path(base) / ("host" if int(index) == HOST else str(int(index)))


def visible_indices(env: dict[str, str] | None = None, *, need: int = 1) -> tuple[int, ...]:
    """Every GPU ``CUDA_VISIBLE_DEVICES`` lists, in order (what a server calls devices 0, 1, …).

    Unset, empty or without a numeric entry: the machine shows devices ``0 … need-1``, as a host whose GPUs are
    all visible shows at least the ones a server asks for. Like CUDA, the list stops at the first entry that is
    not an index."""
    raw = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES", "")
    indices: list[int] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry.isdigit():
            break
        indices.append(int(entry))
    return tuple(indices) if indices else tuple(range(max(1, int(need))))


def visible_index(env: dict[str, str] | None = None) -> int:
    """The first entry of ``CUDA_VISIBLE_DEVICES`` (what a server on that machine would call device 0)."""
    return visible_indices(env)[0]


def _write(path: Path, record: ProcessRecord | DeviceRecord) -> None:
    # Write a temp file in the same folder and rename: readers see the old or the new record, never a torn one.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(path: Path) -> ProcessRecord | None:
    try:
        record: ProcessRecord = json.loads(path.read_text())
        return record
    except (FileNotFoundError, json.JSONDecodeError):
        return None  # removed or replaced under us; the next reading sees the new state


def _load_device(path: Path) -> DeviceRecord | None:
    try:
        record: DeviceRecord = json.loads(path.read_text())
        return record
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _alive(record: ProcessRecord) -> bool:
    """True while the registering process runs (a reused pid with another start time counts as dead)."""
    pid = int(record["pid"])
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started = record.get("create_time")
        return started is None or abs(proc.create_time() - float(started)) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # another user's live process: we cannot look, but it exists


def register(
    index: int,
    *,
    pid: int,
    gpu_name: str,
    total_mib: float,
    used_mib: float,
    release_s: float,
    directory: str | os.PathLike[str] | None = None,
) -> Path:
    """Record that ``pid`` holds ``used_mib`` of GPU ``index`` (total ``total_mib``). Returns the record's path."""
    folder = device_dir(index, directory)
    # The device's own record outlives every process, so a reader still knows the total after all are released.
    _write(folder / DEVICE_FILE, DeviceRecord(gpu_name=gpu_name, total_mib=float(total_mib)))
    path = folder / f"{int(pid)}.json"
    record = ProcessRecord(
        pid=int(pid),
        create_time=_create_time(pid),
        gpu_name=gpu_name,
        total_mib=float(total_mib),
        used_mib=float(used_mib),
        util_pct=0.0,
        release_s=float(release_s),
        exited_at=None,
        updated_at=time.time(),
    )
    _write(path, record)
    return path


def update(
    index: int,
    pid: int,
    *,
    used_mib: float | None = None,
    util_pct: float | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> None:
    """Change what a registered process holds or how busy it is. Unknown pids are ignored (already released)."""
    path = device_dir(index, directory) / f"{int(pid)}.json"
    record = _load(path)
    if record is None:
        return
    if used_mib is not None:
        record["used_mib"] = float(used_mib)
    if util_pct is not None:
        record["util_pct"] = float(util_pct)
    record["updated_at"] = time.time()
    _write(path, record)


def mark_exited(index: int, pid: int, directory: str | os.PathLike[str] | None = None) -> None:
    """A clean exit: the memory stays visible for the record's ``release_s`` from now."""
    path = device_dir(index, directory) / f"{int(pid)}.json"
    record = _load(path)
    if record is None or record.get("exited_at") is not None:
        return
    record["exited_at"] = time.time()
    record["util_pct"] = 0.0
    _write(path, record)


def read(index: int, directory: str | os.PathLike[str] | None = None) -> DeviceReading:
    """Sum the registrations on GPU ``index``; note deaths and drop records whose release delay has passed."""
    folder = device_dir(index, directory)
    now = time.time()
    used = util = 0.0
    total: float | None = None
    processes: list[ProcessRecord] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = _load(path)
        if record is None:
            continue
        if record.get("exited_at") is None and not _alive(record):
            record["exited_at"] = now  # first reader to see the death starts the release clock
            record["util_pct"] = 0.0
            _write(path, record)
        exited = record.get("exited_at")
        if exited is not None and now - float(exited) >= float(record.get("release_s", 0.0)):
            path.unlink(missing_ok=True)
            continue
        total = float(record["total_mib"]) if total is None else max(total, float(record["total_mib"]))
        used += float(record["used_mib"])
        util = max(util, float(record.get("util_pct") or 0.0))
        processes.append(record)
    if total is None and (info := _load_device(folder / DEVICE_FILE)) is not None:
        total = float(info["total_mib"])
    if total is not None:
        used = min(used, total)
    return DeviceReading(used_mib=used, total_mib=total, util_pct=util, processes=processes)


def others_used_mib(index: int, pid: int, directory: str | os.PathLike[str] | None = None) -> float:
    """What every registration except ``pid``'s holds: the memory a starting server cannot have."""
    reading = read(index, directory)
    return sum(float(p["used_mib"]) for p in reading.processes if int(p["pid"]) != int(pid))
