"""A study's stored settings (``user_attrs["autotune"]``: ``StudyConfig.to_dict`` at sweep time) as the report
and ``apply`` read them: which engine measured, and on which device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from autotune.config.sections import NumericsLimits, is_simulated


def engine_table(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``[engine]`` table of a stored study config (older/flat dicts keep the keys at the top level)."""
    engine = config.get("engine")
    return engine if isinstance(engine, Mapping) else config


def engine_kind(config: Mapping[str, Any]) -> str:
    engine = config.get("engine")
    return str(engine.get("kind") or "sglang") if isinstance(engine, Mapping) else str(engine or "sglang")


def simulated(config: Mapping[str, Any]) -> bool:
    """Whether the stored study ran on a simulated engine (asked of its kind, not its name)."""
    return is_simulated(engine_kind(config))


def device_name(config: Mapping[str, Any]) -> str:
    """Where the study measured, by its engine and device: the simulated GPU profile for the simulator,
    "CPU" for SGLang's CPU backend (the simulator's says whose pace it keeps), else the GPU it recorded (a real
    GPU's ``sim_gpu`` is only the profile the planner assumed, so it is named as such)."""
    engine = engine_table(config)
    cpu = str(engine.get("device") or config.get("device") or "cuda") == "cpu"
    if cpu and simulated(config):
        return f"CPU (simulated, paced as {engine.get('sim_gpu') or config.get('sim_gpu') or 'b200'})"
    recorded = config.get("gpu_name") or engine.get("gpu_name")
    if recorded:
        return str(recorded)
    sim_gpu = engine.get("sim_gpu") or config.get("sim_gpu")
    if simulated(config):
        gpu = sim_gpu or engine.get("gpu") or config.get("gpu")
        if isinstance(gpu, Mapping):
            gpu = gpu.get("name")
        return str(gpu or "GPU")
    if cpu:
        return "CPU"
    return f"GPU (planner profile {sim_gpu})" if sim_gpu else "GPU"


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, kw_only=True)
class StudySettings:
    """A study's stored settings as ``apply`` reads them (``of``): the ``[engine]`` table's fields, the table of the
    launcher it ran on, the workload, the numerics limits, and ``gpu``, where it measured (``device_name``)."""

    kind: str | None = None  # [engine] kind; None: not recorded
    model: str | None = None
    profile: str | None = None
    sim_gpu: str | None = None
    python: str | None = None
    device: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # may hold secrets: written only through ``redaction``
    launcher: str = "local"
    launcher_settings: dict[str, Any] = field(default_factory=dict)  # its [launcher.<name>] table, unset fields out
    sim_options: dict[str, Any] = field(default_factory=dict)  # the simulator's (empty for any other engine)
    workload: dict[str, Any] = field(default_factory=dict)  # [workload] as stored (provenance.json keeps it so)
    sglang_version: str | None = None
    gpu: str | None = None
    numerics: NumericsLimits = field(default_factory=NumericsLimits)  # [objective] numerics; unset: no limits

    @classmethod
    def of(cls, stored: Mapping[str, Any]) -> StudySettings:
        """From ``user_attrs["autotune"]`` (``StudyConfig.to_dict``), or an older flat dict of the same keys."""
        engine = engine_table(stored)
        nested = isinstance(stored.get("engine"), Mapping)
        kind = engine.get("kind") if nested else stored.get("engine")
        launcher = str(engine.get("launcher") or "local")
        table = (stored.get("launcher") or {}).get(launcher) or {}
        return cls(
            kind=_text(kind),
            model=_text(engine.get("model")),
            profile=_text(engine.get("profile")),
            sim_gpu=_text(engine.get("sim_gpu")),
            python=_text(engine.get("python")),
            device=_text(engine.get("device")),
            env={str(k): str(v) for k, v in (engine.get("env") or {}).items()},
            launcher=launcher,
            launcher_settings={k: v for k, v in table.items() if v not in (None, [], {})}
            if isinstance(table, dict)
            else {},
            sim_options=dict(engine.get("sim_options") or {}) if is_simulated(str(kind or "sim")) else {},
            workload=dict(stored.get("workload") or {}),
            sglang_version=_text(stored.get("sglang_version")),
            gpu=device_name(stored) if stored else None,
            numerics=_limits(stored),
        )


def _limits(stored: Mapping[str, Any]) -> NumericsLimits:
    objective = stored.get("objective")
    raw = objective.get("numerics") if isinstance(objective, Mapping) else None
    try:
        return NumericsLimits(**raw) if isinstance(raw, Mapping) else NumericsLimits()
    except (ValidationError, TypeError):  # a study stored by a different version: judge without limits
        return NumericsLimits()
