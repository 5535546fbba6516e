"""The fleet's own log: what happened to its servers between rollouts (a death, a restart, a foreign process on a
port, the keeper giving up), append-only JSONL beside the fleet file that ``fleet status`` and ``watch`` read.

Each event carries its one-line account (``line``), so every view says the same words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Required, TypedDict, cast

from autotune.deploy.fleetfile import Fleet
from autotune.deploy.rolloutlog import JsonlLog


class FleetEvent(TypedDict, total=False):
    event: Required[str]  # keeper_start, keeper_stop, exited, unresponsive, removed, foreign, restarting,
    #                       restarted, restart_failed, readmitted, gave_up, serving, lent, returned
    time: Required[str]  # ISO 8601, UTC
    line: Required[str]  # the account every view prints
    server: str
    cause: str  # the engine's failure class of a death (runtime_oom, crash, …), or "unknown"
    attempt: int
    seconds: float
    return_s: float  # a lent server's return: from its start to back in the router
    capacity: dict[str, int | None]


def events_path(fleet: Fleet) -> Path:
    assert fleet.path is not None
    return fleet.path.with_name(fleet.path.stem + ".events.jsonl")


class FleetLog(JsonlLog):
    """The fleet's events (``FleetEvent``), each with the line every view prints."""

    @classmethod
    def of(cls, fleet: Fleet) -> FleetLog:
        return cls(events_path(fleet))

    def append(self, event: str, line: str, **fields: Any) -> FleetEvent:
        return cast(FleetEvent, self.write(event, line=line, **fields))

    def events(self) -> list[FleetEvent]:
        return cast(list[FleetEvent], self.records())

    def recent(self, count: int) -> list[FleetEvent]:
        return self.events()[-count:]


def shown(event: FleetEvent) -> str:
    """``12:03:04 gpu1: exited …``: an event as ``fleet status`` and ``watch`` print it (UTC clock time)."""
    clock = event["time"][11:19]
    who = f"{event['server']}: " if event.get("server") else ""
    return f"{clock} {who}{event['line']}"
