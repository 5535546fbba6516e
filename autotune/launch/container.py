"""The ``container`` launcher: a server in SGLang's official image under docker or podman.

The command follows SGLang's documented ``docker run`` line (GPU selection, shared memory, the published port, the
Hugging Face cache mount, ``HF_TOKEN``, the image, ``python3 -m sglang.launch_server … --host 0.0.0.0``), with
three differences that keep a trial honest:

- the port is published on 127.0.0.1 only (the spec's host says otherwise), while the server listens on 0.0.0.0
  inside, where the container's own network namespace is its loopback;
- a secret variable is passed by name (``-e HF_TOKEN``) with its value in the runtime's environment, so it never
  appears in an argv that ``ps`` shows;
- no ``--rm``: a server that dies at startup would take its log and exit code with it. ``stop`` removes the
  container (``rm -f``) after reading both, so nothing is left either way.

A trial's container never outlives its harness: beside it runs a keeper, a tiny local process that removes the
container (``rm -f``) when SIGTERMed, watched by the local launcher's watchdog (``launch/watchdog.py``), which
SIGTERMs it once the harness is gone, SIGKILL included. A detached (fleet) container has neither.

The default is a private IPC namespace with ``--shm-size``: the container's ``/dev/shm`` is its own and goes with
it, so there is nothing to attribute. ``ipc = "host"`` (the docs' other flag) puts SGLang's ``/dev/shm`` files on
the host, where this launcher does not clean them.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from autotune.errors import ServerError
from autotune.launch.base import (
    LOG_TAIL_LINES,
    LaunchSpec,
    MemoryReader,
    ReaderFactory,
    ServerExited,
    ServerStartTimeout,
    log_tail,
    port_is_free,
)
from autotune.launch.memory import used_mib, wait_released
from autotune.launch.watchdog import Watchdog
from autotune.redaction import looks_secret, reference

IMAGE = "lmsysorg/sglang:latest"
HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface"
PASS_ENV = ("HF_TOKEN",)  # passed by name from the harness's environment when set, as SGLang's docs pass it
GONE = -1  # the exit code of a container that vanished before its code was read (removed by someone else)
_CALL_TIMEOUT_S = 60.0
ALIVE_TTL_S = 0.5
KEEPER_GRACE_S = 10.0  # the watchdog's wait for the keeper's ``rm -f`` before it SIGKILLs the keeper's group
# The keeper: on SIGTERM, remove the container from a session of its own (so the watchdog's SIGKILL of the keeper's
# group cannot cut it short), after a note in the server's log; then exit. argv: runtime, name, log path.
KEEPER = """
import os, signal, subprocess, sys
runtime, name, log = sys.argv[1:4]
def gone(*_):
    with open(log, "a") as fh:
        fh.write(f"[autotune keeper] harness gone; removing container {name}\\n")
    subprocess.run([runtime, "rm", "-f", name], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, start_new_session=True, timeout=120, check=False)
    os._exit(0)
signal.signal(signal.SIGTERM, gone)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("keeping", flush=True)
while True:
    signal.pause()
