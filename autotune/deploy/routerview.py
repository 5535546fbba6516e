"""The job's view of a fleet, through its router: the router's health, its workers and their loads, and the
fleet's completions and output tok/s over the last minute, with the requests waiting at the router.

Read-only GETs: the router's ``/health`` and ``/workers``, its Prometheus endpoint, and each worker's own
``/metrics`` (SGLang's ``num_running_reqs`` / ``num_queue_reqs`` / ``generation_tokens_total``). Completions are
the router's successful upstream responses; the router proxies HTTP without counting tokens, so output tokens are
the workers' counters. Rates need two readings: each view appends its reading to a small file beside the router's
record and compares with the reading closest to a minute ago (a first view waits a few seconds for a second one).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

from prometheus_client.parser import text_string_to_metric_families

from autotune.deploy import router
from autotune.deploy.fleetfile import Fleet

WINDOW_S = 60.0
FIRST_WAIT_S = 3.0  # a first view, with nothing to compare with, reads again after this long
KEEP_S = 300.0


def series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``name`` in a Prometheus text body, by ``prometheus_client``'s parser (a
    body it cannot read has none)."""
    try:
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and not math.isnan(sample.value)
        ]
    except ValueError:
        return []


def total(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for got, v in series(text, name) if all(got.get(k) == want for k, want in labels.items()))


class Sample(TypedDict):
    """One line of the router's samples file: when, the router's 2xx responses so far, each worker's generated
    tokens so far (by URL), and the connections open at the router."""

    t: float
    completions: float
    tokens: dict[str, float]
    connections: float


@dataclass(kw_only=True)
class WorkerLoad:
    url: str
    in_router: bool
    healthy: bool
    running: int | None = None  # the server's own gauges
    queued: int | None = None
    router_load: int | None = None  # the router's count of its requests there

    @property
    def in_flight(self) -> int | None:
        return None if self.running is None else self.running + (self.queued or 0)


@dataclass(kw_only=True)
class RouterView:
    url: str
    pid: int | None
    healthy: bool
    workers: list[WorkerLoad] = field(default_factory=list)
    completions: float | None = None  # per minute
    output_tok_s: float | None = None
    over_s: float | None = None  # the span the two figures above cover
    in_flight: int | None = None  # requests open at the router
    queued: int | None = None  # of those, not yet at any server

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "workers": [{**asdict(w), "in_flight": w.in_flight} for w in self.workers]}

    def lines(self) -> list[str]:
        state = "healthy" if self.healthy else "not answering"
        out = [f"router {self.url} (pid {self.pid}): {state}, {sum(w.in_router for w in self.workers)} worker(s)"]
        if self.over_s is not None:
            out.append(
                f"through the router over the last {self.over_s:.0f} s: {self.completions or 0:,.0f} "
                f"completions/min, {self.output_tok_s or 0:,.0f} output tok/s; {self.in_flight} in flight "
                f"at the router, {self.queued} queued there"
            )
        for w in self.workers:
            where = "in the router" if w.in_router else "OUT of the router"
            load = "-" if w.running is None else f"{w.running} running, {w.queued} queued"
            out.append(
                f"  {w.url}: {where}, {'healthy' if w.healthy else 'unhealthy'}, {load}"
                + (f" (router: {w.router_load} in flight)" if w.router_load is not None else "")
            )
        return out


def _reading(record: router.Record, urls: list[str]) -> tuple[Sample, dict[str, str]]:
    texts = {u: router.get(u, "/metrics") for u in urls}
    worker_texts = {u: t for u, t in texts.items() if isinstance(t, str)}
    text = router.get(record.metrics_base, "/metrics")
    text = text if isinstance(text, str) else ""
    done = sum(
        v
        for labels, v in series(text, "smg_router_upstream_responses_total")
        if labels.get("status_code", "").startswith("2")
    )
    tokens = {u: total(t, "sglang:generation_tokens_total") for u, t in worker_texts.items()}
    return (
        Sample(t=time.time(), completions=done, tokens=tokens, connections=total(text, "smg_http_connections_active")),
        worker_texts,
    )


def _history(path: Path, now: float) -> list[Sample]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    return [cast(Sample, r) for r in rows if isinstance(r, dict) and now - float(r.get("t", 0)) <= KEEP_S]


def _rates(old: Sample, new: Sample) -> tuple[float, float, float]:
    """(completions/min, output tok/s, span); a worker whose counter fell restarted: it counts from zero."""
    span = max(1e-6, new["t"] - old["t"])
    done = max(0.0, new["completions"] - old["completions"])
    tokens = 0.0
    for url, value in new["tokens"].items():
        before = old["tokens"].get(url, value)
        tokens += value - before if value >= before else value
    return 60.0 * done / span, tokens / span, span


def view(fleet: Fleet, *, first_wait_s: float = FIRST_WAIT_S) -> RouterView | None:
    """The router's view of the fleet, or None when the fleet has no router running."""
    record = router.running(fleet)
    if record is None:
        return None
    healthy = router.get(record.url, "/health") is not None
    listed = {w.get("url"): w for w in router.workers(record)}
    urls = list(dict.fromkeys([*(s.url for s in fleet.servers), *(u for u in listed if u)]))
    path = router.samples_path(fleet)
    reading, texts = _reading(record, urls)
    history = _history(path, reading["t"])
    if not [r for r in history if reading["t"] - r["t"] >= 1.0] and first_wait_s > 0:
        history.append(reading)
        time.sleep(first_wait_s)
        reading, texts = _reading(record, urls)
    older = [r for r in history if reading["t"] - r["t"] >= 1.0]
    base = min(older, key=lambda r: abs(reading["t"] - r["t"] - WINDOW_S)) if older else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [*history, reading]))
    out = RouterView(url=record.url, pid=record.pid, healthy=healthy)
    for url in urls:
        text, entry = texts.get(url), listed.get(url) or {}
        running = int(total(text, "sglang:num_running_reqs")) if text is not None else None
        queued = int(total(text, "sglang:num_queue_reqs")) if text is not None else None
        out.workers.append(
            WorkerLoad(
                url=url,
                in_router=url in listed,
                healthy=bool(entry.get("is_healthy")),
                running=running,
                queued=queued,
                router_load=entry.get("load"),
            )
        )
    if base is not None:
        out.completions, out.output_tok_s, out.over_s = _rates(base, reading)
    out.in_flight = int(reading["connections"])
    at_servers = sum(w.in_flight or 0 for w in out.workers if w.in_router)
    out.queued = max(0, out.in_flight - at_servers)
    return out
