"""The health wait every launcher's start ends in.

Apart from ``stopping`` because of httpx: the watchdog process (one per launch) imports ``stopping`` to stop a
server whose harness died, and httpx would cost each of them about 0.12 CPU-s of imports it never uses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from autotune import tls
from autotune.launch.base import PortTaken, ServerExited, ServerStartTimeout


def wait_healthy(
    url: Callable[[], str],
    timeout_s: float,
    *,
    ended: Callable[[], int | None],
    tail: Callable[[], str],
    stop_event: threading.Event | None = None,
    poll_s: float = 0.1,
    owns_port: Callable[[], bool | None] | None = None,
) -> None:
    """Return once ``url()``'s ``/health`` answers 200; ``ServerExited`` as soon as ``ended`` gives an exit code,
    ``ServerStartTimeout`` when the time runs out or ``stop_event`` is set (every launcher's ``wait_ready``).
    ``owns_port``: whether the answer came from this server (a launcher that can see its processes' sockets);
    False raises ``PortTaken``: a port taken between its pick and the bind, minutes later for a real model,
    answers for another server."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False, **tls.secured()) as client:
        while True:
            code = ended()
            if code is not None:
                raise ServerExited(code, tail())
            try:
                if client.get(f"{url()}/health").status_code == 200:
                    if owns_port is not None and owns_port() is False:
                        raise PortTaken(url(), tail())
                    return
            except httpx.HTTPError:
                pass  # pending, or not listening yet
            if (stop_event is not None and stop_event.is_set()) or time.monotonic() >= deadline:
                raise ServerStartTimeout(timeout_s, tail())
            time.sleep(poll_s)
