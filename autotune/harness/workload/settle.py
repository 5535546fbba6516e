"""The replay's side of the settle rule (``autotune.settle``): output tokens counted into fixed slices by arrival
time as the chunks come in, so the control loop reads each finished slice without walking the records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotune.settle import Settler, SettleRule, Settling, settle

__all__ = ["NextWindow", "SettleRule", "Settler", "Settling", "SliceTally", "settle", "settling_figures"]


class NextWindow(Settler):
    """The settle rule of a window that follows another in the same closed loop: the loop is warm, so the window
    opens at once (``before``: every slice rate since the loop's start) and ends as any window does (its floor,
    target and cap). Its ``Settling`` counts slices from the loop's start, so its ``window`` is in the loop's clock."""

    def __init__(self, rule: SettleRule, before: Sequence[float]):
        super().__init__(rule)
        self.rates = list(before)
        self.warmup_end = len(self.rates)
        self.warmup_settled = True


class SliceTally:
    """Tokens per slice of ``slice_s`` seconds since the replay's start, by each chunk's arrival time."""

    def __init__(self, slice_s: float):
        self.slice_s = slice_s
        self.tokens: list[int] = []

    def add(self, t: float, n: int) -> None:
        index = int(t / self.slice_s)
        if index >= len(self.tokens):
            self.tokens.extend([0] * (index + 1 - len(self.tokens)))
        self.tokens[index] += n

    def slice(self, index: int) -> int:
        return self.tokens[index] if index < len(self.tokens) else 0


def settling_figures(settling: Settling | None) -> dict[str, Any]:
    """A trial's ``measurement`` entries: ``settled`` (the window met the settle rule before its caps; an unsettled
    trial is recorded, never crowned) and ``settling`` (every slice's tok/s, where the window began and ended)."""
    if settling is None:
        return {}
    return {"settled": settling.settled, "settling": settling.to_dict()}
