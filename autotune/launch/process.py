"""One server's lifecycle: launch in its own process group, readiness, bounded stop, release, cleanup.

Nothing a trial starts may outlive it: the next server sizes its pools from *free* GPU memory, so a
leftover process, a held port or memory still being released would skew (or OOM) the next trial. A watchdog
process per non-detached server (``autotune.launch.watchdog``) stops it within seconds of the harness's death,
SIGKILL included; a pid file per server lets a later run remove what even that missed, and only that. /dev/shm files go
only
when proven this server's (``autotune.launch.shm``): other servers on the host have files of the same shapes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

import psutil

from autotune.errors import ServerError
from autotune.launch.base import (
    LogFile,
    MemoryReader,
    ServerExited,
    ServerRecord,
    ServerStartTimeout,
    url_scheme,
)
from autotune.launch.health import wait_healthy
from autotune.launch.memory import used_mib
from autotune.launch.ports import free_port, listens, port_is_free
from autotune.launch.procgroup import group_pids
from autotune.launch.shm import SHM_DIR, ShmOwnership, ShmSampler, launch_ports, release_semaphores, snapshot
from autotune.launch.stopping import Release, StopSteps, stop_and_release
from autotune.launch.watchdog import Watchdog

GONE = -1  # the exit code of a detached server found again by its record: not our child, its code unknown
WATCHDOG_GRACE_S = 5.0  # harness gone: SIGTERM to the launcher, SIGKILL of the group this much later
log = logging.getLogger(__name__)
__all__ = [
    "ServerExited",
    "ServerProcess",
    "ServerStartTimeout",
    "cleanup_orphans",
    "free_port",
    "port_is_free",
    "stop_process_group",
]


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


def _still_runs(proc: psutil.Process) -> bool:
    """The very process (``is_running`` compares its start time: a reused pid is not it) runs, not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _terminate(proc: psutil.Process) -> None:
    try:
        proc.terminate()
    except psutil.Error:
        pass


def group_steps(proc: psutil.Process, pgid: int) -> StopSteps:
    """The stop of a process group led by ``proc`` that is not our child (a fleet's server, an orphan): SIGTERM
    the leader only, SIGKILL the whole group."""
    return StopSteps(
        what=f"process group {pgid}",
        running=lambda: _still_runs(proc),
        terminate=lambda: _terminate(proc),
        kill=lambda: _kill_group(pgid, signal.SIGKILL),
        gone=lambda: not _still_runs(proc) and not _group_alive(pgid),
    )


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
    stop_and_release(group_steps(proc, pgid), Release(), grace_s=grace_s, release_timeout_s=max(grace_s, 5.0))
    try:
        return proc.wait(timeout=0)  # a child's code (it is a zombie until reaped); None for anyone else's
    except psutil.Error:
        return None


def proven_process(record: ServerRecord) -> psutil.Process | None:
    """The process ``record`` names, if it is still that one: the same start time (a record from a pid file alone
    has none: then its command line must carry the record's port), not a zombie; else None."""
    if record.pid is None:
        return None
    try:
        proc = psutil.Process(record.pid)
        if record.create_time is not None:
            same = abs(proc.create_time() - record.create_time) < 0.05
        else:
            same = str(record.port) in proc.cmdline()
    except psutil.Error:
        return None
    return proc if same and _still_runs(proc) else None


class PidFile(TypedDict):
    """A local server's ``server-<pid>.json``: what ``cleanup_orphans`` needs to prove the server and its harness
    (pid and start time each) and which /dev/shm files are its (``ShmOwnership.from_record``)."""

    pid: int | None
    create_time: float | None
    cmdline: list[str]
    port: int
    host: str
    log_path: str
    detached: bool
    harness_pid: int
    harness_create_time: float
    shm_dir: str
    launch_id: str
    shm_before: list[str]
    shm_ports: list[int]
    shm_owned: dict[str, int]


