"""The records one trial produces: capacity, metrics, GPU peaks, how far its window can be trusted, its fidelity
probe's figures, its later windows, its stress phase, and the TrialResult that holds them.

These are the contract between the harness (which fills them), the study (which stores ``to_dict()`` as an
Optuna user attribute under ``"result"``) and everything downstream (report, apply, trials), which read them
back with ``TrialResult.from_dict``. Keys are stable: add fields, never rename them. The window's trust
(``measurement``) and the fidelity probe's figures (``fidelity``) have modules of their own; all are read from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, TypedDict, get_args

from autotune.results.fidelity import (
    FidelityFigures,
    differing_flags,
    fidelity_summary,
    flag_list,
    numerics_line,
)
from autotune.results.measurement import MeasurementVerdict, Rejections, ServerProgress
from autotune.results.stored import from_known, typed

__all__ = [
    "OOM_STATUSES",
    "PORT_TAKEN",
    "PROBE_ERROR",
    "REPEAT",
    "STATUSES",
    "TOO_SLOW",
    "UNTRUSTED_STATUSES",
    "WRITE_ERROR",
    "Capacity",
    "DevicePeak",
    "FailureKind",
    "FidelityFigures",
    "GpuPeaks",
    "MeasurementVerdict",
    "Metrics",
    "Outcome",
    "Percentiles",
    "Placement",
    "Rejections",
    "ServerProgress",
    "Status",
    "StressResult",
    "TrialResult",
    "Window",
    "differing_flags",
    "fidelity_summary",
    "flag_list",
    "granted",
    "granted_line",
    "halves_drift",
    "numerics_line",
]

Status = Literal[
    "ok",
    "startup_oom",
    "runtime_oom",
    "crash",
    "timeout",
    "bad_args",
    "skipped_infeasible",
    "interrupted",
    "invalid_measurement",
    "client_bound",
    "probe_error",
    "too_slow",
    "write_error",
    "port_taken",
    "repeat",
]
FailureKind = Literal["startup_oom", "runtime_oom", "crash", "timeout", "bad_args"]
STATUSES: tuple[str, ...] = get_args(Status)
OOM_STATUSES: frozenset[str] = frozenset({"startup_oom", "runtime_oom", "skipped_infeasible"})
# The config ran, but the figure cannot be trusted: the simulated server could not keep pace with its model
# (``invalid_measurement``) or the replay client's CPU was saturated (``client_bound``). Not the config's fault and
# not deterministic: stored like a crash (FAIL, never crowned, no tok/s), never as the memory wall.
UNTRUSTED_STATUSES: frozenset[str] = frozenset({"invalid_measurement", "client_bound"})
# The window measured, but the fidelity probe (``harness.fidelity``) that had to compare this config's outputs with
# the reference's could not (a server error, no ``return_logprob`` support): a FAIL with its reason, never crowned,
# since nobody knows whether it answers like the baseline. ``metrics`` keeps the measured window for diagnosis.
PROBE_ERROR = "probe_error"
# The server was alive and making progress (its log or counters moved) but delivered no token inside the measured
# window: the window was too short for this config on this host, not a crash of the config. A FAIL, never the wall.
TOO_SLOW: Final = "too_slow"
# A file of the trial (records, result, log) could not be written (disk full, read-only): not the config's outcome;
# the trial is failed with the path and free space named and the study stops.
WRITE_ERROR = "write_error"
# Another process answered /health on the port picked for the server before the server bound it
# (``launch.base.PortTaken``): the host's, not the config's; the trial is failed and its config queued again once,
# on a port picked afresh, and it does not count toward the budget.
PORT_TAKEN: Final = "port_taken"
# The search proposed a config the study had already measured (``ok``, the baseline's included): not launched again;
# the trial is told the earlier trial's figure (``reused_from``) so the sampler learns it, and it costs no budget.
REPEAT: Final = "repeat"


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What the server actually allocated, read from its startup log and ``/server_info``."""

    max_running_requests: int | None = None  # effective, per DP worker
    kv_tokens: int | None = None  # max_total_num_tokens
    mamba_slots: int | None = None  # derived max_mamba_cache_size
    mem_fraction_static: float | None = None  # resolved
    context_len: int | None = None
    chunked_prefill_size: int | None = None
    weights_gib: float | None = None
    kv_gib: float | None = None
    mamba_gib: float | None = None  # ssm + conv + speculative intermediates
    graphs_gib: float | None = None
    available_gib: float | None = None  # available_gpu_mem after startup
    bound_by: str | None = None  # the pool SGLang said lowered max_running_requests: "mamba" or "kv" (its warning)

    def pools(self) -> dict[str, int | None]:
        """What it allocated that a restart or a rollout compares: running cap, KV tokens, Mamba slots."""
        return {
            "max_running_requests": self.max_running_requests,
            "kv_tokens": self.kv_tokens,
            "mamba_slots": self.mamba_slots,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Capacity | None:
        return from_known(cls, data)


@dataclass(frozen=True, kw_only=True)
class Percentiles:
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """Client-side measurements over the measured window (ramp-up and drain tail excluded)."""

    output_tok_s: float
    request_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    accept_length: float | None = None  # server-side, for the window only
    output_tokens: int = 0  # tokens that arrived inside the window
    completed: int = 0  # requests finished inside the window
    errors: int = 0  # failed or aborted streams (never dropped silently)
    window_s: float = 0.0
    concurrency: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Metrics | None:
        if data is None:
            return None
        data = dict(data)
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            data[key] = from_known(Percentiles, data.get(key)) or Percentiles()
        return from_known(cls, data)


@dataclass(frozen=True, kw_only=True)
class DevicePeak:
    """One GPU's own peak in a server over several GPUs."""

    index: int
    peak_used_gib: float | None = None
    total_gib: float | None = None
    headroom_gib: float | None = None  # total - peak


@dataclass(frozen=True, kw_only=True)
class GpuPeaks:
    """What the GPU monitor saw during the trial."""

    peak_used_gib: float | None = None
    total_gib: float | None = None
    headroom_gib: float | None = None  # total - peak
    mean_util_pct: float | None = None
    peak_power_w: float | None = None
    samples: int = 0
    # A server over several GPUs: each one's peak; the fields above are then the fullest GPU's (the one that OOMs
    # first decides headroom). None on one GPU.
    per_gpu: tuple[DevicePeak, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["per_gpu"] = None if self.per_gpu is None else [asdict(d) for d in self.per_gpu]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> GpuPeaks | None:
        if data is None:
            return None
        per_gpu = data.get("per_gpu")
        return from_known(
            cls,
            {
                **data,
                "per_gpu": None
                if per_gpu is None
                else tuple(d if isinstance(d, DevicePeak) else from_known(DevicePeak, d) for d in per_gpu),
            },
        )


@dataclass(frozen=True, kw_only=True)
class StressResult:
    """The stress phase's verdict (``harness.stress``): ``survived`` unless the server died (``failure``:
    ``runtime_oom``, ``crash``)."""

    survived: bool
    failure: str | None = None  # the engine's failure kind when the server died
    reason: str | None = None  # the log line that decided it
    ended: str = ""  # "peak reached" | "all requests done" | "cap reached" | "server exited" | "interrupted"
    duration_s: float = 0.0
    requests: int = 0
    running_cap: int | None = None
    completed: int = 0
    errors: int = 0
    max_tokens: int = 0
    prompt_tokens_max: int = 0
    prompt_tokens_mean: float = 0.0
    peak_used_gib: float | None = None
    total_gib: float | None = None
    planned_peak_gib: float | None = None
    retractions: int = 0
    kv_peak_tokens: int | None = None  # the most KV tokens the scheduler logged in use
    kv_target_tokens: int | None = None
    mamba_peak_slots: int | None = None
    mamba_target_slots: int | None = None
    running_peak: int | None = None
    prefill_peak_tokens: int | None = None  # the largest prefill batch the scheduler logged
    prefill_target_tokens: int | None = None
    reached_peak: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> StressResult | None:
        return from_known(cls, data) if data else None

    @property
    def interrupted(self) -> bool:
        return self.ended == "interrupted"


@dataclass(frozen=True, kw_only=True)
class Window:
    """One extra window of a launch (``harness.windows``; the launch's first window stays in the result's
    ``metrics``). ``index``: 2 for the first extra window; ``status``: ``ok``, or why its figure is not trusted
    (then ``output_tok_s`` is None)."""

    index: int
    status: str
    output_tok_s: float | None
    tok_s_per_gpu: float | None
    output_tokens: int
    window_s: float
    settled: bool | None  # the settle rule met before its caps (``autotune.settle``)
    first_pass: int  # the pass markers this window sent: first_pass … last_pass
    last_pass: int
    reason: str | None = None
    measurement: Mapping[str, Any] = field(default_factory=dict)  # slices, client_busy, sim_lag, drift

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.output_tok_s is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Window:
        return from_known(cls, data)


class Placement(TypedDict):
    """Where a launch ran, the same whatever its outcome: a ``TrialResult``'s engine, GPUs and files by field name."""

    engine: str
    device: str
    gpu_index: int | None
    gpus: list[int] | None
    trial_dir: str
    log_path: str


class Outcome(TypedDict, total=False):
    """What a launch's phases settle of a ``TrialResult`` (the start, the window, the follow-up steps), by field
    name: the trial builds ``TrialResult(config=…, **placement, **outcome)``."""

    status: Status
    reason: str | None
    exit_code: int | None
    log_tail: str | None
    capacity: Capacity | None
    modelled_startup_s: float | None
    metrics: Metrics | None
    gpu: GpuPeaks | None
    host: GpuPeaks | None
    measurement: MeasurementVerdict | None
    fidelity: FidelityFigures | None
    windows: tuple[Window, ...] | None
    stress: StressResult | None


# What a result of SGLang's CPU backend leaves out: a GPU's block, placement and startup model, a GPU's power.
GPU_ONLY = ("gpu", "gpu_index", "gpus", "modelled_startup_s")
GPU_ONLY_PEAKS = ("peak_power_w", "per_gpu")


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """One trial's outcome. A failure is data: ``status`` says what happened, ``reason`` the log line why."""

    status: Status
    config: dict[str, Any]  # SGLang flags by dest name (fixed + tuned), exactly what was launched
    engine: str = "sim"
    device: str = "cuda"  # "cpu": SGLang's CPU backend (real or simulated): no GPU keys in ``to_dict``
    capacity: Capacity | None = None
    metrics: Metrics | None = None
    gpu: GpuPeaks | None = None
    # A server without a GPU (SGLang's CPU backend): what it held of the host's memory (its processes' PSS and its
    # /dev/shm files) and the host's CPU use, in the monitor's figures; such a record has no ``gpu`` block and no
    # ``modelled_startup_s`` (a GPU's startup model).
    host: GpuPeaks | None = None
    gpu_index: int | None = None  # the server's first GPU (``gpus`` holds them all)
    gpus: list[int] | None = None  # every GPU the server spanned (tp × pp × dp as SGLang counts them); None: none
    durations_s: dict[str, float] = field(default_factory=dict)  # startup, warmup, measure, teardown
    reason: str | None = None  # the log line (or planner message) that decided a failure
    log_path: str | None = None
    log_tail: str | None = None
    trial_dir: str | None = None
    exit_code: int | None = None
    modelled_startup_s: float | None = None  # server-reported startup_time (load + graphs), for cost accounting
    plan: dict[str, Any] | None = None  # the planner's prediction for this config (MemoryPlan.to_dict())
    measurement: MeasurementVerdict | None = None  # how trustworthy the window was, whether it was re-measured
    # The fidelity probe's figures; None when the trial's config changes no output-changing flag against the
    # reference (its outputs equal the reference's by construction).
    fidelity: FidelityFigures | None = None
    # More windows measured in the same launch after the first (the confirmation's within-launch repeats,
    # ``search.confirm``): one entry per window, the first window's figures stay in ``metrics``. None: one window.
    windows: tuple[Window, ...] | None = None
    # The stress phase run in the same launch (the winner's worst case before the crown): peak memory, retractions,
    # runtime OOM, survived. None: not stressed.
    stress: StressResult | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def output_tok_s(self) -> float | None:
        return self.metrics.output_tok_s if self.metrics else None

    @property
    def gpus_spanned(self) -> int:
        """How many GPUs the server held (1 for a server without GPUs: the CPU backend's one host)."""
        return max(1, len(self.gpus or ()))

    @property
    def tok_s_per_gpu(self) -> float | None:
        """Output tok/s ÷ GPUs spanned: what a fleet of these servers delivers per GPU (the search ranks by it)."""
        tok_s = self.output_tok_s
        return None if tok_s is None else tok_s / self.gpus_spanned

    @property
    def peaks(self) -> GpuPeaks | None:
        """The memory the monitor saw the server hold: its GPUs', or the host's on the CPU backend."""
        return self.host if self.device == "cpu" else self.gpu

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("gpu", "host"):
            peaks = getattr(self, key)
            data[key] = peaks.to_dict() if peaks is not None else None
        if self.device == "cpu":  # no GPU, no GPU's figures: its memory is the host's, its time CPU time
            for key in GPU_ONLY:
                data.pop(key, None)
            if data["host"] is not None:
                data["host"] = {k: v for k, v in data["host"].items() if k not in GPU_ONLY_PEAKS}
        data["fidelity"] = self.fidelity.to_dict() if self.fidelity is not None else None
        data["measurement"] = self.measurement.to_dict() if self.measurement is not None else None
        data["windows"] = None if self.windows is None else [w.to_dict() for w in self.windows]
        return data

    @classmethod
    def of(cls, trial: Any) -> TrialResult | None:
        """The result a study stored on ``trial`` (an Optuna trial: ``user_attrs["result"]``, written by the search
        loop); None for a trial that stored none. The one reader of a stored trial's result."""
        data = (getattr(trial, "user_attrs", None) or {}).get("result") if trial is not None else None
        return cls.from_dict(data) if isinstance(data, Mapping) and data else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialResult:
        data = dict(data)
        for key, kind in (
            ("capacity", Capacity),
            ("metrics", Metrics),
            ("gpu", GpuPeaks),
            ("host", GpuPeaks),
            ("measurement", MeasurementVerdict),
            ("fidelity", FidelityFigures),
            ("stress", StressResult),
        ):
            data[key] = typed(kind, data.get(key))
        windows = data.get("windows")
        data["windows"] = None if windows is None else tuple(typed(Window, w) for w in windows)
        return from_known(cls, data)


def halves_drift(first: float, second: float) -> float:
    """How far a window's two halves' token counts differ, over their mean: 0 when steady, 2 when every token
    arrived in one half."""
    mean = (first + second) / 2
    return round(abs(second - first) / mean, 4) if mean > 0 else 0.0


POOL_WORDS = {"mamba": "the Mamba state pool", "kv": "the KV pool"}


def granted(config: dict[str, Any] | None, capacity: Capacity | None) -> tuple[int, int, str | None] | None:
    """``(asked, got, pool)`` when the running cap SGLang granted (per DP worker) is below the config's
    ``max_running_requests`` (SGLang divides it over DP workers), else None; ``pool`` is the one SGLang's
    warning named (``Capacity.bound_by``), None where it named none."""
    asked = (config or {}).get("max_running_requests")
    got = capacity.max_running_requests if capacity else None
    if asked is None or got is None:
        return None
    dp = int((config or {}).get("attn_dp_size") or (config or {}).get("dp_size") or 1)
    per_dp = int(asked) // max(1, dp)
    return (per_dp, int(got), capacity.bound_by if capacity else None) if got < per_dp else None


def granted_line(config: dict[str, Any] | None, capacity: Capacity | None) -> str | None:
    """ "asked for 32 running, got 24: the Mamba state pool bound it", or None when SGLang granted what was asked."""
    g = granted(config, capacity)
    if g is None:
        return None
    asked, got, pool = g
    return f"asked for {asked} running, got {got}" + (f": {POOL_WORDS.get(pool, pool)} bound it" if pool else "")
