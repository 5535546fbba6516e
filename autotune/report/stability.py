"""Each measured trial's per-slice throughput (``TrialResult.measurement.settling``): the report's stability strip.

A trial's figure is the mean of its window's slices (``autotune.settle``); the strip shows every slice against
that mean, so a wavy or still-rising load is visible beside the number it produced, and an unsettled trial (never
crowned) is named as such.
"""

from __future__ import annotations

import optuna
import pandas as pd

from autotune.results import TrialResult
from autotune.settle import settling_of

STABILITY_SECTION = (  # the page's title and explanation of the strip
    "Stability of each measurement",
    "Each trial's throughput per slice (2 s) since its replay started, over its window's mean (white: the trial's "
    "figure; the mark: where its window began). The warm-up ends once the load stops rising, the window once its "
    "95% interval is within the target; a trial that reached its cap first is unsettled: recorded, never crowned.",
)
COLUMNS = ["trial", "label", "slice", "t_s", "tok_s", "relative", "phase", "settled"]


def stability_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per slice of every trial that recorded its slices: time since the replay's start, tok/s, tok/s over
    the window's mean (``relative``), ``phase`` ("warm-up" or "window") and whether the trial settled."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        result = TrialResult.of(trial)
        settling = settling_of(result.measurement if result is not None else None)
        if settling is None or not settling.tok_s:
            continue
        lo, hi = settling.warmup_slices, settling.warmup_slices + settling.window_slices
        window = settling.tok_s[lo:hi]
        mean = sum(window) / len(window) if window else 0.0
        label = str(trial.user_attrs.get("label") or trial.user_attrs.get("role") or "")
        for i, rate in enumerate(settling.tok_s[:hi]):
            rows.append(
                {
                    "trial": trial.number,
                    "label": label,
                    "slice": i,
                    "t_s": round(i * settling.slice_s, 3),
                    "tok_s": rate,
                    "relative": rate / mean if mean > 0 else 0.0,
                    "phase": "warm-up" if i < lo else "window",
                    "settled": settling.settled,
                }
            )
    return pd.DataFrame(rows, columns=COLUMNS)
