"""The simulated engine: the same launch, through ``python -m autotune.sim``, on a simulated GPU.

The simulator takes SGLang's flags and prints SGLang's log lines, so everything but the command and the
GPU reader is shared with the real engine (``logparse``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.harness.engines import logparse
from autotune.harness.engines.base import GpuReader
from autotune.harness.engines.sglang import launch_env, reject_harness_flags


def sim_argv(options: Mapping[str, Any]) -> list[str]:
    """``{"startup_s": 0.3, "shm": True}`` → ``["--sim-startup-s", "0.3", "--sim-shm"]``."""
    argv: list[str] = []
    for key, value in options.items():
        name = key.removeprefix("sim_").removeprefix("sim-").replace("_", "-")
        if value is None or value is False:
            continue
        argv.append(f"--sim-{name}")
        if value is not True:
            argv.append(str(value))
    return argv


class SimEngine(logparse.LogReading):
    """Launches the simulated SGLang server; its GPU is ``autotune.sim.device``."""

    name = "sim"

    def __init__(
        self,
        *,
        model_path: str = "qwen3.6-27b",
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        sim_gpu: str = "b200",
        sim_options: Mapping[str, Any] | None = None,
    ):
        self.model_path = model_path
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.sim_gpu = sim_gpu
        self.sim_options = dict(sim_options or {})

    @property
    def shm_dir(self) -> Path | None:
        """Where this simulator leaves its SGLang-like /dev/shm files (``--sim-shm DIR``), for teardown to clean."""
        value = self.sim_options.get("shm", self.sim_options.get("sim_shm"))
        if value is None or value is False:
            return None
        return Path("/dev/shm") if value is True else Path(str(value))

    def argv(self, config: Mapping[str, Any], *, port: int, host: str = "127.0.0.1") -> list[str]:
        from autotune.sglang.flags import FlagTable

        return [
            self.python, "-m", "autotune.sim", "--model-path", self.model_path, "--host", host, "--port", str(port),
            *FlagTable.bundled().to_argv(dict(config)), "--sim-gpu", self.sim_gpu, *sim_argv(self.sim_options),
        ]

    def env(self, *, gpu_index: int | None) -> dict[str, str]:
        return launch_env(self.extra_env, gpu_index=gpu_index)

    def preflight(self) -> None:
        """The simulator ships with autotune: nothing to check."""

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        from autotune.sglang.flags import FlagTable

        reject_harness_flags(config, fix="remove it from the config")
        return FlagTable.bundled().check(dict(config))

    def gpu_reader(self, gpu_index: int | None) -> GpuReader:
        from autotune.harness.gpu import SimGpuReader

        return SimGpuReader(0 if gpu_index is None else gpu_index)
