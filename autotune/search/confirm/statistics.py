"""The confirmation's statistics: per-contender medians, bootstrap intervals and the memory headroom seen."""

from __future__ import annotations

from typing import Any

import numpy as np

from autotune.results import TrialResult
from autotune.search.objective import per_gpu

BOOTSTRAP = 2000


def median(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


def interval(rng: np.random.Generator, values: list[float]) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median."""
    if len(values) < 2:
        v = median(values)
        return v, v
    samples = rng.choice(values, size=(BOOTSTRAP, len(values)), replace=True)
    meds = np.median(samples, axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def gain_interval(rng: np.random.Generator, win: list[float], base: list[float]) -> tuple[float, float]:
    a = rng.choice(win, size=(BOOTSTRAP, len(win)), replace=True)
    b = rng.choice(base, size=(BOOTSTRAP, len(base)), replace=True)
    mb = np.median(b, axis=1)
    ratios = np.median(a, axis=1) / np.where(mb > 0, mb, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return float("nan"), float("nan")
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def headroom(results: list[TrialResult]) -> float | None:
    """Memory left on the device at peak: measured when the GPU monitor saw it, else the planner's figure."""
    seen = [r.gpu.headroom_gib for r in results if r.gpu and r.gpu.headroom_gib is not None]
    if seen:
        return min(seen)
    planned = [r.plan["gib"]["headroom"] for r in results if r.plan and r.plan.get("gib")]
    return min(planned) if planned else None


def run_stats(rng: np.random.Generator, runs: list[dict[str, Any]],
               order: list[int]) -> tuple[dict[int, list[float]], dict[int, dict[str, Any]]]:
    """Per trial: its tok/s per run (a failed run counts 0) and their median, interval, failures and headroom."""
    results: dict[int, list[TrialResult]] = {n: [] for n in order}
    for run in runs:
        results.setdefault(run["trial"], []).append(TrialResult.from_dict(run["result"]))
    tok = {n: [(per_gpu(r) or 0.0) if r.ok else 0.0 for r in rs] for n, rs in results.items()}  # the score
    stats = {n: {"median": median(v), "ci": interval(rng, v), "runs": len(v),
                 "failed": sum(1 for r in results[n] if not r.ok), "headroom_gib": headroom(results[n])}
             for n, v in tok.items()}
    return tok, stats


def jsonable(stats: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {str(n): {**s, "ci": list(s["ci"])} for n, s in stats.items()}
