"""Configs that measured above the baseline without being crowned (unsettled, or not resolved from its noise), so the
summary never says "no config beat the baseline" while one did measure above it; the baseline's own flags and
pruned windows are never listed. docs/search.md ("The search and the confirmation").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from autotune.search.confirm.decision import ContenderStat, Verdict
from autotune.search.seeding import launch_key, unsettled, window_pruned


@dataclass(frozen=True)
class AboveEntry:
    """A trial not crowned that measured above the baseline: its gain, whether the confirmation measured it, and
    whether its windows settled (the summary's ``--json`` stores it under these names)."""

    trial: int
    gain: float
    confirmed: bool
    settled: bool


def _confirmed(stats: Mapping[str, ContenderStat], trial: FrozenTrial) -> ContenderStat | None:
    entry = stats.get(str(trial.number))
    return entry if entry and entry.median else None


def above_baseline(trials: list[FrozenTrial], verdict: Verdict | None, base: FrozenTrial | None) -> list[AboveEntry]:
    """By gain: each trial not crowned that measured above the
    baseline (``base``, a measured one; None: none). Confirmed figures are compared with the baseline's confirmed
    figure (``verdict``: the finished confirmation's, None without one); an unconfirmed trial (never relaunched) is
    listed only where its search window was unsettled, against the baseline's search figure."""
    if base is None or not base.values or base.values[0] <= 0:
        return []
    stats = verdict.stats if verdict is not None else {}
    winner = verdict.winner_trial if verdict is not None else None
    base_conf = _confirmed(stats, base)
    out = []
    for t in trials:
        if (
            t.number == base.number
            or t.state != TrialState.COMPLETE
            or t.user_attrs.get("status") != "ok"
            or not t.values
            or t.user_attrs.get("reused_from") is not None
            or launch_key(t) == launch_key(base)
            or t.number == winner
        ):
            continue
        entry = _confirmed(stats, t)
        if entry is not None and base_conf is not None:
            gain = float(entry.median or 0.0) / float(base_conf.median or 1.0)
            settled = not entry.unsettled_windows
        elif unsettled(t) and not window_pruned(t):
            gain, settled = t.values[0] / base.values[0], False
        else:
            continue
        if gain > 1.0:
            out.append(AboveEntry(t.number, round(gain, 4), confirmed=entry is not None, settled=settled))
    return sorted(out, key=lambda e: -e.gain)


def above_line(entries: list[AboveEntry], *, window_key: str = "workload.measure_max_s") -> str:
    """One line for the summary: which configs measured how far above the baseline, why none was crowned, and what
    to change (the window cap for unsettled windows, more confirmation launches for an unresolved gain)."""
    parts = []
    for e in entries[:4]:
        how = "confirmed" if e.confirmed else "search run"
        why = "did not settle" if not e.settled else "not resolved from the baseline's noise"
        parts.append(f"trial {e.trial} {e.gain:.2f}× ({how}, {why})")
    more = f" and {len(entries) - 4} more" if len(entries) > 4 else ""
    fixes = []
    if any(not e.settled for e in entries):
        fixes.append(
            f"lengthen {window_key} (the window cap) or loosen workload.target_half_width so their windows settle"
        )
    if any(e.settled for e in entries):
        fixes.append("give the confirmation more launches (study.confirm_max_repeats) or a coarser study.resolution")
    return (
        f"no config was shown to beat the baseline, but {', '.join(parts)}{more} measured above it: "
        f"{'; or '.join(fixes)}, and sweep again (the baseline stands until then)"
    )
