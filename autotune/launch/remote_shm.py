"""A server's ``/dev/shm`` files on another host: ``launch.shm``'s rules, with the facts read over the ssh transport
in a few bounded calls (paths ``shlex.quote``d, records NUL-separated). docs/engines-and-launchers.md ("SGLang's
/dev/shm files").
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from autotune.errors import AutotuneError
from autotune.launch.shm import proven, sglang_shaped, unheld_semaphores

log = logging.getLogger(__name__)

Call = Callable[[str, float], tuple[int, str, str]]  # (command, timeout_s) -> (code, stdout, stderr) on the host
CALL_TIMEOUT_S = 60.0
ALL_PROCESSES = -1  # ``facts_command(..., holders=ALL_PROCESSES)``: what every process on the host holds


def snapshot_command(directory: str, ports: Collection[int], record: str | None = None) -> str:
    """The record of a start, NUL-separated: ``dir <directory>``, ``ports <p> …``, then ``n <name>`` for every entry
    of ``directory`` now (none when it does not exist). With ``record`` (a file on the host) it is kept there
    too, so a later command that has only the pid file (a fleet's ``down``) can tell the server's files."""
    header = " ".join(shlex.quote(r) for r in (f"dir {directory}", " ".join(["ports", *map(str, sorted(ports))])))
    listing = (
        f"{{ printf '%s\\0' {header}; "
        f"find {shlex.quote(directory)} -mindepth 1 -maxdepth 1 -printf 'n %f\\0' 2>/dev/null; true; }}"
    )
    if record is None:
        return listing
    folder = record.rpartition("/")[0] or "."
    return f"mkdir -p {shlex.quote(folder)} && {listing} >{shlex.quote(record)} && cat {shlex.quote(record)}"


def parse_record(text: str) -> tuple[str, set[int], set[str]] | None:
    """``snapshot_command``'s output → (directory, ports, names); None when it is not one (nothing is then removed)."""
    records = text.split("\0")
    directory = next((r[4:] for r in records if r.startswith("dir ")), None)
    ports = next((r[6:].split() for r in records if r.startswith("ports ") or r == "ports"), None)
    if not directory or ports is None or not all(p.isdigit() for p in ports):
        return None
    return directory, {int(p) for p in ports}, {r[2:] for r in records if r.startswith("n ") and len(r) > 2}


def facts_command(directory: str, holders: int | None) -> str:
    """The host's facts as NUL-separated records: ``u <uid>``; ``f <inode> <uid> <type> <name>`` for each entry of
    ``directory``; and ``i <inode>`` for each file there held (fd or mapping, deleted names included) by the
    process group ``holders`` (``ALL_PROCESSES``: by any process; None: no holders read)."""
    lines = [
        f"d=$(cd {shlex.quote(directory)} 2>/dev/null && pwd -P) || exit 0",
        "printf 'u %s\\0' \"$(id -u)\"",
        "find \"$d\" -mindepth 1 -maxdepth 1 -printf 'f %i %U %y %f\\0'",
    ]
    if holders is not None:
        if holders == ALL_PROCESSES:
            pids = "ps -e -o pid="
        else:
            pids = f"ps -e -o pid= -o pgid= | awk -v g={int(holders)} '$2 == g {{print $1}}'"
        lines.append(
            f"for p in $({pids}); do "
            "find /proc/$p/fd -mindepth 1 -maxdepth 1 -lname \"$d/*\" -exec stat -L -c 'i %i' {} + 2>/dev/null; "
            'awk -v d="$d/" \'index($6, d) == 1 {print "i " $5}\' /proc/$p/maps 2>/dev/null; '
            "done | tr '\\n' '\\0'"
        )
    return "\n".join(lines)


def remove_command(directory: str, files: dict[str, int]) -> str:
    """Remove each name whose inode is still the one proven the server's; prints the removed names (NUL-separated)."""
    steps = [f"cd {shlex.quote(directory)} || exit 0"]
    for name, ino in sorted(files.items()):
        q = shlex.quote(name)
        steps.append(
            f"if [ \"$(stat -c %i -- {q} 2>/dev/null)\" = {int(ino)} ]; then rm -f -- {q} && printf '%s\\0' {q}; fi"
        )
    return "\n".join(steps)


@dataclass
class Facts:
    """What one ``facts_command`` said: this user's SGLang-shaped regular files (name → inode), and held inodes."""

    files: dict[str, int] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)


