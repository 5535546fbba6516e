"""What each trial replays (``WorkloadSpec``) and the request body one prompt becomes on each endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Required, TypedDict

from autotune.errors import WorkloadError
from autotune.prompts import ChatMessage, PromptRow, check_repeats
from autotune.settle import AGREE_TOLERANCE, TARGET_HALF_WIDTH, SettleRule, ramp_seconds

ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """What each trial replays. ``concurrency=None`` means 2 × the server's effective max running requests.

    ``warmup_s`` and ``measure_s`` are floors: the warm-up runs on until its slices agree (at most ``warmup_max_s``),
    the window until its estimate is within ``target_half_width`` (at most ``measure_max_s``); ``autotune.settle``.
    Stream k of ``concurrency`` sends its first request at k / concurrency × ``ramp_s``."""

    prompts: Path
    sample_size: int = 200
    seed: int = 0
    max_tokens: int = 4096
    concurrency: int | None = None
    warmup_s: float = 10.0
    measure_s: float = 30.0
    warmup_max_s: float | None = None  # None: 4 × warmup_s
    measure_max_s: float | None = None  # None: 4 × measure_s
    target_half_width: float = TARGET_HALF_WIDTH
    settle_tolerance: float = AGREE_TOLERANCE
    ramp_s: float | None = None  # None: half the warm-up floor
    endpoint: str = "generate"
    ignore_eos: bool = False
    repeats: str = "fresh"  # a prompt sent again in the window: "fresh" (pass-marked) or "verbatim"
    # How the command that runs the trial names these fields in its messages (``autotune measure``: ``--window``);
    # a field not named here is the study file's ``workload.<field>``.
    option_names: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise WorkloadError(
                f"unknown endpoint {self.endpoint!r}", key="endpoint", fix=f"use one of {sorted(ENDPOINTS)}"
            )
        check_repeats(self.repeats)
        for name in ("sample_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be at least 1", key=name)
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError("concurrency must be at least 1", key="concurrency")
        if self.warmup_s < 0 or self.measure_s <= 0:
            raise WorkloadError("warmup_s must be >= 0 and measure_s > 0", key="measure_s")
        check_settle_fields(self)

    def option(self, name: str) -> str:
        """The name a message gives the field ``name``: ``workload.measure_s`` in a study, ``--window`` under
        ``measure``."""
        return self.option_names.get(name, f"workload.{name}")

    def settle_rule(self) -> SettleRule:
        return settle_rule(self)

    @property
    def ramp(self) -> float:
        """Seconds over which the streams start: within the warm-up floor (a shortened warm-up clips it)."""
        return min(self.warmup_s, ramp_seconds(self.warmup_s, self.ramp_s))


def settle_rule(workload: Any) -> SettleRule:
    """The settle rule of any workload with the spec's fields (the spec, the study's ``[workload]`` section)."""
    return SettleRule(
        warmup_s=workload.warmup_s,
        measure_s=workload.measure_s,
        warmup_max_s=workload.warmup_max_s,
        measure_max_s=workload.measure_max_s,
        target_half_width=workload.target_half_width,
        tolerance=workload.settle_tolerance,
    )


def check_settle_fields(workload: Any) -> None:
    """Caps at or above their floors, a ramp within the warm-up floor, targets above 0."""
    for cap, floor in (("warmup_max_s", "warmup_s"), ("measure_max_s", "measure_s")):
        value = getattr(workload, cap)
        if value is not None and value < getattr(workload, floor):
            raise WorkloadError(
                f"{cap} ({value:g}) is below {floor} ({getattr(workload, floor):g})",
                key=cap,
                fix=f"set {cap} at or above {floor}, or leave it unset (4 × {floor})",
            )
    if workload.ramp_s is not None and workload.ramp_s < 0:
        raise WorkloadError(f"ramp_s must be >= 0, got {workload.ramp_s:g}", key="ramp_s", fix="e.g. ramp_s = 5")
    for name in ("target_half_width", "settle_tolerance"):
        if not 0 < getattr(workload, name) < 1:
            raise WorkloadError(
                f"{name} must lie between 0 and 1 (a share of the mean rate)", key=name, fix="e.g. 0.03 for 3 %"
            )


class SamplingParams(TypedDict):
    max_new_tokens: int
    ignore_eos: bool
    temperature: float


class NativeBody(TypedDict):
    """SGLang's native ``/generate`` request (``GenerateReqInput``), streamed."""

    text: str
    sampling_params: SamplingParams
    stream: bool


class StreamOptions(TypedDict):
    include_usage: bool
    continuous_usage_stats: bool  # SGLang's extension: usage on every chunk, the arrival time of each token


class OpenAIBody(TypedDict, total=False):
    """An OpenAI ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) request, streamed."""

    model: Required[str]
    max_tokens: Required[int]
    ignore_eos: Required[bool]  # SGLang's extension of the OpenAI request
    temperature: Required[float]
    stream: Required[bool]
    stream_options: Required[StreamOptions]
    messages: list[ChatMessage]
    prompt: str


RequestBody = NativeBody | OpenAIBody


def request_body(endpoint: str, row: PromptRow, *, max_tokens: int, ignore_eos: bool, pass_no: int = 0) -> RequestBody:
    """The streaming request for ``row`` on ``endpoint`` (SGLang's native /generate or the OpenAI routes): greedy,
    unless the row carries the job's own temperature (a Batch API body's: it moves speculative acceptance)."""
    n = min(row.max_tokens or max_tokens, max_tokens)
    temperature = row.temperature if row.temperature is not None else 0
    if endpoint == "generate":
        params = SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos, temperature=temperature)
        return NativeBody(text=row.as_text(pass_no), sampling_params=params, stream=True)
    body = OpenAIBody(
        model="default",
        max_tokens=n,
        ignore_eos=ignore_eos,
        temperature=temperature,
        stream=True,
        stream_options=StreamOptions(include_usage=True, continuous_usage_stats=True),
    )
    if endpoint == "chat":
        body["messages"] = row.as_messages(pass_no)
    else:
        body["prompt"] = row.as_text(pass_no)
    return body
