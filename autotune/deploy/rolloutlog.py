"""A rollout's log: append-only JSONL beside the fleet file, each step fsynced before it begins, so a rollout
killed at any point can be resumed or rolled back; and the lock that keeps two rollouts of one fleet apart.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autotune.deploy.fleetfile import Fleet
from autotune.errors import FleetError


def log_path(fleet: Fleet) -> Path:
    assert fleet.path is not None
    return fleet.path.with_name(fleet.path.stem + ".rollout.jsonl")


class RolloutLog:
    """Append-only JSONL; each line is flushed and fsynced before the step it announces begins."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"), **fields}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a kill mid-write; the step it announced is redone anyway
        return out

    def current(self) -> list[dict[str, Any]]:
        """The events of the latest rollout (from its ``begin``)."""
        events = self.events()
        starts = [i for i, e in enumerate(events) if e.get("event") == "begin"]
        return events[starts[-1]:] if starts else []


@contextmanager
def locked(fleet: Fleet) -> Iterator[None]:
    # The kernel drops the lock when its holder dies, so a SIGKILLed rollout never blocks the resume.
    path = log_path(fleet).with_suffix(".lock")
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FleetError(f"another rollout of {fleet.path} is running (lock {path})") from None
        yield
