"""The engines the harness can launch, by name. Plain registration: add a class here to add an engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.errors import ConfigError
from autotune.harness.engines.base import Engine, GpuReader
from autotune.harness.engines.sglang import SGLangEngine
from autotune.harness.engines.sim import SimEngine

ENGINES: dict[str, type] = {"sglang": SGLangEngine, "sim": SimEngine}

__all__ = ["ENGINES", "Engine", "GpuReader", "SGLangEngine", "SimEngine", "make_engine"]


def make_engine(
    kind: str,
    *,
    model_path: str,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    sim_gpu: str = "b200",
    sim_options: Mapping[str, Any] | None = None,
    device: str = "cuda",
) -> Engine:
    """Build the engine called ``kind``; an unknown name is a ConfigError listing the known ones."""
    if kind == "sglang":
        return SGLangEngine(model_path=model_path, python=python, env=env, device=device)
    if kind == "sim":
        return SimEngine(model_path=model_path, python=python, env=env, sim_gpu=sim_gpu, sim_options=sim_options)
    raise ConfigError(
        f"unknown engine {kind!r}", key="engine", fix=f"use one of: {', '.join(sorted(ENGINES))}"
    )
