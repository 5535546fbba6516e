"""The keeper's process: started detached by ``fleet up`` (``autotune fleet keep`` in a session of its own, its
log and record beside the router's), found again by its record (pid and start time) and stopped first by
``fleet down``. One per fleet: a second keeper of the same fleet exits at once (``run/keeper.json.lock``)."""

from __future__ import annotations

import fcntl
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from autotune.deploy.detached import spawn
from autotune.deploy.fleetfile import Fleet, replace_file
from autotune.deploy.fleetlog import FleetLog
from autotune.errors import FleetError
from autotune.launch.process import stop_process_group
from autotune.launch.procgroup import alive_since
from autotune.launch.stopping import wait_until


@dataclass(frozen=True, kw_only=True)
class Record:
    pid: int
    started: float  # the process's create time: a reused pid does not match it
    log: str

    def alive(self) -> bool:
        return alive_since(self.pid, self.started)


def record_path(fleet: Fleet) -> Path:
    return fleet.resolve(fleet.keeper.record)


def pid_path(fleet: Fleet) -> Path:
    """``run/keeper.pid``, so whatever kills a fleet's pid files' processes (a test's teardown) kills it too."""
    return record_path(fleet).with_suffix(".pid")


def read_record(fleet: Fleet) -> Record | None:
    try:
        return Record(**json.loads(record_path(fleet).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def running(fleet: Fleet) -> Record | None:
    record = read_record(fleet)
    return record if record is not None and record.alive() else None


@contextmanager
def only_keeper(fleet: Fleet) -> Iterator[None]:
    """Held for the keeper's life: FleetError when another keeper of this fleet runs."""
    path = record_path(fleet).with_name(record_path(fleet).name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = running(fleet)
            raise FleetError(
                f"a keeper of {fleet.path} already runs" + (f" (pid {other.pid})" if other else "")
            ) from None
        yield


def start(fleet: Fleet, *, timeout_s: float = 30.0) -> Record:
    """The fleet's keeper, started detached unless one runs; returns once it has taken its lock and looks."""
    current = running(fleet)
    if current is not None:
        return current
    assert fleet.path is not None
    log_path = fleet.resolve(fleet.keeper.log)
    proc, started = spawn(
        [sys.executable, "-m", "autotune", "fleet", "keep", "--fleet", str(fleet.path.resolve())], log_path
    )
    record = Record(pid=proc.pid, started=started, log=str(log_path))
    replace_file(record_path(fleet), json.dumps(asdict(record)) + "\n")
    pid_path(fleet).write_text(f"{proc.pid}\n")
    events = FleetLog.of(fleet)
    if (
        not wait_until(lambda: proc.poll() is not None or _started(events, proc.pid), timeout_s, 0.05)
        or proc.poll() is not None
    ):
        stop(fleet)
        raise FleetError(f"the fleet's keeper did not start (log: {log_path})")
    return record


def _started(events: FleetLog, pid: int) -> bool:
    return any(e.get("event") == "keeper_start" and f"(pid {pid})" in e.get("line", "") for e in events.recent(20))


def stop(fleet: Fleet, *, grace_s: float = 15.0) -> bool:
    """SIGTERM (it finishes its look and lets go of the fleet), SIGKILL after ``grace_s``; True if one ran. Returns
    once the process has exited."""
    record = read_record(fleet)
    ran = record is not None and record.alive()
    if record is not None and ran:
        stop_process_group(record.pid, grace_s=grace_s)
        wait_until(lambda: not record.alive(), 10.0, 0.05)
    for path in (record_path(fleet), pid_path(fleet)):
        path.unlink(missing_ok=True)
    return ran
