"""Per-device locks: never two servers on one GPU, whichever worker of a study starts them (a free aligned group taken
all or nothing, released once the server is gone); and the sweep lock, one sweep of a study per GPU.
docs/study-file.md ("Servers over several GPUs").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from autotune.config import StudyConfig
from autotune.errors import StudyError
from autotune.launch.groups import aligned_groups, group_label

LOCK_DIR_ENV = "AUTOTUNE_GPU_LOCK_DIR"
POLL_S = 0.2


class Stopped(StudyError):
    """The sweep was asked to stop while its next launch waited for GPUs."""


def lock_dir(work_dir: Path) -> Path:
    """Where the per-GPU lock files live: ``$AUTOTUNE_GPU_LOCK_DIR``, else ``<work dir>/gpu-locks``."""
    given = os.environ.get(LOCK_DIR_ENV)
    return Path(given) if given else work_dir / "gpu-locks"


class GpuLocks:
    """The per-GPU locks of one pool (``pool`` None: one server's GPUs counted up from ``first``)."""

    def __init__(self, folder: Path, pool: Sequence[int] | None, *, first: int = 0):
        self.folder, self.pool, self.first = folder, tuple(pool) if pool is not None else None, first

    def candidates(self, size: int) -> list[tuple[int, ...]]:
        """The groups a server spanning ``size`` GPUs may take, in order of preference."""
        if self.pool is None:
            return [tuple(range(self.first, self.first + size))]
        return aligned_groups(self.pool, size)

    def try_take(self, size: int) -> Held | None:
        """Every GPU of the first free candidate group, or None when each has a GPU held elsewhere."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for group in self.candidates(size):
            files: list[IO[str]] = []
            try:
                for gpu in group:
                    fh = open(self.folder / f"gpu-{gpu}.lock", "a+")  # noqa: SIM115  (held until release)
                    files.append(fh)
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                for taken in files:
                    taken.close()  # all or nothing: nothing held while waiting
                continue
            for taken in files:
                taken.seek(0)
                taken.truncate()
                taken.write(f"{os.getpid()}\n")
                taken.flush()
            return Held(group, files)
        return None

    def take(
        self,
        size: int,
        *,
        stop: threading.Event | None = None,
        poll_s: float = POLL_S,
        on_wait: Callable[[str], None] | None = None,
    ) -> Held:
        """Wait for a free group of ``size`` GPUs and hold it; ``Stopped`` when ``stop`` is set meanwhile."""
        said = False
        while True:
            held = self.try_take(size)
            if held is not None:
                return held
            if not said and on_wait is not None:
                groups = " / ".join(group_label(g) for g in self.candidates(size))
                on_wait(f"waiting for a free group of {size} GPU{'s' if size > 1 else ''} ({groups})")
                said = True
            if stop is not None and stop.wait(poll_s):
                raise Stopped("stopped while waiting for GPUs")
            if stop is None:
                threading.Event().wait(poll_s)

    @contextlib.contextmanager
    def holding(
        self, size: int, *, stop: threading.Event | None = None, on_wait: Callable[[str], None] | None = None
    ) -> Iterator[tuple[int, ...]]:
        """``take`` as a context: the group's GPUs, released on exit however the block ends."""
        held = self.take(size, stop=stop, on_wait=on_wait)
        try:
            yield held.gpus
        finally:
            held.release()


class Held:
    """A group's GPUs held by this process until ``release``."""

    def __init__(self, gpus: tuple[int, ...], files: list[IO[str]]):
        self.gpus, self._files = gpus, files

    def release(self) -> None:
        for fh in self._files:
            if not fh.closed:
                fh.close()
        self._files = []


def hold_sweep_gpus(cfg: StudyConfig, names: list[str]) -> list[Any]:
    """Take the study's sweep lock of every name (a GPU, or a shared pool's worker slot), all or none; a name held
    by another sweep of this study is a StudyError naming the holder. Keyed by storage too: the same study name in
    two storages (benchmarks, seeds) is two studies. Released when the files close or the process dies."""
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha1(cfg.storage_url.encode()).hexdigest()[:10]
    held: list[Any] = []
    for name in names:
        path = cfg.work_dir / f"sweep-{tag}-gpu{name}.lock"
        fh = open(path, "a+")  # noqa: SIM115  (held for the sweep's lifetime)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            for other in held:
                other.close()
            what = f"GPU {name}" if name.isdigit() else f"worker slot {name}"
            raise StudyError(
                f"study {cfg.name!r} is being swept on {what} by pid {holder}; "
                f"wait for it, stop it or use other GPUs (the lock is {path})"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        held.append(fh)
    return held
