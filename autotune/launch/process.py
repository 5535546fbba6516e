"""One server's lifecycle: launch in its own process group, readiness, bounded stop, release, cleanup.

Nothing a trial starts may outlive it: the next server sizes its pools from *free* GPU memory, so a
leftover process, a held port or memory still being released would skew (or OOM) the next trial. A watchdog
process per non-detached server (``autotune.launch.watchdog``) stops it within seconds of the harness's death,
SIGKILL included; a pid file per server lets a later run remove what even that missed, and only that. /dev/shm files go only
when proven this server's (``autotune.launch.shm``): other servers on the host have files of the same shapes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil

from autotune.errors import ServerError
from autotune.launch.base import (
    LOG_TAIL_LINES,
    MemoryReader,
    ServerExited,
    ServerStartTimeout,
    free_port,
    log_tail,
    port_is_free,
)
from autotune.launch.memory import used_mib, wait_released
from autotune.launch.procgroup import group_pids
from autotune.launch.shm import SHM_DIR, ShmOwnership, ShmSampler, launch_ports, release_semaphores, snapshot
from autotune.launch.watchdog import Watchdog

WATCHDOG_GRACE_S = 5.0  # harness gone: SIGTERM to the launcher, SIGKILL of the group this much later
log = logging.getLogger(__name__)
__all__ = ["ServerExited", "ServerProcess", "ServerStartTimeout", "cleanup_orphans", "free_port", "port_is_free",
           "stop_process_group"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_pids(pgid))  # killpg succeeds on zombies too; only count members that still run


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def stop_process_group(pid: int, *, grace_s: float) -> int | None:
    """SIGTERM ``pid`` alone, then SIGKILL its whole group after ``grace_s``; the exit code when it is our child.

    Only the launcher gets SIGTERM: SGLang's children answer a SIGTERM of their own with a 5 s crash-diagnostics
    sleep, and the launcher stops them itself.
    """
    try:
        proc = psutil.Process(pid)
        pgid = os.getpgid(pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    code = None
    try:
        proc.terminate()
        code = proc.wait(timeout=grace_s)
    except psutil.TimeoutExpired:
        pass
    except psutil.NoSuchProcess:
        pass
    _kill_group(pgid, signal.SIGKILL)
    _wait_group_gone(pgid, max(grace_s, 5.0))
    return code


class ServerProcess:
    """A server launched from an argv list; a context manager, and nothing outlives it (unless ``detach``)."""

    def __init__(
        self,
        argv: list[str],
        *,
        port: int,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        gpu_index: int | None = None,
        log_path: Path,
        gpu_reader: MemoryReader | None = None,
        run_dir: Path | None = None,
        detach: bool = False,
        shm_dir: Path | None = None,
        watchdog_grace_s: float = WATCHDOG_GRACE_S,
    ) -> None:
        if isinstance(argv, str):
            raise TypeError("argv must be a list of arguments, never a shell string")
        self.argv, self.port, self.host = list(argv), port, host
        self.env, self.gpu_index = dict(env or {}), gpu_index
        self.log_path, self.gpu_reader = Path(log_path), gpu_reader
        self.run_dir = Path(run_dir) if run_dir is not None else Path.cwd() / "runs"
        self.detach, self.watchdog_grace_s = detach, watchdog_grace_s
        self.shm_dir = Path(shm_dir) if shm_dir is not None else SHM_DIR
        self.base_url = f"http://{host}:{port}"
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.teardown_error: str | None = None  # a release that timed out: reported, never a hang
        self.removed_shm: list[str] = []
        self.unattributed_shm: list[str] = []  # new SGLang-like files not proven this server's: left in place
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._shm: ShmOwnership | None = None
        self._sampler: ShmSampler | None = None
        self._baseline_mib: float | None = None
        self._pid_file: Path | None = None
        self._create_time: float | None = None
        self._watchdog: Watchdog | None = None

    # -- start ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._proc is not None:
            raise ServerError("server already started")
        if not port_is_free(self.host, self.port):
            raise ServerError(f"port {self.host}:{self.port} is busy (stop what holds it or pick another port)")
        self._shm = ShmOwnership(self.shm_dir, snapshot(self.shm_dir), launch_ports(self.port, self.argv))
        track = getattr(self.gpu_reader, "track", None)  # a reader of this server's own processes (CPU backend)
        if self.gpu_reader is not None and track is None:
            self._baseline_mib = used_mib(self.gpu_reader)
        env = {**os.environ, **self.env}  # the engine's env says which GPU, if any (a CPU server gets none)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            # the watchdog first: between the server's launch and the message naming it, only microseconds pass
            watchdog = None if self.detach else Watchdog(grace_s=self.watchdog_grace_s)
            try:
                self._proc = subprocess.Popen(
                    self.argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True, close_fds=True,
                )
            except BaseException as exc:
                if watchdog is not None:
                    watchdog.stand_down()
                if isinstance(exc, OSError):
                    raise ServerError(f"cannot launch {self.argv[0]!r}: {exc}") from exc
                raise
        self.pid = self._proc.pid
        self._pid_file = self.run_dir / f"server-{self.pid}.json"
        if watchdog is not None:
            watchdog.watch(self.pid, self._pid_file)
            self._watchdog = watchdog
        self._pgid = self.pid  # start_new_session: the server leads its own group
        try:
            self._create_time = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            self._create_time = None
        if track is not None:
            pgid, shm = self._pgid, self._shm
            track(lambda: group_pids(pgid), shm.size_bytes)
            self._baseline_mib = 0.0  # the tree held nothing before it existed
        self._write_pid_file()
        self._sampler = ShmSampler(self._shm, self._pgid, self._write_pid_file)
        self._sampler.start()

    def _write_pid_file(self) -> None:
        """The record a later ``cleanup_orphans`` needs; rewritten as /dev/shm files are attributed."""
        me = psutil.Process()
        shm = self._shm
        assert shm is not None  # set by start() before any record is written
        record = {
            "pid": self.pid, "create_time": self._create_time, "cmdline": self.argv, "port": self.port,
            "host": self.host, "log_path": str(self.log_path), "detached": self.detach, "harness_pid": me.pid,
            "harness_create_time": me.create_time(), "shm_dir": str(self.shm_dir),
            "shm_before": sorted(shm.before), "shm_ports": sorted(shm.ports), "shm_owned": shm.owned,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._pid_file = self.run_dir / f"server-{self.pid}.json"
        tmp = self._pid_file.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self._pid_file)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def poll(self) -> int | None:
        if self._proc is not None and self.exit_code is None:
            self.exit_code = self._proc.poll()
        return self.exit_code

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        """Return once ``/health`` answers 200; a process that exits ends the wait at once."""
        if self._proc is None:
            raise ServerError("server not started")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if self.poll() is not None:
                    raise ServerExited(self.exit_code, self.log_tail())
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if stop_event is not None and stop_event.is_set():
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                if time.monotonic() >= deadline:
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                time.sleep(0.1)

    # -- stop -------------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """SIGTERM the launcher, SIGKILL the group after ``grace_s``; free port, clean /dev/shm, device released.

        Close the replay client's streams before calling this: SIGTERM alone drains every in-flight request.
        """
        if self._proc is None or self._pgid is None or self._shm is None:
            return None
        pgid, shm = self._pgid, self._shm
        problems: list[str] = []
        if self._sampler is not None:
            self._sampler.stop()  # the last look at what the group holds, before it dies
            self._sampler = None
        if self.alive:
            try:
                self._proc.send_signal(signal.SIGTERM)  # the launcher only (see stop_process_group)
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        _kill_group(pgid, signal.SIGKILL)
        try:
            self._proc.wait(timeout=max(5.0, release_timeout_s))
        except subprocess.TimeoutExpired:
            problems.append(f"process {self.pid} survived SIGKILL")
        self.exit_code = self._proc.returncode
        deadline = time.monotonic() + release_timeout_s
        if not _wait_group_gone(pgid, release_timeout_s):
            problems.append(f"process group {pgid} still alive after SIGKILL")
        while not port_is_free(self.host, self.port):
            if time.monotonic() >= deadline:
                problems.append(f"port {self.port} still busy after {release_timeout_s:g} s")
                break
            time.sleep(0.02)
        self.removed_shm, self.unattributed_shm = shm.remove()
        self._release_semaphores(shm)
        if self.unattributed_shm:
            log.warning("left %d new file(s) in %s not proven this server's: %s", len(self.unattributed_shm),
                        self.shm_dir, ", ".join(self.unattributed_shm))
        if self.gpu_reader is not None:
            left = max(0.0, deadline - time.monotonic())
            if not wait_released(self.gpu_reader, self._baseline_mib, left):
                problems.append(f"GPU memory not released within {release_timeout_s:g} s")
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        self._stand_down()
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    def _release_semaphores(self, shm: ShmOwnership) -> None:
        """The group is gone: semaphores new since the start that nobody on the host holds were its (see shm)."""
        if not self.unattributed_shm:
            return
        freed = release_semaphores(self.shm_dir, shm.before | set(self.removed_shm))
        self.removed_shm = sorted([*self.removed_shm, *freed])
        self.unattributed_shm = [n for n in self.unattributed_shm if n not in freed]

    def _stand_down(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stand_down()
            self._watchdog = None

    def release(self) -> None:
        """Leave a detached server running and stop watching it: the sampler thread ends with one last look, and
        the pid file keeps what it proved for ``cleanup_orphans``."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        self._stand_down()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.detach:
            self.release()
        else:
            self.stop()


