"""Ctrl-C during a sweep: one handler for the search and the confirmation alike (``search.sweep``), so the first
SIGINT stops the current server cleanly and ends the sweep as interrupted, and a second gives up at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_stops(stop: threading.Event) -> Iterator[None]:
    """First Ctrl-C: stop the current server cleanly and end the sweep (``stop`` set). Second: give up at once.
    Off the main thread (where no handler can be installed) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
