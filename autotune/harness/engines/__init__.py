"""The engines the harness can launch, by name. An engine is one module whose class meets ``EngineClass``
(``name``, ``simulated``, ``from_settings``, ``planner_gpu``) and one entry in ``ENGINES`` and in
``config.sections.ENGINE_KINDS`` (which the study file is checked against when it loads: config sits below the
harness); ``register`` adds one from outside the package (a plugin, a test) to both. docs/contributing.md."""

from __future__ import annotations

import functools
from typing import Any

from autotune.config.sections import ENGINE_KINDS, EngineKind, EngineSection
from autotune.errors import ConfigError
from autotune.harness.engines.base import Engine, EngineClass, EngineSettings, GpuReader
from autotune.harness.engines.sglang import SGLangEngine
from autotune.harness.engines.sim import SimEngine
from autotune.sglang.gpus import GpuProfile

ENGINES: dict[str, EngineClass] = {"sglang": SGLangEngine, "sim": SimEngine}

__all__ = [
    "ENGINES",
    "Engine",
    "EngineSettings",
    "GpuReader",
    "SGLangEngine",
    "SimEngine",
    "make_engine",
    "planner_gpu",
    "register",
    "study_gpu",
]


def register(cls: EngineClass) -> EngineClass:
    """Add an engine class to the registry and its kind to what study and fleet files are checked against."""
    ENGINES[cls.name] = cls
    ENGINE_KINDS[cls.name] = EngineKind(cls.name, simulated=cls.simulated)
    planner_gpu.cache_clear()
    return cls


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
