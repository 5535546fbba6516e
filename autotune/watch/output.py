"""What ``autotune watch`` says about a cycle to people and logs: one plain line per finding, quiet server or
unreachable one. (JSON is the report's ``to_dict``; the Prometheus series are ``watch.prometheus``'s.)
"""

from __future__ import annotations

from typing import Any


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def status_line(server: Any) -> str:
    """One server's live figures over the window, for cycles where it shows no drift."""
    g = server.gauges
    parts = [
        f"{g.get('num_running_reqs', 0):.0f} running, {g.get('num_queue_reqs', 0):.0f} queued",
        f"KV {_pct(g.get('full_token_usage', g.get('token_usage')))}",
    ]
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
