"""The fleet's own log: what happened to its servers between rollouts (a death, a restart, a foreign process on a
port, the keeper giving up), append-only JSONL beside the fleet file that ``fleet status`` and ``watch`` read.

Each event carries its one-line account (``line``), so every view says the same words.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any, Required, TypedDict, cast

from autotune.deploy.fleetfile import Fleet


class FleetEvent(TypedDict, total=False):
    event: Required[str]  # keeper_start, keeper_stop, exited, unresponsive, removed, foreign, restarting,
    #                       restarted, restart_failed, readmitted, gave_up, serving, lent, returned
    time: Required[str]  # ISO 8601, UTC
    line: Required[str]  # the account every view prints
    server: str
    cause: str  # the engine's failure class of a death (runtime_oom, crash, …), or "unknown"
    attempt: int
    pid: int
    seconds: float
    return_s: float  # a lent server's return: from its start to back in the router
    capacity: dict[str, int | None]


def events_path(fleet: Fleet) -> Path:
    assert fleet.path is not None
    return fleet.path.with_name(fleet.path.stem + ".events.jsonl")


class FleetLog:
    """Append-only JSONL; each line is flushed and fsynced, so a reader never misses an event that happened."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def of(cls, fleet: Fleet) -> FleetLog:
        return cls(events_path(fleet))

    def append(self, event: str, line: str, **fields: Any) -> FleetEvent:
        record = cast(FleetEvent, {"event": event, "time": now(), "line": line, **fields})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return record

    def events(self) -> list[FleetEvent]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        out: list[FleetEvent] = []
        for text in lines:
            try:
                out.append(json.loads(text))
            except ValueError:
                continue  # a line torn by a kill mid-write
        return out

    def recent(self, count: int) -> list[FleetEvent]:
        return self.events()[-count:]


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def shown(event: FleetEvent) -> str:
    """``12:03:04 gpu1: exited …``: an event as ``fleet status`` and ``watch`` print it (UTC clock time)."""
    clock = event["time"][11:19]
    who = f"{event['server']}: " if event.get("server") else ""
    return f"{clock} {who}{event['line']}"
