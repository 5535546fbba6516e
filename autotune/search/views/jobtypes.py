"""The job view's record types (``views.jobview``), below both the view and the summary that carries it."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class JobHours(TypedDict):
    """One config's run of the job: servers of ``gpus_per_server`` GPUs, its hours (and the interval's), cost."""

    servers: int
    gpus_per_server: int
    hours: float
    hours_range: list[float] | None
    gpu_hours: float
    cost: float | None


class JobView(TypedDict):
    """The job's line and, where the figures answer it, the baseline's and the winner's hours."""

    line: str
    baseline: JobHours | None
    winner: JobHours | None
    mean_output_tokens: NotRequired[float]
    output_from: NotRequired[str]  # "job" ([job] mean_output_tokens) or "baseline's window"
