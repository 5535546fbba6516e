"""The verdict from confirmation runs, no study needed (a stored confirmation is decided again as is): each
contender resolved, tied within the resolution, close or open against the best; who wins a tie; no winner when
the best did not beat the baseline. docs/search.md ("The confirmation").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from autotune.search.confirm.noise import Estimate, NoiseModel, Ratio, estimates, ratio, stand_in_var
from autotune.search.confirm.samples import ConfirmationRun, by_contender

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContenderStat:
    """A contender's confirmed figures, per GPU: ``median`` the estimate and ``ci`` its interval, ``runs`` its
    launches (failed ones included) and ``windows`` theirs; ``from_search``: the search run's figure under the
    confirmation's noise terms (no launch of its own). Stored under the trial's number in ``stats``."""

    median: float | None = None
    ci: tuple[float | None, float | None] | None = None
    runs: int = 0
    windows: int = 0
    failed: int = 0
    headroom_gib: float | None = None
    unsettled_windows: int = 0
    from_search: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the keys stored studies hold (``from_search`` only when set)."""
        out = dataclasses.asdict(self)
        out["ci"] = list(self.ci) if self.ci is not None else None
        if not self.from_search:
            del out["from_search"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContenderStat:
        ci = data.get("ci")
        names = {f.name for f in dataclasses.fields(cls)} - {"ci"}
        return cls(
            ci=(ci[0], ci[1]) if isinstance(ci, list | tuple) and len(ci) == 2 else None,
            **{k: v for k, v in data.items() if k in names and v is not None},
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """What the confirmation decided from its runs (``decide``): the record every reader takes. Stored as plain
    data only in the study's ``confirmation`` attribute (``to_dict``/``from_dict``, the keys stored studies hold).

    ``outcome``: ``"winner"``, ``"baseline"`` (no config beat it: ``winner_trial`` None, no gain) or ``"none"`` (no
    contender ran cleanly throughout). ``decided``: nothing is open (the stages stop); ``contention``: who the
    next stage relaunches; ``resolved``: every gain resolved (None for ``"none"``). ``stats``: per contender (by
    trial number as text) the stored figures; ``noise``: ``NoiseModel.to_dict()``; ``demoted``: trial → why."""

    outcome: str
    winner_trial: int | None = None
    baseline_trial: int | None = None
    gain: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    note: str = ""
    decided: bool = True
    resolved: bool | None = None
    contention: tuple[int, ...] = ()
    runner_up_trial: int | None = None
    runner_up_gain: float | None = None
    runner_up_ci: tuple[float, float] | None = None
    resolution: float = RESOLUTION
    noise: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stats: Mapping[str, ContenderStat] = dataclasses.field(default_factory=dict)
    demoted: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the keys a study has always held (``runner_up_*`` only with a winner, ``resolved``
        unless nothing ran cleanly, ``demoted`` only when one was)."""
        out: dict[str, Any] = {
            "baseline_trial": self.baseline_trial,
            "resolution": self.resolution,
            "noise": dict(self.noise),
            "stats": {k: v.to_dict() for k, v in self.stats.items()},
            **({"demoted": dict(self.demoted)} if self.demoted else {}),
            "winner_trial": self.winner_trial,
            "gain": self.gain,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "outcome": self.outcome,
            "note": self.note,
            "decided": self.decided,
            "contention": list(self.contention),
        }
        if self.outcome != "none":
            out["resolved"] = self.resolved
        if self.outcome == "winner":
            out.update(
                runner_up_trial=self.runner_up_trial,
                runner_up_gain=self.runner_up_gain,
                runner_up_ci=list(self.runner_up_ci) if self.runner_up_ci is not None else None,
            )
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Verdict | None:
        """The verdict in a stored confirmation (None for none stored); a confirmation stored before ``outcome``
        reads as ``"none"``. Whether it finished is the confirmation's ``complete``, not the verdict's."""
        if not data:
            return None
        ci = data.get("runner_up_ci")
        return cls(
            outcome=data.get("outcome") or "none",
            winner_trial=data.get("winner_trial"),
            baseline_trial=data.get("baseline_trial"),
            gain=data.get("gain"),
            ci_low=data.get("ci_low"),
            ci_high=data.get("ci_high"),
            note=data.get("note") or "",
            decided=data.get("decided", True),
            resolved=data.get("resolved"),
            contention=tuple(data.get("contention") or ()),
            runner_up_trial=data.get("runner_up_trial"),
            runner_up_gain=data.get("runner_up_gain"),
            runner_up_ci=(ci[0], ci[1]) if ci else None,
            resolution=data.get("resolution", RESOLUTION),
            noise=dict(data.get("noise") or {}),
            stats={k: ContenderStat.from_dict(v) for k, v in (data.get("stats") or {}).items()},
            demoted=dict(data.get("demoted") or {}),
        )

    def stat(self, trial: int | None) -> ContenderStat | None:
        """A contender's stored figures (``median``, ``ci``, ``runs``, ``windows``, ...), None when not confirmed."""
        return None if trial is None else self.stats.get(str(trial))


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


def decide(
    runs: Sequence[ConfirmationRun],
    order: Sequence[int],
    baseline: int | None,
    *,
    same_as_baseline: Collection[int] = (),
    resolution: float = RESOLUTION,
    demoted: Mapping[int, str] | None = None,
    given: Sequence[ConfirmationRun] = (),
    searched: Mapping[int, float] | None = None,
) -> Verdict:
    """Winner, gain and interval from confirmation runs.

    ``same_as_baseline``: contenders that launched the baseline's exact flags. ``demoted``: contenders that may not
    win (trial → why: a failed stress phase), named in the note. ``given``: search runs that stand in for a
    baseline not relaunched (far behind the leader: ``ranking.IN_REACH``), one launch of one window each; they
    add nothing to the noise terms, the gain over that baseline has its interval, and the baseline, outside
    ``order``, never wins; when that one reading leaves open whether anything beat the baseline, ``contention`` is
    the baseline alone, which the confirmation then relaunches (``stages.confirm``). ``Verdict`` says what each
    field means. ``searched``: each contender's search-run tok/s
    per GPU, from which a stand-in's error is learnt (``noise.stand_in_var``). The interval is analytic, so the
    same runs always give the same verdict.
    """
    demoted = dict(demoted or {})
    noise, est = estimates(by_contender([*given, *runs], order))
    from_search = {run.trial for run in given}
    if from_search and searched:
        noise, est = _stand_ins(noise, est, from_search, searched)
    nothing = functools.partial(
        Verdict,
        baseline_trial=baseline,
        resolution=resolution,
        noise=noise.to_dict(),
        stats=_stats(est, noise, from_search),
        demoted={str(n): why for n, why in demoted.items()},
    )
    candidates = [n for n in order if est[n].launches and not est[n].failed and n not in demoted]
    if not candidates:
        return nothing(
            outcome="none", note=_demoted_note(demoted) or "no contender ran cleanly in every confirmation run"
        )
    top = max(candidates, key=lambda n: est[n].rate)
    twins = {n for n in same_as_baseline if n != baseline}
    stand = {n: s for n in candidates if n != top and (s := standing(est[top], est[n], noise, resolution))}
    base_stand = stand.get(baseline) if baseline is not None else None  # a given baseline is no candidate
    if baseline in from_search and baseline != top and baseline in est:
        base_stand = standing(est[top], est[baseline], noise, resolution)
    held = _baseline_holds(est, top, base_stand, baseline, twins, resolution)
    if held is not None:
        why, decided = held
        # one search reading of the baseline blocks it: the baseline is what to relaunch, not the contenders
        contention = (
            [baseline]
            if baseline in from_search
            else sorted({top, *(n for n, s in stand.items() if s.state == "open" and n not in twins)})
        )
        return nothing(
            outcome="baseline",
            note=_join(f"no config beat the baseline: {why}", _demoted_note(demoted)),
            decided=decided,
            resolved=decided,
            contention=() if decided else tuple(contention),
        )
    others = {n: s for n, s in stand.items() if n not in twins}  # noise around the baseline's flags is no candidate
    tied = [top, *(n for n, s in others.items() if s.state in ("within", "open"))]  # a close one may be far slower
    winner, tie_note = _break_tie(est, top, tied)
    base = ratio(est[winner], est[baseline], noise) if baseline is not None and baseline in est else None
    if base is None and baseline is not None:
        tie_note = _join(tie_note, "the baseline failed in confirmation, so no gain is given")
    runner = max(others, key=lambda n: est[n].rate, default=None)
    open_ = [n for n, s in others.items() if s.state == "open"]
    within = [n for n, s in others.items() if s.state == "within"]
    close = [n for n, s in others.items() if s.state == "close"]
    against = others[runner].against_best if runner else None  # (a runner-up trial 0 has none stored)
    note = _winner_note(est, others, top, winner, runner, tie_note, resolution)
    return nothing(
        outcome="winner",
        winner_trial=winner,
        note=_join(note, _demoted_note(demoted)),
        gain=base.gain if base else None,
        ci_low=base.low if base else None,
        ci_high=base.high if base else None,
        runner_up_trial=runner,
        runner_up_gain=against.gain if against else None,
        runner_up_ci=(against.low, against.high) if against else None,
        resolved=not open_ and not within and not close,
        decided=not open_,
        contention=tuple(sorted({top, *open_})) if open_ else (),
    )


def _winner_note(
    est: Mapping[int, Any],
    others: Mapping[int, Standing],
    top: int,
    winner: int,
    runner: int | None,
    tie_note: str,
    resolution: float,
) -> str:
    """Why the winner stands: still open against the runner-up, tied within the resolution, settled within it (a
    close one), or resolved (the tie-break's note, if any)."""
    open_ = [n for n, s in others.items() if s.state == "open"]
    within = [n for n, s in others.items() if s.state == "within"]
    close = [n for n, s in others.items() if s.state == "close"]
    if open_ and runner is not None:
        r = others[runner].against_best
        return (
            f"tied: trial {top}'s gain over the runner-up (trial {runner}) is not resolved after "
            f"{est[top].launches} launches ({_ci(r)}); {tie_note or f'trial {winner} has the fastest estimate'}"
        )
    if within and runner is not None:
        r = others[runner].against_best
        return (
            f"tied within {_pct(resolution)}: trial {top}'s gain over trial {runner} is {r.gain:.3f}× "
            f"({_ci(r)}, inside ±{_pct(resolution)}); {tie_note}"
        )
    if close:
        n = max(close, key=lambda c: est[c].rate)
        r = others[n].against_best
        return (
            f"settled within {_pct(resolution)}: trial {top}'s gain over trial {n} is {r.gain:.3f}× ({_ci(r)}): "
            f"not resolved, but trial {top} is at most {_pct(resolution)} slower, so no launch would change the pick"
        )
    return tie_note


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _demoted_note(demoted: Mapping[int, str]) -> str:
    return "; ".join(f"trial {n} demoted: {why}" for n, why in demoted.items())


def _stand_ins(
    noise: NoiseModel, est: dict[int, Estimate], from_search: Collection[int], searched: Mapping[int, float]
) -> tuple[NoiseModel, dict[int, Estimate]]:
    """The noise model with the stand-in term, and each search run standing in held to at least that variance."""
    var = stand_in_var({n: e for n, e in est.items() if n not in from_search}, searched)
    if var is None:
        return noise, est
    widened = {n: dataclasses.replace(e, var=max(e.var, var)) if n in from_search else e for n, e in est.items()}
    return dataclasses.replace(noise, stand_in_var=var), widened


def _stats(
    est: Mapping[int, Estimate], noise: NoiseModel, from_search: Collection[int] = ()
) -> dict[str, ContenderStat]:
    """Per contender (by trial number as text), its figures (``median``: the confirmed estimate)."""
    return {
        str(n): ContenderStat(
            median=e.rate,
            ci=e.interval(noise),
            runs=e.launches + e.failed,
            windows=e.windows,
            failed=e.failed,
            headroom_gib=e.headroom_gib,
            unsettled_windows=e.unsettled,
            from_search=n in from_search,
        )
        for n, e in est.items()
    }


def _baseline_holds(
    est: Mapping[int, Estimate], top: int, s: Standing | None, baseline: int | None, twins: set[int], resolution: float
) -> tuple[str, bool] | None:
    """(why no config beat the baseline, whether that is decided); None when one did. ``s``: the baseline's
    standing against the best."""
    if top == baseline or top in twins:
        return (
            f"the fastest confirmed config (trial {top}) runs the baseline's own flags"
            if top != baseline
            else "the baseline has the fastest confirmed estimate"
        ), True
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
        return top, (
            f"trials {names} are statistically tied; trial {top} has the fastest estimate and "
            f"{top_room:.1f} GiB headroom (≥ {TIE_HEADROOM_FLOOR_GIB:.0f} GiB, so headroom does not decide)"
        )
    if roomy != top and room[roomy] is not None:
        extra = (room[roomy] or 0.0) - (room[top] or 0.0)
        return roomy, (
            f"trials {names} are statistically tied; chose trial {roomy} over the fastest estimate "
            f"(trial {top}) for {extra:.1f} GiB more headroom"
        )
    return top, f"trials {names} are statistically tied; trial {top} has the fastest estimate and the most headroom"
