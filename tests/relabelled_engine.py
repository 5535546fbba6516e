"""A third engine that lives only in the tests: the simulator launched through autotune's own CLI
(``python -m autotune sim ...``) under another name, measuring only (no ``Predictor``). It is built from the
shared settings, registered with ``autotune.harness.engines.register`` and nothing else in the package names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.harness.engines import EngineSettings, GpuReader, SimEngine
from autotune.sglang.gpus import GpuProfile


class RelabelledEngine:
    """The simulated server started as ``autotune sim``; the simulator's checks, device and GPU reader."""

    name = "relabelled"
    simulated = True

    def __init__(self, inner: SimEngine):
        self._inner = inner
        self.model_path = inner.model_path
        self.device = inner.device

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> RelabelledEngine:
        return cls(SimEngine.from_settings(settings))

    @classmethod
    def planner_gpu(cls, settings: EngineSettings, gpu_index: int) -> GpuProfile:
        return SimEngine.planner_gpu(settings, gpu_index)

    @property
    def shm_dir(self) -> Path | None:
        return self._inner.shm_dir

    def argv(self, config: Mapping[str, Any], *, port: int, host: str = "127.0.0.1") -> list[str]:
        python, dash_m, module, *rest = self._inner.argv(config, port=port, host=host)
        assert (dash_m, module) == ("-m", "autotune.sim")
        return [python, "-m", "autotune", "sim", *rest]

    def env(self) -> dict[str, str]:
        return self._inner.env()

    def preflight(self) -> None:
        self._inner.preflight()

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return self._inner.check(config)

    def gpu_reader(self, gpu_index: int | None) -> GpuReader:
        return self._inner.gpu_reader(gpu_index)
