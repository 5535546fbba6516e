"""What a measured rate means for the user's job: its wall time, GPU-hours and cost on its fleet.

The seed job measured success in hours (902,087 completions on seven B200s, a 41-hour run), not tok/s. Given the
job's size (``[job]``: completions, GPUs, optional GPU-hour price and mean output tokens) and a config's output
rate per server with the GPUs one server spans, the job runs on ``gpus // span`` servers at the sum of their rates.
The interval comes from the rate's interval (the confirmation's CI): a slower bound is a longer job.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, kw_only=True)
class Job:
    """The job's size. ``mean_output_tokens`` None: the sample's measured mean is used (see ``job_time``)."""

    completions: int
    gpus: int
    gpu_hour_cost: float | None = None
    mean_output_tokens: float | None = None


@dataclass(frozen=True, kw_only=True)
class JobTime:
    """One config's job: ``servers`` of ``span`` GPUs each, its hours (and the interval's), GPU-hours and cost."""

    servers: int
    span: int
    fleet_tok_s: float
    hours: float
    gpu_hours: float
    cost: float | None
    hours_range: tuple[float, float] | None = None


class JobShapeError(ValueError):
    """The job's GPUs cannot hold one server of the config (its span is larger than the job's GPU count)."""


def job_time(
    job: Job, tok_s: float, *, span: int = 1, mean_output_tokens: float, tok_s_range: tuple[float, float] | None = None
) -> JobTime:
    """The job at ``tok_s`` per server (``span`` GPUs each); ``mean_output_tokens`` when the job gives none."""
    if tok_s <= 0:
        raise ValueError("a rate of 0 tok/s never finishes the job")
    servers = job.gpus // max(1, span)
    if servers < 1:
        raise JobShapeError(f"the job's {job.gpus} GPU{'s' * (job.gpus != 1)} cannot hold one server of {span} GPUs")
    tokens = job.completions * (job.mean_output_tokens or mean_output_tokens)

    def hours_at(rate: float) -> float:
        return tokens / (servers * rate) / SECONDS_PER_HOUR

    hours = hours_at(tok_s)
    gpu_hours = hours * servers * span
    spread = None
    if tok_s_range is not None and min(tok_s_range) > 0:
        lo, hi = sorted(tok_s_range)
        spread = (hours_at(hi), hours_at(lo))
    cost = gpu_hours * job.gpu_hour_cost if job.gpu_hour_cost is not None else None
    return JobTime(
        servers=servers,
        span=span,
        fleet_tok_s=servers * tok_s,
        hours=hours,
        gpu_hours=gpu_hours,
        cost=cost,
        hours_range=spread,
    )


def _hours(t: JobTime) -> str:
    if t.hours_range is None:
        return f"{t.hours:,.1f} h"
    return f"{t.hours:,.1f} h ({t.hours_range[0]:,.1f}–{t.hours_range[1]:,.1f})"


def job_line(job: Job, baseline: JobTime | None, winner: JobTime) -> str:
    """One line for the summary, ``trials``, the report's headline and ``apply``: the job before and after."""
    head = f"this job ({job.completions:,} completions on {job.gpus} GPU{'s' * (job.gpus != 1)}): "
    if baseline is None:
        text = f"{_hours(winner)}, {winner.gpu_hours:,.0f} GPU-hours"
        return head + text + (f", ${winner.cost:,.0f}" if winner.cost is not None else "")
    text = (
        f"{_hours(baseline)} → {_hours(winner)} on {winner.servers} server{'s' * (winner.servers != 1)}, "
        f"{baseline.gpu_hours:,.0f} → {winner.gpu_hours:,.0f} GPU-hours "
        f"({baseline.gpu_hours - winner.gpu_hours:,.0f} saved)"
    )
    if baseline.cost is not None and winner.cost is not None:
        text += f", ${baseline.cost:,.0f} → ${winner.cost:,.0f}"
    return head + text