"""


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
        self, *, runtime: str = "docker", image: str = IMAGE, mounts: Sequence[str] | None = None,
        ipc: str = "private", shm_size: str = "32g", python: str = "python3", pass_env: Sequence[str] = PASS_ENV,
        extra_args: Sequence[str] = (), pull_timeout_s: float = 1800.0, watchdog_grace_s: float = KEEPER_GRACE_S,
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
            self.runtime, "run", "-d", "--name", name, *self.gpu_args(spec.gpus), *ipc,
            "-p", f"{spec.host}:{spec.port}:{spec.port}", *env_args,
            *[a for m in mounts for a in ("-v", m)], *self.extra_args,
            self.image, *inside_argv(spec.argv, python=self.python),
        ]
        return argv, hidden

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> ContainerServer:
        if shutil.which(self.runtime) is None:
            raise ServerError(f"container runtime {self.runtime!r} not found (install docker or podman, or set the "
                              "container launcher's runtime to its path)")
        if not port_is_free(spec.host, spec.port):
            raise ServerError(f"port {spec.host}:{spec.port} is busy (stop what holds it or pick another port)")
        name = spec.name or f"autotune-{secrets.token_hex(6)}"
        argv, hidden = self.command(spec, name)
        server = ContainerServer(self.runtime, name, spec, gpu_reader=gpu_reader)
        if server.exists():  # never ours to remove: the failure path below removes only what this run created
            raise ServerError(f"a container named {name!r} already exists ({self.runtime} rm -f it if it is stale)")
        server.baseline_mib = used_mib(gpu_reader) if gpu_reader is not None else None
        try:
            done = subprocess.run(argv, env={**os.environ, **hidden}, capture_output=True, text=True,
                                  timeout=self.pull_timeout_s, check=False)
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


class ContainerServer:
    """One container: alive and exit code from ``inspect``, log from ``logs`` (copied to the spec's log file),
    stopped with ``stop -t <grace>`` then ``kill`` and removed with ``rm -f``."""

    pid: int | None = None  # ``run -d`` leaves no client process

    def __init__(self, runtime: str, name: str, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None):
        self.runtime, self.name, self.spec, self.gpu_reader = runtime, name, spec, gpu_reader
        self.port, self.log_path = spec.port, Path(spec.log_path)
        connect = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host
        self.base_url = f"http://{connect}:{spec.port}"
        self.exit_code: int | None = None
        self.teardown_error: str | None = None
        self.container_id: str | None = None
        self.baseline_mib: float | None = None
        self._keeper: subprocess.Popen[bytes] | None = None
        self._watchdog: Watchdog | None = None
        self._alive_at: tuple[float, bool] | None = None  # (when, answer) of the last ``alive`` read

    def keep(self, runtime_path: str, grace_s: float) -> None:
        """Start the keeper and its watchdog: from now on the harness's death removes the container."""
        watchdog = Watchdog(grace_s=grace_s)
        try:
            keeper = subprocess.Popen(
                [sys.executable, "-c", KEEPER, runtime_path, self.name, str(self.log_path)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
            )
            assert keeper.stdout is not None
            keeper.stdout.readline()  # its SIGTERM handler is in place
            keeper.stdout.close()
        except BaseException:
            watchdog.stand_down()
            raise
        self._keeper, self._watchdog = keeper, watchdog
        run_dir = self.spec.run_dir or self.log_path.parent
        watchdog.watch(keeper.pid, run_dir / f"container-{self.name}.json")  # no record: nothing on the host to clean

    def _stand_down(self) -> None:
        """The harness stops the container itself: the watchdog goes first, then the keeper (SIGKILL, no rm)."""
        if self._watchdog is not None:
            self._watchdog.stand_down()
            self._watchdog = None
        if self._keeper is not None:
            self._keeper.kill()
            self._keeper.wait(timeout=10)
            self._keeper = None

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
        done = subprocess.run([self.runtime, "logs", self.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=_CALL_TIMEOUT_S, check=False)
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
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if self.poll() is not None:
                    raise ServerExited(self.exit_code, self.log_tail())
                if (stop_event is not None and stop_event.is_set()) or time.monotonic() >= deadline:
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                time.sleep(0.2)

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """``stop -t <grace>`` (SIGTERM, SIGKILL after the grace), ``kill`` if it still runs, the log copied,
        ``rm -f``; released once the container is gone, the port free and the GPU memory back."""
        problems: list[str] = []
        grace = max(0, math.ceil(grace_s))
        if self._running():
            try:
                self._cli("stop", "-t", str(grace), self.name, timeout=grace + max(5.0, release_timeout_s))
            except subprocess.TimeoutExpired:
                problems.append(f"{self.runtime} stop did not return")
            if self._running():
                self._cli("kill", self.name)
        self._copy_logs()
        self.poll()
        deadline = time.monotonic() + release_timeout_s
        self.remove()
        while self._state() is not None:
            if time.monotonic() >= deadline:
                problems.append(f"container {self.name} still present after {release_timeout_s:g} s")
                break
            time.sleep(0.1)
        while not port_is_free(self.spec.host, self.port):
            if time.monotonic() >= deadline:
                problems.append(f"port {self.port} still busy after {release_timeout_s:g} s")
                break
            time.sleep(0.05)
        if self.gpu_reader is not None:
            left = max(0.0, deadline - time.monotonic())
            if not wait_released(self.gpu_reader, self.baseline_mib, left):
                problems.append(f"GPU memory not released within {release_timeout_s:g} s")
        self._stand_down()
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    def exists(self) -> bool:
        return self._state() is not None

    def remove(self) -> None:
        self._cli("rm", "-f", self.name)

    def release(self) -> None:
        """Leave the container running (a fleet's): a detached spec has no keeper; any other stops being kept."""
        self._stand_down()

    def __enter__(self) -> ContainerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.spec.detach:
            self.stop()

