"""The engines the harness can launch, by name. Plain registration: an engine is one module whose class has a
``name`` and a ``from_settings`` classmethod, and one entry here (and its name in ``config.sections.ENGINE_KINDS``,
which the study file is checked against when it loads; config sits below the harness and cannot read this)."""

from __future__ import annotations

import functools
from typing import Any

from autotune.config.sections import EngineSection
from autotune.errors import ConfigError
from autotune.harness.engines.base import Engine, EngineClass, EngineSettings, GpuReader
from autotune.harness.engines.sglang import SGLangEngine
from autotune.harness.engines.sim import SimEngine
from autotune.sglang.gpus import GpuProfile

ENGINES: dict[str, EngineClass] = {"sglang": SGLangEngine, "sim": SimEngine}

__all__ = ["ENGINES", "Engine", "EngineSettings", "GpuReader", "SGLangEngine", "SimEngine", "make_engine",
           "planner_gpu", "study_gpu"]


def make_engine(kind: str, **settings: Any) -> Engine:
    """Build the engine called ``kind`` from ``EngineSettings``' fields (``model_path``, ``python``, ``env``,
    ``sim_gpu``, ``sim_options``, ``device``); an unknown name is a ConfigError listing the known ones."""
    cls = ENGINES.get(kind)
    if cls is None:
        raise ConfigError(f"unknown engine {kind!r}", key="engine", fix=f"use one of: {', '.join(sorted(ENGINES))}")
    return cls.from_settings(EngineSettings(**settings))


@functools.cache
def planner_gpu(kind: str, *, sim_gpu: str | None, device: str = "cuda", gpu_index: int = 0) -> GpuProfile:
    """The GPU profile the planner plans engine ``kind``'s servers with: the simulated device's, or the real GPU
    at ``gpu_index`` as its driver reports it (``EngineClass.planner_gpu``); read once per process."""
    cls = ENGINES.get(kind)
    if cls is None:
        raise ConfigError(f"unknown engine {kind!r}", key="engine", fix=f"use one of: {', '.join(sorted(ENGINES))}")
    return cls.planner_gpu(EngineSettings(model_path="", sim_gpu=sim_gpu, device=device), gpu_index)


def study_gpu(engine: EngineSection) -> GpuProfile:
    """The planner's GPU for a study's ``[engine]`` section."""
    return planner_gpu(engine.kind, sim_gpu=engine.sim_gpu, device=engine.device, gpu_index=engine.first_gpu)
