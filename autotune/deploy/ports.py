"""Which ports a new fleet's servers and its router get: ``apply`` must never hand out a port another process's
server holds, where that server would later pass for the fleet's (or the router could not bind)."""

from __future__ import annotations

from collections.abc import Iterable

from autotune.errors import ConfigError
from autotune.launch.ports import port_is_free

DEFAULT_BASE_PORT = 30000  # SGLang's own default port; apply takes the next free ones when it is in use


def pick_ports(count: int, host: str, base_port: int | None = None) -> list[int]:
    """``count`` ports for new servers: from ``DEFAULT_BASE_PORT`` up, skipping any in use on ``host`` (another
    process's server must never pass for the fleet's); a ``base_port`` the user gave is used as given, and one of
    its ports in use is a ``ConfigError`` naming it."""
    ports: list[int] = []
    port = DEFAULT_BASE_PORT if base_port is None else base_port
    while len(ports) < count:
        if port > 65535:
            raise ConfigError(
                f"no {count} free ports from {ports[0] if ports else port} up on {host}",
                key="--base-port",
                fix="give a lower --base-port",
            )
        if port_is_free(host, port):
            ports.append(port)
        elif base_port is not None:
            raise ConfigError(
                f"port {port} is in use on {host}",
                key="--base-port",
                fix="stop what holds it, or give another --base-port (without one, apply picks free ports)",
            )
        port += 1
    return ports


def pick_after(ports: Iterable[int], count: int, host: str) -> list[int]:
    """``count`` ports after the highest of ``ports`` (a new fleet's servers), skipping any of them and any in use
    on ``host``: the router's ports must collide with neither its servers nor another process."""
    used = set(ports)
    picked: list[int] = []
    port = max(used, default=DEFAULT_BASE_PORT - 1) + 1
    while len(picked) < count:
        if port > 65535:
            raise ConfigError(
                f"no {count} free ports after {max(used, default=port)} on {host}",
                key="[router] port",
                fix="give the servers lower ports, or set [router] port",
            )
        if port not in used and port_is_free(host, port):
            picked.append(port)
        port += 1
    return picked
