"""Whether ours' stated claims hold against the truth's steady state.

Ours' confirmation states, per study, a 95 % interval for the winner's gain over the baseline and, where it
found one, a verdict that two configs are "tied within r" (the gap's whole interval inside ±r) or "settled within
r" (the winner at most r slower). Each is checked here against the steady-state rates of the configs it names
(``steady_truth``): a 95 % interval should hold the true gain in about 95 % of studies (the table calls ≥ 90 %
met), a "within r" verdict be true (the table calls ≥ 95 % met).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping
from typing import Any

PAIR = re.compile(r"(tied|settled) within ([\d.]+) %: trial (\d+)'s gain over trial (\d+)")
BASELINE_TIE = re.compile(r"trial (\d+)'s [\d,]+ tok/s against the baseline's [\d,]+ is tied within ([\d.]+) %")


def claims(confirm: Mapping[str, Any]) -> list[tuple[str, int, int, float]]:
    """The "within r" verdicts of one confirmation: (kind, trial a, trial b, r); kind "tied" says |a/b − 1| ≤ r,
    "settled" says a ≥ (1 − r) b."""
    note = str(confirm.get("note") or "")
    out = [(kind, int(a), int(b), float(r) / 100) for kind, r, a, b in PAIR.findall(note)]
    base = confirm.get("baseline_trial")
    if base is not None:
        out += [("tied", int(a), int(base), float(r) / 100) for a, r in BASELINE_TIE.findall(note)]
    return out


def check(run: Any, rate: Callable[[Mapping[str, Any]], float]) -> dict[str, Any]:
    """One study's claims against ``rate`` (a config's steady rate per GPU): ``gain`` (the stated interval, the true
    gain, whether it holds it; None without a stated gain) and ``verdicts`` ((kind, true ratio, holds) each)."""
    conf: Mapping[str, Any] = getattr(run, "confirm", None) or {}
    configs: Mapping[int, dict[str, Any]] = getattr(run, "trial_configs", None) or {}
    out: dict[str, Any] = {"gain": None, "verdicts": []}
    win, base = conf.get("winner_trial"), conf.get("baseline_trial")
    if (
        conf.get("gain") is not None
        and isinstance(win, int)
        and isinstance(base, int)
        and win in configs
        and base in configs
        and rate(configs[base])
    ):
        true = rate(configs[win]) / rate(configs[base])
        low, high = float(conf["ci_low"]), float(conf["ci_high"])
        out["gain"] = {
            "low": low,
            "high": high,
            "stated": float(conf["gain"]),
            "true": true,
            "holds": low <= true <= high,
        }
    for kind, a, b, r in claims(conf):
        if a not in configs or b not in configs or not rate(configs[b]):
            continue
        ratio = rate(configs[a]) / rate(configs[b])
        holds = abs(ratio - 1) <= r if kind == "tied" else ratio >= 1 - r
        out["verdicts"].append((kind, ratio, holds))
    return out


def coverage(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled over studies: how many stated gain intervals held the true gain, how many verdicts were true, and the
    median interval's width (high over low − 1; None without one): coverage bought by width alone shows there."""
    gains = [c["gain"] for c in checks if c["gain"] is not None]
    verdicts = [v[2] for c in checks for v in c["verdicts"]]
    widths = [g["high"] / g["low"] - 1 for g in gains if g["low"] > 0]
    return {
        "gain_held": sum(g["holds"] for g in gains),
        "gains": len(gains),
        "verdicts_true": sum(verdicts),
        "verdicts": len(verdicts),
        "median_width": statistics.median(widths) if widths else None,
    }


def width(cov: Mapping[str, Any]) -> str:
    """The median interval width as the table prints it (``5.4 %``), or – without an interval."""
    return "–" if cov.get("median_width") is None else f"{100 * cov['median_width']:.1f} %"


def share(held: int, total: int) -> str:
    """``held/total (pct %)``, or – when there was nothing to check."""
    return f"{held}/{total} ({100 * held / total:.0f} %)" if total else "–"
