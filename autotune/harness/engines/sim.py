"""The simulated engine: the same launch, through ``python -m autotune.sim``, on a simulated GPU.

The simulator takes SGLang's flags and prints SGLang's log lines, so everything but the command and the
GPU reader is shared with the real engine (the harness reads both with ``logparse``). This module is the
harness's only door into ``autotune.sim``: the simulated GPU's reader, the study workload as the simulator's, and
``predict`` (one
trial on the simulator's virtual clock, no server), which no other engine offers.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from autotune.harness.engines.base import DeviceProcess, EngineSettings, GpuReader
from autotune.harness.engines.sglang import reject_harness_flags
from autotune.harness.gpu import MIB_PER_GIB, GpuReading
from autotune.harness.workload import WorkloadSpec
from autotune.results import MeasurementVerdict, Status, TrialResult
from autotune.sglang.flags import FlagTable
from autotune.sglang.gpus import GpuProfile, load_gpu
from autotune.sim import device
from autotune.sim.__main__ import main as _serve_main
from autotune.sim.evaluate import SimWorkload, evaluate

DEFAULT_SIM_GPU = "b200"
STATUSES = ("ok", "startup_oom", "runtime_oom", "bad_args", "crash", "timeout")  # what a trial may end as


def serve(argv: list[str]) -> int:
    """``autotune sim ARGS...``: the simulated server in this process (the CLI reaches the simulator here)."""
    return _serve_main(argv)


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


class SimEngine:
    """Launches the simulated SGLang server; its GPU is ``autotune.sim.device``."""

    name = "sim"
    simulated = True

    def __init__(
        self,
        *,
        model_path: str = "qwen3.6-27b",
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        sim_gpu: str | None = "b200",
        sim_options: Mapping[str, Any] | None = None,
        device: str = "cuda",
    ):
        self.model_path = model_path
        self.device = device  # "cpu": SGLang's CPU backend, its pools in the host's memory (the sim's ``HOST``)
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.sim_gpu = sim_gpu or DEFAULT_SIM_GPU
        self.sim_options = dict(sim_options or {})

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> SimEngine:
        return cls(
            model_path=settings.model_path,
            python=settings.python,
            env=settings.env,
            sim_gpu=settings.sim_gpu,
            sim_options=settings.sim_options,
            device=settings.device,
        )

    @classmethod
    def planner_gpu(cls, settings: EngineSettings, gpu_index: int) -> GpuProfile:
        """The simulated device is the profile: ``sim_gpu`` (default b200)."""
        return load_gpu(settings.sim_gpu or DEFAULT_SIM_GPU)

    @property
    def shm_dir(self) -> Path | None:
        """Where this simulator leaves its SGLang-like /dev/shm files (``--sim-shm DIR``), for teardown to clean."""
        value = self.sim_options.get("shm", self.sim_options.get("sim_shm"))
        if value is None or value is False:
            return None
        return Path("/dev/shm") if value is True else Path(str(value))

    def argv(self, config: Mapping[str, Any], *, port: int, host: str = "127.0.0.1") -> list[str]:
        device = ["--device", "cpu"] if self.device == "cpu" and "device" not in config else []
        return [
            self.python,
            "-m",
            "autotune.sim",
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(port),
            *FlagTable.bundled().to_argv(dict(config)),
            *device,
            "--sim-gpu",
            self.sim_gpu,
            *sim_argv(self.sim_options),
        ]

    def env(self) -> dict[str, str]:
        """The engine's own variables; the simulated GPUs are the launcher's CUDA_VISIBLE_DEVICES, one per rank."""
        return dict(self.extra_env)

    def preflight(self) -> None:
        """The simulator ships with autotune: nothing to check."""

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        reject_harness_flags(config, fix="remove it from the config")
        return FlagTable.bundled().check(dict(config))

    def gpu_reader(self, gpu_index: int | None) -> GpuReader:
        """The simulated GPU ``gpu_index``; the shared host memory on the CPU backend."""
        if self.device == "cpu":
            return SimGpuReader(device.HOST)
        return SimGpuReader(0 if gpu_index is None else gpu_index)

    def predict(
        self,
        config: Mapping[str, Any],
        workload: WorkloadSpec,
        prompts: Sequence[str],
        *,
        seed: int = 0,
    ) -> TrialResult:
        """One trial on the simulator's virtual clock (no server, no waiting): this engine's model and GPU,
        ``workload``'s shape over ``prompts`` (the study's sample). Noise as ``sim_options["noise"]``."""
        ev = evaluate(
            dict(config),
            sim_workload(workload, prompts),
            model=self.model_path,
            gpu=self.sim_gpu,
            seed=seed,
            noise=float(self.sim_options.get("noise", 0.0)),
        )
        status = cast(Status, ev.status if ev.status in STATUSES else "crash")
        return TrialResult(
            status=status,
            config=dict(config),
            engine="sim",
            device=self.device,
            capacity=ev.capacity,
            metrics=ev.metrics,
            reason=ev.reason,
            modelled_startup_s=ev.startup_s,
            plan=ev.plan,
            measurement=None
            if ev.settling is None
            else MeasurementVerdict(settled=ev.settling.settled, settling=ev.settling.to_dict()),
        )


def sim_workload(workload: WorkloadSpec, prompts: Sequence[str]) -> SimWorkload:
    """A study's workload as the simulator's, over ``prompts``."""
    return SimWorkload(
        prompts=list(prompts),
        max_tokens=workload.max_tokens,
        concurrency=workload.concurrency,
        warmup_s=workload.warmup_s,
        measure_s=workload.measure_s,
        ignore_eos=workload.ignore_eos,
        repeats=workload.repeats,
        warmup_max_s=workload.warmup_max_s,
        measure_max_s=workload.measure_max_s,
        target_half_width=workload.target_half_width,
        settle_tolerance=workload.settle_tolerance,
        ramp_s=workload.ramp_s,
    )


class SimGpuReader:
    """The simulated GPU (``autotune.sim.device``): the registry sim servers write their memory into."""

    def __init__(self, index: int = 0, directory: str | None = None):
        self.index, self.directory = index, directory

    def read(self) -> GpuReading:
        r = device.read(self.index, directory=self.directory)
        return GpuReading(
            used_gib=r.used_mib / MIB_PER_GIB,
            total_gib=None if r.total_mib is None else r.total_mib / MIB_PER_GIB,
            util_pct=getattr(r, "util_pct", None),
        )

    def processes(self) -> list[DeviceProcess]:
        """Every registration: pid, GiB held, and whether the process has exited (its memory still being freed)."""
        r = device.read(self.index, directory=self.directory)
        return [
            {
                "pid": int(p["pid"]),
                "used_gib": float(p["used_mib"]) / MIB_PER_GIB,
                "exited": p.get("exited_at") is not None,
            }
            for p in r.processes
        ]

    def close(self) -> None:
        pass
