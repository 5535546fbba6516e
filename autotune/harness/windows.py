"""More windows in the same launch (``WindowsStep``): the confirmation's cheap repeats, continuing the first window's
closed loop so a launch pays its warm-up once and no window is served from an earlier one's radix cache.
docs/search.md ("The confirmation: windows, launches and a stated resolution").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from autotune.harness.steps import Launch, StepOutcome, after_ok
from autotune.harness.trial import _ended_early, window_verdict
from autotune.harness.workload import ReplayRecords, metrics_from_records
from autotune.launch import ServerHandle
from autotune.results import Window


@dataclasses.dataclass(frozen=True)
class WindowsStep:
    """``count`` more windows after the launch's first, in the same closed loop. ``span``: the GPUs the server spans
    (for tok/s per GPU). Their records lie beside the first's (``records-window-<index>.jsonl``)."""

    count: int
    span: int = 1

    @property
    def later_windows(self) -> int:
        """The windows the launch's loop measures after its first for this step (``trial._run_once`` reads it)."""
        return max(0, self.count)

    def runs_after(self, fields: Mapping[str, Any], server: ServerHandle) -> bool:
        return self.count > 0 and after_ok(fields, server)

    def __call__(self, server: ServerHandle, launch: Launch, fields: Mapping[str, Any]) -> StepOutcome:
        windows: list[Window] = []  # their phases were shown live, as the loop reached them (``trial``)
        for index, records in enumerate(launch.later, start=2):
            ended = _ended_early(server, launch.engine, records) if records.stopped_early else None
            if ended is not None:  # interrupted, or the server died in this window: the launch's outcome
                return StepOutcome(
                    status=ended.get("status"),
                    reason=ended.get("reason"),
                    exit_code=ended.get("exit_code"),
                    log_tail=ended.get("log_tail"),
                    windows=tuple(windows),
                )
            windows.append(window_of(records, index, self.span))
        return StepOutcome(windows=tuple(windows))


def window_of(records: ReplayRecords, index: int, span: int) -> Window:
    """A replay's figures as one window: a tok/s only where the window measured the server (as the first's)."""
    metrics = metrics_from_records(records)
    status, reason, figures = window_verdict(records, metrics)
    # the passes of the requests it sent (a window too short to send one: those it saw)
    passes = (
        [r.pass_no for r in records.requests if r.sent >= records.window[0]]
        or [r.pass_no for r in records.requests]
        or [0]
    )
    tok_s = metrics.output_tok_s if status is None else None
    return Window(
        index=index,
        status=status or "ok",
        output_tok_s=tok_s,
        tok_s_per_gpu=None if tok_s is None else tok_s / max(1, span),
        output_tokens=metrics.output_tokens,
        window_s=round(metrics.window_s, 3),
        settled=figures.settled,
        first_pass=min(passes),
        last_pass=max(passes),
        reason=reason,
        measurement={"client_busy": figures.client_busy, **figures.to_dict()},
    )  # client_busy even when None
