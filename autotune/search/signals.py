"""Ctrl-C during a sweep: one handler for the search and the confirmation alike (``search.sweep``), so the first
SIGINT stops the current server cleanly and ends the sweep as interrupted, and a second gives up at once; and the
supervisor of workers forwarding it to them (``on_sigint``, ``scaleout``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def on_sigint(act: Callable[[], None]) -> Iterator[None]:
    """Ctrl-C calls ``act`` while the block runs; the previous handler is back after it. Off the main thread (where
    no handler can be installed) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: act())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sigint_stops(stop: threading.Event) -> contextlib.AbstractContextManager[None]:
    """First Ctrl-C: stop the current server cleanly and end the sweep (``stop`` set). Second: give up at once."""

    def act() -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    return on_sigint(act)