class ServerProcess(LogFile):
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
        gpus: tuple[int, ...] = (),
        launch_id: str | None = None,
    ) -> None:
        if isinstance(argv, str):
            raise TypeError("argv must be a list of arguments, never a shell string")
        self.argv, self.port, self.host = list(argv), port, host
        self.env, self.gpu_index = dict(env or {}), gpu_index
        self.log_path, self.gpu_reader = Path(log_path), gpu_reader
        self.run_dir = Path(run_dir) if run_dir is not None else Path.cwd() / "runs"
        self.detach, self.watchdog_grace_s = detach, watchdog_grace_s
        self.shm_dir = Path(shm_dir) if shm_dir is not None else SHM_DIR
        self.base_url = f"{url_scheme(self.argv)}://{host}:{port}"
        self.gpus, self.launch_id = tuple(gpus), launch_id or secrets.token_hex(6)
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
        self._attached: psutil.Process | None = None  # a server another process started, proven by its record

    @classmethod
    def attached(cls, record: ServerRecord) -> ServerProcess:
        """The detached server ``record`` describes (started by an earlier command); not alive when its pid now
        runs something else. Its /dev/shm ownership comes from the pid-file record its start left in ``run_dir``."""
        server = cls(
            [],
            port=record.port,
            host=record.host,
            log_path=Path(record.log_path),
            detach=True,
            run_dir=Path(record.run_dir) if record.run_dir else None,
            gpus=record.gpus,
            launch_id=record.launch_id,
        )
        server.pid, server._pgid, server._create_time = record.pid, record.pid, record.create_time
        server._attached = proven_process(record)
        server._pid_file = server.run_dir / f"server-{record.pid}.json"
        try:
            data = json.loads(server._pid_file.read_text())  # a dead server's own (same start): its files go
            same_start = record.create_time is not None and data.get("create_time") == record.create_time
            server._shm = ShmOwnership.from_record(data) if server._attached is not None or same_start else None
        except (OSError, ValueError, TypeError, AttributeError):
            server._shm = None  # no record, or a damaged one: it proves nothing, and nothing is removed
        if server._shm is None and server._attached is None:
            server._pid_file = None  # gone, or not ours: nothing to stop, nothing proven
        return server

    def record(self) -> ServerRecord:
        return ServerRecord(
            launcher="local",
            launch_id=self.launch_id,
            host=self.host,
            port=self.port,
            log_path=str(self.log_path),
            gpus=self.gpus,
            pid=self.pid,
            create_time=self._create_time,
            run_dir=str(self.run_dir),
        )

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
                    self.argv,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
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
        record = PidFile(
            pid=self.pid,
            create_time=self._create_time,
            cmdline=self.argv,
            port=self.port,
            host=self.host,
            log_path=str(self.log_path),
            detached=self.detach,
            harness_pid=me.pid,
            harness_create_time=me.create_time(),
            shm_dir=str(self.shm_dir),
            launch_id=self.launch_id,
            shm_before=sorted(shm.before),
            shm_ports=sorted(shm.ports),
            shm_owned=shm.owned,
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._pid_file = self.run_dir / f"server-{self.pid}.json"
        tmp = self._pid_file.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self._pid_file)

    @property
    def alive(self) -> bool:
        if self._attached is not None:
            return _still_runs(self._attached)
        return self._proc is not None and self._proc.poll() is None

    def poll(self) -> int | None:
        if self._proc is not None and self.exit_code is None:
            self.exit_code = self._proc.poll()
        elif self._proc is None and self.pid is not None and self.exit_code is None and not self.alive:
            self.exit_code = GONE  # not our child: its code is its parent's to read
        return self.exit_code

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        """Return once ``/health`` answers 200; a process that exits ends the wait at once."""
        if self._proc is None and self._attached is None:
            raise ServerError("server not started")
        wait_healthy(
            lambda: self.base_url,
            timeout_s,
            ended=self.poll,
            tail=self.log_tail,
            stop_event=stop_event,
            owns_port=lambda: listens(group_pids(self._pgid), self.port),
        )

    # -- stop -------------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """SIGTERM the launcher, SIGKILL the group after ``grace_s``; free port, clean /dev/shm, device released
        (``stopping.stop_and_release``). A server found again by its record is stopped the same way.

        Close the replay client's streams before calling this: SIGTERM alone drains every in-flight request.
        """
        steps = self._stop_steps()
        if steps is None:
            if self._proc is None and self._attached is None and self._shm is not None and self._pid_file:
                self._clean_files()  # a detached server that died: the files its pid file proved its own go
                self._pid_file.unlink(missing_ok=True)
            return self.exit_code
        if self._sampler is not None:
            self._sampler.stop()  # the last look at what the group holds, before it dies
            self._sampler = None
        elif self._shm is not None and self._pgid is not None:
            self._shm.observe(group_pids(self._pgid))  # a detached server's last look, from its record on
        release = Release(
            port=self.port,
            port_free=lambda: port_is_free(self.host, self.port),
            reader=self.gpu_reader,
            baseline_mib=self._baseline_mib,
        )
        problems = stop_and_release(steps, release, grace_s=grace_s, release_timeout_s=release_timeout_s)
        self.poll()
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        self._stand_down()
        self._attached = None
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    def _stop_steps(self) -> StopSteps | None:
        """Our child's stop (its exit code read by ``Popen``), or a proven detached server's; None: nothing to stop."""
        pgid, proc = self._pgid, self._proc
        if pgid is None:
            return None
        if self._attached is not None:
            return dataclasses.replace(group_steps(self._attached, pgid), clean_files=self._clean_files)
        if proc is None or self._shm is None:
            return None

        def terminate() -> None:
            try:
                proc.send_signal(signal.SIGTERM)  # the launcher only (see stop_process_group)
            except ProcessLookupError:
                pass

        return StopSteps(
            what=f"process group {pgid}",
            running=lambda: proc.poll() is None,
            terminate=terminate,
            kill=lambda: _kill_group(pgid, signal.SIGKILL),
            gone=lambda: proc.poll() is not None and not _group_alive(pgid),
            clean_files=self._clean_files,
        )

    def _clean_files(self) -> None:
        """The group is gone: remove the /dev/shm files it provably owned (the port rule applied once more)."""
        shm = self._shm
        if shm is None:
            return
        shm.observe(())
        self.removed_shm, self.unattributed_shm = shm.remove()
        if self._proc is not None:  # a trial's: since its start, only seconds to minutes passed (see shm)
            self._release_semaphores(shm)
        if self.unattributed_shm:
            log.warning(
                "left %d new file(s) in %s not proven this server's: %s",
                len(self.unattributed_shm),
                self.shm_dir,
                ", ".join(self.unattributed_shm),
            )

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


def _record_matches(record: PidFile) -> bool:
    """The pid still belongs to the process the file recorded (same start time and cmdline)."""
    try:
        proc = psutil.Process(record["pid"])
        created = record.get("create_time")
        same_start = created is not None and abs(proc.create_time() - created) < 0.05
        return same_start and proc.cmdline() == record.get("cmdline")
    except (psutil.Error, KeyError, TypeError):
        return False


def _harness_alive(record: PidFile) -> bool:
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
                killed.append(record["pid"])
        if shm is not None:
            shm.observe(())  # the port rule still applies to what appeared since
            removed, left = shm.remove()
            if left and "shm_before" in record:
                log.warning(
                    "left %d new file(s) in %s not proven server %s's: %s",
                    len(left),
                    shm.directory,
                    record.get("pid"),
                    ", ".join(left),
                )
        pid_file.unlink(missing_ok=True)
    return killed