def _record_matches(record: dict[str, Any]) -> bool:
    """The pid still belongs to the process the file recorded (same start time and cmdline)."""
    try:
        proc = psutil.Process(record["pid"])
        same_start = record.get("create_time") is not None and abs(proc.create_time() - record["create_time"]) < 0.05
        return same_start and proc.cmdline() == record.get("cmdline")
    except (psutil.Error, KeyError, TypeError):
        return False


def _harness_alive(record: dict[str, Any]) -> bool:
    try:
        proc = psutil.Process(record["harness_pid"])
        return bool(abs(proc.create_time() - record["harness_create_time"]) < 0.05)
    except (psutil.Error, KeyError, TypeError):
        return False


def cleanup_orphans(run_dir: Path, *, grace_s: float = 5.0) -> list[int]:
    """Kill servers whose harness died (pid files in ``run_dir``), verified by start time and cmdline.

    Detached servers (fleets) and servers whose harness still runs are left alone; pid files of servers that
    are gone are removed, with the /dev/shm files their record (or a last look at the live orphan) proves theirs.
    The semaphore rule (``release_semaphores``) is not applied here: since the orphan started, any neighbour may
    have come and gone; the watchdog applies it within seconds of the harness's death.
    Returns the killed pids.
    """
    killed: list[int] = []
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return killed
    for pid_file in sorted(run_dir.glob("server-*.json")):
        try:
            record = json.loads(pid_file.read_text())
        except (OSError, ValueError):
            continue
        alive = _record_matches(record)
        if alive and (record.get("detached") or _harness_alive(record)):
            continue  # a fleet server, or one whose harness still runs: not an orphan
        try:
            shm = ShmOwnership.from_record(record)
        except (TypeError, ValueError, AttributeError):
            shm = None  # a damaged record proves nothing: its files stay
        if alive:
            try:
                pgid = os.getpgid(record["pid"])
            except ProcessLookupError:
                pgid = None  # it died just now
            if pgid is not None:
                if shm is not None:
                    shm.observe(group_pids(pgid))
                stop_process_group(record["pid"], grace_s=grace_s)
                _wait_group_gone(pgid, grace_s)
                killed.append(record["pid"])
        if shm is not None:
            shm.observe(())  # the port rule still applies to what appeared since
            removed, left = shm.remove()
            if left and "shm_before" in record:
                log.warning("left %d new file(s) in %s not proven server %s's: %s", len(left), shm.directory,
                            record.get("pid"), ", ".join(left))
        pid_file.unlink(missing_ok=True)
    return killed
