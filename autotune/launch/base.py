"""The Launcher contract: WHERE a server runs (this host's process group, a Slurm job, a container, another host
over SSH), apart from WHAT runs (the engine's argv, flag check, failure classes and capacity).

The harness and the fleet hand a launcher one ``LaunchSpec`` and get back a ``ServerHandle``; they never build a
process, a job or a container themselves. A launcher owns device selection (``CUDA_VISIBLE_DEVICES`` for a local
process, ``--gres`` for Slurm, ``--gpus device=N`` for a container) and knows which files its server owns. Every
launcher in ``autotune.launch.LAUNCHERS`` passes one contract suite (``tests/test_launchers.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autotune.errors import ServerError

LOG_TAIL_LINES = 40


class ServerExited(ServerError):
    """The server ended before it became ready (every launcher's ``wait_ready`` raises this one)."""

    def __init__(self, exit_code: int | None, log_tail: str):
        self.exit_code, self.log_tail = exit_code, log_tail
        super().__init__(f"server exited with code {exit_code} before it was ready")


class ServerStartTimeout(ServerError):
    """The server was still not ready when the startup timeout ran out."""

    def __init__(self, timeout_s: float, log_tail: str):
        self.timeout_s, self.log_tail = timeout_s, log_tail
        super().__init__(f"server not ready after {timeout_s:g} s (raise the startup timeout if it was still loading)")


class PortTaken(ServerError):
    """Another process answers ``/health`` on the server's port: the server could never bind it, and its readiness
    (and every figure measured there) would be the other's."""

    def __init__(self, url: str, log_tail: str):
        self.url, self.log_tail = url, log_tail
        super().__init__(
            f"{url} answers /health but no process of this server listens there: another process "
            f"holds the port (stop it, or pick another port)"
        )


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a server's log file ("" when there is none yet)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LogFile:
    """A handle whose server writes its log to ``log_path`` on this host (a local process, a Slurm job's output)."""

    log_path: Path

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)


def url_scheme(argv: list[str]) -> str:
    """``https`` for a server started with a certificate (SGLang's ``--ssl-certfile``), else ``http``."""
    return "https" if any(a == "--ssl-certfile" or a.startswith("--ssl-certfile=") for a in argv) else "http"


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One server to start: the engine's command and environment, where it listens, the GPUs it gets."""

    argv: list[str]  # the engine's command, never a shell string
    port: int
    log_path: Path
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict)  # the engine's variables; device selection is the launcher's
    gpus: tuple[int, ...] = ()  # the GPUs the server gets (empty: none, e.g. SGLang's CPU backend)
    run_dir: Path | None = None  # the launcher's bookkeeping (pid files, job ids) for orphan cleanup
    shm_dir: Path | None = None  # where the server's shared-memory files appear, when on this host
    detach: bool = False  # a fleet server: outlives the process that started it
    name: str | None = None  # a name the launch owns (a container's, a Slurm job's), when the launcher names things

    def __post_init__(self) -> None:
        if isinstance(self.argv, str):
            raise TypeError("argv must be a list of arguments, never a shell string")


