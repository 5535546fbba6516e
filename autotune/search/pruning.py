"""Stopping a trial's window once its settled slices place it clearly below the incumbent (pruning on slices):
``PruningSettler``, a drop-in for the settle rule's ``Settler``, ends such a window as an unsettled measurement
that is never crowned nor confirmed. docs/search.md ("The confirmation").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.results import MeasurementVerdict
from autotune.settle import Settler, SettleRule, Settling, half_width

MIN_SLICES = 5  # window slices before a prune: fewer carry no interval worth trusting (``half_width`` needs 3)
PRUNED = "pruned"  # how a pruned window's reason begins


@dataclass(frozen=True)
class SlicePruner:
    """Prune when a window's slices put the config's rate, at the top of its 95 % interval, below ``incumbent``
    × (1 − ``resolution``). ``incumbent``: the best figure so far, in the slices' unit (tok/s of one server)."""

    incumbent: float
    resolution: float
    min_slices: int = MIN_SLICES

    def upper(self, rates: Sequence[float]) -> float | None:
        """The top of the 95 % interval of the mean slice rate; None under ``min_slices`` slices."""
        hw = half_width(rates) if len(rates) >= self.min_slices else None
        if hw is None:
            return None
        return sum(rates) / len(rates) * (1 + hw)

    def prune(self, rates: Sequence[float]) -> bool:
        top = self.upper(rates)
        return self.incumbent > 0 and top is not None and top < self.incumbent * (1 - self.resolution)


class PruningSettler(Settler):
    """The settle rule, plus the pruner on the window's slices: stops a clearly losing window early."""

    def __init__(self, rule: SettleRule, pruner: SlicePruner):
        super().__init__(rule)
        self.pruner = pruner

    def add(self, tokens: float) -> Settling | None:
        done = super().add(tokens)
        if done is not None or self.warmup_end is None:
            return done
        window = self.rates[self.warmup_end :]
        if not self.pruner.prune(window):
            return None
        mean = sum(window) / len(window)
        reason = (
            f"{PRUNED}: after {len(window) * self.slice_s:g} s of window its {mean:,.0f} tok/s (95 % at most "
            f"{self.pruner.upper(window):,.0f}) is clearly below the best so far, "
            f"{self.pruner.incumbent:,.0f} tok/s less {round(100 * self.pruner.resolution, 2):g} %"
        )
        return self.verdict(len(window), settled=False, half_width=half_width(window), reason=reason)


def pruned(measurement: MeasurementVerdict | None) -> bool:
    """Whether a trial's ``measurement`` is a pruned window (``settling_figures`` stores the settling there)."""
    settling = (measurement.settling if measurement else None) or {}
    return str(settling.get("reason") or "").startswith(PRUNED)
