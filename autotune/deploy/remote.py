"""Fleet servers on other hosts: the fleet's side of the ``ssh`` launcher (``autotune.launch.ssh``, which holds
the SSH transport and the shell lines). A fleet entry's ``host`` and the fleet's ``remote_dir`` make the launcher;
its ``log`` and ``pid`` paths (relative ones under ``remote_dir``) are the server's files there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from autotune.errors import FleetError, ServerError
from autotune.launch.base import LaunchSpec, ServerExited, ServerStartTimeout
from autotune.launch.ssh import (  # noqa: F401 - re-exported: the lines the fleet sends
    SshLauncher,
    Transport,
    split_host,
    start_command,
)

if TYPE_CHECKING:
    from autotune.deploy.fleetfile import Fleet, FleetServer


def launcher(fleet: Fleet, server: FleetServer, *, transport: Transport | None = None) -> SshLauncher:
    return SshLauncher(host=server.host, remote_dir=fleet.remote_dir, transport=transport)


def server_spec(server: FleetServer, argv: list[str], *, env: Mapping[str, str], gpus: tuple[int, ...]) -> LaunchSpec:
    """The fleet entry as a spec: its pid file is ``<run_dir>/<name>.pid``, i.e. the entry's ``pid`` path."""
    pid = PurePosixPath(server.pid)
    if pid.suffix != ".pid":
        raise FleetError(f"server {server.name}: its pid file must end in .pid (not {server.pid!r})")
    return LaunchSpec(
        argv=argv,
        port=server.port,
        host=server.address,
        env=dict(env),
        gpus=gpus,
        log_path=Path(server.log),
        run_dir=Path(str(pid.parent)),
        name=pid.stem,
        detach=True,
    )


def pid_file(server: FleetServer) -> str:
    """The entry's pid path as the launcher writes it (``run/./x.pid`` → ``run/x.pid``)."""
    return str(PurePosixPath(server.pid))


def start_server(
    fleet: Fleet,
    server: FleetServer,
    argv: list[str],
    *,
    env: Mapping[str, str],
    gpus: tuple[int, ...],
    timeout_s: float,
    transport: Transport | None = None,
) -> int:
    """Start through the ``ssh`` launcher and wait for ``/health``; its pid on the host. FleetError if not."""
    made = launcher(fleet, server, transport=transport)
    spec = server_spec(server, argv, env=env, gpus=gpus)
    try:
        handle = made.start(spec)
    except ServerError as exc:
        raise FleetError(f"server {server.name}: {exc}") from None
    try:
        handle.wait_ready(timeout_s)
    except ServerExited as exc:
        raise FleetError(
            f"server {server.name} on {server.host} exited before it was ready (code {exc.exit_code}; "
            f"log: {made.path(server.log)} there): {exc.log_tail[-300:]}"
        ) from None
    except ServerStartTimeout:
        handle.stop(grace_s=5.0)
        raise FleetError(f"server {server.name} on {server.host} not healthy after {timeout_s:g} s") from None
    handle.release()
    return handle.host_pid


def stop_server(
    fleet: Fleet,
    server: FleetServer,
    *,
    grace_s: float,
    release_timeout_s: float = 60.0,
    transport: Transport | None = None,
) -> list[str] | None:
    """Stop the server its pid file on the host names (``SshLauncher.stop_pid_file``): None when none was recorded
    there, else what the stop could not release in time (empty when it released everything)."""
    return launcher(fleet, server, transport=transport).stop_pid_file(
        pid_file(server), grace_s=grace_s, release_timeout_s=release_timeout_s
    )
