"""What a trial asks its running server over HTTP besides the replay: ``/server_info`` (read by the engine for the
capacity, startup and accept length; by the trial for the stream interval; the simulator's pacing counters at each
window edge) and ``/flush_cache`` (restarting the server's speculative counters before the replay).

A server that does not answer is no error here: each call returns None (or does nothing), and what needed the
answer goes without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from autotune import redaction, tls
from autotune.harness.workload import SimPace


def server_info(base_url: str) -> dict[str, Any] | None:
    """The server's ``/server_info`` JSON as it answered (SGLang's keys); None when it did not."""
    try:
        resp = httpx.get(f"{base_url}/server_info", timeout=10.0, trust_env=False, **tls.secured())
        return redaction.scrub(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def sim_pace(base_url: str) -> SimPace | None:
    """The simulated server's pacing counters (``sim_pace`` in /server_info); None for a real SGLang."""
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False, **tls.secured()) as client:
            resp = await client.get(f"{base_url}/server_info")
        pace = resp.json().get("sim_pace") if resp.status_code == 200 else None
        return SimPace(float(pace["modelled_s"]), float(pace["lag_s"])) if pace is not None else None
    except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
        return None


def server_stream_interval(info: Mapping[str, Any] | None) -> int | None:
    """The server's ``--stream-interval`` as /server_info reports it."""
    value = (info or {}).get("stream_interval")
    return int(value) if isinstance(value, int) else None


def flush_cache(base_url: str) -> None:
    try:
        httpx.post(f"{base_url}/flush_cache", timeout=10.0, trust_env=False, **tls.secured())
    except httpx.HTTPError:
        pass  # only the accept-length fallback loses precision
