"""SGLang's ``--api-key`` as 0.5.23 applies it to its normal endpoints (``srt/utils/auth.py`` L83-171,
``decide_request_auth``): health, readiness and metrics are always open (probes and Prometheus need no key); every
other request needs ``Authorization: Bearer <key>``, compared in constant time, else 401 ``{"error":
"Unauthorized"}``."""

from __future__ import annotations

import secrets
from typing import Any

from starlette.responses import JSONResponse

OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def allowed(method: str, path: str, authorization: str | None, api_key: str | None) -> bool:
    if not api_key or method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, api_key)


class ApiKeyMiddleware:
    """ASGI middleware (a plain one: streamed responses and client disconnects pass through untouched)."""

    def __init__(self, app: Any, *, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if not allowed(scope["method"], scope["path"], headers.get("authorization"), self.api_key):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
