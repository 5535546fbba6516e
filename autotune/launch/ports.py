"""Picking a port for a server: any free one, or one from ``$AUTOTUNE_PORT_RANGE``.

Binding port 0 hands out the kernel's ephemeral ports, which several processes on one host (scale-out workers, a
parallel test run) can all be handed between one's pick and its server's bind. A range gives each of them ports
of its own (``AUTOTUNE_PORT_RANGE=20000-20999``), and a firewall a list it can open; within the range ports are
taken in turn from a random start, so a port just released is not handed out again at once.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from collections.abc import Iterable

import psutil

from autotune.errors import ConfigError

PORT_RANGE_ENV = "AUTOTUNE_PORT_RANGE"

_lock = threading.Lock()
_turns: dict[tuple[int, int], itertools.count[int]] = {}


def port_range(value: str | None = None) -> tuple[int, int] | None:
    """``LOW-HIGH`` from ``value`` or ``$AUTOTUNE_PORT_RANGE`` (None when unset); a malformed one is a ConfigError."""
    raw = (os.environ.get(PORT_RANGE_ENV, "") if value is None else value).strip()
    if not raw:
        return None
    low, sep, high = raw.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()) or not 1024 <= int(low) <= int(high) <= 65535:
        raise ConfigError(
            f"{raw!r} is not a port range", key=PORT_RANGE_ENV, fix="write LOW-HIGH within 1024-65535, e.g. 20000-20999"
        )
    return int(low), int(high)


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on ``host:port`` (a stopped server's port must be free before the next trial)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def listens(pids: Iterable[int], port: int) -> bool | None:
    """Whether one of ``pids`` holds a listening socket on ``port``: the server answering there is theirs. None
    when no process could be read (another user's, a platform that hides them): unknown, never a no."""
    known = False
    for pid in pids:
        try:
            sockets = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or not ours to read: says nothing
            continue
        known = True
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in sockets):
            return True
    return False if known else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now: the next free one of ``$AUTOTUNE_PORT_RANGE`` when set, else one the OS picks."""
    span = port_range()
    if span is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    low, high = span
    size = high - low + 1
    with _lock:
        turn = _turns.setdefault(span, itertools.count(random.randrange(size)))
        for _ in range(size):
            port = low + next(turn) % size
            if port_is_free(host, port):
                return port
    raise ConfigError(
        f"no free port in {low}-{high}", key=PORT_RANGE_ENV, fix="widen the range, or stop what holds its ports"
    )
