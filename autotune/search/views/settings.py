"""A study's stored settings (``user_attrs["autotune"]``: ``StudyConfig.to_dict`` at sweep time) as the report
and ``apply`` read them: which engine measured, and on which device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def engine_table(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``[engine]`` table of a stored study config (older/flat dicts keep the keys at the top level)."""
    engine = config.get("engine")
    return engine if isinstance(engine, Mapping) else config


def engine_kind(config: Mapping[str, Any]) -> str:
    engine = config.get("engine")
    return str(engine.get("kind") or "sglang") if isinstance(engine, Mapping) else str(engine or "sglang")


def device_name(config: Mapping[str, Any]) -> str:
    """Where the study measured, by its engine and device: the simulated GPU profile for the simulator,
    "CPU" for SGLang's CPU backend, else the GPU it recorded (a real GPU's ``sim_gpu`` is only the profile
    the planner assumed, so it is named as such)."""
    engine = engine_table(config)
    recorded = config.get("gpu_name") or engine.get("gpu_name")
    if recorded:
        return str(recorded)
    sim_gpu = engine.get("sim_gpu") or config.get("sim_gpu")
    if engine_kind(config) == "sim":
        gpu = sim_gpu or engine.get("gpu") or config.get("gpu")
        if isinstance(gpu, Mapping):
            gpu = gpu.get("name")
        return str(gpu or "GPU")
    if str(engine.get("device") or config.get("device") or "cuda") == "cpu":
        return "CPU"
    return f"GPU (planner profile {sim_gpu})" if sim_gpu else "GPU"
