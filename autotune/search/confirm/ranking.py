"""Who is confirmed: the top-k distinct feasible search trials, and the baseline and the hand-written configs that
are still in reach of the leader (a baseline out of reach is not relaunched: its search run stands in)."""

from __future__ import annotations

from collections.abc import Mapping

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.search.gpus import gains
from autotune.search.summary import unsettled

# An enqueued config or a baseline whose search figure is under this share of the leader's is not relaunched: no
# window or launch noise (a few %) closes that gap, and a launch of it is the price of a contender's. An enqueued
# one keeps its search figure in the summary; the baseline's search run joins the decision as one launch of one
# window (``decision.decide``'s ``given``), so the gain still has its interval.
IN_REACH = 0.5


def feasible(trial: FrozenTrial) -> bool:
    return trial.user_attrs.get("status") == "ok" and all(c <= 0 for c in trial.user_attrs.get("constraint", [0]))


def contenders(study: optuna.Study, top_k: int) -> tuple[list[FrozenTrial], FrozenTrial | None, list[FrozenTrial]]:
    """(top-k distinct feasible trials, the baseline trial, the ok enqueued trials in reach of the leader: at least
    ``IN_REACH`` × its search value), by search value."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    gain = gains(study)  # swept on several GPUs: rank by tok/s ÷ the trial's own GPU's baseline
    ranked = sorted((t for t in done if feasible(t) and not unsettled(t)),  # an unsettled figure is never crowned
                    key=lambda t: -gain.get(t.number, t.values[0]))
    seen: set[str | None] = set()
    top: list[FrozenTrial] = []
    for t in ranked:
        key = t.user_attrs.get("launch_key")
        if key in seen or t.user_attrs.get("reused_from") is not None:
            continue
        seen.add(key)
        if len(top) < top_k:
            top.append(t)
    baseline = next((t for t in done if t.user_attrs.get("role") == "baseline"), None)
    refs = [t for t in done if t.user_attrs.get("role") == "enqueued" and feasible(t)
            and t not in top and t.user_attrs.get("launch_key") != (baseline and baseline.user_attrs.get("launch_key"))
            and in_reach(t, top, gain)]
    return top, baseline, refs


def in_reach(trial: FrozenTrial, top: list[FrozenTrial], gain: Mapping[int, float]) -> bool:
    """Whether ``trial``'s search figure is at least ``IN_REACH`` × the leader's (always, with no leader); ``gain``:
    ``gpus.gains`` of the study (empty: raw search values)."""
    if not top:
        return True
    return bool(gain.get(trial.number, trial.values[0]) >= IN_REACH * gain.get(top[0].number, top[0].values[0]))
