"""The window's figures from a replay's records: tokens by arrival time, latencies of what the window observed."""

from __future__ import annotations

import numpy as np

from autotune.harness.workload.records import CUT, ReplayRecords
from autotune.results import Metrics, Percentiles


def _pct(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles()
    arr = np.asarray(values, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return Percentiles(
        p50=round(float(p50), 3), p90=round(float(p90), 3), p99=round(float(p99), 3), mean=round(float(arr.mean()), 3)
    )


def metrics_from_records(records: ReplayRecords, *, window: tuple[float, float] | None = None) -> Metrics:
    """Steady-state figures for the window: tokens by arrival time, latencies of what the window observed."""
    start, end = window or records.window
    span = max(end - start, 1e-9)
    tokens, completed, errors = 0, 0, 0
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    accept_num = accept_den = 0.0
    for rec in records.requests:
        if rec.error is not None:
            errors += 1
        prev = None
        first = next((t for t, n in rec.chunks if n > 0), None)
        if first is not None and start <= first < end:
            ttft.append(first - rec.sent)
        for t, n in rec.chunks:
            if start <= t < end:
                tokens += n
                if prev is not None and n > 0:
                    itl.extend([(t - prev) / n] * n)
            prev = t
        ended = rec.ended
        done = rec.error is None and rec.finish_reason not in (None, CUT) and ended is not None
        if done and ended is not None and start <= ended < end:
            completed += 1
            e2e.append(ended - rec.sent)
            if rec.accept_length is not None:
                accept_num += rec.accept_length * rec.tokens
                accept_den += rec.tokens
    return Metrics(
        output_tok_s=round(tokens / span, 3),
        request_s=round(completed / span, 4),
        ttft_ms=_pct(ttft),
        itl_ms=_pct(itl),
        e2e_ms=_pct(e2e),
        accept_length=round(accept_num / accept_den, 4) if accept_den else None,
        output_tokens=tokens,
        completed=completed,
        errors=errors,
        window_s=round(span, 3),
        concurrency=records.concurrency,
    )