@dataclass(frozen=True, kw_only=True)
class ServerRecord:
    """A started server as plain data: what another process needs to find it again (``Launcher.attach``) and to
    prove it is the one that was started, not whatever holds its pid, job id or port now. Stored as JSON beside a
    fleet's servers (``to_dict`` / ``from_dict``)."""

    launcher: str  # the ``LAUNCHERS`` name that started it
    launch_id: str  # this launch's own token (a job's or container's name carries it when the launcher names them)
    host: str
    port: int
    log_path: str
    gpus: tuple[int, ...] = ()
    pid: int | None = None  # a local process (or one on an ssh host): with ``create_time``, proof against pid reuse
    create_time: float | None = None
    job_id: str | None = None  # a Slurm job
    name: str | None = None  # the job's or container's name as the launcher gave it (an ssh server's: its pid file)
    run_dir: str | None = None  # the launcher's bookkeeping (its own records, e.g. the /dev/shm files at the start)

    @classmethod
    def of(cls, launcher: str, spec: LaunchSpec, launch_id: str, **fields: Any) -> ServerRecord:
        """The record of a server started from ``spec`` (its address, log, GPUs, run dir) with the launcher's own
        ``fields`` (its pid, job id, name)."""
        return cls(
            launcher=launcher,
            launch_id=launch_id,
            host=spec.host,
            port=spec.port,
            log_path=str(spec.log_path),
            gpus=spec.gpus,
            run_dir=str(spec.run_dir) if spec.run_dir else None,
            **fields,
        )

    def detached_spec(self) -> LaunchSpec:
        """What ``Launcher.attach`` knows of the server's spec: where it listens and logs, its GPUs, run dir and
        name; no argv (nothing is started from it)."""
        return LaunchSpec(
            argv=[],
            port=self.port,
            host=self.host,
            log_path=Path(self.log_path),
            gpus=self.gpus,
            run_dir=Path(self.run_dir) if self.run_dir else None,
            detach=True,
            name=self.name,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerRecord:
        """The record ``to_dict`` wrote; ValueError when it is not one (then it proves nothing)."""
        try:
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            known["gpus"] = tuple(int(g) for g in known.get("gpus") or ())
            known["port"] = int(known["port"])
            return cls(**known)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a server record: {exc}") from None


@dataclass(frozen=True)
class GpuReading:
    """One reading of a device, None where it does not say: memory in GiB, utilisation, power, SM clock. A group's
    reading (``launch.memory.GroupReader``) is its fullest device's, with each device's own (``index`` set) under
    ``devices``."""

    used_gib: float | None = None
    total_gib: float | None = None
    util_pct: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    index: int | None = None
    devices: tuple[GpuReading, ...] = ()

    @property
    def free_gib(self) -> float:
        """What is left (``inf`` when used is unknown; with no total known, the most used is the fullest)."""
        if self.used_gib is None:
            return float("inf")
        return (self.total_gib or 0.0) - self.used_gib


class MemoryReader(Protocol):
    """What a launcher reads to know a stopped server's device memory is released (``harness.engines.GpuReader``
    satisfies it: NVML, the simulated GPU, host memory)."""

    def read(self) -> GpuReading: ...

    def close(self) -> None: ...


class ServerHandle(Protocol):
    """A started server, however it runs. ``stop`` leaves nothing behind: process, job or container gone, port
    free, GPU memory released, and the files the server provably owned removed."""

    base_url: str
    port: int
    pid: int | None  # the launcher-side process, where there is one (a container's client, srun), else None
    exit_code: int | None
    teardown_error: str | None  # a release that timed out: reported in the trial, never a hang

    @property
    def alive(self) -> bool: ...

    def poll(self) -> int | None:
        """The exit code once the server has ended, else None."""
        ...

    def log_text(self) -> str: ...

    def log_tail(self, lines: int = 40) -> str: ...

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        """Return once the server answers its health check; ``ServerExited`` / ``ServerStartTimeout`` otherwise."""
        ...

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """Stop with a grace period, wait until it is released; its exit code."""
        ...

    def release(self) -> None:
        """Forget a detached server without stopping it (a fleet's)."""
        ...

    def record(self) -> ServerRecord:
        """This server as plain data, for ``Launcher.attach`` in another process (a fleet's later command)."""
        ...


class Launcher(Protocol):
    """Starts servers somewhere. ``name`` is its key in ``LAUNCHERS``."""

    name: str

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> ServerHandle:
        """Start ``spec``'s server (not yet ready: call ``wait_ready``); raise ``ServerError`` when it cannot be
        started at all (port busy, the launcher's tool missing). ``gpu_reader``, when given, is read before the start
        and after the stop: ``stop`` waits until the memory is back (``teardown_error`` when it is not)."""
        ...

    def attach(self, record: ServerRecord) -> ServerHandle:
        """The server ``record`` describes, found again without starting anything; a handle whose ``alive`` is
        False when what runs under its pid, job id or name now is not provably that server (nothing of it is then
        signalled by ``stop``)."""
        ...

    def device_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """The variables that select ``gpus`` for a process this launcher starts (empty when it selects them
        another way, or when ``gpus`` is empty)."""
        ...

    def memory_reader(self, gpus: tuple[int, ...], local: ReaderFactory) -> MemoryReader:
        """A reader of the memory of ``gpus`` where this launcher's servers run: ``local(gpus)`` (the engine's
        reader on this host) for a server on this host, something that reads the other host for one elsewhere."""
        ...


ReaderFactory = Callable[[tuple[int, ...]], MemoryReader]  # this host's reader of some GPUs (the engine's kind)


class LauncherFactory(Protocol):
    """What ``LAUNCHERS`` holds: a launcher class, built from its ``[launcher.<name>]`` table."""

    def from_settings(self, settings: Mapping[str, Any]) -> Launcher: ...
