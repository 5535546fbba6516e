"""What the confirmation measured for the trial ``apply`` deploys, read from the verdict the sweep printed.

The sweep's summary quotes each confirmed trial's estimate (the verdict's ``median`` × the GPUs its server spans,
``views.summary.confirmed_rate``); ``provenance.json`` carries the same figure, so a fleet is checked against what
the user read. Any trial the confirmation launched is confirmed (the winner, a runner-up, a contender of a study
no config of which beat the baseline), with its launches' figures; only the winner has a gain over the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.results import TrialResult
from autotune.search.confirm.decision import Verdict
from autotune.search.confirm.record import Confirmation
from autotune.search.confirm.samples import launch_tok_s
from autotune.search.objective import gpus_spanned
from autotune.search.views.summary import confirmed_rate


@dataclass(frozen=True, kw_only=True)
class Confirmed:
    """A trial's figures as ``apply`` writes them: ``tok_s`` (the confirmed estimate, else the search figure),
    ``runs`` (per confirmation launch: the mean of its windows), whether it was confirmed, and the winner's gain."""

    tok_s: float | None
    runs: list[float]
    confirmed: bool
    gain: float | None = None
    gain_ci: tuple[float | None, float | None] = (None, None)


def confirmed_figures(confirmation: Confirmation, verdict: Verdict, trial: int, result: TrialResult) -> Confirmed:
    """Trial ``trial``'s figures from the confirmation (``result``: its search result, for a trial never confirmed)."""
    launched = [launch_tok_s(run) for run in confirmation.runs_of(trial)]
    runs = [float(v) for v in launched if v]  # a failed launch has no figure
    stat = verdict.stat(trial)
    rate = None if stat is not None and stat.from_search else confirmed_rate(confirmation, trial, gpus_spanned(result))
    winner = verdict.winner_trial == trial
    if rate is not None:
        tok_s: float | None = rate[0]
    elif runs and winner:  # a confirmation stored before its estimates: the median launch
        tok_s = sorted(runs)[len(runs) // 2]
    else:
        tok_s = result.output_tok_s
    confirmed = winner or (rate is not None and bool(runs))
    return Confirmed(
        tok_s=tok_s,
        runs=runs if confirmed else [],
        confirmed=confirmed,
        gain=verdict.gain if winner else None,
        gain_ci=(verdict.ci_low, verdict.ci_high) if winner else (None, None),
    )
