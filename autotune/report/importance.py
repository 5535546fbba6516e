"""Which flags mattered: Optuna's parameter importances for the report's importance chart, or an empty frame
(``NOT_ENOUGH_TO_RANK``) where the trials cannot rank them honestly.

Apart from ``report.data`` because it asks Optuna's evaluator, with its own rules for which trials count.
"""

from __future__ import annotations

import math
import warnings

import optuna
import pandas as pd

IMPORTANCE_MIN_TRIALS = 5  # completed trials that set a flag before its importance is computed
NOT_ENOUGH_TO_RANK = "not enough trials to rank flags"


def importance_frame(study: optuna.Study) -> pd.DataFrame:
    """Optuna's parameter importances for reaching the top tok/s (PED-ANOVA: deterministic and needs no
    scikit-learn, unlike fANOVA). OOMs count as 0 tok/s, so feasibility shapes them too.

    Each flag is scored over the completed trials that *have* it (a conditional flag, such as the radix-cache
    strategy only when the cache is on, leaves other trials out; requiring every flag at once would leave too few
    trials, and PED-ANOVA then returns zeros that normalise to a meaningless uniform split). PED-ANOVA scores
    each flag on its own marginal, so per-flag scores are comparable. Empty (``NOT_ENOUGH_TO_RANK``) when no
    flag has enough trials or the evaluator cannot tell the flags apart: never a uniform chart."""
    empty = pd.DataFrame(columns=["param", "importance", "trials"])
    complete = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if t.params]
    searched = [t for t in complete if t.user_attrs.get("role", "search") == "search"]
    flags = list(dict.fromkeys(p for t in (searched or complete) for p in t.params))
    raw: dict[str, float] = {}
    counts: dict[str, int] = {}
    for flag in flags:
        have = [t for t in complete if flag in t.params]
        if len(have) < IMPORTANCE_MIN_TRIALS or len({repr(t.params[flag]) for t in have}) < 2:
            continue
        try:
            with warnings.catch_warnings():
                # PED-ANOVA is "experimental" and warns that it ranks low targets; the negated tok/s is exactly that.
                warnings.simplefilter("ignore")
                scores = optuna.importance.get_param_importances(
                    study,
                    evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
                    params=[flag],
                    target=lambda t: -t.values[0],
                    normalize=False,
                )
        except (ValueError, RuntimeError, ZeroDivisionError):
            continue
        value = float(scores.get(flag, 0.0))
        if math.isfinite(value):  # zero is a finding too (the top trials spread like all of them)
            raw[flag], counts[flag] = max(value, 0.0), len(have)
    total = sum(raw.values())
    if len(raw) < 2 or total <= 0:
        return empty
    shares = {k: v / total for k, v in raw.items()}
    if max(shares.values()) - min(shares.values()) < 1e-9:  # the evaluator cannot tell the flags apart
        return empty
    ordered = sorted(shares, key=lambda k: shares[k], reverse=True)
    return pd.DataFrame(
        {"param": ordered, "importance": [shares[k] for k in ordered], "trials": [counts[k] for k in ordered]}
    )
