"""The report's "numerics" section: which trials answer differently from the baseline, by how much, and why the
winner is the one it is when the study limits how much outputs may differ.

Numbers come from ``report.data.trials_frame`` (the fidelity probe's figures per trial, ``harness.fidelity``) and
the study's stored ``[objective] numerics``; this module only arranges them.
"""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from autotune.report import data
from autotune.results import FidelityFigures, differing_flags, flag_list
from autotune.search.confirm.record import Confirmation

COLUMNS = [
    "trial",
    "label",
    "outcome",
    "tok_s",
    "changes",
    "prefix_match",
    "tokens",
    "exact_share",
    "logprob_delta",
    "within_limit",
]
EXPLAIN = (
    "A trial whose config changes an output-changing flag against the baseline (docs/numerics.md) is "
    "probed after its throughput window: K fixed prompts of the sample, greedy, N tokens, compared with the "
    "baseline's outputs. prefix_match is the mean number of leading tokens identical to the baseline's, "
    "exact_share the share of prompts whose N tokens all match, logprob_delta the mean |Δ logprob| (nats) of "
    "the baseline's tokens where both sides scored them. Every confirmed contender is probed too, in its first "
    "confirmation launch, table or not: one whose outputs changed though no such flag did is listed as changed "
    "unexpectedly. Trials without a row here cannot change outputs, or matched the baseline's."
)


def _changes(fidelity: FidelityFigures) -> str:
    if fidelity.unexpected:  # the contender probe's catch: no table flag explains it
        return f"{differing_flags(fidelity)} (no flag known to change outputs, yet its outputs changed unexpectedly)"
    return flag_list(fidelity.changes)


def numerics_frame(frame: pd.DataFrame, study: Any) -> pd.DataFrame:
    """One row per probed trial: the flags that differ, the probe's figures, and the verdict against the limit."""
    limits = data.numerics_limits(data.study_config(study))
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    confirmation = Confirmation.of(study)
    rows = []
    for _, info in frame.iterrows():
        fidelity = data.trial_fidelity(by_number[info["trial"]], confirmation)
        if fidelity is None or not fidelity.probed or not (fidelity.changes or fidelity.unexpected):
            continue  # a contender probe that found the baseline's outputs has nothing to show here
        if fidelity.error:
            verdict = "probe failed"
        elif not limits.limits():
            verdict = "no limit set"
        else:
            verdict = "no" if any(v > 0 for v in limits.violations(fidelity.to_dict())) else "yes"
        rows.append(
            {
                "trial": int(info["trial"]),
                "label": info["label"],
                "outcome": info["outcome"],
                "tok_s": info["tok_s"],
                "changes": _changes(fidelity),
                "prefix_match": fidelity.prefix_match_mean,
                "tokens": fidelity.tokens,
                "exact_share": fidelity.exact_share,
                "logprob_delta": fidelity.mean_abs_logprob_delta,
                "within_limit": verdict,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def _limit_text(limits: Any) -> str:
    names = {
        "prefix_match_mean": "mean prefix match",
        "mean_abs_logprob_delta": "mean |Δ logprob|",
        "exact_share": "exact share",
    }
    return ", ".join(f"{names[f]} {op} {v:g}" for f, op, v in limits.limits())


def summary(
    frame: pd.DataFrame, numerics: pd.DataFrame, study: Any, *, winner: int | None, baseline: int | None
) -> list[str]:
    """Sentences for the section: the winner against the baseline, and why faster trials were passed over."""
    limits = data.numerics_limits(data.study_config(study))
    out: list[str] = []
    by_trial = numerics.set_index("trial") if len(numerics) else None
    if winner is not None:
        if by_trial is not None and winner in by_trial.index:
            w = by_trial.loc[winner]
            out.append(
                f"The winner (trial {winner}) changes {w['changes']} against the baseline (trial {baseline}): "
                f"on {_fmt(w['tokens'], '{:.0f}')}-token greedy outputs it matches the baseline's for "
                f"{_fmt(w['prefix_match'], '{:.1f}')} tokens on average, {_fmt(w['exact_share'], '{:.0%}')} of "
                f"prompts exactly, mean |Δ logprob| {_fmt(w['logprob_delta'], '{:.3f}')}."
            )
        else:
            out.append(
                f"The winner (trial {winner}) keeps the baseline's numerics: its greedy outputs equal the "
                "baseline's by construction (no output-changing flag differs)."
            )
    if limits.limits():
        over = frame[frame.get("over_numerics_limit", pd.Series(False, index=frame.index)).astype(bool)]
        win_tok = (
            float(frame.loc[frame["trial"] == winner, "tok_s"].iloc[0])
            if winner is not None and (frame["trial"] == winner).any()
            else math.nan
        )
        faster = over[over["tok_s"] > win_tok] if not math.isnan(win_tok) else over
        if len(faster):
            best = faster.sort_values("tok_s", ascending=False).iloc[0]
            row = (
                by_trial.loc[int(best["trial"])]
                if by_trial is not None and int(best["trial"]) in by_trial.index
                else None
            )
            detail = (
                f" (it changes {row['changes']} and matched the baseline for {_fmt(row['prefix_match'], '{:.1f}')}"
                f" tokens on average)"
                if row is not None
                else ""
            )
            out.append(
                f"Why this winner: {len(faster)} trial(s) ran faster but their outputs differ from the "
                f"baseline's beyond the study's limit ({_limit_text(limits)}); the fastest, trial "
                f"{int(best['trial'])}, ran {best['tok_s']:,.0f} tok/s{detail}. The limit is one more "
                "constraint of the search, so those trials are never crowned."
            )
        elif len(over):
            out.append(
                f"{len(over)} trial(s) broke the study's limit ({_limit_text(limits)}); none was faster "
                "than the winner."
            )
        else:
            out.append(f"Limit: {_limit_text(limits)}; no trial broke it.")
    elif len(numerics):
        out.append(
            "No limit is set ([objective] numerics in the study file): the figures are measured and shown, "
            "and the winner was chosen on speed alone."
        )
    return out


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return fmt.format(value)


def section_html(
    frame: pd.DataFrame,
    numerics: pd.DataFrame,
    study: Any,
    *,
    winner: int | None,
    baseline: int | None,
    table_html: Any,
) -> str:
    """The card: the summary sentences, then the per-trial table (``table_html``: the page's table renderer)."""
    sentences = summary(frame, numerics, study, winner=winner, baseline=baseline)
    if not len(numerics) and not sentences:
        return ""
    body = "".join(f'<p class="why">{html.escape(s)}</p>' for s in sentences)
    if len(numerics):
        shown = numerics.assign(
            tok_s=numerics["tok_s"].map(lambda v: _fmt(v, "{:,.0f}")),
            exact_share=numerics["exact_share"].map(lambda v: _fmt(v, "{:.0%}")),
            logprob_delta=numerics["logprob_delta"].map(lambda v: _fmt(v, "{:.4f}")),
            prefix_match=numerics["prefix_match"].map(lambda v: _fmt(v, "{:.1f}")),
        )
        body += table_html(shown)
    else:
        body += "<p>No trial changed an output-changing flag: every output equals the baseline's by construction.</p>"
    return (
        f'<section class="card" id="numerics"><h2>Numerics</h2><p class="explain">{html.escape(EXPLAIN)}</p>'
        f"{body}</section>"
    )
