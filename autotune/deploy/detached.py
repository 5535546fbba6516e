"""A fleet's own long-lived helper process (the router, the keeper): started in a session of its own, so it
outlives the command that started it, its output appended to its log, and reaped whenever it ends (no zombie)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil


def spawn(
    command: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], float]:
    """Start ``command`` (an argv list) detached; the process and its create time (what its record proves it by)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            close_fds=True,
        )
    threading.Thread(target=proc.wait, name=f"reaper-{proc.pid}", daemon=True).start()
    return proc, psutil.Process(proc.pid).create_time()
