"""A full disk is one line and a failed trial, never a traceback or a trial left RUNNING: ``disk_error`` recognises a
failed write, ``Ballast`` keeps room to fail the trial in flight, ``Room`` checks free space before the search and
each ask, ``starved`` tells a server that died for want of room for its log. docs/search.md ("Nothing poisons a
study").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from autotune.errors import DiskError

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
DB_FULL_PHRASES = ("database or disk is full", "no space left on device")  # SQLITE_FULL; a journal file
BALLAST_BYTES = 512 * 1024  # enough for SQLite to journal a few trial updates: the in-flight trial's FAIL
FLOOR_BYTES = 1024 * 1024  # below this no trial fits (its log, records and result): stop before asking ...
DB_FLOOR_BYTES = 256 * 1024  # ... and below this the storage cannot record one more trial beside its reserve
# What a trial writes when the study has no finished trial to measure: a 30-60 s window's per-request records at a
# few thousand tok/s plus the server log and result.json (the example study's trials write 1-6 MiB).
TRIAL_BYTES_ESTIMATE = 8 * 1024 * 1024
DB_TRIAL_BYTES_ESTIMATE = 64 * 1024  # what a trial adds to a SQLite study (its result, plan and attributes)


def free_bytes(path: Path | str | None) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent), None when unknown."""
    if path is None:
        return None
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human(n: int | None) -> str:
    """``2_500_000`` → ``2.4 MiB``."""
    if n is None:
        return "unknown"
    if n < 1024:
        return f"{n} bytes"
    value = float(n) / 1024
    units = ["KiB", "MiB", "GiB"]
    while value >= 1024 and len(units) > 1:
        value /= 1024
        units.pop(0)
    return f"{value:.1f} {units[0]}"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def db_full(exc: BaseException) -> bool:
    """The study storage failed because its disk is full (SQLite through SQLAlchemy/Optuna, or a journal file)."""
    return any(
        any(p in str(e).lower() for p in DB_FULL_PHRASES) or (isinstance(e, OSError) and e.errno in FULL_ERRNOS)
        for e in _chain(exc)
    )


def disk_error(exc: BaseException, *, db_path: Path | None = None, fallback: Path | None = None) -> DiskError | None:
    """``exc`` as a one-line ``DiskError`` naming the path and its free space, or None when it is no failed write."""
    for e in _chain(exc):
        if isinstance(e, DiskError):
            return e
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            path = Path(e.filename) if e.filename else fallback
            return _make(path, e.strerror or str(e))
    if db_full(exc):
        return _make(db_path or fallback, "the study database could not be written (database or disk is full)")
    return None


def _make(path: Path | None, what: str) -> DiskError:
    free = free_bytes(path)
    where = str(path) if path is not None else "the study folder"
    return DiskError(
        f"cannot write {where}: {what}; {human(free)} free there. Free space on that disk (or move the "
        "study file and its folder to a larger one, the database with --storage) and run the same "
        "command again to resume",
        path=str(path) if path is not None else None,
        free_bytes=free,
    )


STARVED_BYTES = 64 * 1024  # a trial folder's disk with less than this free could not take the server's log


def starved(result: Any) -> DiskError | None:
    """A failed trial whose server left no log on a disk with no room for one: the server died writing its log
    (the simulator exits 1, SGLang crashes), so the failure is the disk's, not the config's (never ``bad_args``)."""
    if result.ok or result.status == "write_error" or (result.log_tail or "").strip() or not result.log_path:
        return None
    free = free_bytes(result.log_path)
    if free is None or free >= STARVED_BYTES:
        return None
    return _make(Path(result.log_path), f"the server could not write its log ({result.status} with an empty log)")


