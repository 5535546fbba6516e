"""The ``ssh`` launcher: a server on another host over SSH (asyncssh: ``autotune[remote]``), detached there.

The argv is shell-joined only here, at the SSH boundary; host keys are checked and only public keys offered; the
transport is injectable; exit codes, the host's GPU memory and its /dev/shm are read on the host. The whole
contract: docs/contracts.md (``launch/ssh.py``) and docs/engines-and-launchers.md.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

import httpx

from autotune import tls
from autotune.errors import ConfigError, FleetError, ServerError
from autotune.launch.base import (
    LOG_TAIL_LINES,
    Launcher,
    LaunchSpec,
    MemoryReader,
    ReaderFactory,
    ServerExited,
    ServerHandle,
    ServerRecord,
    ServerStartTimeout,
    url_scheme,
)
from autotune.launch.local import DEVICE_ORDER
from autotune.launch.remote_memory import NoReading, RemoteGpuReader
from autotune.launch.remote_shm import RemoteShm
from autotune.launch.shm import SHM_DIR, launch_ports
from autotune.launch.stopping import Release, StopSteps, memory_baseline, stop_and_release

log = logging.getLogger(__name__)

Transport = Callable[[str, str, float], tuple[int, str, str]]
REMOTE_POLL_S = 0.2  # a stop step asked again over SSH: each asking is a round trip to the host
GONE = -1  # poll() of a server that is gone without an exit status (killed by a signal, or its status lost)
ALIVE_TTL_S = 0.5  # `alive` asks the host at most twice a second: the replay reads it from its event loop
_CALL_TIMEOUT_S = 60.0


def split_host(host: str) -> tuple[str | None, str, int | None]:
    """``user@name:port`` → (user, name, port); user and port are optional."""
    user, _, rest = host.rpartition("@")
    name, _, port = rest.partition(":")
    if not name or (port and not port.isdigit()):
        raise FleetError(f"cannot read host {host!r}: write name, user@name or user@name:port")
    return user or None, name, int(port) if port else None


def is_loopback(name: str) -> bool:
    """``localhost`` or a loopback address: the "other host" is this one, and this host's readers read it."""
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _path(remote_dir: str, relative: str) -> str:
    return relative if relative.startswith(("/", "~")) else f"{remote_dir.rstrip('/')}/{relative}"


def start_command(
    argv: Sequence[str], *, env: Mapping[str, str], log: str, pid: str, remote_dir: str, exit_status: str | None = None
) -> str:
    """The shell line that starts one server detached (own session, so its pid is its process group); prints
    the pid. With ``exit_status`` (a file), the server runs under ``sh``, which writes its exit code there."""
    log, pid = _path(remote_dir, log), _path(remote_dir, pid)
    q = shlex.quote
    files = [log, pid] + ([_path(remote_dir, exit_status)] if exit_status else [])
    dirs = " ".join(q(d) for d in sorted({f.rpartition("/")[0] or "." for f in files}))
    command = [q(a) for a in argv]
    clear = ""
    if exit_status:
        status = _path(remote_dir, exit_status)
        command = ["sh", "-c", q('"$@"; echo $? >"$0"'), q(status), *command]
        clear = f"rm -f {q(status)} && "
    launch = " ".join(["env", *(q(f"{k}={v}") for k, v in sorted(env.items())), "setsid", *command])
    return f"mkdir -p {dirs} && {clear}{{ {launch} >{q(log)} 2>&1 </dev/null & echo $! >{q(pid)}; cat {q(pid)}; }}"


def shm_record(pid_file: str) -> str:
    """Beside the pid file: the /dev/shm listing the server's start took (``launch.remote_shm``)."""
    return pid_file.removesuffix(".pid") + ".shm"


async def _run(host: str, command: str, timeout_s: float) -> tuple[int, str, str]:
    try:
        import asyncssh  # optional (autotune[remote]): only servers on other hosts need it
    except ImportError:
        raise ServerError("servers on other hosts need asyncssh: pip install 'autotune[remote]'") from None
    user, name, port = split_host(host)
    options: dict[str, Any] = {"preferred_auth": "publickey"}  # never a password prompt
    if user:
        options["username"] = user
    if port:
        options["port"] = port

    async def session() -> Any:
        async with asyncssh.connect(name, **options) as conn:  # known_hosts: asyncssh's default check
            return await conn.run(command, check=False)

    try:
        result = await asyncio.wait_for(session(), timeout_s)  # bounds the connect as well as the command
    except (OSError, asyncssh.Error) as exc:  # TimeoutError is an OSError
        raise FleetError(f"ssh {host}: {exc.__class__.__name__}: {exc}") from None
    return int(result.exit_status or 0), str(result.stdout or ""), str(result.stderr or "")


