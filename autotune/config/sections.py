"""The study file's sections as pydantic models: ``[study]``, ``[engine]``, ``[space]``, ``[workload]``,
``[objective]``, ``[baseline]``, ``[[enqueue]]`` and ``[job]``.

Each model checks what it can alone (types, ranges, known metrics, a parameter's shape, an SLO's syntax). What
needs the whole file or SGLang's flag table (flag names, profiles, the prompt file, relative paths) is
``autotune.config``'s job when it assembles them into a ``StudyConfig``. Apart, so the file's schema reads in
one place and the loader stays short.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from autotune.errors import ConfigError
from autotune.job import Job
from autotune.settle import AGREE_TOLERANCE, TARGET_HALF_WIDTH, SettleRule, ramp_of, settle_rule

Scalar = str | int | float | bool
UNSET = "unset"  # a choice meaning "leave the flag out: SGLang's default"
METRICS = (
    "output_tok_s",
    "request_s",
    "accept_length",
    *(f"{p}_{m}_ms" for m in ("ttft", "itl", "e2e") for p in ("p50", "p90", "p99", "mean")),
)


@dataclass(frozen=True)
class EngineKind:
    """What the layers below the harness know of an engine: its name, and whether it is a model of a GPU (it runs
    the planner's profile on ``sim_gpu`` and its figures are the model's) rather than a server on a real device."""

    name: str
    simulated: bool = False


# The harness's engine registry as config sees it (``autotune.harness.engines.ENGINES``, which a test holds equal
# to this; ``harness.engines.register`` adds to both). Kept here because config (layer 2) sits below the harness
# (layer 4) and a study file's `kind` must fail as one line when it loads, before any engine is built.
ENGINE_KINDS: dict[str, EngineKind] = {k.name: k for k in (EngineKind("sglang"), EngineKind("sim", simulated=True))}


def engine_kind(name: str) -> EngineKind:
    """The kind called ``name``; a ConfigError listing the known ones otherwise."""
    if name not in ENGINE_KINDS:
        raise ConfigError(f"unknown engine {name!r}", key="engine", fix=f"use one of: {', '.join(ENGINE_KINDS)}")
    return ENGINE_KINDS[name]


def is_simulated(name: str) -> bool:
    """Whether the engine called ``name`` is a model of a GPU (False for a name no registered engine has, e.g. a
    stored study's engine this process does not know)."""
    kind = ENGINE_KINDS.get(name)
    return kind is not None and kind.simulated


# ``launch.LAUNCHERS``' names (config sits below launch/; a test keeps the two equal)
LAUNCHER_KINDS = ("local", "container", "slurm", "ssh")
_CONSTRAINT = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$")


def fix_error(error_type: str, message: str, fix: str, **ctx: Any) -> PydanticCustomError:
    """A validator's error that carries its own fix, which the loader prints in the usual one line."""
    return PydanticCustomError(error_type, message, {**ctx, "fix": fix})


class StrictModel(BaseModel):
    """Unknown keys are errors; a loaded config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class StudySection(StrictModel):
    name: str | None = None  # default: the TOML's file name without suffix
    storage: str | None = None  # default: sqlite:///<toml dir>/<name>.db
    trials: int = Field(40, ge=1)  # the total target, counting trials a previous run finished
    seed: int = 0
    sampler: Literal["tpe", "random", "gp", "cmaes"] = "tpe"
    edge_starts: int = Field(0, ge=0)  # planner-chosen starting points on the memory wall (autotune/search/starts.py)
    # Stop the search before `trials` once this many launches in a row found no gain beyond `resolution` over the
    # best so far (autotune/search/stopping.py); 0: always spend the whole budget.
    patience: int = Field(0, ge=0)
    # "wall": each sampled config gets the highest mem_fraction_static of its [space] range the corrected planner
    # expects to start (autotune/search/wall.py), where the study has a planner and searches or fixes
    # max_running_requests; "sampled": the sampler picks it as any other flag.
    memory_fraction: Literal["wall", "sampled"] = "wall"
    confirm_top_k: int = Field(3, ge=0)
    # The confirmation (autotune/search/confirm/): every contender is launched once and measured over
    # confirm_windows windows in that launch (fresh pass markers each); the top two are launched confirm_repeats
    # times in all, which estimates the between-launch term; contenders still open against the best are
    # relaunched one launch a stage, up to confirm_max_repeats launches each, until the best's gain over each is
    # resolved or tied within `resolution` (a fraction: 0.02 = gains inside ±2 % are a tie, the headroom decides).
    confirm_repeats: int = Field(2, ge=1)
    confirm_max_repeats: int = Field(8, ge=1)
    confirm_windows: int = Field(3, ge=1)
    resolution: float = Field(0.02, gt=0, lt=0.5)


class EngineSection(StrictModel):
    kind: str = "sim"  # one of ENGINE_KINDS
    python: str | None = None
    model: str = "qwen3.6-27b"  # bundled profile name, HF config.json directory, or checkpoint path
    profile: str | None = None  # model profile for the planner when `model` is not one (default: model)
    gpu: int = Field(0, ge=0)  # the first GPU: a server spanning N takes gpu … gpu+N-1 (SGLang's --base-gpu-id)
    # The GPUs a sweep may use (its pool): each server gets a free aligned group of the size it spans. Not with gpu.
    gpus: list[int] | None = None
    port: int | None = Field(None, ge=1, le=65535)
    # The simulated device (default b200). On a real GPU the planner reads the device; a sim_gpu set there must
    # name the same GPU.
    sim_gpu: str | None = None
    sim_options: dict[str, Any] = {}
    env: dict[str, str] = {}
    device: str = "cuda"
    timeouts: dict[str, float] = {}
    fixed: dict[str, Any] = {}
    # A GPU other processes hold (``harness.tenancy``): stop the study at once, or wait up to busy_wait_s for it.
    busy_gpu: Literal["stop", "wait"] = "stop"
    busy_wait_s: float = Field(600.0, gt=0)
    launcher: str = "local"  # where the trial's server runs: one of LAUNCHER_KINDS

    @field_validator("gpus")
    @classmethod
    def _distinct_gpus(cls, gpus: list[int] | None) -> list[int] | None:
        if gpus is None:
            return None
        if not gpus or any(g < 0 for g in gpus):
            raise fix_error("bad_gpus", "gpus must list GPU indices", "write e.g. gpus = [0, 1]")
        if len(set(gpus)) != len(gpus):
            raise fix_error(
                "bad_gpus", "gpus names a GPU twice", "name each GPU once: two servers on one GPU skew both"
            )
        return gpus

    @model_validator(mode="before")
    @classmethod
    def _sim_gpu_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sim_gpu") is None and is_simulated(str(data.get("kind", "sim"))):
            return {**data, "sim_gpu": "b200"}
        return data

    @model_validator(mode="after")
    def _gpu_or_gpus(self) -> EngineSection:
        if self.gpus is not None and "gpu" in self.model_fields_set:
            raise fix_error(
                "gpu_and_gpus",
                "both gpu and gpus are given",
                "give gpus = [..] for a pool, or gpu = N for a first GPU, not both",
            )
        return self

    @property
    def pool(self) -> tuple[int, ...] | None:
        """The GPUs a sweep shares among its servers (``gpus``); None: servers count up from ``gpu``."""
        return tuple(self.gpus) if self.gpus is not None else None

    @property
    def first_gpu(self) -> int:
        """The first GPU this study's servers use: the pool's first, else ``gpu``."""
        return self.gpus[0] if self.gpus else self.gpu

    @field_validator("launcher")
    @classmethod
    def _known_launcher(cls, launcher: str) -> str:
        if launcher not in LAUNCHER_KINDS:
            raise fix_error(
                "unknown_launcher",
                "unknown launcher {launcher}",
                f"use one of: {', '.join(LAUNCHER_KINDS)}",
                launcher=repr(launcher),
            )
        return launcher

    @property
    def simulated(self) -> bool:
        """The engine is a model of a GPU (``EngineKind.simulated``): the study plans and paces with its profile."""
        return engine_kind(self.kind).simulated

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in ENGINE_KINDS:
            raise fix_error(
                "unknown_engine", "unknown engine {kind}", f"use one of: {', '.join(ENGINE_KINDS)}", kind=repr(kind)
            )
        return kind


class SlurmSection(StrictModel):
    """``[launcher.slurm]``: where the study's jobs go; empty fields leave the cluster's defaults."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm's time-limit syntax, e.g. "01:00:00"
    extra_args: list[str] = []  # more sbatch options, one argument each (e.g. "--constraint=h200")


class ContainerSection(StrictModel):
    """``[launcher.container]``: SGLang's image under docker or podman."""

    runtime: str = "docker"  # or "podman", or a path to either
    image: str | None = None  # default: SGLang's official image
    mounts: list[str] | None = None  # "host:container[:ro]"; default: the Hugging Face cache
    ipc: Literal["private", "host"] = "private"
    shm_size: str = "32g"
    python: str = "python3"  # the interpreter inside the image
    extra_args: list[str] = []  # more `run` options, one argument each


class SshSection(StrictModel):
    """``[launcher.ssh]``: the host a study's (or a fleet's) servers start on, and the folder their files go in."""

    host: str | None = None  # "user@name:port" (user and port optional); required with [engine] launcher = "ssh"
    remote_dir: str = "autotune-fleet"  # relative log/pid paths live under this folder on the host


class LauncherSection(StrictModel):
    """``[launcher.<name>]`` tables: each launcher's settings (the one ``[engine] launcher`` names is used)."""

    slurm: SlurmSection = SlurmSection()
    container: ContainerSection = ContainerSection()
    ssh: SshSection = SshSection()

    def settings(self, name: str) -> dict[str, Any]:
        """The named launcher's settings as given (no table, or ``local``: none); defaults stay the launcher's."""
        section = getattr(self, name, None)
        return section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else {}


class Condition(StrictModel):
    flag: str
    in_: list[Scalar | None] | None = Field(None, alias="in")
    not_in: list[Scalar | None] | None = None

    @model_validator(mode="after")
    def _one_test(self) -> Condition:
        if (self.in_ is None) == (self.not_in is None):
            raise ValueError("give exactly one of `in` or `not_in`")
        return self


class ParamSpec(StrictModel):
    type: Literal["int", "float", "categorical"] | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: list[Scalar] | None = None
    when: str | None = None  # e.g. "speculative_algorithm != none"
    condition: Condition | None = None

    @model_validator(mode="after")
    def _shape(self) -> ParamSpec:
        kind = self.kind
        if kind == "categorical":
            if not self.choices:
                raise ValueError("choices must be a non-empty list")
            if self.low is not None or self.high is not None:
                raise ValueError("give either choices or low/high, not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("an int/float range needs both low and high (or give choices=[...])")
        if self.low >= self.high:
            raise ValueError(f"empty range: low ({self.low:g}) must be below high ({self.high:g})")
        if self.step is not None and self.log:
            raise ValueError("step and log cannot be combined (Optuna)")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        if self.step is not None and self.step <= 0:
            raise ValueError("step must be positive")
        if kind == "int" and any(v is not None and v != int(v) for v in (self.low, self.high, self.step)):
            raise ValueError("an int range needs whole-number low, high and step")
        return self

    @property
    def kind(self) -> str:
        if self.type:
            return self.type
        return "categorical" if self.choices is not None else "float"

    @property
    def choice_values(self) -> list[Scalar | None]:
        """Choices with "unset" turned into None (flag left out)."""
        return [None if c == UNSET else c for c in self.choices or []]


class WorkloadSection(StrictModel):
    """What each trial replays, from the study file's ``[workload]`` to the replay client (the harness's
    ``WorkloadSpec`` is this record). ``concurrency=None`` means 2 × the server's effective max running requests.
    ``warmup_s`` and ``measure_s`` are floors of the settle rule (``autotune.settle``, docs/search.md)."""

    prompts: Path = Path("../examples/prompts.jsonl")
    sample_size: int = Field(200, ge=1)
    seed: int = 0
    max_tokens: int = Field(4096, ge=1)
    concurrency: int | None = Field(None, ge=1)
    # Floors of the settle rule (``autotune.settle``): the warm-up runs on until its slices agree, the window until
    # its estimate's 95 % half-width is within ``target_half_width``, each at most its cap (unset: 4 × the floor).
    warmup_s: float = Field(10, ge=0)
    measure_s: float = Field(30, gt=0)
    warmup_max_s: float | None = Field(None, ge=0)
    measure_max_s: float | None = Field(None, gt=0)
    target_half_width: float = Field(TARGET_HALF_WIDTH, gt=0, lt=1)
    settle_tolerance: float = Field(AGREE_TOLERANCE, gt=0, lt=1)
    ramp_s: float | None = Field(None, ge=0)  # streams start over this long (unset: half of warmup_s)
    endpoint: Literal["generate", "completions", "chat"] = "generate"
    ignore_eos: bool = False
    # A prompt the replay sends again once its walk through the sample comes round: "fresh" marks each walk at the
    # prompt's front so no cache serves it from an earlier walk (a one-pass job of distinct prompts); "verbatim"
    # re-sends the text (a job that really sends a prompt several times).
    repeats: Literal["fresh", "verbatim"] = "fresh"
    # How the command that runs the trial names these fields in its messages (``autotune measure``: ``--window``);
    # a field not named is the study file's ``workload.<field>`` (``named_by``).
    _option_names: dict[str, str] = PrivateAttr(default_factory=dict)

    def named_by(self, names: dict[str, str]) -> WorkloadSection:
        """This workload, its fields named in messages as a command's options (``{"measure_s": "--window"}``)."""
        named = self.model_copy()
        named._option_names = dict(names)
        return named

    def option(self, name: str) -> str:
        """The name a message gives the field ``name``: ``workload.measure_s`` in a study, ``--window`` under
        ``measure``."""
        return self._option_names.get(name, f"workload.{name}")

    def settle_rule(self) -> SettleRule:
        return settle_rule(self)

    @property
    def ramp(self) -> float:
        return ramp_of(self)

    @model_validator(mode="after")
    def _settle_bounds(self) -> WorkloadSection:
        for cap, floor in (("warmup_max_s", "warmup_s"), ("measure_max_s", "measure_s")):
            value = getattr(self, cap)
            if value is not None and value < getattr(self, floor):
                raise ValueError(
                    f"{cap} ({value:g}) is below {floor} ({getattr(self, floor):g}): set it at or "
                    f"above {floor}, or leave it unset (4 × {floor})"
                )
        if self.ramp_s is not None and self.ramp_s > self.warmup_s:
            raise ValueError(
                f"ramp_s ({self.ramp_s:g}) must lie within the warm-up floor (warmup_s = "
                f"{self.warmup_s:g}): lower ramp_s or raise warmup_s"
            )
        return self


class SecondObjective(StrictModel):
    metric: str
    direction: Literal["minimize", "maximize"] = "minimize"

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"unknown metric {v!r}; known: {', '.join(METRICS)}")
        return v


class NumericsLimits(StrictModel):
    """``[objective] numerics``: the fidelity probe's size and how closely a trial's greedy outputs must match the
    study's reference config (its baseline) when the trial changes an output-changing flag
    (``autotune.sglang.numerics``). Both limits are off by default: the figures are measured and shown, and a set
    limit becomes one more Optuna constraint, learnt like the memory wall."""

    min_prefix_match: float | None = Field(None, ge=0)  # mean tokens per prompt before the first differing one
    max_mean_abs_logprob_delta: float | None = Field(None, ge=0)  # nats, over reference tokens both sides scored
    min_exact_share: float | None = Field(None, ge=0, le=1)  # share of prompts whose `tokens` tokens all match
    prompts: int = Field(16, ge=1, le=256)  # K fixed prompts of the sample
    tokens: int = Field(256, ge=1, le=8192)  # N greedy tokens per prompt

    @model_validator(mode="after")
    def _reachable(self) -> NumericsLimits:
        if self.min_prefix_match is not None and self.min_prefix_match > self.tokens:
            raise ValueError(
                f"min_prefix_match ({self.min_prefix_match:g}) cannot exceed the probe's tokens ({self.tokens})"
            )
        return self

    def limits(self) -> list[tuple[str, str, float]]:
        """(figure, op, limit) for each limit set, in a fixed order: the constraint entries' order."""
        out = []
        for name, figure, op in (
            ("min_prefix_match", "prefix_match_mean", ">="),
            ("max_mean_abs_logprob_delta", "mean_abs_logprob_delta", "<="),
            ("min_exact_share", "exact_share", ">="),
        ):
            value = getattr(self, name)
            if value is not None:
                out.append((figure, op, float(value)))
        return out

    def violations(self, fidelity: dict[str, Any] | None) -> list[float]:
        """One constraint entry per limit set (> 0: violated). A trial without a probe (its outputs equal the
        reference's by construction) or the reference's own run scores like a perfect match; a probe that failed
        or lacks the figure violates the limit, since nobody measured that it holds."""
        perfect = {"prefix_match_mean": float(self.tokens), "exact_share": 1.0, "mean_abs_logprob_delta": 0.0}
        probed = isinstance(fidelity, dict) and fidelity.get("role") == "probe"
        out = []
        for figure, op, limit in self.limits():
            value = fidelity.get(figure) if probed else perfect[figure]  # type: ignore[union-attr]
            if value is None or (probed and fidelity.get("error")):  # type: ignore[union-attr]
                out.append(1.0)
            else:
                out.append(limit - float(value) if op == ">=" else float(value) - limit)
        return out


class ObjectiveSection(StrictModel):
    metric: Literal["output_tok_s"] = "output_tok_s"
    constraints: list[str] = []  # SLOs such as "p99_ttft_ms <= 5000"
    second: SecondObjective | None = None
    numerics: NumericsLimits = NumericsLimits()  # the fidelity probe and its optional limits

    @field_validator("constraints")
    @classmethod
    def _parse(cls, values: list[str]) -> list[str]:
        for text in values:
            m = _CONSTRAINT.match(text)
            if not m or m.group(1) not in METRICS:
                raise ValueError(
                    f"cannot read constraint {text!r}: write '<metric> <= <number>' with a metric "
                    f"from {', '.join(METRICS)}"
                )
        return values

    def parsed_constraints(self) -> list[tuple[str, str, float]]:
        out = []
        for text in self.constraints:
            m = _CONSTRAINT.match(text)
            assert m  # validated above
            out.append((m.group(1), m.group(2), float(m.group(3))))
        return out


class BaselineSection(StrictModel):
    label: str = "baseline"
    flags: dict[str, Any] = {}  # empty: engine defaults + fixed flags
    env: dict[str, Any] = {}  # SGLang environment levers (merged into flags as ``env:NAME`` when the file loads)


class Enqueued(StrictModel):
    label: str
    flags: dict[str, Any]
    env: dict[str, Any] = {}


class JobSection(StrictModel):
    """``[job]``: the job the study tunes for, so results read as its hours and cost (``autotune.job``)."""

    completions: int = Field(ge=1)
    gpus: int = Field(ge=1)
    gpu_hour_cost: float | None = Field(None, ge=0)
    mean_output_tokens: float | None = Field(None, gt=0)  # None: the sample's measured mean

    def as_job(self) -> Job:
        return Job(
            completions=self.completions,
            gpus=self.gpus,
            gpu_hour_cost=self.gpu_hour_cost,
            mean_output_tokens=self.mean_output_tokens,
        )
