"""The two-level noise model (window, launch) the confirmation decides with, estimated from its own runs: each
contender's estimate and standard error, the stand-in term for a baseline's search run, and a gain's log-ratio t
interval. The model and its formulas: docs/search.md ("The confirmation").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from autotune.search.confirm.samples import LaunchSample, least_headroom
from autotune.settle import t975  # the settle rule's: one Student t for every interval


def _ss(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values)


@dataclasses.dataclass(frozen=True)
class NoiseModel:
    """The two terms and their degrees of freedom; a variance is None when no run could estimate it."""

    window_var: float | None
    window_df: int
    between_var: float | None  # pooled variance of launch means
    between_df: int
    mean_inverse_windows: float = 1.0  # mean 1/n over the launches between_var pools
    stand_in_var: float | None = None  # σS²: a search run against its config's confirmed rate (``stand_in_var``)

    @property
    def separated(self) -> bool:
        """Whether the window term is known apart (some launch measured two or more windows)."""
        return self.window_var is not None

    @property
    def launch_var(self) -> float | None:
        """σL²; with one window per launch everywhere it is the whole spread of one launch (not separated)."""
        if self.between_var is None:
            return None
        return max(0.0, self.between_var - (self.window_var or 0.0) * self.mean_inverse_windows)

    @property
    def window_cv(self) -> float | None:
        return None if self.window_var is None else math.sqrt(self.window_var)

    @property
    def launch_cv(self) -> float | None:
        var = self.launch_var
        return None if var is None else math.sqrt(var)

    @property
    def df(self) -> int:
        """The degrees of freedom an interval is read with: the launch term's when it counts, else the window's."""
        if self.launch_var:
            return self.between_df
        return self.window_df if self.window_var else 0

    def line(self) -> str:
        """``window CV x %, launch CV y %``, or what could not be estimated and why."""
        w, lcv = self.window_cv, self.launch_cv
        if w is not None and lcv is not None:
            return f"window CV {w:.1%}, launch CV {lcv:.1%}".replace("%", " %")
        if w is not None:
            return f"window CV {w:.1%}, launch CV not estimated (one launch per contender)".replace("%", " %")
        if lcv is not None:
            return (
                f"launch CV {lcv:.1%} (one window per launch: the window and launch terms are not separated)".replace(
                    "%", " %"
                )
            )
        return "noise not estimated (one measurement per contender)"

    def to_dict(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 6)

        out = {
            "window_cv": r(self.window_cv),
            "launch_cv": r(self.launch_cv),
            "window_df": self.window_df,
            "launch_df": self.between_df,
            "separated": self.separated,
            "line": self.line(),
        }
        if self.stand_in_var is not None:  # stored only when a search run stood in
            out["stand_in_cv"] = r(math.sqrt(self.stand_in_var))
        return out


def estimate_noise(samples: Iterable[list[LaunchSample]]) -> NoiseModel:
    """Both terms pooled over every contender's clean launches (a failed launch carries no window)."""
    ss_w = ss_b = 0.0
    df_w = df_b = 0
    inverse: list[float] = []
    for launches in samples:
        clean = [s for s in launches if s.ok and s.rates]
        logs = [[math.log(r) for r in s.rates] for s in clean]
        for ys in logs:
            if len(ys) > 1:
                ss_w += _ss(ys)
                df_w += len(ys) - 1
        if len(logs) > 1:
            ss_b += _ss([sum(ys) / len(ys) for ys in logs])
            df_b += len(logs) - 1
            inverse += [1 / len(ys) for ys in logs]
    return NoiseModel(
        window_var=ss_w / df_w if df_w else None,
        window_df=df_w,
        between_var=ss_b / df_b if df_b else None,
        between_df=df_b,
        mean_inverse_windows=sum(inverse) / len(inverse) if inverse else 1.0,
    )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A contender's confirmed figure: the mean of its clean launches' mean log tok/s per GPU and its SE²."""

    trial: int
    launches: int  # clean launches
    windows: int
    failed: int  # launches that did not run cleanly
    log_mean: float | None
    var: float
    headroom_gib: float | None
    unsettled: int = 0

    @property
    def rate(self) -> float:
        """tok/s per GPU (0 without a clean launch)."""
        return 0.0 if self.log_mean is None else math.exp(self.log_mean)

    def interval(self, noise: NoiseModel) -> tuple[float, float]:
        """The rate's 95 % interval (a point when no noise term is known)."""
        if self.log_mean is None:
            return 0.0, 0.0
        half = t975(noise.df) * math.sqrt(self.var) if noise.df and self.var > 0 else 0.0
        return math.exp(self.log_mean - half), math.exp(self.log_mean + half)


