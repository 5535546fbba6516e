"""The ``local`` launcher: a server as a process group on this host (``ServerProcess``), its GPUs chosen by
``CUDA_VISIBLE_DEVICES``.

``CUDA_DEVICE_ORDER=PCI_BUS_ID`` goes with every GPU selection, so the index CUDA uses is the one NVML (the
monitor, the GPU pre-check) reads; a server without GPUs (SGLang's CPU backend) gets neither variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.launch.base import Launcher, LaunchSpec, MemoryReader, ReaderFactory, ServerHandle, ServerRecord
from autotune.launch.process import WATCHDOG_GRACE_S, ServerProcess

DEVICE_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class LocalLauncher:
    """Starts ``ServerProcess``es: own process group, watchdog unless detached, pid files, /dev/shm ownership."""

    name = "local"

    def __init__(self, *, watchdog_grace_s: float = WATCHDOG_GRACE_S) -> None:
        self.watchdog_grace_s = watchdog_grace_s

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> LocalLauncher:
        """The study file has no ``[launcher.local]`` table: nothing to set."""
        return cls()

    def device_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        if not gpus:
            return {}
        return {**DEVICE_ORDER, "CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in gpus)}

    def memory_reader(self, gpus: tuple[int, ...], local: ReaderFactory) -> MemoryReader:
        """This host's reader: the server runs here."""
        return local(gpus)

    def server(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> ServerProcess:
        """The server, not started yet (a context manager: ``with launcher.server(spec) as s``)."""
        return ServerProcess(
            spec.argv,
            port=spec.port,
            host=spec.host,
            env={**spec.env, **self.device_env(spec.gpus)},
            gpu_index=spec.gpus[0] if spec.gpus else None,
            log_path=spec.log_path,
            gpu_reader=gpu_reader,
            run_dir=spec.run_dir,
            detach=spec.detach,
            shm_dir=spec.shm_dir,
            watchdog_grace_s=self.watchdog_grace_s,
            gpus=spec.gpus,
        )

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> ServerProcess:
        server = self.server(spec, gpu_reader=gpu_reader)
        server.start()
        return server

    def attach(self, record: ServerRecord) -> ServerProcess:
        """The process group ``record`` names, proven by its start time (see ``ServerProcess.attached``)."""
        return ServerProcess.attached(record)


def _conforms(server: ServerProcess, launcher: LocalLauncher) -> tuple[ServerHandle, Launcher]:
    """Never called: mypy holds ``ServerProcess`` to ``ServerHandle`` and ``LocalLauncher`` to ``Launcher``."""
    return server, launcher
