"""One server's lifecycle: launch in its own process group, readiness, bounded stop, release, cleanup.

Nothing a trial starts may outlive it: the next server sizes its pools from *free* GPU memory, so a
leftover process, a held port or memory still being released would skew (or OOM) the next trial. A pid file
per server lets a later run remove what a SIGKILLed harness left behind, and only that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import psutil

from autotune.errors import ServerError
from autotune.gpu import used_mib, wait_released

LOG_TAIL_LINES = 40
SHM_DIR = Path("/dev/shm")
# What SGLang (and the simulator imitating it) leaves in /dev/shm even on a clean exit: the CPU all-reduce
# buffer, the load-report segment and multiprocessing semaphores. Anything else there is not ours to touch.
SHM_PREFIXES = ("sglang", "deepspeed_allreduce_buffer", "sem.mp-", "autotune")
_PID_IN_NAME = re.compile(r"\d{3,}")


def shm_snapshot(shm_dir: Path) -> set[str]:
    try:
        return {entry.name for entry in os.scandir(shm_dir)}
    except OSError:
        return set()


def _shm_owner_ok(name: str, own_pids: set[int]) -> bool:
    """A name that carries a pid must carry one of ours; a live foreign pid means another server's file."""
    for match in _PID_IN_NAME.findall(name):
        pid = int(match)
        if pid in own_pids:
            return True
        if psutil.pid_exists(pid):
            return False
    return True


def remove_new_shm(shm_dir: Path, before: set[str], own_pids: set[int]) -> list[str]:
    """Remove the SGLang files created in ``shm_dir`` since ``before`` by this server, and nothing else."""
    removed = []
    uid = os.getuid()
    for name in sorted(shm_snapshot(shm_dir) - before):
        path = shm_dir / name
        try:
            if not name.startswith(SHM_PREFIXES) or path.lstat().st_uid != uid or not path.is_file():
                continue
            if not _shm_owner_ok(name, own_pids):
                continue
            path.unlink()
            removed.append(name)
        except OSError:
            continue
    return removed


class ServerExited(ServerError):
    """The server process ended before it became ready."""

    def __init__(self, exit_code: int | None, log_tail: str):
        self.exit_code, self.log_tail = exit_code, log_tail
        super().__init__(f"server exited with code {exit_code} before it was ready")


class ServerStartTimeout(ServerError):
    """The server was still not ready when the startup timeout ran out."""

    def __init__(self, timeout_s: float, log_tail: str):
        self.timeout_s, self.log_tail = timeout_s, log_tail
        super().__init__(f"server not ready after {timeout_s:g} s (raise the startup timeout if it was still loading)")


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg succeeds on zombies too; only count members that still run.
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


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
        time.sleep(0.05)
    return True


