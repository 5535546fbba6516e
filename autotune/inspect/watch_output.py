"""What ``autotune watch`` says about a cycle: plain lines for people and logs, JSON for alerting systems,
and a Prometheus text file of its own findings (``autotune_drift{server, rule}``) for an existing
Prometheus/Grafana to scrape through node_exporter's textfile collector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

from autotune.inspect.watch_rules import RULES


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def status_line(server: Any) -> str:
    """One server's live figures over the window, for cycles where it shows no drift."""
    g = server.gauges
    parts = [f"{g.get('num_running_reqs', 0):.0f} running, {g.get('num_queue_reqs', 0):.0f} queued",
             f"KV {_pct(g.get('full_token_usage', g.get('token_usage')))}"]
    if "mamba_usage" in g:
        parts.append(f"Mamba {_pct(g['mamba_usage'])}")
    if g.get("gen_throughput") is not None:
        parts.append(f"{g['gen_throughput']:,.0f} tok/s")
    t = server.traffic
    if t.get("prompt_mean") is not None:
        shape = f"prompts ≈ {t['prompt_mean']:,.0f}"
        if t.get("output_mean") is not None:
            shape += f", outputs ≈ {t['output_mean']:,.0f}"
        parts.append(f"{shape} tokens over {t['requests']:.0f} requests")
    return f"{server.url}: {'; '.join(parts)} ({server.samples} samples, {server.window_s:.0f} s): no drift"


def lines(report: Any) -> list[str]:
    """One line per finding (evidence, reason, fix), one per quiet server, one per server that did not answer."""
    out: list[str] = []
    for server in report.servers:
        if server.findings:
            out += [f.line() for f in server.findings]
        else:
            out.append(status_line(server))
        out += [f"{server.url}: note: {note}" for note in server.notes]
    out += [f"{failure.message} (not watched this cycle)" for failure in report.failures]
    return out


def write_prometheus(report: Any, path: Path) -> None:
    """``autotune_drift{server, rule}`` (1 firing, 0 not) for every rule of every server that answered,
    ``autotune_watch_up{server}`` and the cycle's timestamp; written atomically by ``prometheus_client``."""
    registry = CollectorRegistry()
    drift = Gauge("autotune_drift", "1 when autotune watch finds this drift rule firing on this server",
                  ["server", "rule"], registry=registry)
    up = Gauge("autotune_watch_up", "1 when autotune watch could read the server this cycle", ["server"],
               registry=registry)
    last = Gauge("autotune_watch_last_cycle_timestamp_seconds", "When autotune watch last sampled the fleet",
                 registry=registry)
    for server in report.servers:
        up.labels(server=server.url).set(1)
        firing = {f.rule for f in server.findings}
        for rule in RULES:
            drift.labels(server=server.url, rule=rule).set(1 if rule in firing else 0)
    for failure in report.failures:
        up.labels(server=failure.url).set(0)
    last.set(report.t)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry)
