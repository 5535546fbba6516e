"""Who is confirmed: the top-k distinct feasible search trials (settled, or unsettled but above the baseline), and
the baseline and the hand-written configs that are still in reach of the leader (a baseline out of reach is not
relaunched: its search run stands in). On a study swept on several GPUs they are ranked by gain over their own
GPU's baseline where each has one (``gains``; ``views.gpus`` shows it)."""

from __future__ import annotations

from collections.abc import Mapping

import optuna
import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from autotune.results import TrialResult
from autotune.search.confirm.twins import twin_key
from autotune.search.seeding import unsettled, window_pruned

# An enqueued config or a baseline whose search figure is under this share of the leader's is not relaunched: no
# window or launch noise (a few %) closes that gap, and a launch of it is the price of a contender's. An enqueued
# one keeps its search figure in the summary; the baseline's search run joins the decision as one launch of one
# window (``decision.decide``'s ``given``), so the gain still has its interval.
IN_REACH = 0.5


def feasible(trial: FrozenTrial) -> bool:
    return trial.user_attrs.get("status") == "ok" and all(c <= 0 for c in trial.user_attrs.get("constraint", [0]))


def ranked(study: optuna.Study) -> list[FrozenTrial]:
    """The finished trials the confirmation may take, best search value first (by gain over their own GPU's
    baseline on a study swept on several GPUs): feasible, and settled, or unsettled but above the baseline (never
    crowned on that figure, but re-measured by the confirmation rather than dropped: a config far faster than
    production is the one to confirm). A pruned window (``pruning``: stopped clearly below the best so far) is none."""
    return _ranked(*_field(study))


def _field(study: optuna.Study) -> tuple[list[FrozenTrial], dict[int, float], FrozenTrial | None]:
    """(the completed trials, ``gains``, the baseline trial): what ranking reads, gathered once."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    baseline = next((t for t in done if t.user_attrs.get("role") == "baseline"), None)
    return done, gains(study), baseline  # gains: swept on several GPUs, tok/s ÷ the trial's own GPU's baseline


def _ranked(done: list[FrozenTrial], gain: Mapping[int, float], baseline: FrozenTrial | None) -> list[FrozenTrial]:
    floor = gain.get(baseline.number, baseline.values[0]) if baseline is not None and feasible(baseline) else None

    def eligible(t: FrozenTrial) -> bool:
        if not feasible(t) or (unsettled(t) and window_pruned(t)):
            return False
        return not unsettled(t) or (floor is not None and gain.get(t.number, t.values[0]) > floor)

    return sorted((t for t in done if eligible(t)), key=lambda t: -gain.get(t.number, t.values[0]))


def contenders(
    study: optuna.Study,
    top_k: int,
    *,
    held: float | None = None,
) -> tuple[list[FrozenTrial], FrozenTrial | None, list[FrozenTrial]]:
    """(top-k distinct trials of ``ranked``, the baseline trial, the ok enqueued trials in reach of the leader: at
    least ``IN_REACH`` × its search value), by search value. ``held``: KV tokens a running request holds at steady
    state (``twins.held_tokens``); given, twins (``twins.twin_key``: one server at two memory fractions) count as
    one."""
    done, gain, baseline = _field(study)
    seen: set[str] = set()
    top: list[FrozenTrial] = []
    for t in _ranked(done, gain, baseline):
        key = twin_key(t, held)
        if key in seen or t.user_attrs.get("reused_from") is not None:
            continue
        seen.add(key)
        if len(top) < top_k:
            top.append(t)
    refs = [
        t
        for t in done
        if t.user_attrs.get("role") == "enqueued"
        and feasible(t)
        and t not in top
        and t.user_attrs.get("launch_key") != (baseline and baseline.user_attrs.get("launch_key"))
        and in_reach(t, top, gain)
    ]
    return top, baseline, refs


def in_reach(trial: FrozenTrial, top: list[FrozenTrial], gain: Mapping[int, float]) -> bool:
    """Whether ``trial``'s search figure is at least ``IN_REACH`` × the leader's (always, with no leader); ``gain``:
    ``gains`` of the study (empty: raw search values)."""
    if not top:
        return True
    return bool(gain.get(trial.number, trial.values[0]) >= IN_REACH * gain.get(top[0].number, top[0].values[0]))


# --- a study swept on several GPUs: each trial against its own GPU's baseline ------------------------------
def _tok_s(trial: optuna.trial.FrozenTrial) -> float | None:
    result = TrialResult.of(trial)
    return result.output_tok_s if result is not None and result.ok else None


def gpu_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per finished trial: its GPU, tok/s, its GPU's baseline tok/s, and ``gain`` = tok/s ÷ that
    baseline. Comparing gains, not raw tok/s, keeps a fast device from crowning its own trials."""
    rows = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
        rows.append(
            {
                "trial": t.number,
                "gpu": t.user_attrs.get("gpu", "unknown"),
                "role": t.user_attrs.get("role", "search"),
                "status": t.user_attrs.get("status", "fail"),
                "tok_s": _tok_s(t),
            }
        )
    frame = pd.DataFrame(rows, columns=["trial", "gpu", "role", "status", "tok_s"])
    base = frame[(frame.role == "baseline") & frame.tok_s.notna()].groupby("gpu").tok_s.median()
    frame["baseline_tok_s"] = frame.gpu.map(base).astype(float)
    frame["gain"] = frame.tok_s.astype(float) / frame.baseline_tok_s
    return frame.sort_values("trial").reset_index(drop=True)


def gains(study: optuna.Study) -> dict[int, float]:
    """Trial number → tok/s ÷ its own GPU's baseline, for ranking a study swept on two or more GPUs; empty
    (rank by raw tok/s) on one GPU or when a GPU that served trials has no baseline to divide by."""
    frame = gpu_frame(study)
    ok = frame[frame.tok_s.notna()]
    if ok.gpu.nunique() < 2 or ok.gain.isna().any():
        return {}
    return {int(n): float(g) for n, g in zip(ok.trial, ok.gain, strict=True)}