def parse_facts(text: str) -> Facts:
    """``facts_command``'s output; a record of another shape is skipped (nothing unproven is ever removed)."""
    records = text.split("\0")
    uid = next((r[2:].strip() for r in records if r.startswith("u ")), None)
    facts = Facts()
    for record in records:
        if record.startswith("f "):
            parts = record[2:].split(" ", 3)
            if (
                len(parts) == 4
                and parts[0].isdigit()
                and parts[1] == uid
                and parts[2] == "f"
                and sglang_shaped(parts[3])
            ):
                facts.files[parts[3]] = int(parts[0])
        elif record.startswith("i ") and record[2:].strip().isdigit():
            facts.held.add(int(record[2:].strip()))
    return facts


def parse_names(text: str) -> set[str]:
    return {name for name in text.split("\0") if name}


class RemoteShm:
    """One server's files in ``directory`` on the host ``call`` reaches: ``snapshot`` before the start,
    ``observe(pgid)`` while the group still runs (just before the stop), ``release()`` once it is gone."""

    def __init__(self, call: Call, directory: str, ports: Collection[int], *, host: str = "the host"):
        self.call, self.directory, self.host = call, directory, host
        self.ports = {int(p) for p in ports}
        self.before: set[str] | None = None  # None: no listing at start, so nothing can be told new (none removed)
        self.owned: dict[str, int] = {}
        self.removed: list[str] = []  # what ``release`` removed, and the new files it left (unproven)
        self.left: list[str] = []

    @classmethod
    def from_record(cls, call: Call, text: str, *, host: str = "the host") -> RemoteShm | None:
        """The files of a server started by an earlier command, from the record its start kept on the host."""
        parsed = parse_record(text)
        if parsed is None:
            return None
        directory, ports, before = parsed
        shm = cls(call, directory, ports, host=host)
        shm.before = before
        return shm

    def snapshot(self, record: str | None = None) -> None:
        """List the directory before the start (and keep the listing in ``record`` on the host, when given)."""
        out = self._ask(snapshot_command(self.directory, self.ports, record))
        parsed = None if out is None else parse_record(out)
        self.before = None if parsed is None else parsed[2]

    def observe(self, pgid: int) -> None:
        """Attribute the new files that group ``pgid`` holds now, or that name one of the server's ports."""
        facts = self._facts(pgid)
        if facts is not None:
            self.owned.update(proven(self._new(facts), self.ports, facts.held))

    def release(self) -> tuple[list[str], list[str]]:
        """Remove the proven files (and, the group being gone, the new semaphores nobody holds); return (removed,
        new files left because unproven)."""
        if self.before is None:
            return [], []
        facts = self._facts(None)
        if facts is None:
            return [], []
        self.removed, self.left = self._release(facts)
        return self.removed, self.left

    def _release(self, facts: Facts) -> tuple[list[str], list[str]]:
        new = self._new(facts)
        doomed = {n: ino for n, ino in new.items() if self.owned.get(n) == ino}
        doomed.update(proven(new, self.ports))
        if unheld_semaphores({n: i for n, i in new.items() if n not in doomed}, ()):
            everyone = self._facts(ALL_PROCESSES)
            if everyone is not None:
                fresh = self._new(everyone)
                doomed.update(unheld_semaphores({n: i for n, i in fresh.items() if n not in doomed}, everyone.held))
        removed: list[str] = []
        if doomed:
            out = self._ask(remove_command(self.directory, doomed))
            removed = sorted(parse_names(out or "") & set(doomed))
        left = sorted(set(new) - set(removed))
        if left:
            log.warning(
                "left %d new file(s) in %s on %s not proven this server's: %s",
                len(left),
                self.directory,
                self.host,
                ", ".join(left),
            )
        return removed, left

    def _new(self, facts: Facts) -> dict[str, int]:
        before = self.before or set()
        return {n: ino for n, ino in facts.files.items() if n not in before}

    def _facts(self, holders: int | None) -> Facts | None:
        out = self._ask(facts_command(self.directory, holders))
        return None if out is None else parse_facts(out)

    def _ask(self, command: str) -> str | None:
        """The command's output; None when the host could not be asked (its files are then left, never guessed)."""
        try:
            code, out, err = self.call(command, CALL_TIMEOUT_S)
        except (AutotuneError, OSError) as exc:
            log.warning("cannot read %s on %s: %s", self.directory, self.host, exc)
            return None
        if code != 0:
            log.warning("reading %s on %s failed (exit %d): %s", self.directory, self.host, code, err.strip()[:200])
            return None
        return out
