"""One TLS context, and the keys this process presents, for every HTTP client autotune opens (built once per
process: httpx would build one per client). docs/fleet.md ("Only the fleet's servers", "Keys past loopback").
"""

from __future__ import annotations

import functools
import os
import ssl
from pathlib import Path
from typing import Any

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


_keys: dict[str, list[tuple[str, str]]] = {}  # origin → (path prefix, key), the longest prefix first


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"


def present(base_url: str, key: str, *, prefix: str = "/") -> None:
    """Send ``key`` (``Authorization: Bearer``) with every request of this process to ``base_url`` whose path
    starts with ``prefix``."""
    entries = [e for e in _keys.get(_origin(httpx.URL(base_url)), []) if e[0] != prefix]
    _keys[_origin(httpx.URL(base_url))] = sorted([*entries, (prefix, key)], key=lambda e: -len(e[0]))


class _Keys(httpx.Auth):
    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        for prefix, key in _keys.get(_origin(request.url), []):
            if request.url.path.startswith(prefix) and "authorization" not in request.headers:
                request.headers["Authorization"] = f"Bearer {key}"
                break
        yield request


_AUTH = _Keys()


def secured() -> dict[str, Any]:
    """What every client autotune opens passes (``httpx.Client(..., **tls.secured())``): the shared verifying context,
    which trusts the fleets' CAs, and the keys presented for their servers."""
    return {"verify": context(), "auth": _AUTH}
