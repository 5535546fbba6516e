"""TTFT and ITL quantiles for the baseline and the top trials: the report's latency figure, from the
per-request ``records.jsonl`` a trial leaves behind (or its stored percentiles when it kept none).

Apart from ``report.data`` because it reads files beside the study, not the study alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TypedDict

import numpy as np
import optuna
import pandas as pd

from autotune.report.data import attr_or_nan, baseline_trial
from autotune.results import TrialResult

QUANTILES = {"p5": 5, "p25": 25, "p50": 50, "p75": 75, "p90": 90, "p95": 95, "p99": 99}


class RecordLine(TypedDict, total=False):
    """One line of a trial's ``records.jsonl``, the keys this figure reads: the replay client's
    (``harness.workload.records.RequestRecord``: ``sent`` and ``chunks`` of (arrival, new tokens), seconds) or
    pre-computed per-request ``ttft_s`` and ``itl_s``. A record with an ``error`` is left out."""

    sent: float | None
    chunks: list[tuple[float, int]]
    error: str | None
    ttft_s: float | None
    itl_s: list[float] | None


def key_trials(frame: pd.DataFrame, study: optuna.Study, top: int = 3) -> list[int]:
    """Baseline first, then the ``top`` fastest feasible trials (the ones a latency figure can show legibly)."""
    numbers = []
    base = baseline_trial(frame, study)
    if base is not None:
        numbers.append(base)
    fastest = frame[frame["feasible"]].sort_values("tok_s", ascending=False)["trial"]
    numbers += [int(n) for n in fastest if n != base][:top]
    return numbers


def _records(trial_dir: str, base_dir: Path | None) -> list[RecordLine]:
    if not trial_dir:
        return []
    path = Path(trial_dir) / "records.jsonl"
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def latency_frame(
    frame: pd.DataFrame, study: optuna.Study, *, top: int = 3, base_dir: Path | None = None
) -> pd.DataFrame:
    """TTFT and ITL quantiles (ms) for the baseline and the top trials.

    From per-request records when the trial kept them (every quantile), else from the stored percentiles
    (p50/p90/p99 only). Summaries, not raw samples, keep the page small with any number of requests.
    """
    rows = []
    by_trial = frame.set_index("trial")
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for number in key_trials(frame, study, top):
        info = by_trial.loc[number]
        records = _records(info["trial_dir"], base_dir)
        result = TrialResult.of(by_number[number]) if number in by_number else None
        stored = result.metrics if result else None
        for metric in ("ttft", "itl"):
            row = {"trial": number, "label": info["label"], "role": info["role"], "metric": metric}
            values = _record_values(records, metric)
            if values.size:
                row.update({k: float(np.percentile(values, q)) for k, q in QUANTILES.items()})
                row.update({"mean": float(values.mean()), "n": int(values.size), "source": "records"})
            elif stored is not None:
                pct = stored.ttft_ms if metric == "ttft" else stored.itl_ms
                row.update({k: math.nan for k in QUANTILES})
                row.update(
                    {
                        "p50": attr_or_nan(pct, "p50"),
                        "p90": attr_or_nan(pct, "p90"),
                        "p99": attr_or_nan(pct, "p99"),
                        "mean": attr_or_nan(pct, "mean"),
                        "n": 0,
                        "source": "stored percentiles",
                    }
                )
            else:
                continue
            rows.append(row)
    return pd.DataFrame(rows, columns=["trial", "label", "role", "metric", *QUANTILES, "mean", "n", "source"])


def _record_values(records: list[RecordLine], metric: str) -> np.ndarray:
    """Seconds → ms, from either the replay client's records (``sent`` + ``chunks`` of (arrival, tokens), ITL
    spread over a chunk's tokens as the metrics do) or pre-computed ``ttft_s`` / ``itl_s`` fields."""
    values: list[float] = []
    for rec in records:
        if rec.get("error"):
            continue
        sent = rec.get("sent")
        if "chunks" in rec and sent is not None:
            arrivals = [(float(t), int(n)) for t, n in rec["chunks"] if int(n) > 0]
            if metric == "ttft" and arrivals:
                values.append(arrivals[0][0] - float(sent))
            elif metric == "itl":
                for (prev, _), (t, n) in zip(arrivals, arrivals[1:], strict=False):
                    values.extend([(t - prev) / n] * n)
        elif metric == "ttft" and (ttft := rec.get("ttft_s")) is not None:
            values.append(ttft)
        elif metric == "itl":
            values.extend(rec.get("itl_s") or [])
    return np.asarray(values, dtype=float) * 1000.0
