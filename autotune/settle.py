"""When a closed-loop measurement has settled: one rule on the run's per-slice throughput, used by the HTTP replay
(``harness.workload``) and by the simulator's in-process evaluator (``sim.evaluate``), so both stop at the same
slice on the same series. The rule (warm-up slices that agree, a window whose long-run 95 % interval is narrow
enough, caps at ``CAP_FACTOR`` × the floors) and why its defaults: docs/search.md ("steady state by construction").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

SLICE_S = 2.0  # seconds per slice (shorter for a window floor under MIN_WINDOW_SLICES slices of it)
MIN_WINDOW_SLICES = 5  # slices a window floor holds at least: a shorter floor gets shorter slices
AGREE_SLICES = 3  # consecutive slices that must agree before the warm-up may end
AGREE_TOLERANCE = 0.20  # ... their two runs' means within this share of each other
TARGET_HALF_WIDTH = 0.05  # the window's 95 % half-width, as a share of its mean rate
CAP_FACTOR = 4.0  # a cap left unset is this many times its floor
LAG_SHARE = 1 / 3  # the long-run variance sums autocovariances over lags up to this share of the slices
# An unset ramp spans this share of the warm-up floor: stream k of c starts at k / c × ramp, so the closed loop
# starts desynchronised, and the floor's second half (three 2 s slices of a 10 s floor) sees the ramped-in load.
RAMP_SHARE = 0.5
# Two-sided 95 % Student t quantiles for 1..10 degrees of freedom; beyond, the Cornish-Fisher expansion (< 1e-3 off).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def ramp_seconds(warmup_s: float, ramp_s: float | None) -> float:
    """The ramp a workload asked for, else ``RAMP_SHARE`` of its warm-up floor."""
    return warmup_s * RAMP_SHARE if ramp_s is None else ramp_s


def t975(df: float) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (floored: the safe side)."""
    n = max(1, int(df))
    if n <= len(_T975):
        return _T975[n - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * n) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * n**2)


def half_width(rates: Sequence[float]) -> float | None:
    """The 95 % half-width of the mean of ``rates`` over that mean; None under 3 slices or a mean of 0 (nothing to
    be sure of). The variance of the mean is the long-run one (Newey-West, Bartlett weights over lags up to a third
    of the slices): waves of prefills make neighbouring slices covary, positively or, over a wave, negatively."""
    n = len(rates)
    mean = sum(rates) / n if n else 0.0
    if n < 3 or mean <= 0:
        return None
    dev = [r - mean for r in rates]
    gamma0 = sum(d * d for d in dev) / n
    if gamma0 == 0:
        return 0.0
    lags = max(1, int(n * LAG_SHARE))
    long_run = gamma0 + 2 * sum(
        (1 - k / (lags + 1)) * sum(a * b for a, b in zip(dev, dev[k:], strict=False)) / n for k in range(1, lags + 1)
    )
    long_run = max(long_run, gamma0 / n)  # an estimate driven to 0 by a wave's negative lags is not certainty
    return t975(n - 1) * math.sqrt(long_run / n) / mean


def agree(rates: Sequence[float], run: int, tolerance: float) -> bool:
    """Whether the last two runs of ``run`` consecutive slices agree: their mean rates lie within ``tolerance`` of
    each other's mean (and carried tokens at all). Runs, not single slices: a slice of a long-prompt workload swings
    ±30 % with the waves of prefills even in steady state, a run of three (6 s) about ±10 %."""
    if len(rates) < 2 * run:
        return False
    before = sum(rates[-2 * run : -run]) / run
    last = sum(rates[-run:]) / run
    mean = (before + last) / 2
    return mean > 0 and abs(last - before) <= tolerance * mean


