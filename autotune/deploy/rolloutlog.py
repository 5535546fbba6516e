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
from typing import IO, Any, Required, TypedDict, cast

from autotune.deploy.fleetfile import Fleet
from autotune.errors import FleetError
from autotune.launch.stopping import wait_until


class Figures(TypedDict, total=False):
    """What a server's verification measured: the capacity it reports, and the canary's tok/s when one ran."""

    capacity: Required[dict[str, int | None]]  # max_running_requests, kv_tokens, mamba_slots
    tok_s: float


class RolloutEvent(TypedDict, total=False):
    """One line of the log: its kind and time, and the fields that kind carries. ``begin`` holds the plan
    (``config``, ``previous``, ``servers``, ``expect``, ``canary``, ``rollback_on_failure``, ``source``); the steps
    name their ``server``; ``verified`` adds its ``Figures``; ``end`` its ``result`` and ``summary``."""

    event: Required[str]  # begin, step, verified, failed, restore_failed, restored, revert, reverted, resume,
    #                       rollback, end
    time: Required[str]  # ISO 8601, UTC
    server: str
    to: str  # the config file a step or revert puts the server on
    reason: str
    result: str  # done, failed, rolled_back
    summary: str
    done: list[str]
    servers: list[str]
    config: str
    previous: dict[str, str]  # server → the config file it ran before
    expect: dict[str, float | None]  # ``rollout.Expectation`` as plain data
    canary: dict[str, str | int | float | bool | None] | None  # ``rollout.Canary`` as plain data
    rollback_on_failure: bool
    source: dict[str, str | int]  # where the config came from (study, trial)
    capacity: dict[str, int | None]
    tok_s: float


def log_path(fleet: Fleet) -> Path:
    assert fleet.path is not None
    return fleet.path.with_name(fleet.path.stem + ".rollout.jsonl")


class JsonlLog:
    """Append-only JSONL of events (``event``, ``time`` and the kind's fields); each line is flushed and fsynced
    before the step it announces begins, and a line torn by a kill mid-write is skipped on reading."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": now(), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return record

    def records(self) -> list[dict[str, Any]]:
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


def now() -> str:
    """ISO 8601, UTC, to the millisecond: every event's ``time``."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class RolloutLog(JsonlLog):
    """A rollout's steps (``RolloutEvent``)."""

    def append(self, event: str, **fields: Any) -> RolloutEvent:
        """Write one event (``fields``: the keys ``RolloutEvent`` names for it) and return it as written."""
        return cast(RolloutEvent, self.write(event, **fields))

    def events(self) -> list[RolloutEvent]:
        return cast(list[RolloutEvent], self.records())

    def current(self) -> list[RolloutEvent]:
        """The events of the latest rollout (from its ``begin``)."""
        events = self.events()
        starts = [i for i, e in enumerate(events) if e.get("event") == "begin"]
        return events[starts[-1] :] if starts else []


def lock_path(fleet: Fleet) -> Path:
    return log_path(fleet).with_suffix(".lock")


def _try_lock(fh: IO[str]) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextmanager
def locked(fleet: Fleet, *, holder: str = "a rollout", wait_s: float = 0.0) -> Iterator[None]:
    """The fleet's lock for anything that stops or starts its servers (a rollout, ``fleet down``, the keeper's
    restart), held for the block; waits up to ``wait_s`` for it, then FleetError naming who holds it. The kernel
    drops the lock when its holder dies, so a SIGKILLed rollout never blocks the resume."""
    path = lock_path(fleet)
    with open(path, "a+") as fh:
        if not wait_until(lambda: _try_lock(fh), wait_s, 0.05):
            fh.seek(0)
            who = fh.read().strip() or "another rollout"
            raise FleetError(
                f"{who} holds {fleet.path} (lock {path}); run this again once it is done "
                "(autotune fleet status says what it does)"
            )
        fh.seek(0)
        fh.truncate()
        fh.write(f"{holder} (pid {os.getpid()})\n")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fh.flush()
