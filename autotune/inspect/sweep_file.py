"""A ready ``autotune sweep`` study file from a diagnosis: the server's config as the baseline, the planner's
first suggestion enqueued, and a search space centred on the flags that suggestion changes.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, NotRequired, TypedDict
from urllib.parse import urlsplit

import tomli_w

from autotune.inspect.diagnose import InspectError, ServerDiagnosis
from autotune.inspect.suggest import Advice


class ParamRange(TypedDict, total=False):
    """One ``[space]`` entry as the study file holds it (``config.sections.ParamSpec`` reads it back): a stepped
    int or float range, or choices."""

    type: Literal["int", "float"]
    low: float
    high: float
    step: float
    choices: list[str]


class EngineTable(TypedDict, total=False):
    """The ``[engine]`` keys a sweep file from a diagnosis sets (``fixed``: the server's other flags, by dest)."""

    kind: Literal["sim", "sglang"]
    model: str | None
    sim_gpu: str
    profile: str
    fixed: dict[str, Any]


class WorkloadTable(TypedDict, total=False):
    """The ``[workload]`` keys a sweep file from a diagnosis sets."""

    prompts: str
    sample_size: int
    max_tokens: int
    ignore_eos: bool


class StudyTable(TypedDict):
    """The ``[study]`` keys a sweep file from a diagnosis sets."""

    name: str
    trials: int


class FlagsEntry(TypedDict):
    """A labelled config: the ``[baseline]`` table, or one ``[[enqueue]]`` entry (flags by dest)."""

    label: str
    flags: dict[str, Any]


class StudyFile(TypedDict):
    """The study file a diagnosis writes, table by table, in the order it is written (``config.load_config``
    reads it back)."""

    study: StudyTable
    engine: EngineTable
    space: dict[str, ParamRange]
    baseline: FlagsEntry
    enqueue: NotRequired[list[FlagsEntry]]
    workload: NotRequired[WorkloadTable]


def _dumps(doc: StudyFile) -> str:
    """The study file's TOML; a value TOML cannot hold is this command's error, not a crash."""
    try:
        return tomli_w.dumps(doc)
    except TypeError as exc:
        raise InspectError(f"cannot write a study file: {exc}") from None


def _int_range(centre: int, step: int, low_frac: float, high_frac: float, floor: int) -> ParamRange:
    low = max(floor, step * max(1, math.floor(centre * low_frac / step)))
    high = step * math.ceil(centre * high_frac / step)
    if high <= low:
        high = low + 2 * step
    return ParamRange(type="int", low=low, high=high, step=step)


def _float_range(centre: float, below: float, above: float, lo: float, hi: float, step: float) -> ParamRange:
    low = round(max(lo, centre - below), 2)
    high = round(min(hi, centre + above), 2)
    if high <= low:
        low = round(high - 2 * step, 2)
    return ParamRange(type="float", low=low, high=high, step=step)


def space_for(d: ServerDiagnosis, advice: Advice) -> dict[str, ParamRange]:
    """Ranges around the first suggestion of ``advice``, ``d``'s (or the current config when there is none)."""
    config = advice.config
    first = advice.suggestions[0].changes if advice.suggestions else {}
    centre = {**config, **first}
    space: dict[str, ParamRange] = {}
    ratio = advice.ratio or 1
    slots = centre.get("max_mamba_cache_size") or d.capacity.mamba_slots
    if slots:
        space["max_mamba_cache_size"] = _int_range(int(slots), ratio, 0.6, 1.3, ratio)
    mfs = float(
        centre.get("mem_fraction_static") or (advice.suggestions[0].mem_fraction_static if advice.suggestions else 0.85)
    )
    space["mem_fraction_static"] = _float_range(mfs, 0.05, 0.02, 0.5, 0.95, 0.01)
    mrr = centre.get("max_running_requests")
    if mrr:
        space["max_running_requests"] = _int_range(int(mrr), 8, 0.5, 1.5, 8)
    ratio_value = first.get("mamba_full_memory_ratio")
    if ratio_value:
        space["mamba_full_memory_ratio"] = _float_range(float(ratio_value), ratio_value / 2, ratio_value, 0.1, 4.0, 0.1)
    if "mamba_ssm_dtype" in first:
        space["mamba_ssm_dtype"] = ParamRange(choices=["unset", "bfloat16"])
    if "kv_cache_dtype" in first:
        space["kv_cache_dtype"] = ParamRange(choices=["auto", "fp8_e4m3"])
    return space


def _study_name(url: str, origin: str = "inspect") -> str:
    parts = urlsplit(url)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{origin}-{parts.hostname}-{parts.port or 80}").strip("-")


def sweep_toml(
    d: ServerDiagnosis,
    *,
    prompts: str | None = None,
    trials: int = 30,
    workload: WorkloadTable | None = None,
    origin: str = "inspect",
) -> str:
    """The study file text; raises ``InspectError`` when the diagnosis has no planner advice to centre on.
    ``workload`` replaces the default ``[workload]`` keys (``autotune watch`` writes the drifted traffic)."""
    advice = d.advice
    if advice is None or advice.model is None or advice.gpu is None:
        missing = "model" if advice is None or advice.model is None else "GPU"
        raise InspectError(
            f"{d.url}: cannot write a sweep file without a {missing} profile",
        )
    space = space_for(d, advice)
    config = advice.config
    fixed = {k: v for k, v in config.items() if k not in space and v is not None and k != "device"}
    baseline = {k: config[k] for k in space if config.get(k) is not None}
    engine = EngineTable(kind="sim" if d.state.simulated else "sglang")
    if d.state.simulated:
        engine["model"], engine["sim_gpu"] = advice.model, advice.gpu
    else:
        engine["model"], engine["profile"] = d.state.model_path or advice.model, advice.model
    doc = StudyFile(
        study=StudyTable(name=_study_name(d.url, origin), trials=trials),
        engine=EngineTable(**engine, fixed=fixed),
        space=space,
        baseline=FlagsEntry(label="running config", flags=baseline),
    )
    if advice.suggestions:
        first = advice.suggestions[0]
        doc["enqueue"] = [FlagsEntry(label=origin + ": " + " ".join(first.argv), flags={**baseline, **first.changes})]
    head = [f"# Written by `autotune {origin} {d.url}`: {d.headline}.", f"# Planner: {advice.reproduction}"]
    if workload is None:
        head.append(
            '# [workload] prompts: the job\'s own prompts (JSONL rows with "prompt" or chat "messages"), '
            "relative to this file"
        )
        workload = WorkloadTable(prompts=prompts or "prompts.jsonl", max_tokens=4096)
    doc["workload"] = workload
    return "\n".join(head) + "\n\n" + _dumps(doc)
