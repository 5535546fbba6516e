"""What a launcher's contract case provides (``tests/launchcase_<name>.py``, see ``tests/test_launchers.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# A tiny simulated SGLang server: ready in ~0.1 s, its simulated GPU memory released 0.2 s after it exits.
SIM_FLAGS = [
    "--model-path",
    "qwen3.6-27b",
    "--sim-gpu",
    "b200",
    "--sim-startup-s",
    "0.1",
    "--sim-release-s",
    "0.2",
    "--sim-warmup-s",
    "0",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaseEnv:
    """One launcher, set up to start the simulated engine, and whether it can run here.

    ``python`` is the interpreter *where the server runs* (a container's, a Slurm node's); ``env`` goes into every
    spec and must carry ``AUTOTUNE_SIM_DEVICE_DIR`` as the server sees it; ``device_dir`` is that same registry as
    this test process sees it (to check the memory is released). ``work`` holds logs and run files.
    ``skip``: why the launcher cannot run here (a missing tool), or None.
    """

    launcher: Any
    python: str
    env: Mapping[str, str]
    device_dir: Path
    work: Path
    host: str = "127.0.0.1"
    skip: str | None = None

    def sim_argv(self, port: int, *extra: str) -> list[str]:
        """The simulated server's command on ``port`` (the sim engine's, with a tiny startup)."""
        return [self.python, "-m", "autotune.sim", "--host", self.host, "--port", str(port), *SIM_FLAGS, *extra]
