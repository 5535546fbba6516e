"""The ``container`` launcher: a server in SGLang's official image under docker or podman.

SGLang's documented ``docker run`` line, with the port published on 127.0.0.1 only, a secret passed by name
(``-e HF_TOKEN``), no ``--rm`` (a server that dies at startup keeps its log and exit code until ``stop`` reads them
and removes it) and a keeper that removes a trial's container when the harness dies: docs/engines-and-launchers.md.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ServerError
from autotune.launch.base import (
    LOG_TAIL_LINES,
    Launcher,
    LaunchSpec,
    MemoryReader,
    ReaderFactory,
    ServerHandle,
    ServerRecord,
    log_tail,
    url_scheme,
)
from autotune.launch.health import wait_healthy
from autotune.launch.keeper import Keeper, Kept
from autotune.launch.ports import port_is_free
from autotune.launch.stopping import Release, StopSteps, memory_baseline, stop_and_release
from autotune.redaction import looks_secret, reference

IMAGE = "lmsysorg/sglang:latest"
HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface"
PASS_ENV = ("HF_TOKEN",)  # passed by name from the harness's environment when set, as SGLang's docs pass it
GONE = -1  # the exit code of a container that vanished before its code was read (removed by someone else)
_CALL_TIMEOUT_S = 60.0
ALIVE_TTL_S = 0.5
KEEPER_GRACE_S = 10.0  # the watchdog's wait for the keeper's ``rm -f`` before it SIGKILLs the keeper's group


def hf_cache_mount() -> str:
    """``$HF_HOME`` (else ``~/.cache/huggingface``) as the image's cache, so weights are downloaded once per host."""
    host = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return f"{host}:{HF_CACHE_IN_CONTAINER}"


def inside_argv(argv: Sequence[str], *, python: str) -> list[str]:
    """The engine's command as it runs in the image: its interpreter (a host path means nothing there) becomes
    ``python``, and the server listens on 0.0.0.0, the container's side of the published port."""
    out = list(argv)
    if len(out) > 1 and out[1] == "-m":
        out[0] = python
    for i, arg in enumerate(out):
        if arg == "--host" and i + 1 < len(out):
            out[i + 1] = "0.0.0.0"
            return out
        if arg.startswith("--host="):
            out[i] = "--host=0.0.0.0"
            return out
    return [*out, "--host", "0.0.0.0"]


