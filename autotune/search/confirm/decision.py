"""The verdict from confirmation runs: the winner, its gain over the baseline, whether the gain over the runner-up
is resolved, and the headroom tie-break; no study needed, so a stored confirmation is decided again as is."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from autotune.search.confirm.statistics import gain_interval, jsonable, run_stats

# A tie goes to the fastest median; only when that config's measured headroom is below this floor does the
# roomiest tied config win instead: the roomier config is usually the slower one (benchmarks/README.md).
TIE_HEADROOM_FLOOR_GIB = 4.0


def decide(runs: list[dict[str, Any]], order: list[int], baseline: int | None, seed: int, *,
           same_as_baseline: Collection[int] = ()) -> dict[str, Any]:
    """Winner, gain and interval from confirmation runs (``{"trial", "repeat", "result"}``), no study needed.

    ``same_as_baseline``: contenders that launched the baseline's exact flags (its launch key). When the best
    contender is the baseline or one of these, or the baseline's interval overlaps the best's (not resolved
    from it), no config beat the baseline: ``winner_trial`` is None, ``outcome`` ``"baseline"``, no gain.
    ``outcome`` is ``"winner"`` when there is one and ``"none"`` when no contender ran cleanly throughout.
    """
    rng = np.random.default_rng(seed)
    tok, stats = run_stats(rng, runs, order)
    candidates = [n for n in order if stats[n]["runs"] and not stats[n]["failed"]]
    nothing = {"winner_trial": None, "baseline_trial": baseline, "gain": None, "ci_low": None, "ci_high": None}
    if not candidates:
        return {**nothing, "outcome": "none", "note": "no contender ran cleanly in every confirmation run",
                "stats": jsonable(stats)}
    top = max(candidates, key=lambda n: stats[n]["median"])
    tied = [n for n in candidates if stats[n]["ci"][1] >= stats[top]["ci"][0]]
    twins = {n for n in same_as_baseline if n != baseline}
    unresolved = _baseline_holds(stats, top, tied, baseline, twins)
    if unresolved is not None:
        # the baseline tied with the best: more repeats may separate them (sequential confirmation)
        contention = sorted({top, *(n for n in tied if n not in twins)} | ({baseline} if baseline in candidates else set()))
        return {**nothing, "outcome": "baseline", "note": f"no config beat the baseline: {unresolved}",
                "stats": jsonable(stats), "resolved": top == baseline or top in twins, "contention": contention}
    tied = [n for n in tied if n not in twins]  # noise around the baseline's flags is no candidate
    resolution = _resolution(rng, tok, stats, top, [n for n in candidates if n not in twins])
    winner, note = _break_tie(stats, top, tied)
    gain = ci_low = ci_high = None
    if baseline is not None and stats.get(baseline, {}).get("median"):
        gain = stats[winner]["median"] / stats[baseline]["median"]
        ci_low, ci_high = gain_interval(rng, tok[winner], tok[baseline])
    elif baseline is not None:
        note = (note + "; " if note else "") + "the baseline failed in confirmation, so no gain is given"
    if not resolution["resolved"] and resolution["runner_up_trial"] is not None:
        low, high = resolution["runner_up_ci"]
        why = note or f"trial {winner} has the fastest median"
        note = (f"tied: trial {top}'s gain over the runner-up (trial {resolution['runner_up_trial']}) is not resolved "
                f"after {max(stats[top]['runs'], 1)} repeats (95 % CI {low:.3f}–{high:.3f}×); {why}")
    return {"winner_trial": winner, "baseline_trial": baseline, "gain": gain, "ci_low": ci_low,
            "ci_high": ci_high, "outcome": "winner", "note": note, "stats": jsonable(stats),
            "contention": sorted(set(tied) | ({baseline} if baseline in candidates else set())), **resolution}


def _baseline_holds(stats: dict[int, dict[str, Any]], top: int, tied: list[int], baseline: int | None,
                    twins: set[int]) -> str | None:
    """Why no config beat the baseline (the best runs its flags, or is within its noise); None when one did."""
    if top == baseline or top in twins:
        return (f"the fastest confirmed config (trial {top}) runs the baseline's own flags" if top != baseline
                else "the baseline has the fastest confirmed median")
    if baseline is not None and baseline in tied:
        return (f"trial {top}'s median ({stats[top]['median']:,.0f} tok/s) is within the baseline's "
                f"run-to-run noise ({stats[baseline]['median']:,.0f} tok/s; 95 % intervals overlap)")
    return None


def _break_tie(stats: dict[int, dict[str, Any]], top: int, tied: list[int]) -> tuple[int, str]:
    """(winner, note) among statistically tied contenders: the fastest median unless it is short of headroom."""
    if len(tied) <= 1:
        return top, ""
    roomy = max(tied, key=lambda n: (stats[n]["headroom_gib"] if stats[n]["headroom_gib"] is not None
                                     else float("-inf"), stats[n]["median"]))
    top_room = stats[top]["headroom_gib"]
    if top_room is not None and top_room >= TIE_HEADROOM_FLOOR_GIB:
        return top, (f"trials {', '.join(map(str, tied))} are statistically tied (95 % intervals overlap); "
                     f"trial {top} has the fastest median and {top_room:.1f} GiB headroom "
                     f"(≥ {TIE_HEADROOM_FLOOR_GIB:.0f} GiB, so headroom does not decide)")
    if roomy != top and stats[roomy]["headroom_gib"] is not None:
        extra = stats[roomy]["headroom_gib"] - (stats[top]["headroom_gib"] or 0.0)
        return roomy, (f"trials {', '.join(map(str, tied))} are statistically tied (95 % intervals overlap); "
                       f"chose trial {roomy} over the fastest median (trial {top}) for {extra:.1f} GiB more headroom")
    return top, (f"trials {', '.join(map(str, tied))} are statistically tied (95 % intervals overlap); "
                 f"trial {top} has the fastest median and the most headroom")


def _resolution(rng: np.random.Generator, tok: dict[int, list[float]], stats: dict[int, dict[str, Any]], top: int,
                candidates: list[int]) -> dict[str, Any]:
    """Whether the best median's gain over the runner-up is resolved: its bootstrap 95 % interval excludes 1."""
    others = [n for n in candidates if n != top]
    if not others:
        return {"runner_up_trial": None, "runner_up_gain": None, "runner_up_ci": None, "resolved": True}
    runner = max(others, key=lambda n: stats[n]["median"])
    gain = stats[top]["median"] / stats[runner]["median"] if stats[runner]["median"] else float("inf")
    low, high = gain_interval(rng, tok[top], tok[runner])
    resolved = bool(np.isfinite(low) and low > 1.0) or not stats[runner]["median"]
    return {"runner_up_trial": runner, "runner_up_gain": gain, "runner_up_ci": [low, high], "resolved": resolved}
