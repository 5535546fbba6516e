"""``autotune watch --listen``: watch's Prometheus series served over HTTP (``GET /metrics``), for a Prometheus
that scrapes watch directly instead of through node_exporter's textfile collector.

Loopback by default (``:9400`` is ``127.0.0.1:9400``): the series name the fleet's servers, so exposing them
beyond the host is the operator's explicit choice. The server thread lives exactly as long as the ``with``.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_wsgi_server

from autotune.errors import ConfigError
from autotune.watch.prometheus import DriftCollector, registry_of

DEFAULT_HOST = "127.0.0.1"
THREAD_NAME = "autotune-watch-listen"
_FIX = "write HOST:PORT, e.g. 127.0.0.1:9400, or :9400 for loopback"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT``, ``:PORT`` or ``PORT`` (both on 127.0.0.1) → (host, port); port 0 picks one."""
    host, colon, port = text.strip().rpartition(":")
    if not colon:
        host, port = "", text.strip()
    host = host.removeprefix("[").removesuffix("]") or DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"cannot read address {text!r}", key="--listen", fix=_FIX)
    return host, int(port)


class MetricsServer:
    """``prometheus_client``'s WSGI server on (host, port) for ``collector``, stopped and joined on exit."""

    def __init__(self, host: str, port: int, collector: DriftCollector) -> None:
        self.host, self.port, self.collector = host, port, collector
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the bound port, when 0 was asked for)."""
        if self._httpd is None:
            return self.host, self.port
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def start(self) -> MetricsServer:
        try:
            self._httpd, self._thread = start_wsgi_server(
                self.port, addr=self.host, registry=registry_of(self.collector)
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {self.host}:{self.port} ({exc.strerror or exc})",
                key="--listen",
                fix="choose a free port, or :0 for any",
            ) from None
        self._thread.name = THREAD_NAME
        return self

    def stop(self) -> None:
        """Stop serving, close the socket and wait for the thread (``shutdown`` returns once its loop has)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
