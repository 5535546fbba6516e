"""The one stop-and-release routine every launcher runs: terminate the main process, kill what is left, wait for the
port, remove the server's ``/dev/shm`` files, wait for the device memory; each wait bounded, what did not happen
in time a problem, never a hang. Each launcher gives its ``StopSteps``. docs/contracts.md (``launch/stopping.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from autotune.errors import AutotuneError
from autotune.launch.base import MemoryReader
from autotune.launch.memory import used_mib, wait_released

POLL_S = 0.02
READ_RETRY_S = 0.5  # a memory reading that failed (a remote host unreachable a moment) is tried again this later


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class StopSteps:
    """How one launcher does each step of the stop, for one server."""

    what: str  # "process group 4242", "Slurm job 17", "container autotune-x": named in a problem
    running: Callable[[], bool]  # the server's main process still runs
    terminate: Callable[[], None]  # the polite signal, to the main process only
    kill: Callable[[], None]  # everything of it that is left, at once
    gone: Callable[[], bool]  # nothing of it is left (reaps what needs reaping)
    clean_files: Callable[[], None] = _nothing  # remove the files it provably owned (after it is gone)
    poll_s: float = POLL_S  # how often a step is asked again (a Slurm query costs an RPC)


@dataclass(frozen=True)
class Release:
    """What the stop waits for once the server is gone: its port, and its device memory (``baseline_mib`` is the
    memory in use before the start; None: no wait, e.g. a server without GPUs)."""

    port: int | None = None
    port_free: Callable[[], bool] | None = None
    reader: MemoryReader | None = None
    baseline_mib: float | None = None


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False); asked at least once."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def memory_baseline(reader: MemoryReader | None, gpus: tuple[int, ...] = (0,)) -> float | None:
    """The memory in use before a start, for the stop's release wait; None (no wait) without a reader, without
    GPUs (host memory is shared: "back to where it was" never comes on a busy host), or when it cannot be read."""
    if reader is None or not gpus:
        return None
    try:
        return used_mib(reader)
    except AutotuneError:
        return None


def wait_memory(reader: MemoryReader, baseline_mib: float | None, deadline: float, timeout_s: float) -> str | None:
    """Wait until the memory is back at ``baseline_mib`` by ``deadline`` (``timeout_s`` after the stop began); a
    reading that fails is tried again until then. None when released, else the problem."""
    failure: AutotuneError | None = None
    while True:
        try:
            if wait_released(reader, baseline_mib, max(0.0, deadline - time.monotonic())):
                return None
            failure = None
        except AutotuneError as exc:
            failure = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(READ_RETRY_S)
    if failure is not None:
        return f"GPU memory not checked in the {timeout_s:g} s after the stop: {failure}"
    return f"GPU memory not released within {timeout_s:g} s"


def stop_and_release(steps: StopSteps, release: Release, *, grace_s: float, release_timeout_s: float) -> list[str]:
    """Run the stop (see the module's docstring); the problems, empty when everything was released in time."""
    problems: list[str] = []
    if steps.running():
        steps.terminate()
        wait_until(lambda: not steps.running(), grace_s, steps.poll_s)
    steps.kill()
    deadline = time.monotonic() + release_timeout_s  # the port and the memory: within the release timeout
    kill_wait_s = max(release_timeout_s, 5.0)  # what is left after a kill: however short that timeout
    if not wait_until(steps.gone, kill_wait_s, steps.poll_s):
        steps.kill()  # once more: a job the controller had not yet started cancelling
        problems.append(f"{steps.what} still there {kill_wait_s:g} s after the kill")
    if release.port_free is not None and not wait_until(release.port_free, max(0.0, deadline - time.monotonic())):
        problems.append(f"port {release.port} still busy after {release_timeout_s:g} s")
    steps.clean_files()
    if release.reader is not None and release.baseline_mib is not None:
        problem = wait_memory(release.reader, release.baseline_mib, deadline, release_timeout_s)
        if problem is not None:
            problems.append(problem)
    return problems
