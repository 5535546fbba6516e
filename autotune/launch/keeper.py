"""A server with no local process (a Slurm job, a container) never outlives its harness: a keeper stands for it.

The keeper is a tiny local process that runs one cleanup command (``scancel``, ``docker rm -f``) when SIGTERMed,
watched by the local launcher's watchdog (``launch/watchdog.py``), which SIGTERMs it once the harness is gone,
SIGKILL included. The command runs from a session of its own, so the watchdog's SIGKILL of the keeper's group
cannot cut it short. A detached (fleet) server has no keeper.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from autotune.launch.base import LaunchSpec
from autotune.launch.watchdog import Watchdog

# argv: log path, the note for the log, the cleanup command as a JSON list.
KEEPER = """
import json, os, signal, subprocess, sys
log, note, command = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def gone(*_):
    with open(log, "a") as fh:
        fh.write(note + "\\n")
    subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   start_new_session=True, timeout=120, check=False)
    os._exit(0)
signal.signal(signal.SIGTERM, gone)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("keeping", flush=True)
while True:
    signal.pause()
"""


class Keeper:
    """The keeper process and its watchdog: from ``__init__`` on, the harness's death runs ``command``."""

    def __init__(self, command: Sequence[str], *, log_path: Path, note: str, grace_s: float, record: Path):
        watchdog = Watchdog(grace_s=grace_s)
        try:
            keeper = subprocess.Popen(
                [sys.executable, "-c", KEEPER, str(log_path), note, json.dumps(list(command))],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            assert keeper.stdout is not None
            keeper.stdout.readline()  # its SIGTERM handler is in place
            keeper.stdout.close()
        except BaseException:
            watchdog.stand_down()
            raise
        self._keeper: subprocess.Popen[bytes] | None = keeper
        self._watchdog: Watchdog | None = watchdog
        watchdog.watch(keeper.pid, record)  # no such record: nothing on the host to clean after it

    def stand_down(self) -> None:
        """The harness stops the server itself: the watchdog goes first, then the keeper (SIGKILL, no cleanup)."""
        if self._watchdog is not None:
            self._watchdog.stand_down()
            self._watchdog = None
        if self._keeper is not None:
            self._keeper.kill()
            self._keeper.wait(timeout=10)
            self._keeper = None


class Kept:
    """What a handle with a keeper (a Slurm job, a container) shares: ``release`` and the end of ``stop`` stand the
    keeper down; leaving a ``with`` block stops a server that is not detached."""

    spec: LaunchSpec
    _keeper: Keeper | None = None

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        raise NotImplementedError

    def _stand_down(self) -> None:
        if self._keeper is not None:
            self._keeper.stand_down()
            self._keeper = None

    def release(self) -> None:
        """Leave the server running (a fleet's): a detached spec has no keeper; any other stops being kept."""
        self._stand_down()

    def __exit__(self, *exc: object) -> None:
        if not self.spec.detach:
            self.stop()
