"""More windows in the same launch: the confirmation's cheap repeats (``WindowsStep``, a follow-up step).

A relaunch costs minutes on a real GPU (weights, graph capture); another window in the running server costs its
warm-up floor and its window. Most of a window's spread is the window's own (which prompts and output lengths came
due), which more windows shrink; what a relaunch adds is a second, smaller term the confirmation estimates apart.

Each window replays the sample from its first row under the study's settle rule (a server already warm settles at
the floor) with its own pass markers: window w starts past every pass an earlier window of the launch sent
(``replay(first_pass=…)``), so a ``fresh`` replay never has a prompt served from the radix cache of an earlier
window. A ``verbatim`` study re-sends its prompts as they are, in every window as in one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.harness.files import writing
from autotune.harness.steps import Launch, StepOutcome, after_ok
from autotune.harness.trial import (
    _ended_early,
    _should_stop,
    _sim_pace,
    auto_concurrency,
    measurement_verdict,
)
from autotune.harness.workload import ReplayRecords, metrics_from_records, replay
from autotune.launch import ServerHandle
from autotune.results import Window


def passes_sent(path: Path) -> int:
    """The highest pass number a launch's earlier window sent, from its ``records.jsonl`` (0 when it has none)."""
    if not path.exists():
        return 0
    with open(path, encoding="utf-8") as fh:
        return max((int(json.loads(line).get("pass_no") or 0) for line in fh if line.strip()), default=0)


@dataclasses.dataclass(frozen=True)
class WindowsStep:
    """``count`` more windows after the launch's first, in the same server. ``span``: the GPUs the server spans
    (for tok/s per GPU). Writes each window's records beside the first's (``records-window-<index>.jsonl``)."""

    count: int
    span: int = 1

    def runs_after(self, fields: Mapping[str, Any], server: ServerHandle) -> bool:
        return self.count > 0 and after_ok(fields, server)

    def __call__(self, server: ServerHandle, launch: Launch, fields: Mapping[str, Any]) -> StepOutcome:
        concurrency = launch.workload.concurrency or auto_concurrency(fields.get("capacity"))
        next_pass = passes_sent(launch.trial_dir / "records.jsonl") + 1
        windows: list[Window] = []
        t0 = time.monotonic()
        try:
            for index in range(2, self.count + 2):
                launch.phase(f"window {index} of {self.count + 1}", {"first_pass": next_pass})
                records = self._replay(server, launch, concurrency, next_pass)
                with writing(launch.trial_dir / f"records-window-{index}.jsonl", partial=True):
                    records.write_jsonl(launch.trial_dir / f"records-window-{index}.jsonl")
                ended = _ended_early(server, launch.engine, records)
                if ended is not None:  # interrupted, or the server died in this window: the launch's outcome
                    return StepOutcome(status=ended.get("status"), reason=ended.get("reason"),
                                       exit_code=ended.get("exit_code"), log_tail=ended.get("log_tail"),
                                       windows=tuple(windows))
                window = window_of(records, index, next_pass, self.span)
                windows.append(window)
                next_pass = window.last_pass + 1
        finally:
            launch.durations["windows"] = round(time.monotonic() - t0, 3)
        return StepOutcome(windows=tuple(windows))

    @staticmethod
    def _replay(server: ServerHandle, launch: Launch, concurrency: int, first_pass: int) -> ReplayRecords:
        workload = launch.workload
        return asyncio.run(replay(
            server.base_url, launch.sample, concurrency=concurrency, max_tokens=workload.max_tokens,
            warmup_s=workload.warmup_s, measure_s=workload.measure_s, endpoint=workload.endpoint,
            ignore_eos=workload.ignore_eos, repeats=workload.repeats,
            should_stop=functools.partial(_should_stop, server, launch.stop_event),
            request_timeout_s=launch.timeouts.request_s, window_probe=functools.partial(_sim_pace, server.base_url),
            rule=workload.settle_rule(), ramp_s=workload.ramp, first_pass=first_pass,
        ))


def window_of(records: ReplayRecords, index: int, first_pass: int, span: int) -> Window:
    """A replay's figures as one window: a tok/s only where the window measured the server (as the first's)."""
    metrics = metrics_from_records(records)
    verdict, reason, figures = measurement_verdict(records)
    status: str | None = verdict  # a window's own statuses add ``no_tokens``
    last = max((r.pass_no for r in records.requests), default=first_pass)
    if status is None and metrics.output_tokens == 0:
        status, reason = "no_tokens", "no token arrived inside the window"
    tok_s = metrics.output_tok_s if status is None else None
    return Window(index=index, status=status or "ok", output_tok_s=tok_s,
                  tok_s_per_gpu=None if tok_s is None else tok_s / max(1, span), output_tokens=metrics.output_tokens,
                  window_s=round(metrics.window_s, 3), settled=figures.get("settled"), first_pass=first_pass,
                  last_pass=max(last, first_pass), reason=reason, measurement=figures)
