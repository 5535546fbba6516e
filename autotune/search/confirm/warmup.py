"""The confirmation's warm-up: long enough that the closed loop's first wave of requests has turned over
(``max_tokens`` at the contender's measured per-request decode rate, after the ramp; at most ``TURNOVER_CAP_S``), so
its claims are about the job's rate. docs/search.md ("The confirmation").
"""

from __future__ import annotations

import math
from typing import Any

from autotune.results import TrialResult
from autotune.settle import SLICE_S, ramp_seconds

TURNOVER_CAP_S = 600.0  # a warm-up floor past this is a config too slow to confirm at steady state anyway


def turnover_s(result: TrialResult | None, max_tokens: int) -> float | None:
    """Seconds one request of ``max_tokens`` takes at ``result``'s per-request decode rate: its output tok/s over
    the requests running at once (the server's cap when it logged one, else the replay's streams); None when the
    launch measured no rate."""
    if result is None or result.metrics is None:
        return None
    rate = float(result.metrics.output_tok_s or 0.0)
    streams = int(result.metrics.concurrency or 0)
    running = int(result.capacity.max_running_requests or 0) if result.capacity is not None else 0
    at_once = min(streams, running) if streams and running else streams or running
    if rate <= 0 or at_once <= 0:
        return None
    return max_tokens * at_once / rate


def steady_warmup(result: TrialResult | None, workload: Any) -> float:
    """The warm-up floor of a confirmation launch of the config ``result`` measured: the ramp plus one turnover
    (``turnover_s``), rounded up to a whole slice, at least ``workload.warmup_s`` and at most ``TURNOVER_CAP_S``
    (never below the study's floor); the study's floor when the launch measured no rate."""
    floor = float(workload.warmup_s)
    turn = turnover_s(result, int(workload.max_tokens))
    if turn is None:
        return floor
    ramp = min(floor, ramp_seconds(floor, workload.ramp_s))  # the study's ramp, which the confirmation keeps
    wanted = math.ceil((ramp + turn) / SLICE_S) * SLICE_S
    return max(floor, min(TURNOVER_CAP_S, wanted))