class Ballast:
    """A reserve file beside a file-backed study storage: freed when the storage says its disk is full, so the
    trial in flight can still be failed (never left RUNNING) before the sweep stops. One per sweep process
    (workers of one node share the database); a killed sweep's is removed by the next one to place its own."""

    def __init__(self, db_path: Path | None, size: int = BALLAST_BYTES):
        self.path = None if db_path is None else db_path.with_name(f".{db_path.name}.{os.getpid()}.reserve")
        self.size = size

    def _remove_dead(self) -> None:
        assert self.path is not None
        for other in self.path.parent.glob(self.path.name.rsplit(".", 2)[0] + ".*.reserve"):
            pid = other.name.rsplit(".", 2)[1]
            if pid.isdigit() and other != self.path and not psutil.pid_exists(int(pid)):
                with contextlib.suppress(OSError):
                    other.unlink()

    def place(self) -> bool:
        """Write the reserve (False, and nothing left behind, when the disk cannot hold it)."""
        if self.path is None:
            return False
        self._remove_dead()
        try:
            with open(self.path, "wb") as fh:
                fh.write(b"\0" * self.size)  # real blocks (not a sparse file): they must be there to give back
                fh.flush()
                os.fsync(fh.fileno())
            return True
        except OSError:
            self.release()
            return False

    def release(self) -> bool:
        """Give the reserve back to the disk; True when there was one."""
        if self.path is None or not self.path.exists():
            return False
        with contextlib.suppress(OSError):
            self.path.unlink()
        return True


def trial_bytes(trials_dir: Path) -> tuple[int, str]:
    """What one trial writes: the median size of the study's trial folders whose ``result.json`` says ok (a failed
    trial writes less than a measured one), else ``TRIAL_BYTES_ESTIMATE``. Returns (bytes, how it was found)."""
    sizes = []
    if trials_dir.is_dir():
        for d in trials_dir.iterdir():
            try:
                ok = json.loads((d / "result.json").read_text()).get("status") == "ok"
            except (OSError, ValueError, AttributeError):
                continue  # not a trial folder, or one without a result
            if ok:
                sizes.append(sum(f.stat().st_size for f in d.rglob("*") if f.is_file()))
    if sizes:
        return int(statistics.median(sizes)), f"measured on {len(sizes)} finished trial folder(s)"
    return TRIAL_BYTES_ESTIMATE, "estimated; no finished trial to measure yet"


class Room:
    """Free space of the trials folder and the storage's folder, against what the study will write."""

    def __init__(self, trials_dir: Path, db_path: Path | None):
        self.trials_dir, self.db_path = trials_dir, db_path

    def _places(self) -> list[tuple[str, Path]]:
        places = [("trials folder", self.trials_dir)]
        if self.db_path is not None:
            places.append(("study database", self.db_path))
        return places

    def _per_trial(self, n_trials: int) -> dict[str, tuple[int, str]]:
        """What one trial writes to each place: measured where the study has finished trials, else estimated."""
        per = {"trials folder": trial_bytes(self.trials_dir)}
        if self.db_path is not None:
            size = self.db_path.stat().st_size if self.db_path.is_file() else 0
            per["study database"] = (
                (size // n_trials, f"measured: the database over its {n_trials} trial(s)")
                if n_trials and size
                else (DB_TRIAL_BYTES_ESTIMATE, "estimated")
            )
        return per

    def warning(self, trials_left: int, n_trials: int = 0) -> str | None:
        """A line when a place cannot hold the trials left (the sweep starts anyway: trials may write less).
        ``n_trials``: how many trials the study's database holds already (to measure what one adds)."""
        per = self._per_trial(n_trials)
        for label, path in self._places():
            each, how = per[label]
            need = each * max(1, trials_left)
            free = free_bytes(path)
            if free is not None and free < need:
                return (
                    f"warning: the {label} ({path}) has {human(free)} free; a trial writes about {human(each)} "
                    f"there ({how}), the {trials_left} trial(s) left about {human(need)}: a write may fail "
                    "mid-study (the trial then fails as write_error and the sweep stops)"
                )
        return None

    def check(self) -> None:
        """Before an ask: ``DiskError`` when a place cannot hold one more trial (the trials folder: what a finished
        trial of this study wrote, at most ``FLOOR_BYTES``; the storage: ``DB_FLOOR_BYTES``), so no trial is
        created RUNNING on a disk that cannot record it."""
        per, _ = trial_bytes(self.trials_dir)
        floors = {"trials folder": min(per, FLOOR_BYTES), "study database": DB_FLOOR_BYTES}
        for label, path in self._places():
            free = free_bytes(path)
            if free is not None and free < floors[label]:
                raise DiskError(
                    f"the {label} ({path}) has only {human(free)} free (one more trial needs about "
                    f"{human(floors[label])}); free space on that disk and run the same command again to "
                    "resume",
                    path=str(path),
                    free_bytes=free,
                )
