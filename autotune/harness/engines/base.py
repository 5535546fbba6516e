"""The Engine contract: everything that differs between launching SGLang and launching the simulator.

The harness (trial.py) owns this Protocol and never imports an implementation; ``ENGINES`` in
``autotune.harness.engines`` maps a name to a class, built from one ``EngineSettings`` (``EngineClass``). An
engine may also offer ``predict(config, workload, prompts, *, seed)``: the trial on a virtual clock without a
server (the sim engine's only). Flag names in configs are SGLang ``dest`` names (``max_mamba_cache_size``);
booleans are store-true flags (``True`` → present, ``False`` → absent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypedDict, runtime_checkable

from autotune.launch.base import GpuReading
from autotune.launch.memory import GroupReader
from autotune.results import TrialResult
from autotune.sglang.flags import FlagTable
from autotune.sglang.gpus import GpuProfile


class DeviceProcess(TypedDict):
    """A process holding memory on a device, as a reader's ``processes()`` names it: its GiB (None where the driver
    does not say), and whether it has exited (its memory still being freed)."""

    pid: int
    used_gib: float | None
    exited: bool


class GpuReader(Protocol):
    """One memory/utilisation reading of one device. Implemented by NVML, the simulated GPU and psutil.

    A reader may also offer ``track(pids, files_bytes)`` (the host-memory one does): ``launch.process.ServerProcess``
    then hands it
    the server's own process group, so other processes' memory never counts as the server's (SGLang's CPU backend).
    A reader of a device may offer ``processes()`` (NVML and the simulated GPU do): its ``DeviceProcess`` list,
    what ``harness.tenancy`` reads to refuse a launch next to a tenant.
    """

    def read(self) -> GpuReading:
        """Memory, utilisation, power and SM clock, None where the device does not say."""
        ...

    def close(self) -> None: ...


class Engine(Protocol):
    """What differs between engines: the launch (argv, env), the checks before it and the device it runs on.
    Reading a server's output is SGLang's format for every engine (``logparse``'s functions); an engine that can
    answer without a server also offers ``Predictor``."""

    name: str
    model_path: str  # what the server loads (a checkpoint, or the simulator's profile)
    device: str  # "cuda", or "cpu" for SGLang's CPU backend (host memory, no GPU)

    @property
    def shm_dir(self) -> Path | None:
        """Where the server leaves /dev/shm files for teardown to clean (None: it leaves none)."""
        ...

    def argv(self, config: Mapping[str, Any], *, port: int, host: str = "127.0.0.1") -> list[str]:
        """The launch command as an argv list (never a shell string)."""
        ...

    def env(self) -> dict[str, str]:
        """The engine's own variables for a launch; device selection (``CUDA_VISIBLE_DEVICES``) is the launcher's."""
        ...

    def preflight(self) -> None:
        """Raise ``EngineError`` when the engine cannot launch at all (e.g. SGLang not importable)."""
        ...

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The config dest-keyed and typed, as the server will read it; ``ConfigError`` (with a did-you-mean)
        for any flag the engine does not know or a bad value."""
        ...

    def gpu_reader(self, gpu_index: int | None) -> GpuReader:
        """A reader of the device this engine's server runs on (NVML, the simulated GPU, or host memory)."""
        ...


@runtime_checkable
class Predictor(Protocol):
    """What an engine that can answer without a server offers (the simulator's virtual clock): a trial's result
    for ``config`` over the study's workload and prompt sample. The study's warm start and benchmarks ask it."""

    def predict(
        self, config: Mapping[str, Any], workload: Any, prompts: Sequence[str], *, seed: int = 0
    ) -> TrialResult: ...


@runtime_checkable
class InstalledSGLang(Protocol):
    """What an engine that launches an installed SGLang offers: that SGLang's own flag table and its version (a
    re-tune translates an earlier study's configs to them). An engine without it runs the bundled 0.5.23 rules."""

    def flag_table(self) -> FlagTable: ...

    def sglang_version(self) -> str | None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Everything any engine is built from (the study's ``[engine]`` section, ``measure``'s and a fleet's options).
    One record for all engines, so ``make_engine`` needs no per-engine branch: each engine reads the fields it
    uses and leaves the rest (SGLang ignores ``sim_gpu`` and ``sim_options``)."""

    model_path: str
    python: str | None = None
    env: Mapping[str, str] | None = None
    sim_gpu: str | None = None  # the simulated device (default b200); on a real GPU, the profile it must match
    sim_options: Mapping[str, Any] | None = None
    device: str = "cuda"


class EngineClass(Protocol):
    """What ``ENGINES`` holds: an engine class by its ``name``, built from the settings. ``simulated``: a model of
    a GPU (it runs the planner's profile on ``sim_gpu``; its figures are the model's), as ``config.EngineKind``."""

    name: str
    simulated: bool

    def from_settings(self, settings: EngineSettings) -> Engine: ...

    def planner_gpu(self, settings: EngineSettings, gpu_index: int) -> GpuProfile:
        """The GPU profile the planner plans this engine's servers with (the simulated one, or the real device)."""
        ...


def launch_gpus(engine: Engine, gpus: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """The GPUs a launcher gives the engine's server: none for SGLang's CPU backend (``device`` "cpu": no
    CUDA_VISIBLE_DEVICES), else the group (the simulator picks its simulated devices from it, CPU or not)."""
    if gpus is None or engine.device == "cpu":
        return ()
    return (gpus,) if isinstance(gpus, int) else tuple(gpus)


def group_reader(engine: Engine, gpus: tuple[int, ...]) -> GpuReader:
    """The reader of a server's devices: the engine's reader of its one GPU, or a ``GroupReader`` over every GPU
    of a group (the fullest decides headroom); the engine's host reader when the server has no GPU."""
    if len(gpus) <= 1:
        return engine.gpu_reader(gpus[0] if gpus else None)
    return GroupReader({g: engine.gpu_reader(g) for g in gpus})
