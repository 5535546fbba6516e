"""The verdict from confirmation runs, no study needed (a stored confirmation is decided again as is).

Each contender's estimate and the gain of the best over every other come from the two-level noise model
(``noise``). Against the best, a contender is *resolved* (the gain's 95 % interval excludes 1), *tied within the
resolution* (the whole interval inside ±``resolution``: a result, nothing more to measure), *close* (the interval's
low end at or above 1 − ``resolution``: the best is at most that much slower, so no launch would change the pick;
it may be far faster, so a close contender is not in the tie) or *open* (more launches may tell). The confirmation
relaunches only the open ones and the best (``contention``), until none is open or the launches are spent. A tie (within the resolution, or open when the launches are spent) goes to the
fastest estimate unless its memory headroom is under ``TIE_HEADROOM_FLOOR_GIB``; then to the roomiest. A best
config that runs the baseline's own flags, or that is not resolved from the baseline, did not beat it: no winner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from autotune.search.confirm.noise import Estimate, NoiseModel, Ratio, estimates, ratio
from autotune.search.confirm.samples import by_contender

# A tie goes to the fastest estimate; only when that config's measured headroom is below this floor does the
# roomiest tied config win instead: the roomier config is usually the slower one (benchmarks/README.md).
TIE_HEADROOM_FLOOR_GIB = 4.0
# The default ``[study] resolution``: gains inside ±2 % are a tie. Below what a fleet sees from one day's traffic to
# the next, and about the narrowest interval a few launches of three windows reach at the simulator's noise
# (docs/search.md): a finer resolution is stated in the study when it matters.
RESOLUTION = 0.02


@dataclasses.dataclass(frozen=True)
class Standing:
    """How a contender stands against the best: resolved below it, tied within the resolution, or open."""

    trial: int
    against_best: Ratio
    state: str  # "resolved" | "within" | "close" | "open"


def _pct(r: float) -> str:
    """A resolution as the note says it: ``2 %``, ``0.5 %``."""
    return f"{round(r * 100, 2):g} %"


def _ci(r: Ratio) -> str:
    return f"95 % CI {r.low:.3f}–{r.high:.3f}×"


def standing(best: Estimate, other: Estimate, noise: NoiseModel, resolution: float) -> Standing | None:
    r = ratio(best, other, noise)
    if r is None:
        return None
    if r.excludes_one():
        state = "resolved"
    elif r.within(resolution):
        state = "within"
    else:  # the best at most ``resolution`` slower (no launch would change the pick), or not even that
        state = "close" if r.low >= 1.0 - resolution else "open"
    return Standing(other.trial, r, state)


def decide(runs: list[dict[str, Any]], order: list[int], baseline: int | None, *,
           same_as_baseline: Collection[int] = (), resolution: float = RESOLUTION,
           demoted: Mapping[int, str] | None = None, given: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Winner, gain and interval from confirmation runs (``{"trial", "repeat", "result"}``); the stored JSON.

    ``same_as_baseline``: contenders that launched the baseline's exact flags. ``demoted``: contenders that may not
    win (trial → why: a failed stress phase), named in the note. ``given``: search runs that stand in for a
    baseline not relaunched (far behind the leader: ``ranking.IN_REACH``), one launch of one window each; they
    add nothing to the noise terms, the gain over that baseline has its interval, and the baseline, outside
    ``order``, never wins. ``outcome``: ``"winner"``, ``"baseline"`` (no
    config beat it: ``winner_trial`` None, no gain) or ``"none"`` (no contender ran cleanly throughout).
    ``decided``: nothing is open (the stages stop); ``contention``: who the next stage relaunches. The interval is
    analytic, so the same runs always give the same verdict.
    """
    demoted = dict(demoted or {})
    noise, est = estimates(by_contender([*given, *runs], order))
    from_search = {int(run["trial"]) for run in given}
    common: dict[str, Any] = {"baseline_trial": baseline, "resolution": resolution, "noise": noise.to_dict(),
              "stats": _stats(est, noise, from_search),
              **({"demoted": {str(n): why for n, why in demoted.items()}} if demoted else {})}
    nothing: dict[str, Any] = {**common, "winner_trial": None, "gain": None, "ci_low": None, "ci_high": None}
    candidates = [n for n in order if est[n].launches and not est[n].failed and n not in demoted]
    if not candidates:
        return {**nothing, "outcome": "none", "note": _demoted_note(demoted) or
                "no contender ran cleanly in every confirmation run", "decided": True, "contention": []}
    top = max(candidates, key=lambda n: est[n].rate)
    twins = {n for n in same_as_baseline if n != baseline}
    stand = {n: s for n in candidates if n != top and (s := standing(est[top], est[n], noise, resolution))}
    base_stand = stand.get(baseline) if baseline is not None else None  # a given baseline is no candidate
    if baseline in from_search and baseline != top and baseline in est:
        base_stand = standing(est[top], est[baseline], noise, resolution)
    held = _baseline_holds(est, top, base_stand, baseline, twins, resolution)
    if held is not None:
        why, decided = held
        contention = sorted({top, *(n for n, s in stand.items() if s.state == "open" and n not in twins)})
        return {**nothing, "outcome": "baseline", "note": _join(f"no config beat the baseline: {why}",
                                                                _demoted_note(demoted)),
                "decided": decided, "resolved": decided, "contention": [] if decided else contention}
    others = {n: s for n, s in stand.items() if n not in twins}  # noise around the baseline's flags is no candidate
    tied = [top, *(n for n, s in others.items() if s.state in ("within", "open"))]  # a close one may be far slower
    winner, tie_note = _break_tie(est, top, tied)
    verdict = {**nothing, "winner_trial": winner, "outcome": "winner"}
    base = ratio(est[winner], est[baseline], noise) if baseline is not None and baseline in est else None
    if base is not None:
        verdict.update(gain=base.gain, ci_low=base.low, ci_high=base.high)
    elif baseline is not None:
        tie_note = _join(tie_note, "the baseline failed in confirmation, so no gain is given")
    runner = max(others, key=lambda n: est[n].rate, default=None)
    open_ = [n for n, s in others.items() if s.state == "open"]
    within = [n for n, s in others.items() if s.state == "within"]
    close = [n for n, s in others.items() if s.state == "close"]
    verdict.update(runner_up_trial=runner, runner_up_gain=others[runner].against_best.gain if runner else None,
                   runner_up_ci=[others[runner].against_best.low, others[runner].against_best.high] if runner else None,
                   resolved=not open_ and not within and not close, decided=not open_,
                   contention=sorted({top, *open_}) if open_ else [])
    note = _winner_note(est, others, top, winner, runner, tie_note, resolution)
    verdict["note"] = _join(note, _demoted_note(demoted))
    return verdict


