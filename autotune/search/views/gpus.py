"""Per-GPU results of a study swept on several GPUs (one worker per GPU group, ``search.scaleout``).

A trial's GPU is the group its server ran on (``user_attrs["gpu"]``, ``host:0,1``). The baseline runs once per
study, so in a new study one group has it; where every group has a baseline of its own (studies swept before that,
or baselines run again on purpose) ``gpu_frame`` divides each trial's tok/s by its own GPU's baseline (the gain a
config brings on the device that measured it), and ``per_gpu_frame`` gives the device-to-device spread for the
report.
"""

from __future__ import annotations

import numpy as np
import optuna
import pandas as pd

from autotune.search.confirm.ranking import gains, gpu_frame

__all__ = ["gains", "gpu_frame", "gpu_spread", "per_gpu_frame", "render_gpus"]


def per_gpu_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per GPU: trials run, baseline tok/s, its ratio to the median GPU's (``vs_median``: the
    device-to-device spread), and the best trial there by raw tok/s and by gain over its own baseline."""
    frame = gpu_frame(study)
    rows = []
    for gpu, g in frame.groupby("gpu", sort=True):
        ok = g[g.tok_s.notna()]
        best = ok.loc[ok.tok_s.idxmax()] if len(ok) else None
        gained = ok[ok.gain.notna()]
        best_gain = gained.loc[gained.gain.idxmax()] if len(gained) else None
        rows.append(
            {
                "gpu": gpu,
                "trials": len(g),
                "ok": len(ok),
                "baseline_tok_s": g.baseline_tok_s.iloc[0],
                "best_trial": None if best is None else int(best.trial),
                "best_tok_s": None if best is None else float(best.tok_s),
                "best_gain_trial": None if best_gain is None else int(best_gain.trial),
                "best_gain": None if best_gain is None else float(best_gain.gain),
            }
        )
    out = pd.DataFrame(
        rows,
        columns=["gpu", "trials", "ok", "baseline_tok_s", "best_trial", "best_tok_s", "best_gain_trial", "best_gain"],
    )
    out = out.astype(
        {
            "trials": int,
            "ok": int,
            "best_trial": "Int64",
            "best_gain_trial": "Int64",
            "baseline_tok_s": float,
            "best_tok_s": float,
            "best_gain": float,
        }
    )
    median = float(np.nanmedian(out.baseline_tok_s)) if out.baseline_tok_s.notna().any() else float("nan")
    out["vs_median"] = out.baseline_tok_s.astype(float) / median
    return out


def gpu_spread(study: optuna.Study) -> float | None:
    """(fastest − slowest baseline) ÷ median baseline across GPUs; None with fewer than two calibrated GPUs."""
    base = per_gpu_frame(study).baseline_tok_s.dropna()
    if len(base) < 2:
        return None
    return float((base.max() - base.min()) / base.median())


def render_gpus(study: optuna.Study) -> str:
    """The per-GPU lines under a sweep's summary: calibration, spread, and each GPU's best gain."""
    per = per_gpu_frame(study)
    spread = gpu_spread(study)
    head = (
        "per GPU (configs compare by tok/s ÷ their own GPU's baseline"
        if gains(study)
        # workers sharing a pool, or a device without its own baseline: no per-device calibration applies
        else "per GPU (configs compare by tok/s per GPU: not every GPU group ran its own baseline"
    )
    lines = [head + (f"; baselines spread {spread:.1%})" if spread is not None else ")")]
    for row in per.itertuples():
        base = (
            f"baseline {row.baseline_tok_s:,.0f} tok/s ({row.vs_median:.2f}× median)"
            if pd.notna(row.baseline_tok_s)
            else "no baseline"
        )
        best = f"; best gain trial {row.best_gain_trial}: {row.best_gain:.2f}×" if pd.notna(row.best_gain) else ""
        lines.append(f"  {row.gpu}: {row.trials} trials, {base}{best}")
    return "\n".join(lines)
