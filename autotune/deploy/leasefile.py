"""The lease's record (``run/lease.json``): which server of the fleet is lent to which study's sweep, read by
every view of the fleet; lending and giving back are ``deploy.lease``'s."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from autotune.deploy.fleetfile import Fleet
from autotune.launch.procgroup import alive_since


@dataclass(frozen=True, kw_only=True)
class Lease:
    server: str
    study: str
    pid: int  # the sweep's process: while it lives, the server is the study's
    started: float  # its create time (a reused pid does not match it)
    since: str  # ISO 8601, UTC
    serving: int  # the fleet's servers serving the job while it is out
    total: int

    def holder_alive(self) -> bool:
        return alive_since(self.pid, self.started)

    @property
    def line(self) -> str:
        """``s1 lent to study tune since 12:03:04 (sweep pid 4242); 2 of 3 servers serving``."""
        return (
            f"{self.server} lent to study {self.study} since {self.since[11:19]} UTC (sweep pid {self.pid}); "
            f"{self.serving} of {self.total} servers serving"
        )


def lease_path(fleet: Fleet) -> Path:
    return fleet.resolve("run/lease.json")


def current(fleet: Fleet) -> Lease | None:
    try:
        return Lease(**json.loads(lease_path(fleet).read_text()))
    except (OSError, ValueError, TypeError):
        return None
