"""A trial's own writes (its folder, records, result, server log, probe outputs): a full or read-only disk is one
``DiskError`` naming the path and the free space, not an ``OSError`` traceback out of the middle of a trial.

Only the errnos that mean "this disk cannot take the write" become a ``DiskError`` (the study stops with one line:
every later trial would fail the same way); any other ``OSError`` is left as it is.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from autotune.errors import DiskError

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent); None if unknown."""
    for candidate in (Path(path), *Path(path).parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _size(n: int | None) -> str:
    if n is None:
        return "free space unknown"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{value:,.0f} B free" if unit == "B" else f"{value:,.1f} {unit} free"


def disk_error(exc: OSError, path: Path) -> DiskError:
    """The one-line error for a write to ``path`` that failed with ``exc`` (a ``DISK_ERRNOS`` errno)."""
    free = free_bytes(path)
    what = "read-only file system" if exc.errno == errno.EROFS else (exc.strerror or str(exc))
    fix = (
        "mount it writable or move the study elsewhere"
        if exc.errno == errno.EROFS
        else "free space there or move the study to a larger disk"
    )
    return DiskError(f"cannot write {path}: {what} ({_size(free)} on its disk): {fix}", path=str(path), free_bytes=free)


@contextlib.contextmanager
def writing(path: Path, *, partial: bool = False) -> Iterator[None]:
    """Run a write of ``path``: a disk-full / quota / read-only ``OSError`` becomes ``disk_error``. ``partial``:
    the write creates ``path``, so a failed one removes what it left (a truncated result must not be read later)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        if partial:
            with contextlib.suppress(OSError):
                Path(path).unlink(missing_ok=True)
        raise disk_error(exc, Path(getattr(exc, "filename", None) or path)) from exc