def model_mount(argv: Sequence[str]) -> str | None:
    """A ``--model-path`` that is a directory on this host, mounted read-only at the same path (a Hub id is not)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "--model-path" and Path(argv[i + 1]).is_dir():
            path = str(Path(argv[i + 1]).resolve())
            return f"{path}:{path}:ro"
    return None


class ContainerLauncher:
    """Starts each server as ``<runtime> run -d`` of ``image``; the handle drives the same runtime CLI."""

    name = "container"

    def __init__(
        self,
        *,
        runtime: str = "docker",
        image: str = IMAGE,
        mounts: Sequence[str] | None = None,
        ipc: str = "private",
        shm_size: str = "32g",
        python: str = "python3",
        pass_env: Sequence[str] = PASS_ENV,
        extra_args: Sequence[str] = (),
        pull_timeout_s: float = 1800.0,
        watchdog_grace_s: float = KEEPER_GRACE_S,
    ) -> None:
        if ipc not in ("private", "host"):
            raise ServerError(f"container ipc must be 'private' or 'host', not {ipc!r}")
        self.runtime, self.image, self.ipc, self.shm_size = runtime, image, ipc, shm_size
        self.mounts = list(mounts) if mounts is not None else [hf_cache_mount()]
        self.python, self.pass_env, self.extra_args = python, tuple(pass_env), list(extra_args)
        self.pull_timeout_s, self.watchdog_grace_s = pull_timeout_s, watchdog_grace_s

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ContainerLauncher:
        """From the study's ``[launcher.container]`` table (validated by ``config.sections.ContainerSection``);
        a field left out keeps this class's default."""
        return cls(**{k: v for k, v in settings.items() if v is not None})

    @property
    def podman(self) -> bool:
        return Path(self.runtime).name.startswith("podman")

    def device_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """Nothing: the runtime selects the GPUs, and inside the container they are 0..n-1."""
        return {}

    def memory_reader(self, gpus: tuple[int, ...], local: ReaderFactory) -> MemoryReader:
        """This host's reader: the container runs on this host's GPUs (NVML outside sees them by host index)."""
        return local(gpus)

    def gpu_args(self, gpus: tuple[int, ...]) -> list[str]:
        """``--gpus device=N`` (docker; several as ``"device=0,1"``, quoted for docker's CSV parser) or one CDI
        ``--device nvidia.com/gpu=N`` per GPU (podman)."""
        if not gpus:
            return []
        if self.podman:
            return [a for g in gpus for a in ("--device", f"nvidia.com/gpu={int(g)}")]
        ids = ",".join(str(int(g)) for g in gpus)
        return ["--gpus", f"device={ids}" if len(gpus) == 1 else f'"device={ids}"']

    def command(self, spec: LaunchSpec, name: str) -> tuple[list[str], dict[str, str]]:
        """The ``run`` argv and the secret values it names (for the runtime's environment, never the argv)."""
        ipc = ["--ipc=host"] if self.ipc == "host" else ["--shm-size", self.shm_size]
        env_args: list[str] = []
        hidden: dict[str, str] = {}
        env = {k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"}  # the runtime selects GPUs
        for key in self.pass_env:
            if key not in env and os.environ.get(key):
                env[key] = os.environ[key]
        for key, value in env.items():
            ref = reference(value)  # ``${NAME}``: filled from this process's environment, like a fleet launch
            if ref is not None or looks_secret(key, value):
                env_args += ["-e", key]
                hidden[key] = os.environ.get(ref, "") if ref is not None else str(value)
            else:
                env_args += ["-e", f"{key}={value}"]
        mounts = [*self.mounts, *filter(None, [model_mount(spec.argv)])]
        argv = [
            self.runtime,
            "run",
            "-d",
            "--name",
            name,
            *self.gpu_args(spec.gpus),
            *ipc,
            "-p",
            f"{spec.host}:{spec.port}:{spec.port}",
            *env_args,
            *[a for m in mounts for a in ("-v", m)],
            *self.extra_args,
            self.image,
            *inside_argv(spec.argv, python=self.python),
        ]
        return argv, hidden

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> ContainerServer:
        if shutil.which(self.runtime) is None:
            raise ServerError(
                f"container runtime {self.runtime!r} not found (install docker or podman, or set the "
                "container launcher's runtime to its path)"
            )
        if not port_is_free(spec.host, spec.port):
            raise ServerError(f"port {spec.host}:{spec.port} is busy (stop what holds it or pick another port)")
        name = spec.name or f"autotune-{secrets.token_hex(6)}"
        argv, hidden = self.command(spec, name)
        server = ContainerServer(self.runtime, name, spec, gpu_reader=gpu_reader)
        if server.exists():  # never ours to remove: the failure path below removes only what this run created
            raise ServerError(f"a container named {name!r} already exists ({self.runtime} rm -f it if it is stale)")
        server.baseline_mib = memory_baseline(gpu_reader, spec.gpus)
        try:
            done = subprocess.run(
                argv,
                env={**os.environ, **hidden},
                capture_output=True,
                text=True,
                timeout=self.pull_timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            server.remove()
            raise ServerError(f"{self.runtime} run did not return within {self.pull_timeout_s:g} s") from exc
        if done.returncode != 0:
            server.remove()  # a container created but not started holds its name
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ServerError(f"{self.runtime} run failed (exit {done.returncode}): {last}")
        server.container_id = done.stdout.strip() or None
        if not spec.detach:
            try:
                server.keep(str(shutil.which(self.runtime)), self.watchdog_grace_s)
            except BaseException:
                server.remove()
                raise
        return server

    def attach(self, record: ServerRecord) -> ContainerServer:
        """The container ``record`` names (by its name, which carries the launch's token); not alive once gone."""
        server = ContainerServer(self.runtime, str(record.name), record.detached_spec(), launch_id=record.launch_id)
        if server.exists():
            server.container_id = record.name
        return server


class ContainerServer(Kept):
    """One container: alive and exit code from ``inspect``, log from ``logs`` (copied to the spec's log file),
    stopped with ``stop -t <grace>`` then ``kill`` and removed with ``rm -f``."""

    pid: int | None = None  # ``run -d`` leaves no client process

    def __init__(
        self,
        runtime: str,
        name: str,
        spec: LaunchSpec,
        *,
        gpu_reader: MemoryReader | None = None,
        launch_id: str | None = None,
    ):
        self.runtime, self.name, self.spec, self.gpu_reader = runtime, name, spec, gpu_reader
        self.launch_id = launch_id or name
        self.port, self.log_path = spec.port, Path(spec.log_path)
        connect = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host
        self.base_url = f"{url_scheme(spec.argv)}://{connect}:{spec.port}"
        self.exit_code: int | None = None
        self.teardown_error: str | None = None
        self.container_id: str | None = None
        self.baseline_mib: float | None = None
        self._keeper: Keeper | None = None
        self._alive_at: tuple[float, bool] | None = None  # (when, answer) of the last ``alive`` read

    def record(self) -> ServerRecord:
        return ServerRecord.of("container", self.spec, self.launch_id, name=self.name)

    def keep(self, runtime_path: str, grace_s: float) -> None:
        """Start the keeper: from now on the harness's death removes the container."""
        run_dir = self.spec.run_dir or self.log_path.parent
        self._keeper = Keeper(
            [runtime_path, "rm", "-f", self.name],
            log_path=self.log_path,
            grace_s=grace_s,
            note=f"[autotune keeper] harness gone; removing container {self.name}",
            record=run_dir / f"container-{self.name}.json",
        )

    def _cli(self, *args: str, timeout: float = _CALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.runtime, *args], capture_output=True, text=True, timeout=timeout, check=False)

    def _state(self) -> tuple[bool, int] | None:
        """(running, exit code) from ``inspect``; None once the container is gone."""
        done = self._cli("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", self.name)
        if done.returncode != 0:
            return None
        running, _, code = done.stdout.strip().partition(" ")
        return running == "true", int(code or 0)

    def _running(self) -> bool:
        state = self._state()
        return state is not None and state[0]

    @property
    def alive(self) -> bool:
        """Running. Read at most once per ``ALIVE_TTL_S``: the replay asks from its event loop, and each answer is a
        runtime call (``inspect``) that would stall the measured window."""
        if self.exit_code is not None:
            return False
        if self._alive_at is None or time.monotonic() - self._alive_at[0] >= ALIVE_TTL_S:
            state = self._state()
            # stamped once answered: a runtime slower than the TTL must not be asked again on the next call
            self._alive_at = (time.monotonic(), state is not None and state[0])
        return self._alive_at[1]

    def poll(self) -> int | None:
        if self.exit_code is None:
            state = self._state()
            if state is None:
                self.exit_code = GONE
            elif not state[0]:
                self.exit_code = state[1]
        return self.exit_code

    def _copy_logs(self) -> None:
        """The container's output into the spec's log file (the trial's ``server.log``), whole each time."""
        done = subprocess.run(
            [self.runtime, "logs", self.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=_CALL_TIMEOUT_S,
            check=False,
        )
        if done.returncode == 0:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_bytes(done.stdout)

    def log_text(self) -> str:
        self._copy_logs()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        self._copy_logs()
        return log_tail(self.log_path, lines)

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        """Return once ``/health`` answers 200 on the published port; a container that ends ends the wait."""
        wait_healthy(
            lambda: self.base_url, timeout_s, ended=self.poll, tail=self.log_tail, stop_event=stop_event, poll_s=0.2
        )

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """``stop -t <grace>`` (SIGTERM, SIGKILL after the grace), ``kill`` if it still runs, the log copied,
        ``rm -f``; released once the container is gone, the port free and the GPU memory back."""
        grace = max(0, math.ceil(grace_s))

        def terminate() -> None:
            try:
                self._cli("stop", "-t", str(grace), self.name, timeout=grace + max(5.0, release_timeout_s))
            except subprocess.TimeoutExpired:
                pass  # the kill follows

        def kill() -> None:
            if self._running():
                self._cli("kill", self.name)
            self._copy_logs()
            self.poll()
            self.remove()

        steps = StopSteps(
            what=f"container {self.name}",
            running=self._running,
            terminate=terminate,
            kill=kill,
            gone=lambda: self._state() is None,
            poll_s=0.1,
        )
        release = Release(
            port=self.port,
            port_free=lambda: port_is_free(self.spec.host, self.port),
            reader=self.gpu_reader,
            baseline_mib=self.baseline_mib,
        )
        problems = stop_and_release(steps, release, grace_s=grace_s, release_timeout_s=release_timeout_s)
        self._stand_down()
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    def exists(self) -> bool:
        return self._state() is not None

    def remove(self) -> None:
        self._cli("rm", "-f", self.name)

    def __enter__(self) -> ContainerServer:
        return self


def _conforms(server: ContainerServer, launcher: ContainerLauncher) -> tuple[ServerHandle, Launcher]:
    """Never called: mypy holds ``ContainerServer`` to ``ServerHandle`` and ``ContainerLauncher`` to ``Launcher``."""
    return server, launcher
