"""The report's header card: the confirmation's verdict as the sweep printed it. A winner against the baseline
(its confirmed speed, the gain, the capacity behind it, the flags and launch line), or, when the confirmation
crowned none, that no config beat the baseline and the best confirmed estimates, never a trial as "winner"."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from autotune.report.headline import Gain


@dataclass(frozen=True)
class Facts:
    """What the header card states besides the tables: the study, where it ran, the gain, the winner's and the
    baseline's trials (``winner`` None: the confirmation crowned none), the winner's launch line, and the
    confirmation's verdict."""

    study: str
    model: str
    gpu: str
    engine: str
    gain: Gain
    winner: int | None
    baseline: int | None
    launch: str | None
    second_objective: str
    outcome: str  # the confirmation's verdict (``headline.VerdictFacts``)
    note: str
    defaults_lead: str | None = None  # SGLang's defaults measured above every searched config (``views.summary``)
    host_memory: bool = False  # SGLang's CPU backend: its memory is the host's


def num(value: Any, fmt: str = "{:,.0f}", suffix: str = "") -> str:
    """A figure as the page shows it ("—" for none)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return fmt.format(value) + suffix


def table(frame: pd.DataFrame, links: Sequence[str] = ()) -> str:
    """A frame as an HTML table (numbers right-aligned; ``links``: columns whose values are links)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for column, value in row.items():
            text = html.escape(num(value, "{:,.4g}") if isinstance(value, float) else str(value))
            if column in links and value:
                text = f'<a href="{html.escape(str(value), quote=True)}">{text}</a>'
            numeric = isinstance(value, int | float) or column in ("baseline", "winner", "change")
            cells.append(f'<td class="num">{text}</td>' if numeric else f"<td>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _kpi(label: str, value: str, sub: str = "", cls: str = "") -> str:
    return (
        f'<div class="kpi"><div class="label">{html.escape(label)}</div>'
        f'<div class="value {cls}">{html.escape(value)}</div><div class="sub">{html.escape(sub)}</div></div>'
    )


def header_html(f: Facts, t: Mapping[str, pd.DataFrame]) -> str:
    """The header card: the winner against the baseline, or why there is none."""
    trials = t["trials"]
    counts = trials["outcome"].value_counts()
    meta = (
        f"{f.model} on {f.gpu} · engine {f.engine} · {len(trials)} trials "
        f"({', '.join(f'{n} {k}' for k, n in counts.items())})"
    )
    head = [f"<h1>autotune report — {html.escape(f.study)}</h1>", f'<p class="meta">{html.escape(meta)}</p>']
    if f.defaults_lead:  # before the verdict: what the study did not reach
        head.append(f'<p class="bad">{html.escape(f.defaults_lead)}</p>')
    if f.winner is None:
        head.append(_no_winner(f, t))
        return '<header class="card">' + "".join(head) + "</header>"
    hl = t["headline"].set_index("role")
    win, base = hl.loc["winner"], hl.loc["baseline"]
    g = f.gain
    ci = f"95% CI {g.ci_low:.2f}× – {g.ci_high:.2f}×" if g.ci_low is not None else (g.note or "")
    if g.over_defaults:
        ci += f" · {g.over_defaults:.2f}× SGLang defaults"
    spread = (
        f"95% CI {win['tok_s_low']:,.0f}–{win['tok_s_high']:,.0f} over {win['repeats']} runs"
        if win["repeats"]
        else "single run"
    )
    ratio = g.gain
    if win.get("gpus", 1) > 1:  # ranked per GPU: say what the winner's server spans and its per-GPU score
        spread += f" · {int(win['gpus'])} GPUs, {num(win['tok_s_per_gpu'])} tok/s per GPU"
    kpis = [
        _kpi(
            "winner tok/s" if f.outcome == "winner" else "best trial tok/s (not confirmed)",
            num(win["tok_s"]),
            f"trial {f.winner} · {spread}",
        ),
        _kpi("speed vs baseline", num(ratio, "{:.2f}×"), ci, "good" if ratio and ratio > 1 else "bad"),
        _kpi("max running requests", num(win["max_running_requests"]), f"baseline {num(base['max_running_requests'])}"),
        _kpi("KV tokens", num(win["kv_tokens"]), f"baseline {num(base['kv_tokens'])}"),
        _kpi("Mamba slots", num(win["mamba_slots"]), f"baseline {num(base['mamba_slots'])}"),
        _kpi(
            "headroom (observed)",
            num(win["headroom_gib"], "{:.1f}", " GiB"),
            f"baseline {num(base['headroom_gib'], '{:.1f}', ' GiB')}",
        ),
    ]
    head.append('<div class="kpis">' + "".join(kpis) + "</div>")
    noise = f"Confirmation: {g.noise}." if g.noise else None  # launches, windows, the two noise terms
    head.append(
        f'<p class="why">{html.escape(" ".join(filter(None, [_why(base, win), g.worst_case, noise, g.job])))}</p>'
    )
    head.append("<h3>Winner vs baseline</h3>" + table(_headline_rows(hl)))
    diff = t["flag_diff"]
    head.append("<h3>Flags that changed</h3>" + (table(diff) if len(diff) else "<p>None: the baseline won.</p>"))
    head.append(f"<h3>Launch command</h3><pre>{html.escape(f.launch or '')}</pre>")
    return '<header class="card">' + "".join(head) + "</header>"


def _no_winner(f: Facts, t: Mapping[str, pd.DataFrame]) -> str:
    """The confirmation crowned none: its reason, as the sweep printed it, and the best confirmed estimates (no
    trial is named winner); or, with nothing confirmed and nothing measured, that no trial ran."""
    confirmed = t.get("confirmed")
    if f.outcome not in ("baseline", "none"):
        return '<p class="bad">No trial ran successfully: see the failures below.</p>'
    note = f.note or "no config beat the baseline"
    out = [
        f'<p class="bad">Winner: none. {html.escape(note[:1].upper() + note[1:])} (keep the baseline; nothing to '
        "apply).</p>"
    ]
    if confirmed is not None and len(confirmed):
        shown = confirmed.assign(
            confirmed_tok_s=lambda c: c["confirmed_tok_s"].map(num),
            ci=lambda c: [f"{num(lo)}–{num(hi)}" for lo, hi in zip(c["tok_s_low"], c["tok_s_high"], strict=True)],
            vs_baseline=lambda c: c["vs_baseline"].map(lambda v: num(v, "{:.3f}×")),
        )[["trial", "label", "role", "confirmed_tok_s", "ci", "launches", "vs_baseline"]]
        out.append("<h3>Confirmed estimates</h3>" + table(shown.rename(columns={"ci": "95% CI (tok/s)"})))
    return "".join(out)


def _why(base: pd.Series, win: pd.Series) -> str:
    """One sentence on what changed in capacity, and what it cost, from the same numbers as the table."""

    def move(key: str, name: str, fmt: str = "{:,.0f}", sign: int = 0) -> str | None:
        """``name old → new`` when it changed (in direction ``sign`` if one is given)."""
        old, new = base[key], win[key]
        if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in (old, new)) or old == new:
            return None
        if sign and (new - old) * sign < 0:
            return None
        return f"{name} {num(old, fmt)} → {num(new, fmt)}"

    gains = [
        m
        for m in (
            move("max_running_requests", "running requests", sign=1),
            move("mamba_slots", "Mamba slots", sign=1),
            move("spec_steps", "speculative steps"),
        )
        if m
    ]
    costs = [
        m
        for m in (
            move("kv_tokens", "KV tokens", sign=-1),
            move("headroom_gib", "headroom (GiB)", "{:.1f}", sign=-1),
            move("ttft_p99_ms", "p99 TTFT (ms)", sign=1),
            move("itl_p99_ms", "p99 ITL (ms)", "{:.1f}", sign=1),
        )
        if m
    ]
    if not gains:
        return "The winner runs at the baseline's capacity; its gain comes from the flags below."
    text = "Why it wins: " + ", ".join(gains) + "."
    return text + (" At the cost of: " + ", ".join(costs) + "." if costs else "")


HEADLINE_ROWS = {  # column → (row name, number format)
    "tok_s": ("output tok/s", "{:,.0f}"),
    "max_running_requests": ("max running requests", "{:,.0f}"),
    "kv_tokens": ("KV tokens", "{:,.0f}"),
    "mamba_slots": ("Mamba slots", "{:,.0f}"),
    "spec_steps": ("speculative steps", "{:,.0f}"),
    "peak_gib": ("observed peak memory (GiB)", "{:.1f}"),
    "headroom_gib": ("headroom (GiB)", "{:.1f}"),
    "ttft_p99_ms": ("TTFT p99 (ms)", "{:,.0f}"),
    "itl_p99_ms": ("ITL p99 (ms)", "{:.1f}"),
}


def _headline_rows(hl: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for key, (name, fmt) in HEADLINE_ROWS.items():
        base, win = hl.loc["baseline", key], hl.loc["winner", key]
        change = win / base - 1 if base and not math.isnan(base) and not math.isnan(win) else math.nan
        rows.append({"": name, "baseline": num(base, fmt), "winner": num(win, fmt), "change": num(change, "{:+.0%}")})
    return pd.DataFrame(rows)