def estimate(trial: int, launches: list[LaunchSample], noise: NoiseModel) -> Estimate:
    """``trial``'s estimate under ``noise`` (an unknown term counts 0: the interval says what is known)."""
    clean = [s for s in launches if s.ok and s.rates]
    failed = len(launches) - len(clean)
    if not clean:
        return Estimate(
            trial=trial,
            launches=0,
            windows=0,
            failed=failed,
            log_mean=None,
            var=0.0,
            headroom_gib=least_headroom(launches),
        )
    means = [sum(math.log(r) for r in s.rates) / len(s.rates) for s in clean]
    launch_var, window_var = noise.launch_var or 0.0, noise.window_var or 0.0
    var = sum(launch_var + window_var / len(s.rates) for s in clean) / len(clean) ** 2
    return Estimate(
        trial=trial,
        launches=len(clean),
        windows=sum(len(s.rates) for s in clean),
        failed=failed,
        log_mean=sum(means) / len(means),
        var=var,
        headroom_gib=least_headroom(launches),
        unsettled=sum(s.unsettled for s in clean),
    )


@dataclasses.dataclass(frozen=True)
class Ratio:
    """``a`` over ``b``: the gain and its 95 % interval."""

    gain: float
    low: float
    high: float

    def excludes_one(self) -> bool:
        return self.low > 1.0

    def within(self, resolution: float) -> bool:
        """The whole interval inside ±``resolution``: the two are the same to the stated resolution."""
        return self.low >= 1.0 - resolution and self.high <= 1.0 + resolution


def ratio(a: Estimate, b: Estimate, noise: NoiseModel) -> Ratio | None:
    """``a``'s rate over ``b``'s with the log-ratio's t interval; None when either has no clean launch."""
    if a.log_mean is None or b.log_mean is None:
        return None
    d = a.log_mean - b.log_mean
    se = math.sqrt(a.var + b.var)
    half = t975(noise.df) * se if noise.df and se > 0 else 0.0
    return Ratio(gain=math.exp(d), low=math.exp(d - half), high=math.exp(d + half))


def stand_in_var(est: Mapping[int, Estimate], searched: Mapping[int, float]) -> float | None:
    """σS²: the variance over confirmed contenders of (log search tok/s − log confirmed estimate), less the mean
    SE² of those estimates (floored at 0); None with fewer than two contenders to learn it from. ``searched``: each
    contender's search-run tok/s per GPU. The spread, not the mean square: the contenders' common offset is mostly
    their selection (they were picked for reading high in the search), which a baseline's search run does not share;
    how far one config's reading strays from the others' is what the stand-in's own reading may stray."""
    pairs = [
        (math.log(searched[n]) - e.log_mean, e.var)
        for n, e in est.items()
        if e.log_mean is not None and e.launches and searched.get(n, 0) > 0
    ]
    if len(pairs) < 2:
        return None
    mean = sum(d for d, _ in pairs) / len(pairs)
    spread = sum((d - mean) ** 2 for d, _ in pairs) / (len(pairs) - 1)
    return max(0.0, spread - sum(v for _, v in pairs) / len(pairs))


def estimates(samples: Mapping[int, list[LaunchSample]]) -> tuple[NoiseModel, dict[int, Estimate]]:
    """The noise model of every contender's runs, and each contender's estimate under it."""
    noise = estimate_noise(samples.values())
    return noise, {n: estimate(n, launches, noise) for n, launches in samples.items()}
