"""A trial server never outlives its harness: a tiny watchdog process per non-detached server.

It holds the read end of a pipe only the harness writes; EOF without a "stand down" means the harness is gone
(SIGKILL included): stop the server, remove the /dev/shm files its pid file proves its own, then the pid file.
Why not ``PR_SET_PDEATHSIG``, the protocol and the limits: docs/contracts.md (``launch/watchdog.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TypedDict

from autotune.launch.procgroup import PROC, group_pids
from autotune.launch.shm import ShmOwnership, release_semaphores
from autotune.launch.stopping import Release, StopSteps, stop_and_release

KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the group's members to go
POLL_S = 0.02


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22): pid reuse shows."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rfind(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Target(TypedDict):
    """The harness's message naming the server to stop should it die: its pid, start time (clock ticks, proof
    against pid reuse) and pid-file record to clean up after."""

    pid: int
    start: int | None
    record: str


class StandDown(TypedDict):
    """The harness's message that it stopped the server itself: the watchdog exits touching nothing."""

    stop: bool


class Watchdog:
    """The harness's side: the write end of the pipe and the watchdog process it feeds."""

    def __init__(self, *, grace_s: float) -> None:
        read_fd, self._write_fd = os.pipe()  # both non-inheritable (PEP 446): no other child gets the write end
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "autotune.launch.watchdog", str(read_fd), repr(float(grace_s))],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(self._write_fd)
            raise
        finally:
            os.close(read_fd)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def watch(self, pid: int, record: Path) -> None:
        """From now on, the harness's death stops ``pid``'s group and cleans up after it by ``record``."""
        self._send(Target(pid=pid, start=start_ticks(pid), record=str(record)))

    def stand_down(self, timeout_s: float = 5.0) -> None:
        """The harness handled the server itself: the watchdog exits without touching anything."""
        if self._proc is None:
            return
        try:
            self._send(StandDown(stop=True))
        except OSError:
            pass  # the watchdog is already gone
        os.close(self._write_fd)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _send(self, message: Target | StandDown) -> None:
        os.write(self._write_fd, (json.dumps(message) + "\n").encode())


# -- the watchdog process ---------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie waiting for init to reap it)."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def _kill_group(pid: int) -> None:
    if group_pids(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def stop_server(pid: int, start: int | None, grace_s: float) -> bool:
    """SIGTERM the launcher, SIGKILL its group after ``grace_s`` (``stopping.stop_and_release``, with no port or
    memory to wait for: the next trial's start checks those); False when ``pid`` is no longer our server.

    The group id is the launcher's pid (its own session). While any member lives the kernel does not hand that
    pid to a new process, so members of group ``pid`` are ours unless the leader runs with another start time.
    """
    leader = start_ticks(pid)
    if leader is not None and start is not None and leader != start:
        return False  # the pid was reused: the group of that id is someone else's
    steps = StopSteps(
        what=f"process group {pid}",
        running=lambda: leader is not None and not _gone(pid),
        terminate=lambda: _terminate(pid),
        kill=lambda: _kill_group(pid),
        gone=lambda: not group_pids(pid),
        poll_s=POLL_S,
    )
    stop_and_release(steps, Release(), grace_s=grace_s, release_timeout_s=KILL_WAIT_S)
    return True


def clean_after(record_path: Path, note: str) -> None:
    """Remove the /dev/shm files the pid file proves the server's, note what happened in its log, drop the file."""
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return
    removed: list[str] = []
    try:
        shm = ShmOwnership.from_record(record)
        shm.observe(())  # the port rule still applies to what appeared since the last sample
        removed, _left = shm.remove()
        removed += release_semaphores(shm.directory, shm.before | set(removed))
    except (TypeError, ValueError, AttributeError, OSError):
        pass  # a damaged record proves nothing: its files stay
    log_path = record.get("log_path")
    if log_path:
        try:
            with open(log_path, "a") as fh:
                fh.write(f"[autotune watchdog] {note}; removed {len(removed)} /dev/shm file(s)\n")
        except OSError:
            pass
    record_path.unlink(missing_ok=True)


def run(read_fd: int, grace_s: float) -> int:
    """Read the harness's messages until EOF; act only when EOF comes without a stand-down."""
    target: Target | None = None
    buf = b""
    while True:
        try:
            chunk = os.read(read_fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            message = json.loads(line)
            if message.get("stop"):
                return 0
            target = message
    if target is None:
        return 0  # the harness died before it launched anything
    t0 = time.monotonic()
    pid = int(target["pid"])
    if stop_server(pid, target.get("start"), grace_s) and target.get("record"):
        clean_after(Path(target["record"]), f"harness gone; stopped server {pid} in {time.monotonic() - t0:.1f} s")
    return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's EOF ends the watch
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return run(int(argv[0]), float(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