@dataclass(frozen=True, kw_only=True)
class SettleRule:
    """Floors, caps and targets of one measurement; caps left None are ``CAP_FACTOR`` × their floor."""

    warmup_s: float
    measure_s: float
    warmup_max_s: float | None = None
    measure_max_s: float | None = None
    target_half_width: float = TARGET_HALF_WIDTH
    tolerance: float = AGREE_TOLERANCE
    agree: int = AGREE_SLICES

    @classmethod
    def fixed(cls, warmup_s: float, measure_s: float) -> SettleRule:
        """A warm-up and window of exactly these lengths (caps at the floors); still flagged when unsettled."""
        return cls(warmup_s=warmup_s, measure_s=measure_s, warmup_max_s=warmup_s, measure_max_s=measure_s)

    @property
    def slice_s(self) -> float:
        return min(SLICE_S, self.measure_s / MIN_WINDOW_SLICES)

    def _slices(self, seconds: float) -> int:
        return math.ceil(seconds / self.slice_s - 1e-9)

    @property
    def warmup_slices(self) -> tuple[int, int]:
        """(floor, cap) of the warm-up in slices."""
        floor = self._slices(self.warmup_s)
        cap = self.warmup_s * CAP_FACTOR if self.warmup_max_s is None else self.warmup_max_s
        return floor, max(floor, self._slices(cap))

    @property
    def window_slices(self) -> tuple[int, int]:
        """(floor, cap) of the window in slices."""
        floor = max(1, self._slices(self.measure_s))
        cap = self.measure_s * CAP_FACTOR if self.measure_max_s is None else self.measure_max_s
        return floor, max(floor, self._slices(cap))

    @property
    def max_s(self) -> float:
        """The longest the warm-up and window can run together."""
        return (self.warmup_slices[1] + self.window_slices[1]) * self.slice_s


