"""Whether a GPU is the study's to launch on: what other processes hold, read just before a launch.

A server sizes its pools from the memory it finds *free*, so a trial next to a tenant measures the tenant: its
figures are wrong and every OOM the planner learns from it is the tenant's. A reader that can name the device's
processes (``processes()``: NVML's compute processes, the simulator's registry) tells who holds what. Memory of a
process that has exited is being freed by the driver (a just-stopped trial server of this very study, a killed
neighbour), so the check waits for it, bounded, rather than call it a tenant; live holders decide at once.
Readers without ``processes()`` (SGLang's CPU backend: host memory, no device) are not checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from autotune.errors import GpuBusyError
from autotune.redaction import redact_argv

IDLE_FLOOR_GIB = 1.0  # an idle GPU shows this much used (driver reserve, a monitoring agent): not a tenant
IDLE_FLOOR_SHARE = 0.01  # ... or this share of the device, whichever is larger
RELEASE_WAIT_S = 30.0  # how long memory with no live holder may take to be freed before it counts as held
BUSY_POLL_S = 5.0  # how often ``busy_gpu = "wait"`` looks again
NAME_CHARS = 80  # a holder's command line, shortened, in the one-line message


@dataclass(frozen=True, kw_only=True)
class Holder:
    """A live process holding device memory that is not the study's."""

    pid: int | None  # None: memory no visible process accounts for (another container, the driver)
    used_gib: float
    name: str = ""


@dataclass(frozen=True, kw_only=True)
class Occupancy:
    """One GPU as a launch would find it: what others hold, against the idle floor."""

    gpu: int | str
    total_gib: float | None
    used_gib: float | None
    holders: tuple[Holder, ...] = ()
    releasing_gib: float = 0.0  # held by exited processes, still being freed
    floor_gib: float = IDLE_FLOOR_GIB

    @property
    def others_gib(self) -> float:
        return round(sum(h.used_gib for h in self.holders), 3)

    @property
    def held_gib(self) -> float:
        """Everything not the study's: live holders plus memory of exited processes not yet freed."""
        return round(self.others_gib + self.releasing_gib, 3)

    @property
    def busy(self) -> bool:
        return self.held_gib > self.floor_gib

    def to_dict(self) -> dict[str, Any]:
        """What a trial records as ``measurement.device_at_launch`` (the planner reads ``others_gib``)."""
        data = asdict(self)
        data["holders"] = [asdict(h) for h in self.holders]
        return {**data, "others_gib": self.others_gib, "held_gib": self.held_gib}

    def line(self) -> str:
        """One line naming the GPU, the holders and the GiB, and what to do."""
        total = f" of {self.total_gib:.1f} GiB" if self.total_gib else ""
        held = self.held_gib
        who = "; ".join(_holder_text(h) for h in self.holders)
        if self.releasing_gib > 0:
            who = "; ".join(filter(None, [who, f"{self.releasing_gib:.1f} GiB of exited processes not yet freed"]))
        return (
            f"GPU {self.gpu} is busy: {held:.1f} GiB{total} held by processes that are not this study's "
            f"({who}); a trial there would size its pools from what they leave and every figure would be "
            'theirs. Stop them, pick another GPU ([engine] gpu / --gpus), or set [engine] busy_gpu = "wait"'
        )


def _holder_text(h: Holder) -> str:
    if h.pid is None:
        return f"{h.used_gib:.1f} GiB not attributed to a visible process ({h.name or 'another container?'})"
    return f"pid {h.pid}" + (f" `{h.name}`" if h.name else "") + f" {h.used_gib:.1f} GiB"


def process_name(pid: int) -> str:
    """The command line (shortened), else the process name, else "" when it cannot be seen."""
    try:
        proc = psutil.Process(pid)
        try:
            argv = proc.cmdline()
            # no interpreter path, and no credential another user's server was given on its command line
            text = " ".join([Path(argv[0]).name, *redact_argv(argv[1:])]) if argv else proc.name()
        except psutil.AccessDenied:
            text = proc.name()
    except psutil.Error:
        return ""
    return text if len(text) <= NAME_CHARS else text[: NAME_CHARS - 1] + "…"


def floor_gib(total_gib: float | None) -> float:
    return round(max(IDLE_FLOOR_GIB, IDLE_FLOOR_SHARE * (total_gib or 0.0)), 3)


def checkable(reader: Any) -> bool:
    """A reader that names the device's processes (NVML, the simulated GPU); host memory does not."""
    return callable(getattr(reader, "processes", None))


