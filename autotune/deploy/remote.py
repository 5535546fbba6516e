"""Fleet servers on other hosts, over SSH (asyncssh, optional: ``pip install 'autotune[remote]'``).

The launch is the same argv as a local one; it is shell-joined (``shlex``) only here, at the SSH boundary.
Host keys are checked against ``~/.ssh/known_hosts`` and only public-key authentication (a key file or the
agent) is offered: a fleet file never holds a password. Health is polled over HTTP, as for local servers.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.errors import FleetError


def split_host(host: str) -> tuple[str | None, str, int | None]:
    """``user@name:port`` → (user, name, port); user and port are optional."""
    user, _, rest = host.rpartition("@")
    name, _, port = rest.partition(":")
    if not name or (port and not port.isdigit()):
        raise FleetError(f"cannot read host {host!r}: write name, user@name or user@name:port")
    return user or None, name, int(port) if port else None


def _path(remote_dir: str, relative: str) -> str:
    return relative if relative.startswith(("/", "~")) else f"{remote_dir.rstrip('/')}/{relative}"


def start_command(argv: Sequence[str], *, env: Mapping[str, str], log: str, pid: str, remote_dir: str) -> str:
    """The shell line that starts one server detached (own session, so its pid is its process group)."""
    log, pid = _path(remote_dir, log), _path(remote_dir, pid)
    q = shlex.quote
    dirs = " ".join(q(d) for d in sorted({log.rpartition("/")[0] or ".", pid.rpartition("/")[0] or "."}))
    launch = " ".join(["env", *(q(f"{k}={v}") for k, v in sorted(env.items())), "setsid", *(q(a) for a in argv)])
    return f"mkdir -p {dirs} && {{ {launch} >{q(log)} 2>&1 </dev/null & echo $! >{q(pid)}; cat {q(pid)}; }}"


def stop_command(*, pid: str, remote_dir: str, grace_s: float) -> str:
    """SIGTERM the group (SGLang drains), SIGKILL it after ``grace_s``, remove the pid file."""
    pid = shlex.quote(_path(remote_dir, pid))
    ticks = max(1, int(grace_s * 10))
    return (f"if [ -f {pid} ]; then p=$(cat {pid}); kill -TERM -$p 2>/dev/null; "
            f"for i in $(seq {ticks}); do kill -0 -$p 2>/dev/null || break; sleep 0.1; done; "
            f"kill -KILL -$p 2>/dev/null; rm -f {pid}; echo stopped; fi")


async def _run(host: str, command: str, timeout_s: float) -> tuple[int, str, str]:
    try:
        import asyncssh  # optional (autotune[remote]): only remote fleets need it
    except ImportError:
        raise FleetError("remote fleet hosts need asyncssh: pip install 'autotune[remote]'") from None
    user, name, port = split_host(host)
    options: dict[str, Any] = {"preferred_auth": "publickey"}  # never a password prompt
    if user:
        options["username"] = user
    if port:
        options["port"] = port

    async def session():
        async with asyncssh.connect(name, **options) as conn:  # known_hosts: asyncssh's default check
            return await conn.run(command, check=False)

    try:
        result = await asyncio.wait_for(session(), timeout_s)  # bounds the connect as well as the command
    except (OSError, asyncssh.Error) as exc:  # TimeoutError is an OSError
        raise FleetError(f"ssh {host}: {exc.__class__.__name__}: {exc}") from None
    return int(result.exit_status or 0), str(result.stdout or ""), str(result.stderr or "")


def run(host: str, command: str, *, timeout_s: float = 60.0) -> tuple[int, str, str]:
    return asyncio.run(_run(host, command, timeout_s))


def start_server(fleet, server, argv: list[str], *, env: Mapping[str, str], is_healthy: Callable[[], bool],
                 timeout_s: float) -> int:
    """Launch on the remote host with ``env``, then poll ``is_healthy`` (its ``/health``, from here) until it
    answers or the timeout ends."""
    command = start_command(argv, env=env, log=server.log, pid=server.pid, remote_dir=fleet.remote_dir)
    code, out, err = run(server.host, command)
    if code != 0 or not out.strip().isdigit():
        raise FleetError(f"server {server.name}: launch on {server.host} failed: {(err or out).strip()[:200]}")
    pid = int(out.strip())
    deadline = time.monotonic() + timeout_s
    while not is_healthy():
        alive, _, _ = run(server.host, f"kill -0 {pid}")
        if alive != 0:
            raise FleetError(f"server {server.name} on {server.host} exited before it was ready "
                             f"(log: {_path(fleet.remote_dir, server.log)} there)")
        if time.monotonic() >= deadline:
            stop_server(fleet, server, grace_s=5.0)
            raise FleetError(f"server {server.name} on {server.host} not healthy after {timeout_s:g} s")
        time.sleep(1.0)
    return pid


def stop_server(fleet, server, *, grace_s: float) -> bool:
    command = stop_command(pid=server.pid, remote_dir=fleet.remote_dir, grace_s=grace_s)
    _, out, _ = run(server.host, command, timeout_s=grace_s + 30.0)
    return "stopped" in out