@dataclass(frozen=True, kw_only=True)
class Settling:
    """How one measurement settled: every slice's rate (tok/s) from the run's start, where the window began and
    ended (in slices), and whether both the warm-up and the window met the rule before their caps."""

    slice_s: float
    tok_s: list[float] = field(default_factory=list)
    warmup_slices: int = 0
    window_slices: int = 0
    warmup_settled: bool = True
    settled: bool = True
    half_width: float | None = None  # the window's 95 % half-width over its mean rate
    reason: str | None = None  # why it is unsettled

    @property
    def window(self) -> tuple[float, float]:
        """The window in seconds since the run's start."""
        return self.warmup_slices * self.slice_s, (self.warmup_slices + self.window_slices) * self.slice_s

    @property
    def total_s(self) -> float:
        return self.window[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tok_s": [round(r, 2) for r in self.tok_s],
            "half_width": None if self.half_width is None else round(self.half_width, 4),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Settling | None:
        if not data:
            return None
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def settling_of(measurement: Any) -> Settling | None:
    """The settling a trial's ``measurement`` (``results.MeasurementVerdict``) recorded; None without one."""
    return Settling.from_dict(measurement.settling) if measurement is not None else None


class Settler:
    """The rule fed one slice at a time (its token count): ``add`` returns the ``Settling`` once the run may stop,
    None while it must go on. Deterministic: the same series stops at the same slice (``settle``)."""

    def __init__(self, rule: SettleRule):
        self.rule = rule
        self.slice_s = rule.slice_s
        self.rates: list[float] = []
        self.warmup_end: int | None = None  # slices of warm-up, once it has ended
        self.warmup_settled = True
        self._check_warmup()

    @property
    def in_window(self) -> bool:
        return self.warmup_end is not None

    def _check_warmup(self) -> None:
        floor, cap = self.rule.warmup_slices
        n = len(self.rates)
        if self.warmup_end is not None or n < floor:
            return
        k = self.rule.agree
        if floor == 0 or agree(self.rates, k, self.rule.tolerance):
            self.warmup_end = n
        elif n >= cap:
            self.warmup_end, self.warmup_settled = n, False

    def add(self, tokens: float) -> Settling | None:
        self.rates.append(tokens / self.slice_s)
        if self.warmup_end is None:
            self._check_warmup()
            return None
        window = self.rates[self.warmup_end :]
        floor, cap = self.rule.window_slices
        if len(window) < floor:
            return None
        hw = half_width(window)
        met = hw is not None and hw <= self.rule.target_half_width
        # A window with no token yet runs on to its cap like any unsettled one: a server slow to answer its first
        # streams (a long first prefill, a loaded host) is measured once it does; one that never answers is too
        # slow at the cap (the caller says why), never at the floor.
        idle = not any(window)
        if not met and len(window) < cap:
            return None
        reasons = []
        if not self.warmup_settled:
            reasons.append(
                f"the warm-up's last two runs of {self.rule.agree} slices still differed by more than "
                f"{self.rule.tolerance:.0%} at its cap ({self.warmup_end * self.slice_s:g} s)"
            )
        if idle:
            reasons.append(f"no token arrived in the window's {len(window) * self.slice_s:g} s")
        elif not met:
            reasons.append(
                f"the window's 95% half-width was {'unknown' if hw is None else f'{hw:.1%}'} (target "
                f"{self.rule.target_half_width:.0%}) at its cap ({len(window) * self.slice_s:g} s)"
            )
        return self.verdict(len(window), settled=not reasons, half_width=hw, reason="; ".join(reasons) or None)

    def verdict(self, window_slices: int, *, settled: bool, half_width: float | None, reason: str | None) -> Settling:
        """The run so far as a ``Settling`` whose window is its last ``window_slices`` slices (a subclass that stops
        a window early, ``search.pruning``, reports through it too)."""
        return Settling(
            slice_s=self.slice_s,
            tok_s=list(self.rates),
            warmup_slices=self.warmup_end or 0,
            window_slices=window_slices,
            warmup_settled=self.warmup_settled,
            settled=settled,
            half_width=half_width,
            reason=reason,
        )


def settle(tokens_per_slice: Sequence[float], rule: SettleRule) -> Settling | None:
    """The rule on a whole series: where it stops (None when the series ends before the rule would stop)."""
    settler = Settler(rule)
    for tokens in tokens_per_slice:
        done = settler.add(tokens)
        if done is not None:
            return done
    return None


class SettleFields(Protocol):
    """A workload's settle fields: the study's ``[workload]`` record and the simulator's ``SimWorkload`` both."""

    @property
    def warmup_s(self) -> float: ...
    @property
    def measure_s(self) -> float: ...
    @property
    def warmup_max_s(self) -> float | None: ...
    @property
    def measure_max_s(self) -> float | None: ...
    @property
    def target_half_width(self) -> float: ...
    @property
    def settle_tolerance(self) -> float: ...
    @property
    def ramp_s(self) -> float | None: ...


def settle_rule(workload: SettleFields) -> SettleRule:
    """The rule ``workload``'s fields set."""
    return SettleRule(
        warmup_s=workload.warmup_s,
        measure_s=workload.measure_s,
        warmup_max_s=workload.warmup_max_s,
        measure_max_s=workload.measure_max_s,
        target_half_width=workload.target_half_width,
        tolerance=workload.settle_tolerance,
    )


def ramp_of(workload: SettleFields) -> float:
    """Seconds over which the streams start: within the warm-up floor (a shortened warm-up clips it)."""
    return min(workload.warmup_s, ramp_seconds(workload.warmup_s, workload.ramp_s))


W = TypeVar("W", bound=SettleFields)


def with_warmup(workload: W, warmup_s: float | None) -> W:
    """``workload`` with its warm-up floor raised to ``warmup_s`` and its ramp kept as it was (a longer ramp would only
    delay the turnover); unchanged when ``warmup_s`` is not longer."""
    if warmup_s is None or warmup_s <= workload.warmup_s:
        return workload
    cap = workload.warmup_max_s
    changes = {
        "warmup_s": warmup_s,
        "ramp_s": ramp_of(workload),
        "warmup_max_s": None if cap is None else max(cap, warmup_s),
    }
    if dataclasses.is_dataclass(workload):  # the simulator's SimWorkload
        return dataclasses.replace(workload, **changes)  # type: ignore[type-var]
    return workload.model_copy(update=changes)  # type: ignore[attr-defined, no-any-return]  # the study's record