def occupancy(reader: Any, gpu: int | str, *, own_pids: Iterable[int] = ()) -> Occupancy:
    """One reading: live processes that are not in ``own_pids`` (the study's running servers) are holders;
    memory the device shows used beyond every listed process is a holder with no pid (NVML in a container)."""
    reading = reader.read()
    used, total = reading.used_gib, reading.total_gib
    own = {int(p) for p in own_pids}
    holders: list[Holder] = []
    releasing = listed = 0.0
    for p in reader.processes():
        gib = float(p.get("used_gib") or 0.0)
        listed += gib
        pid = p.get("pid")
        if pid is not None and int(pid) in own:
            continue
        if p.get("exited"):
            releasing += gib
        elif gib > 0 or p.get("used_gib") is None:
            holders.append(
                Holder(
                    pid=None if pid is None else int(pid),
                    used_gib=round(gib, 3),
                    name=process_name(int(pid)) if pid is not None else "",
                )
            )
    floor = floor_gib(total)
    unlisted = (float(used) - listed) if used is not None else 0.0
    if unlisted > floor:  # NVML shows it used, no process we can see holds it
        holders.append(Holder(pid=None, used_gib=round(unlisted, 3)))
    return Occupancy(
        gpu=gpu,
        total_gib=total,
        used_gib=used,
        holders=tuple(holders),
        releasing_gib=round(releasing, 3),
        floor_gib=floor,
    )


def settled(
    reader: Any,
    gpu: int | str,
    *,
    own_pids: Iterable[int] = (),
    release_wait_s: float = RELEASE_WAIT_S,
    poll_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
) -> Occupancy:
    """``occupancy`` once memory with no live holder is freed, or ``release_wait_s`` has passed: a just-stopped
    server (this study's or a killed neighbour's) is not a tenant, only its memory not yet returned."""
    own = tuple(own_pids)
    deadline = clock() + release_wait_s
    while True:
        occ = occupancy(reader, gpu, own_pids=own)
        live = any(h.pid is not None for h in occ.holders)
        if not occ.busy or live or clock() >= deadline:
            return occ
        time.sleep(poll_s)


def check_free(
    reader: Any,
    gpu: int | str,
    *,
    mode: str = "stop",
    wait_s: float = 600.0,
    own_pids: Iterable[int] = (),
    release_wait_s: float = RELEASE_WAIT_S,
    on_wait: Callable[[str], None] | None = None,
    poll_s: float = BUSY_POLL_S,
) -> Occupancy | None:
    """The pre-launch check: the GPU's occupancy when it is free enough to launch on; ``GpuBusyError`` (one line)
    when it is held by others — at once with ``mode="stop"``, after ``wait_s`` of polling with ``"wait"``.
    None for a reader that cannot name processes (nothing to check)."""
    if not checkable(reader):
        return None
    occ = settled(reader, gpu, own_pids=own_pids, release_wait_s=release_wait_s)
    if occ.busy and mode == "wait":
        deadline = time.monotonic() + wait_s
        if on_wait is not None:
            on_wait(f"waiting up to {wait_s:g} s for GPU {gpu}: {occ.line().split('; a trial')[0]}")
        while occ.busy and time.monotonic() < deadline:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            occ = settled(reader, gpu, own_pids=own_pids, release_wait_s=release_wait_s)
        if occ.busy:
            raise GpuBusyError(
                f"{occ.line()} (waited {wait_s:g} s)",
                gpu=gpu,
                holders=[_holder_text(h) for h in occ.holders],
                held_gib=occ.held_gib,
            )
    if occ.busy:
        raise GpuBusyError(occ.line(), gpu=gpu, holders=[_holder_text(h) for h in occ.holders], held_gib=occ.held_gib)
    return occ


def check_engine_gpu(
    engine: Any,
    gpu_index: int | None,
    *,
    mode: str = "stop",
    wait_s: float = 600.0,
    on_wait: Callable[[str], None] | None = None,
) -> Occupancy | None:
    """``check_free`` on the device ``engine`` launches on (``autotune measure`` and the sweep call this). CPU
    servers (no ``processes()`` on their reader) are not checked."""
    return check_engine_gpus(
        engine, (0 if gpu_index is None else gpu_index,), mode=mode, wait_s=wait_s, on_wait=on_wait
    )


def check_engine_gpus(
    engine: Any,
    gpus: Iterable[int],
    *,
    mode: str = "stop",
    wait_s: float = 600.0,
    on_wait: Callable[[str], None] | None = None,
    launcher: Any = None,
) -> Occupancy | None:
    """``check_free`` on every GPU of a server's group, each on its own reader (a tenant on any one of them is
    the server's tenant); the last GPU's occupancy, or None when nothing could be checked. ``launcher``: read the
    GPUs where its servers run (``Launcher.memory_reader``: another host's over SSH), else this host's."""
    if engine.device == "cpu":
        return None
    seen: Occupancy | None = None
    for gpu in gpus:
        if launcher is None:
            reader = engine.gpu_reader(gpu)
        else:
            reader = launcher.memory_reader((gpu,), lambda g: engine.gpu_reader(g[0]))
        try:
            seen = check_free(reader, gpu, mode=mode, wait_s=wait_s, on_wait=on_wait) or seen
        finally:
            reader.close()
    return seen