def _winner_note(est: Mapping[int, Any], others: Mapping[int, Standing], top: int, winner: int, runner: int | None,
                 tie_note: str, resolution: float) -> str:
    """Why the winner stands: still open against the runner-up, tied within the resolution, settled within it (a
    close one), or resolved (the tie-break's note, if any)."""
    open_ = [n for n, s in others.items() if s.state == "open"]
    within = [n for n, s in others.items() if s.state == "within"]
    close = [n for n, s in others.items() if s.state == "close"]
    if open_ and runner is not None:
        r = others[runner].against_best
        return (f"tied: trial {top}'s gain over the runner-up (trial {runner}) is not resolved after "
                f"{est[top].launches} launches ({_ci(r)}); {tie_note or f'trial {winner} has the fastest estimate'}")
    if within and runner is not None:
        r = others[runner].against_best
        return (f"tied within {_pct(resolution)}: trial {top}'s gain over trial {runner} is {r.gain:.3f}× "
                f"({_ci(r)}, inside ±{_pct(resolution)}); {tie_note}")
    if close:
        n = max(close, key=lambda c: est[c].rate)
        r = others[n].against_best
        return (f"settled within {_pct(resolution)}: trial {top}'s gain over trial {n} is {r.gain:.3f}× ({_ci(r)}): "
                f"not resolved, but trial {top} is at most {_pct(resolution)} slower, so no launch would change the pick")
    return tie_note


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _demoted_note(demoted: Mapping[int, str]) -> str:
    return "; ".join(f"trial {n} demoted: {why}" for n, why in demoted.items())


def _stats(est: Mapping[int, Estimate], noise: NoiseModel, from_search: Collection[int] = ()) -> dict[str, Any]:
    """Per contender, the stored figures (``median``: the confirmed estimate, the name the readers know);
    ``from_search``: the figure is the search run's, under the confirmation's noise terms (no launch of its own)."""
    out: dict[str, Any] = {}
    for n, e in est.items():
        low, high = e.interval(noise)
        out[str(n)] = {"median": e.rate, "ci": [low, high], "runs": e.launches + e.failed, "windows": e.windows,
                       "failed": e.failed, "headroom_gib": e.headroom_gib, "unsettled_windows": e.unsettled,
                       **({"from_search": True} if n in from_search else {})}
    return out


def _baseline_holds(est: Mapping[int, Estimate], top: int, s: Standing | None, baseline: int | None,
                    twins: set[int], resolution: float) -> tuple[str, bool] | None:
    """(why no config beat the baseline, whether that is decided); None when one did. ``s``: the baseline's
    standing against the best."""
    if top == baseline or top in twins:
        return (f"the fastest confirmed config (trial {top}) runs the baseline's own flags" if top != baseline
                else "the baseline has the fastest confirmed estimate"), True
    if s is None or s.state == "resolved":
        return None  # (a close baseline is open: a winner must be resolved from it, not merely not slower)
    tok = f"trial {top}'s {est[top].rate:,.0f} tok/s against the baseline's {est[s.trial].rate:,.0f}"
    if s.state == "within":
        return f"{tok} is tied within {_pct(resolution)} ({_ci(s.against_best)})", True
    return f"{tok} is within the baseline's run-to-run noise ({_ci(s.against_best)})", False


def _break_tie(est: Mapping[int, Estimate], top: int, tied: list[int]) -> tuple[int, str]:
    """(winner, note) among tied contenders: the fastest estimate unless it is short of headroom."""
    if len(tied) <= 1:
        return top, ""
    room = {n: est[n].headroom_gib for n in tied}
    roomy = max(tied, key=lambda n: (room[n] if room[n] is not None else float("-inf"), est[n].rate))
    names = ", ".join(map(str, tied))
    top_room = room[top]
    if top_room is not None and top_room >= TIE_HEADROOM_FLOOR_GIB:
        return top, (f"trials {names} are statistically tied; trial {top} has the fastest estimate and "
                     f"{top_room:.1f} GiB headroom (≥ {TIE_HEADROOM_FLOOR_GIB:.0f} GiB, so headroom does not decide)")
    if roomy != top and room[roomy] is not None:
        extra = (room[roomy] or 0.0) - (room[top] or 0.0)
        return roomy, (f"trials {names} are statistically tied; chose trial {roomy} over the fastest estimate "
                       f"(trial {top}) for {extra:.1f} GiB more headroom")
    return top, f"trials {names} are statistically tied; trial {top} has the fastest estimate and the most headroom"
