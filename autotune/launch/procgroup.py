"""A process group seen through ``/proc``: its live members, the files they hold, their memory, and whether a
process is still the one that was started.

``/proc`` is the only place that says which process holds a ``/dev/shm`` file (SGLang's names carry no pid),
and it is cheap enough to read several times a second while a server runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

PROC = "/proc"


def _stat_tail(pid: int | str) -> list[bytes] | None:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces): state, ppid, pgrp, ..."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()


def group_pids(pgid: int | None) -> set[int]:
    """The members of process group ``pgid`` that still run (zombies hold no memory and no files)."""
    if pgid is None:
        return set()
    pids: set[int] = set()
    try:
        entries = os.listdir(PROC)
    except OSError:
        return pids
    for name in entries:
        if not name.isdigit():
            continue
        tail = _stat_tail(name)
        if tail and len(tail) > 2 and tail[0] not in (b"Z", b"X") and int(tail[2]) == pgid:
            pids.add(int(name))
    return pids


def _held(pids: Iterable[int], folder: str) -> Iterator[tuple[str, int, bool]]:
    """(path under ``folder``, inode, mapped) of each file ``pids`` hold open (an fd) or mapped, as ``/proc`` names
    it: a deleted file's path ends in `` (deleted)``."""
    needle = (folder + "/").encode()
    for pid in pids:
        fd_dir = f"{PROC}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
                if target.startswith(folder + "/"):
                    yield target[len(folder) + 1 :], os.stat(f"{fd_dir}/{fd}").st_ino, False
            except OSError:
                continue  # closed meanwhile
        try:
            with open(f"{PROC}/{pid}/maps", "rb") as fh:
                maps = fh.read()
        except OSError:
            continue
        if needle not in maps:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(needle):
                yield os.fsdecode(parts[5][len(needle) :]), int(parts[4]), True


def held_files(pids: Iterable[int], directory: Path) -> dict[str, int]:
    """Names in ``directory`` that ``pids`` hold open or mapped → the inode they hold (a deleted file held open
    under its ``/proc`` name, `` (deleted)`` appended; a deleted mapping left out)."""
    return {
        name: ino
        for name, ino, mapped in _held(pids, os.path.realpath(directory))
        if not (name.endswith(" (deleted)") if mapped else "/" in name)
    }


def held_inodes(pids: Iterable[int] | None, directory: Path) -> set[int]:
    """Inodes of files in ``directory`` that ``pids`` (None: every process we can see) hold open or mapped,
    under any name: a deleted one included. glibc's ``sem_open`` maps a temporary ``sem.XXXXXX``, links it to
    the semaphore's name and unlinks the temporary, so the creator's mapping reads ``sem.XXXXXX (deleted)`` and
    only its inode says it is the ``sem.mp-*`` file (checked with Python's multiprocessing on glibc)."""
    if pids is None:
        try:
            pids = [int(name) for name in os.listdir(PROC) if name.isdigit()]
        except OSError:
            pids = []
    return {ino for _, ino, _ in _held(pids, os.path.realpath(directory))}


def memory_bytes(pid: int) -> int:
    """The process's proportional share of RAM, without shared-memory mappings (counted as whole files instead)."""
    fields: dict[str, int] = {}
    try:
        with open(f"{PROC}/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                key, _, rest = line.partition(b":")
                if key in (b"Pss", b"Pss_Shmem"):
                    fields[key.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "Pss" in fields:
        return max(0, fields["Pss"] - fields.get("Pss_Shmem", 0))
    try:  # no smaps_rollup (old kernel): resident pages
        with open(f"{PROC}/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def alive_since(pid: int, started: float) -> bool:
    """``pid`` still runs and is the process created at ``started`` (psutil's create time): a reused pid is not it,
    nor a zombie."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < 1.0
    except psutil.Error:
        return False
