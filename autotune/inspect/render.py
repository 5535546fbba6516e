"""Draw an ``Inspection`` as rich tables: the fleet overview, then each server's limits, memory and next steps.

Only drawing happens here; every figure was computed (and is tested) in ``diagnosis`` / ``diagnosis_suggest``.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune.inspect.diagnose import Inspection, ServerDiagnosis
from autotune.inspect.suggest import Suggestion

_POOLS = {
    "weights": "weights (target + draft)",
    "pools": "pools (KV + Mamba)",
    "kv": "  KV cache (SGLang's kvcache)",
    "mamba_states": "  Mamba states (ssm + conv)",
    "spec_intermediates": "  speculative intermediates",
    "graphs": "CUDA graphs",
    "free": "free / headroom",
    "gpu_used": "GPU used",
    "gpu_total": "GPU total",
}


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} %"


def _opt(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


GPU_ONLY = ("graphs", "gpu_used", "gpu_total")  # memory rows a server without a GPU (SGLang's CPU backend) has not


def _on_cpu(d: ServerDiagnosis) -> bool:
    return d.state.device == "cpu"


def fleet_table(inspection: Inspection) -> Table:
    table = Table(title="SGLang servers", title_justify="left")
    gpus = not all(_on_cpu(d) for d in inspection.servers)  # a fleet of CPU servers has no GPU column
    for column in (
        "server",
        "max run (binds)",
        "slots",
        "KV tokens",
        "run/queue",
        "KV",
        "Mamba",
        *(["GPU GiB"] if gpus else []),
        "tok/s",
    ):
        table.add_column(column, overflow="fold")
    for d in inspection.servers:
        u, s, c = d.usage, d.state, d.capacity
        gpu = f"{s.gpu.used_gib:.0f}/{s.gpu.total_gib:.0f}" if s.gpu else "-"
        load = f"{u.running}/{u.queued}" if u and u.running is not None else "-"
        tok_s = u.gen_throughput if u and u.gen_throughput is not None else s.last_gen_throughput
        table.add_row(
            d.url.removeprefix("http://"),
            f"{c.effective} ({c.binding or '?'})",
            _opt(c.mamba_slots),
            _opt(c.kv_tokens),
            load,
            _pct(u.kv_used_pct if u else None),
            _pct(u.mamba_used_pct if u else None),
            *([gpu] if gpus else []),
            "-" if tok_s is None else f"{tok_s:,.0f}",
        )
    return table


def _limits(d: ServerDiagnosis) -> Table:
    table = Table(title="max_running_requests = min(...)", title_justify="left")
    for column in ("limit", "value", "from"):
        table.add_column(column)
    for limit in d.capacity.limits:
        mark = " ← binds" if limit.name == d.capacity.binding else ""
        table.add_row(limit.name + mark, f"{limit.value:,}", limit.why)
    return table


def _memory(d: ServerDiagnosis) -> Table:
    table = Table(title="memory (GiB)", title_justify="left")
    for column in ("pool", "server", "planner"):
        table.add_column(column)
    for key, row in d.memory.items():
        if key in GPU_ONLY and _on_cpu(d):
            continue  # no CUDA graphs, no GPU: the CPU backend's memory is the host's
        # The server column says "unknown" where the server reported nothing (never a guess); the planner
        # column leaves blank what the planner does not model.
        server = "unknown" if row["server"] is None else _gib(row["server"])
        table.add_row(_POOLS.get(key, key), server, _gib(row["planner"]))
    return table


def _suggestion_lines(suggestions: list[Suggestion]) -> list[str]:
    """One line per suggestion, flags first so they can be pasted into a launch command."""
    lines = []
    for i, sug in enumerate(suggestions, 1):
        note = f"; {sug.note}" if sug.note else ""
        lines.append(
            f"{i}. {' '.join(sug.argv)}  → {sug.max_running_requests} running (then bound by "
            f"{sug.binding}), {sug.kv_tokens:,} KV tokens, {sug.headroom_gib:.1f} GiB headroom, "
            f"confidence {sug.confidence}{note}"
        )
    return lines


def render(inspection: Inspection, console: Console) -> None:
    if inspection.servers:
        console.print(fleet_table(inspection))
    for d in inspection.servers:
        console.rule(f"{d.url}  SGLang {d.state.version or '?'}  {d.state.model_path or '?'}")
        console.print(d.headline, highlight=False, markup=False)
        console.print(_limits(d))
        console.print(_memory(d))
        if d.state.accept_length is not None:
            console.print(
                f"speculative accept length (since start): {d.state.accept_length:.2f}",
                highlight=False,
                markup=False,
            )
        advice = d.advice
        if advice is not None and advice.reproduction:
            console.print(
                f"planner ({advice.model} on {advice.gpu}), confidence {advice.confidence}: {advice.reproduction}",
                highlight=False,
                markup=False,
            )
        if advice is not None and advice.suggestions:
            console.print("next step (planner predictions):", highlight=False, markup=False)
            for line in _suggestion_lines(advice.suggestions):
                console.print(line, highlight=False, markup=False, soft_wrap=True)
        for line in advice.inert if advice else []:
            console.print(f"inert: {line}", highlight=False, markup=False)
        for note in d.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
    if inspection.differences:
        console.rule("fleet differences")
        for line in inspection.differences:
            console.print(line, highlight=False, markup=False)
    for failure in inspection.failures:
        console.print(Text("cannot inspect ", style="red") + Text(failure.message))
