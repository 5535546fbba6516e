"""One simulated SGLang server in its own process group for a test: started, waited for, killed with its group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.harness.engines import SimEngine
from autotune.launch.ports import free_port  # this worker's own range (tests/conftest.py)


def sim_command(port: int, *flags: str, **options: Any) -> list[str]:
    """``python -m autotune.sim`` for qwen3.6-27b on a simulated B200 on loopback, as the sim engine starts it
    (``SimEngine.argv``), then ``flags``; ``options`` are its ``--sim-*`` options (``startup_s=0.3``)."""
    return SimEngine(sim_options=options).argv({}, port=port) + list(flags)


@contextlib.contextmanager
def sim_server(tmp_path: Path, flags: list[str], env: dict[str, str]) -> Iterator[str]:
    """A qwen3.6-27b sim server on a simulated B200 with ``flags``; yields its URL once ``/health`` answers 200."""
    port = free_port()
    log = (tmp_path / "sim.log").open("wb")
    proc = subprocess.Popen(
        sim_command(port, *flags, startup_s=0.3, release_s=0.2),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "sim.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("simulated server did not become ready in 30 s")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()
