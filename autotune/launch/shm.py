"""Which ``/dev/shm`` files one server made, proven from facts that hold for real SGLang (appeared after it started,
and held by its processes or named by its ports; unheld new semaphores once its group is gone), and their
removal; anything else is left and listed. docs/engines-and-launchers.md ("SGLang's /dev/shm files").
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.launch.procgroup import group_pids, held_inodes

SHM_DIR = Path("/dev/shm")
# SGLang's shapes (and the simulator's, which imitates them); any other name there is not ours to touch.
SEM_PREFIX = "sem.mp-"  # multiprocessing's named semaphores (glibc: /dev/shm/sem.<name>)
SHM_PREFIXES = ("sglang", "deepspeed_allreduce_buffer", SEM_PREFIX, "autotune")
FRESH_S = 5.0  # a new file is checked on every sample this long; after that, every STALE_SCAN_S
STALE_SCAN_S = 1.0
SHM_SAMPLE_S = 0.05  # a server that dies during startup holds its files only for as long as it lives
ALIVE_CHECK_S = 1.0  # with nothing to attribute, how often the sampler checks that the group still lives
_PORT_NAME = re.compile(r"^deepspeed_allreduce_buffer_\d+_[^_]+_(\d+)_\d+$")


def snapshot(directory: Path) -> set[str]:
    try:
        return {entry.name for entry in os.scandir(directory)}
    except OSError:
        return set()


def named_port(name: str) -> int | None:
    """The port in ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (SGLang's dist port), else None."""
    match = _PORT_NAME.match(name)
    return int(match.group(1)) if match else None


def sglang_shaped(name: str) -> bool:
    """A name of SGLang's shapes (or the simulator's): the only files in the directory we may ever remove."""
    return name.startswith(SHM_PREFIXES)


def launch_ports(port: int, argv: Sequence[str]) -> set[int]:
    """The ports a server's files may be named after: its own, and ``--nccl-port`` (SGLang's dist port, which its
    CPU all-reduce buffer is named after) when the launch sets it."""
    ports = {int(port)}
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--nccl-port=") else None
        if arg == "--nccl-port" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.isdigit():
            ports.add(int(value))
    return ports


def proven(pending: Mapping[str, int], ports: Collection[int], held: Collection[int] = ()) -> dict[str, int]:
    """The new files (name → inode) proven the server's: one of its ``ports`` in the name, or its inode among
    those the server's processes ``held`` (fd or mapping, any name). The rule for this host and for another."""
    return {n: ino for n, ino in pending.items() if named_port(n) in ports or ino in held}


def unheld_semaphores(pending: Mapping[str, int], held_anywhere: Collection[int]) -> dict[str, int]:
    """``sem.mp-*`` files new since the server started that no process on the host holds (see the docstring)."""
    return {n: ino for n, ino in pending.items() if n.startswith(SEM_PREFIX) and ino not in held_anywhere}


def new_files(directory: Path, before: set[str]) -> dict[str, int]:
    """SGLang-shaped regular files of this user that were not there at ``before`` → inode."""
    found: dict[str, int] = {}
    uid = os.getuid()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        if entry.name in before or not sglang_shaped(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid and entry.is_file(follow_symlinks=False):
            found[entry.name] = st.st_ino
    return found


class ShmOwnership:
    """The files one server made in ``directory``: appeared after ``before`` AND (held by its group OR name its port).

    ``owned`` maps name → inode, so a file replaced by another server under the same name is never removed.
    """

    def __init__(
        self, directory: Path, before: Iterable[str], ports: Iterable[int] = (), owned: dict[str, int] | None = None
    ):
        self.directory = Path(directory)
        self.before = set(before)
        self.ports = {int(p) for p in ports}
        self.owned: dict[str, int] = dict(owned or {})  # replaced, never mutated: readers in other threads
        self._first_seen: dict[str, float] = {}
        self._last_scan = 0.0

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ShmOwnership:
        """The ownership a pid file recorded (``shm_dir``, ``shm_before``, ``shm_ports``, ``shm_owned``)."""
        owned = {str(k): int(v) for k, v in (record.get("shm_owned") or {}).items()}
        return cls(
            Path(record.get("shm_dir", SHM_DIR)), record.get("shm_before") or [], record.get("shm_ports") or [], owned
        )

    def pending(self) -> bool:
        """Whether a new file is not attributed yet (a scan of the directory only, no /proc)."""
        return any(self.owned.get(n) != ino for n, ino in new_files(self.directory, self.before).items())

    def observe(self, pids: Iterable[int], *, force: bool = True) -> bool:
        """Attribute what ``pids`` (the server's group, now) hold; True when ``owned`` grew.

        Unless ``force``, a file pending for seconds (another server's) is rechecked about once a second, not on
        every call: reading a big process's maps many times a second would cost a core.
        """
        pending = {n: ino for n, ino in new_files(self.directory, self.before).items() if self.owned.get(n) != ino}
        if not pending:
            return False
        now = time.monotonic()
        for name in pending:
            self._first_seen.setdefault(name, now)
        fresh = any(now - self._first_seen[n] < FRESH_S for n in pending)
        found = proven(pending, self.ports)
        pids = set(pids)
        if pids and len(found) < len(pending) and (force or fresh or now - self._last_scan >= STALE_SCAN_S):
            self._last_scan = now
            found = proven(pending, self.ports, held_inodes(pids, self.directory))
        if found:
            self.owned = {**self.owned, **found}
        return bool(found)

    def paths(self) -> list[Path]:
        return [self.directory / name for name in self.owned]

    def size_bytes(self) -> int:
        """RAM the owned files still hold (tmpfs: allocated blocks)."""
        total = 0
        for path in self.paths():
            try:
                total += path.stat().st_blocks * 512
            except OSError:
                continue
        return total

    def remove(self) -> tuple[list[str], list[str]]:
        """Unlink the owned files (same inode only); return (removed, new files left because unproven)."""
        removed = unlink_same(self.directory, self.owned)
        left = sorted(set(new_files(self.directory, self.before)) - set(removed))
        return removed, left


class ShmSampler:
    """Samples, while the server runs, which new /dev/shm files its process group holds (a dead one holds none)."""

    def __init__(
        self, ownership: ShmOwnership, pgid: int, on_grow: Callable[[], None], interval_s: float = SHM_SAMPLE_S
    ):
        self.ownership, self.pgid, self.on_grow, self.interval_s = ownership, pgid, on_grow, interval_s
        self._stop = threading.Event()
        self._alive_at = 0.0
        self._thread = threading.Thread(target=self._run, name="shm-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self, *, force: bool = True) -> bool:
        """One look at what the group holds; False once the group is gone (a dead group holds nothing). Unless
        ``force``, /proc is read only when a new file awaits attribution or ``ALIVE_CHECK_S`` has passed: the
        sampler shares the GIL with the replay client, and a /proc walk every 50 ms cost it ~5 % of a core."""
        now = time.monotonic()
        if not force and now - self._alive_at < ALIVE_CHECK_S and not self.ownership.pending():
            return True
        self._alive_at = now
        pids = group_pids(self.pgid)
        try:
            if self.ownership.observe(pids, force=force):
                self.on_grow()
        except Exception:  # noqa: BLE001 - a failed sample only loses attribution (files are left), never a trial
            pass
        return bool(pids)

    def stop(self) -> None:
        """End the thread, then take one last sample (the group may have mapped something since)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.sample()

    def _run(self) -> None:
        while not self._stop.is_set() and self.sample(force=False):
            self._stop.wait(self.interval_s)


def unlink_same(directory: Path, files: Mapping[str, int]) -> list[str]:
    """Unlink each name whose inode is still the one given (a file recreated under that name by another server
    stays); the names removed, sorted."""
    removed: list[str] = []
    for name, ino in sorted(files.items()):
        path = Path(directory) / name
        try:
            if path.lstat().st_ino == ino:
                path.unlink()
                removed.append(name)
        except OSError:
            continue
    return removed


def release_semaphores(directory: Path, before: Iterable[str]) -> list[str]:
    """Remove the ``sem.mp-*`` files new since ``before`` that no process on the host holds; call it only once
    the server's group is gone (see the module docstring for why that proves them the server's). Returns them."""
    return release_unheld(directory, before, (SEM_PREFIX,))


def release_unheld(directory: Path, before: Iterable[str], shapes: tuple[str, ...]) -> list[str]:
    """Remove the files of ``shapes`` new since ``before`` that no process on the host holds (fd or mapping, any
    name, by inode); call it only once the server is gone. Returns them."""
    candidates = {n: ino for n, ino in new_files(Path(directory), set(before)).items() if n.startswith(shapes)}
    if not candidates:
        return []
    held = held_inodes(None, Path(directory))
    return unlink_same(directory, {n: ino for n, ino in candidates.items() if ino not in held})


def clean_after_job(shm: ShmOwnership) -> tuple[list[str], list[str]]:
    """Once a server whose processes this host could not watch (a Slurm job) is gone: remove the new files its
    ports name and every new SGLang-shaped file that no process on the host holds (created during its life, held
    by nobody once it is gone: its leftovers, e.g. the all-reduce buffer and load segment a clean exit leaves).
    Returns (removed, left: new files someone still holds, not provably its own). Its limit is the semaphores'
    (module docstring): a neighbour's file whose holder died during the job goes too."""
    shm.observe(())
    removed, _ = shm.remove()
    removed = sorted([*removed, *release_unheld(shm.directory, shm.before | set(removed), SHM_PREFIXES)])
    return removed, sorted(set(new_files(shm.directory, shm.before)) - set(removed))