def stop_process_group(pid: int, *, grace_s: float) -> int | None:
    """SIGTERM ``pid``, then SIGKILL its whole group after ``grace_s``; the exit code when it is our child."""
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
        gpu_reader=None,
        run_dir: Path | None = None,
        detach: bool = False,
        shm_dir: Path | None = None,
    ):
        if isinstance(argv, str):
            raise TypeError("argv must be a list of arguments, never a shell string")
        self.argv, self.port, self.host = list(argv), port, host
        self.env, self.gpu_index = dict(env or {}), gpu_index
        self.log_path, self.gpu_reader = Path(log_path), gpu_reader
        self.run_dir = Path(run_dir) if run_dir is not None else Path.cwd() / "runs"
        self.detach = detach
        self.shm_dir = Path(shm_dir) if shm_dir is not None else SHM_DIR
        self.base_url = f"http://{host}:{port}"
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.teardown_error: str | None = None  # a release that timed out: reported, never a hang
        self.removed_shm: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._pgid: int | None = None
        self._shm_before: set[str] = set()
        self._baseline_mib: float | None = None
        self._pid_file: Path | None = None
        self._group_pids: set[int] = set()

    # -- start ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._proc is not None:
            raise ServerError("server already started")
        if not port_is_free(self.host, self.port):
            raise ServerError(f"port {self.host}:{self.port} is busy (stop what holds it or pick another port)")
        self._shm_before = shm_snapshot(self.shm_dir)
        self._baseline_mib = used_mib(self.gpu_reader) if self.gpu_reader is not None else None
        env = {**os.environ, **self.env}
        if self.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_index)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True, close_fds=True,
                )
            except OSError as exc:
                raise ServerError(f"cannot launch {self.argv[0]!r}: {exc}") from exc
        self.pid = self._proc.pid
        self._pgid = self.pid  # start_new_session: the server leads its own group
        self._group_pids.add(self.pid)
        self._write_pid_file()

    def _write_pid_file(self) -> None:
        try:
            created = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            created = None
        me = psutil.Process()
        record = {
            "pid": self.pid, "create_time": created, "cmdline": self.argv, "port": self.port, "host": self.host,
            "log_path": str(self.log_path), "detached": self.detach, "harness_pid": me.pid,
            "harness_create_time": me.create_time(), "shm_dir": str(self.shm_dir),
            "shm_before": sorted(self._shm_before),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._pid_file = self.run_dir / f"server-{self.pid}.json"
        tmp = self._pid_file.with_suffix(".tmp")
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

    def wait_ready(self, timeout_s: float, *, stop_event=None) -> None:
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
                        self._note_group()
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if stop_event is not None and stop_event.is_set():
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                if time.monotonic() >= deadline:
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                time.sleep(0.1)

    def _note_group(self) -> None:
        """Remember the group's pids: /dev/shm names that carry one of them are this server's."""
        if self._pgid is None:
            return
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.info["pid"]) == self._pgid:
                    self._group_pids.add(proc.info["pid"])
            except (ProcessLookupError, psutil.Error):
                continue

    # -- stop -------------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """SIGTERM, bounded grace, SIGKILL the group; then wait for the port and the GPU, and clean /dev/shm.

        Close the replay client's streams before calling this: SIGTERM alone drains every in-flight request.
        """
        if self._proc is None:
            return None
        problems: list[str] = []
        if self.alive:
            self._note_group()
            try:
                self._proc.send_signal(signal.SIGTERM)
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        _kill_group(self._pgid, signal.SIGKILL)
        try:
            self._proc.wait(timeout=max(5.0, release_timeout_s))
        except subprocess.TimeoutExpired:
            problems.append(f"process {self.pid} survived SIGKILL")
        self.exit_code = self._proc.returncode
        deadline = time.monotonic() + release_timeout_s
        if not _wait_group_gone(self._pgid, release_timeout_s):
            problems.append(f"process group {self._pgid} still alive after SIGKILL")
        while not port_is_free(self.host, self.port):
            if time.monotonic() >= deadline:
                problems.append(f"port {self.port} still busy after {release_timeout_s:g} s")
                break
            time.sleep(0.05)
        if self.gpu_reader is not None:
            left = max(0.0, deadline - time.monotonic())
            if not wait_released(self.gpu_reader, self._baseline_mib, left):
                problems.append(f"GPU memory not released within {release_timeout_s:g} s")
        self.removed_shm = remove_new_shm(self.shm_dir, self._shm_before, self._group_pids)
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.detach:
            self.stop()


def _record_matches(record: dict) -> bool:
    """The pid still belongs to the process the file recorded (same start time and cmdline)."""
    try:
        proc = psutil.Process(record["pid"])
        same_start = record.get("create_time") is not None and abs(proc.create_time() - record["create_time"]) < 0.05
        return same_start and proc.cmdline() == record.get("cmdline")
    except (psutil.Error, KeyError, TypeError):
        return False


def _harness_alive(record: dict) -> bool:
    try:
        proc = psutil.Process(record["harness_pid"])
        return abs(proc.create_time() - record["harness_create_time"]) < 0.05
    except (psutil.Error, KeyError, TypeError):
        return False


def cleanup_orphans(run_dir: Path, *, grace_s: float = 5.0) -> list[int]:
    """Kill servers whose harness died (pid files in ``run_dir``), verified by start time and cmdline.

    Detached servers (fleets) and servers whose harness still runs are left alone; pid files of servers that
    are gone are removed. Returns the killed pids.
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
        if alive:
            try:
                pgid = os.getpgid(record["pid"])
            except ProcessLookupError:
                pgid = None  # it died just now
            if pgid is not None:
                stop_process_group(record["pid"], grace_s=grace_s)
                _wait_group_gone(pgid, grace_s)
                killed.append(record["pid"])
        remove_new_shm(Path(record.get("shm_dir", SHM_DIR)), set(record.get("shm_before", [])), {record["pid"]})
        pid_file.unlink(missing_ok=True)
    return killed
