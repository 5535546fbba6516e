"""What a trial runs on, held once: ``TrialSetup`` (the same for every config a runner launches) and ``TrialHooks``
(how the caller watches and stops it).

``run_trial`` used to take these as nine keywords, repeated by every caller and again by its own second launch;
one frozen object keeps a re-measure, a confirmation run and a reference launch on the same engine, GPU and
launcher by construction.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autotune.config import Timeouts
from autotune.harness.engines.base import Engine
from autotune.harness.workload import WorkloadSpec
from autotune.launch import Launcher
from autotune.launch.registry import make_launcher
from autotune.progress import PhaseInfo
from autotune.prompts import PromptSample
from autotune.sglang.parallel import server_gpus

PhaseCallback = Callable[[str, PhaseInfo], None]
DEFAULT_TIMEOUTS = Timeouts()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialSetup:
    """The engine, workload and place of a trial. ``sample``: the prompts (None: drawn from ``workload``);
    ``launcher``: a ``LAUNCHERS`` name or a launcher. Where the server runs: ``gpus``, the group it may use (a
    worker's), or else ``gpu_index``, its first GPU (a server spanning N takes ``gpu_index … gpu_index+N-1``, as
    SGLang's ``--base-gpu-id``); ``gpu_index`` None and no ``gpus``: a server without GPUs."""

    engine: Engine
    workload: WorkloadSpec
    sample: PromptSample | None = None
    launcher: str | Launcher = "local"
    gpu_index: int | None = 0
    gpus: tuple[int, ...] | None = None
    port: int | None = None  # None: a free port per launch
    timeouts: Timeouts = DEFAULT_TIMEOUTS
    run_dir: Path | None = None  # pid files of started servers (None: ./runs)
    shm_dir: Path | None = None  # None: the engine's

    def resolved(self) -> TrialSetup:
        """The sample drawn (and bound to the model's chat template) and the launcher built, once for all launches
        of a trial (an unknown launcher name is a ``ConfigError`` here, before any launch)."""
        sample = self.sample or PromptSample.load(self.workload.prompts, self.workload.sample_size, self.workload.seed)
        # Chat rows sent as text are rendered with the served model's own template when its directory has one.
        sample = sample.for_model(self.engine.model_path)
        return dataclasses.replace(self, sample=sample, launcher=make_launcher(self.launcher))


@dataclasses.dataclass(frozen=True)
class TrialHooks:
    """``on_phase(name, info)``: each phase as it starts (the display; ``info`` has ``progress.PhaseInfo``'s keys);
    ``stop_event``: set to end the trial as ``interrupted``, the server stopped cleanly."""

    on_phase: PhaseCallback | None = None
    stop_event: threading.Event | None = None

    def phase(self, name: str, info: PhaseInfo) -> None:
        if self.on_phase is not None:
            self.on_phase(name, info)

    @property
    def stopped(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()


NO_HOOKS = TrialHooks()


def server_group(setup: TrialSetup, config: Mapping[str, Any]) -> tuple[int, ...]:
    """The GPUs a server with ``config`` gets: as many as it spans (``sglang.parallel.server_gpus``), the first of
    ``setup.gpus`` or counted up from ``setup.gpu_index``. A group smaller than the config needs is handed over as
    it is: the server then fails at startup as SGLang does, which is the trial's outcome to record."""
    need = server_gpus(config)
    if setup.gpus is not None:
        return tuple(setup.gpus[:need])
    if setup.gpu_index is None:
        return ()
    return tuple(range(setup.gpu_index, setup.gpu_index + need))
