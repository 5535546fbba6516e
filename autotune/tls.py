"""One TLS context for every HTTP client autotune opens.

httpx builds a fresh ``ssl.SSLContext`` (and loads the CA bundle) for each client it is given none: about 30 ms of
CPU, even for a plain-HTTP loopback client that never uses it. The harness opens dozens of short-lived clients per
trial (health polls, ``/server_info``, the replay, the fidelity probe, the stop's drain checks), so a sweep spent a
noticeable share of its CPU there. Built once, the context costs that once per process.
"""

from __future__ import annotations

import functools
import os
import ssl
from pathlib import Path

import httpx


@functools.cache
def context() -> ssl.SSLContext:
    """httpx's default verifying context (certifi's CA bundle), built on first use and shared."""
    return httpx.create_ssl_context()


_trusted: set[str] = set()


def trust(ca_file: str | os.PathLike[str]) -> None:
    """Every client of this process also verifies servers against ``ca_file`` (a fleet's own CA,
    ``deploy.fleettls``); loaded once per file."""
    path = str(Path(ca_file).resolve())
    if path not in _trusted:
        context().load_verify_locations(cafile=path)
        _trusted.add(path)