def asyncssh_transport(host: str, command: str, timeout_s: float) -> tuple[int, str, str]:
    """The default transport: one SSH session per command (public key only, known_hosts checked)."""
    return asyncio.run(_run(host, command, timeout_s))


def run(host: str, command: str, *, timeout_s: float = _CALL_TIMEOUT_S) -> tuple[int, str, str]:
    return asyncssh_transport(host, command, timeout_s)


def _port_open(name: str, port: int) -> bool:
    try:
        with socket.create_connection((name, port), timeout=1.0):
            return True
    except OSError:
        return False


class SshLauncher:
    """Starts servers on ``host`` (``user@name:port``) over ``transport``; relative log/pid paths live under
    ``remote_dir`` there."""

    name = "ssh"

    def __init__(self, *, host: str, remote_dir: str = "autotune-fleet", transport: Transport | None = None) -> None:
        split_host(host)  # a malformed host is an error now, not at the first command
        self.host, self.remote_dir = host, remote_dir
        self.transport: Transport = transport or asyncssh_transport

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> SshLauncher:
        """``[launcher.ssh]``: ``host`` (required), ``remote_dir``; ``transport`` only from code (tests)."""
        if not settings.get("host"):
            raise ConfigError(
                "the ssh launcher needs a host", key="launcher.ssh.host", fix='give host = "user@name:port"'
            )
        return cls(
            host=str(settings["host"]),
            remote_dir=str(settings.get("remote_dir", "autotune-fleet")),
            transport=settings.get("transport"),
        )

    @property
    def host_name(self) -> str:
        return split_host(self.host)[1]

    def device_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """As the local launcher's: the process on the host selects its GPUs by ``CUDA_VISIBLE_DEVICES``."""
        if not gpus:
            return {}
        return {**DEVICE_ORDER, "CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in gpus)}

    def memory_reader(self, gpus: tuple[int, ...], local: ReaderFactory) -> MemoryReader:
        """This host's reader (``local``) on a loopback host; else ``nvidia-smi`` on the host, one transport call
        per reading for the whole group; a server without GPUs there gets a reader of nothing (all None)."""
        if is_loopback(self.host_name):
            return local(gpus)
        if not gpus:
            return NoReading()
        return RemoteGpuReader(lambda command, timeout_s: self.call(command, timeout_s=timeout_s), gpus, host=self.host)

    def call(self, command: str, *, timeout_s: float = _CALL_TIMEOUT_S) -> tuple[int, str, str]:
        return self.transport(self.host, command, timeout_s)

    def shm(self, spec: LaunchSpec) -> RemoteShm:
        """The host's shared-memory files of ``spec``'s server: in ``spec.shm_dir`` (where the engine has its server
        write them, a path on the host), else the host's /dev/shm; its ports are its own and ``--nccl-port``."""
        directory = str(spec.shm_dir) if spec.shm_dir is not None else str(SHM_DIR)
        return RemoteShm(
            lambda command, timeout_s: self.call(command, timeout_s=timeout_s),
            directory,
            launch_ports(spec.port, spec.argv),
            host=self.host,
        )

    def path(self, relative: str | PurePosixPath) -> str:
        """A path on the host (relative ones under ``remote_dir``)."""
        return _path(self.remote_dir, str(relative))

    @staticmethod
    def pid_file(spec: LaunchSpec) -> str:
        """Where the server's pid goes on the host: ``<run_dir>/<name or port>.pid``, else beside its log."""
        if spec.run_dir is not None:
            return str(PurePosixPath(str(spec.run_dir)) / f"{spec.name or spec.port}.pid")
        return f"{spec.log_path}.pid"

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> SshServer:
        pid_file = self.pid_file(spec)
        status_file = pid_file.removesuffix(".pid") + ".exit"
        baseline = memory_baseline(gpu_reader, spec.gpus)
        if gpu_reader is not None and spec.gpus and baseline is None:
            log.warning("GPU memory not read before the start on %s: the stop will not wait for its release", self.host)
        shm = self.shm(spec)
        shm.snapshot(self.path(shm_record(pid_file)))  # before the start: only what appears after can be its
        command = start_command(
            spec.argv,
            env={**spec.env, **self.device_env(spec.gpus)},
            log=str(spec.log_path),
            pid=pid_file,
            remote_dir=self.remote_dir,
            exit_status=status_file,
        )
        code, out, err = self.call(command)
        if code != 0 or not out.strip().isdigit():
            raise ServerError(f"launch on {self.host} failed: {(err or out).strip()[:200]}")
        return SshServer(
            self,
            spec,
            pid=int(out.strip()),
            pid_file=pid_file,
            status_file=status_file,
            gpu_reader=gpu_reader,
            baseline_mib=baseline,
            shm=shm,
        )

    def attach(self, record: ServerRecord) -> SshServer:
        """The server whose pid file on the host (``record.name``) still names the recorded pid; else not alive.
        Its /dev/shm files are told by the record its start left beside the pid file."""
        spec = record.detached_spec()
        pid_file = str(record.name or self.pid_file(spec))
        server = SshServer(
            self,
            spec,
            pid=int(record.pid or 0),
            pid_file=pid_file,
            status_file=pid_file.removesuffix(".pid") + ".exit",
            launch_id=record.launch_id,
        )
        shm, pid = self._recorded(pid_file)
        if pid is None or pid != record.pid:
            server.exit_code, server._stopped = GONE, True  # gone, or another server's pid file now
        else:
            server._shm = shm
        return server

    def stop_steps(self, pid_file: str, pgid: int, *, shm: RemoteShm | None = None) -> StopSteps:
        """The stop's steps (``stopping.StopSteps``) for the server whose session leads process group ``pgid`` on
        the host, one short line over the transport each. The group is signalled, not its leader alone: the leader
        is the ``sh`` that records the server's exit status, which would not pass a SIGTERM on. Once the group is
        gone its pid file, the start's record and the /dev/shm files ``shm`` proves it owned are removed."""
        q = shlex.quote

        def group_alive() -> bool:
            return self.call(f"kill -0 -{pgid} 2>/dev/null && echo alive; true", timeout_s=30.0)[1].strip() == "alive"

        def signal(name: str) -> Callable[[], None]:
            def send() -> None:
                self.call(f"kill -{name} -{pgid} 2>/dev/null; true", timeout_s=30.0)

            return send

        def clean_files() -> None:
            self.call(f"rm -f {q(self.path(pid_file))} {q(self.path(shm_record(pid_file)))}", timeout_s=30.0)
            if shm is not None:
                shm.release()

        return StopSteps(
            what=f"process group {pgid} on {self.host}",
            running=group_alive,
            terminate=signal("TERM"),
            kill=signal("KILL"),
            gone=lambda: not group_alive(),
            clean_files=clean_files,
            poll_s=REMOTE_POLL_S,
        )

    def stop_pid_file(
        self, pid_file: str, *, grace_s: float, release: Release | None = None, release_timeout_s: float = 30.0
    ) -> list[str] | None:
        """Stop the server whose pid is in ``pid_file`` on the host through the one stop-and-release routine
        (``stopping.stop_and_release`` with ``stop_steps``): SIGTERM its group, SIGKILL after ``grace_s``, remove
        its files, then wait for ``release`` (its port, its memory). The start's record beside the pid file says
        which /dev/shm files it owned, and what its group holds is read just before the signals. None when no
        server was recorded there, else the problems (empty when everything was released in time)."""
        shm, pgid = self._recorded(pid_file)
        if pgid is None:
            return None
        if shm is not None:
            shm.observe(pgid)
        return stop_and_release(
            self.stop_steps(pid_file, pgid, shm=shm),
            release or Release(),
            grace_s=grace_s,
            release_timeout_s=release_timeout_s,
        )

    def _recorded(self, pid_file: str) -> tuple[RemoteShm | None, int | None]:
        """The pid in ``pid_file`` and the /dev/shm record of its start (one call); (None, None) without them."""
        q = shlex.quote
        code, out, _ = self.call(
            f"cat {q(self.path(pid_file))} 2>/dev/null; printf '\\0'; "
            f"cat {q(self.path(shm_record(pid_file)))} 2>/dev/null; true",
            timeout_s=30.0,
        )
        pid, _, record = out.partition("\0")
        if code != 0 or not pid.strip().isdigit():
            return None, None
        return RemoteShm.from_record(lambda c, t: self.call(c, timeout_s=t), record, host=self.host), int(pid)


class SshServer:
    """A server on another host: its state read over the launcher's transport."""

    def __init__(
        self,
        launcher: SshLauncher,
        spec: LaunchSpec,
        *,
        pid: int,
        pid_file: str,
        status_file: str,
        gpu_reader: MemoryReader | None = None,
        baseline_mib: float | None = None,
        shm: RemoteShm | None = None,
        launch_id: str | None = None,
    ) -> None:
        self.launcher, self.spec = launcher, spec
        self.launch_id = launch_id or secrets.token_hex(6)
        self.pid: int | None = pid  # its pid on the host (the ``sh`` that leads its session there)
        self.host_pid = pid
        self.pid_file, self.status_file = pid_file, status_file
        self.port = spec.port
        name = launcher.host_name
        self.base_url = f"{url_scheme(spec.argv)}://{f'[{name}]' if ':' in name else name}:{spec.port}"
        self.exit_code: int | None = None
        self.teardown_error: str | None = None
        self.removed_shm: list[str] = []
        self.unattributed_shm: list[str] = []  # new SGLang-like files on the host not proven this server's: left
        self._reader, self._baseline, self._shm = gpu_reader, baseline_mib, shm
        self._checked_at: float | None = None
        self._stopped = False

    def record(self) -> ServerRecord:
        return ServerRecord.of("ssh", self.spec, self.launch_id, pid=self.host_pid, name=self.pid_file)

    def _check(self) -> None:
        """One round trip: running, or its exit code (``GONE`` without a status file)."""
        status = shlex.quote(self.launcher.path(self.status_file))
        code, out, _ = self.launcher.call(
            f"if kill -0 {self.host_pid} 2>/dev/null; then echo running; "
            f"else cat {status} 2>/dev/null || echo gone; fi",
            timeout_s=30.0,
        )
        self._checked_at = time.monotonic()
        word = out.strip()
        if code != 0 or word == "running":
            return
        self.exit_code = int(word) if word.lstrip("-").isdigit() else GONE

    @property
    def alive(self) -> bool:
        """Running (``kill -0`` on the host), asked at most once per ``ALIVE_TTL_S``."""
        if self.exit_code is None and (self._checked_at is None or time.monotonic() - self._checked_at >= ALIVE_TTL_S):
            self._check()
        return self.exit_code is None

    def poll(self) -> int | None:
        """The exit code once the server has ended (``GONE``, -1, when the host cannot tell it), else None."""
        if self.exit_code is None:
            self._check()
        return self.exit_code

    def log_text(self) -> str:
        _, out, _ = self.launcher.call(
            f"cat {shlex.quote(self.launcher.path(str(self.spec.log_path)))} 2>/dev/null", timeout_s=30.0
        )
        return out

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=3.0, trust_env=False, **tls.secured()) as client:
            while True:
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self.poll() is not None:
                    raise ServerExited(self.exit_code, self.log_tail())
                if time.monotonic() >= deadline:
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                if stop_event is not None and stop_event.wait(0.1):
                    raise ServerError("startup interrupted")
                time.sleep(0.1 if stop_event is None else 0)

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """The one stop-and-release routine (``stopping.stop_and_release``) with the host's steps
        (``SshLauncher.stop_steps``): SIGTERM the group, SIGKILL after the grace, the host's /dev/shm files the
        server provably owned removed (what its group holds read before the signals), then wait until the port no
        longer answers and, with a GPU reader, the memory is back. A second stop is harmless."""
        if self._stopped:
            return self.exit_code
        self._stopped = True
        self.poll()
        shm = self._shm
        if shm is not None and self.exit_code is None:
            shm.observe(self.host_pid)  # the session's pid is its group's id
        host, port = self.launcher.host_name, self.port
        release = Release(
            port=port, port_free=lambda: not _port_open(host, port), reader=self._reader, baseline_mib=self._baseline
        )
        problems = stop_and_release(
            self.launcher.stop_steps(self.pid_file, self.host_pid, shm=shm),
            release,
            grace_s=grace_s,
            release_timeout_s=release_timeout_s,
        )
        if shm is not None:
            self.removed_shm, self.unattributed_shm = shm.removed, shm.left
        self.teardown_error = "; ".join(problems) or None
        if self.exit_code is None:
            self._check()  # the group is gone: its leader's status, or GONE
        return self.exit_code

    def release(self) -> None:
        """Forget the server without stopping it (a fleet's serves on)."""
        self._stopped = True


def _conforms(server: SshServer, launcher: SshLauncher) -> tuple[ServerHandle, Launcher]:
    """Never called: mypy holds ``SshServer`` to ``ServerHandle`` and ``SshLauncher`` to ``Launcher``."""
    return server, launcher
