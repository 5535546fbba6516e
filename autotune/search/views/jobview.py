"""A study's result as the user's job (``[job]``): the baseline's and the winner's hours, GPU-hours and cost, one
function for the summary, ``trials``, the report and ``apply``. Plain data by design (``JobView``, a ``TypedDict``,
stored as is and read by key). docs/study-file.md ("The job, not only tok/s").
"""

from __future__ import annotations

import optuna

from autotune.job import Job, JobShapeError, JobTime, job_line, job_time
from autotune.results import TrialResult
from autotune.search.confirm.record import Confirmation
from autotune.search.objective import gpus_spanned
from autotune.search.views.jobtypes import JobHours, JobView
from autotune.search.views.summary import baseline_trial, confirmed_rate


def study_job(study: optuna.Study) -> Job | None:
    """The ``[job]`` section the study was run with (stored in its settings), or None."""
    data = (study.user_attrs.get("autotune") or {}).get("job")
    if not isinstance(data, dict) or not data.get("completions") or not data.get("gpus"):
        return None
    return Job(
        completions=int(data["completions"]),
        gpus=int(data["gpus"]),
        gpu_hour_cost=data.get("gpu_hour_cost"),
        mean_output_tokens=data.get("mean_output_tokens"),
    )


def _result(trial: optuna.trial.FrozenTrial | None) -> TrialResult | None:
    result = TrialResult.of(trial)
    return result if result is not None and result.ok and result.metrics is not None else None


def _rate(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> tuple[float, int, tuple[float, float] | None] | None:
    """(server tok/s, GPUs spanned, interval) of a trial: the confirmed median where there is one."""
    result = _result(trial)
    if result is None:
        return None
    span = gpus_spanned(result)  # the score's count: recorded GPUs, else the config's span
    confirmed = confirmed_rate(Confirmation.of(study), trial.number, span)
    if confirmed is not None and confirmed[0] > 0:
        return confirmed[0], span, confirmed[1]
    assert result.output_tok_s is not None
    return float(result.output_tok_s), span, None


def _hours(t: JobTime) -> JobHours:
    return {
        "servers": t.servers,
        "gpus_per_server": t.span,
        "hours": round(t.hours, 3),
        "hours_range": None if t.hours_range is None else [round(h, 3) for h in t.hours_range],
        "gpu_hours": round(t.gpu_hours, 2),
        "cost": None if t.cost is None else round(t.cost, 2),
    }


def job_for_study(study: optuna.Study, winner: int | None) -> JobView | None:
    """The job's view for trial ``winner`` against the
    baseline; None without ``[job]``. A job the figures cannot answer (no measured baseline, a server wider
    than the job's GPUs) still gets a line saying why, never a made-up figure."""
    job = study_job(study)
    if job is None:
        return None
    trials = study.get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    base_t = baseline_trial(trials)
    base_result = _result(base_t)
    measured = (
        base_result.metrics.output_tok_s / base_result.metrics.request_s
        if base_result is not None and base_result.metrics and base_result.metrics.request_s
        else None
    )
    mean_out = job.mean_output_tokens or measured
    head = f"this job ({job.completions:,} completions on {job.gpus} GPU{'s' * (job.gpus != 1)}): "
    if mean_out is None:
        return {
            "line": head + "no measured baseline to take the mean output length from (set [job] mean_output_tokens)",
            "baseline": None,
            "winner": None,
        }
    base_rate = _rate(study, base_t) if base_t is not None else None
    win_rate = _rate(study, by_number[winner]) if winner is not None and winner in by_number else None
    try:
        base = (
            job_time(job, base_rate[0], span=base_rate[1], mean_output_tokens=mean_out, tok_s_range=base_rate[2])
            if base_rate
            else None
        )
        win = (
            job_time(job, win_rate[0], span=win_rate[1], mean_output_tokens=mean_out, tok_s_range=win_rate[2])
            if win_rate
            else None
        )
    except JobShapeError as exc:
        return {"line": head + str(exc), "baseline": None, "winner": None}
    if win is not None:
        line = job_line(job, base, win)
    elif base is not None:
        line = job_line(job, None, base) + " (the baseline)"
    else:
        return None
    return {
        "line": line,
        "baseline": _hours(base) if base else None,
        "winner": _hours(win) if win else None,
        "mean_output_tokens": round(mean_out, 1),
        "output_from": "job" if job.mean_output_tokens else "baseline's window",
    }
