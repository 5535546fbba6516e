"""The engines the harness can launch, by name. Plain registration: an engine is one module whose class has a
``name`` and a ``from_settings`` classmethod, and one entry here (and its name in ``config.sections.ENGINE_KINDS``,
which the study file is checked against when it loads; config sits below the harness and cannot read this)."""

from __future__ import annotations

from typing import Any

from autotune.errors import ConfigError
from autotune.harness.engines.base import Engine, EngineClass, EngineSettings, GpuReader
from autotune.harness.engines.sglang import SGLangEngine
from autotune.harness.engines.sim import SimEngine

ENGINES: dict[str, EngineClass] = {"sglang": SGLangEngine, "sim": SimEngine}

__all__ = ["ENGINES", "Engine", "EngineSettings", "GpuReader", "SGLangEngine", "SimEngine", "make_engine"]


def make_engine(kind: str, **settings: Any) -> Engine:
    """Build the engine called ``kind`` from ``EngineSettings``' fields (``model_path``, ``python``, ``env``,
    ``sim_gpu``, ``sim_options``, ``device``); an unknown name is a ConfigError listing the known ones."""
    cls = ENGINES.get(kind)
    if cls is None:
        raise ConfigError(f"unknown engine {kind!r}", key="engine", fix=f"use one of: {', '.join(sorted(ENGINES))}")
    return cls.from_settings(EngineSettings(**settings))
