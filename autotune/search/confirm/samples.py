"""The confirmation's runs as samples: one ``LaunchSample`` per confirmation launch, with its windows' tok/s per GPU.

A run is a ``ConfirmationRun`` (stored as ``{"trial", "repeat", "result"}``); the result's first window is its
``metrics``, later windows of the same launch are ``result.windows`` (``harness.windows``). Runs stored before
windows existed have none: a launch of one window, which the noise model reads as such.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from autotune.results import TrialResult
from autotune.search.objective import gpus_spanned, per_gpu


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmationRun:
    """One confirmation launch of a contender (``repeat`` k), or a search run standing in for one (``search``:
    a baseline far behind the leader, repeat -1)."""

    trial: int
    repeat: int
    result: TrialResult
    search: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial": self.trial,
            "repeat": self.repeat,
            **({"search": True} if self.search else {}),
            "result": self.result.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConfirmationRun:
        return cls(
            trial=int(data["trial"]),
            repeat=int(data["repeat"]),
            search=bool(data.get("search")),
            result=TrialResult.from_dict(data["result"]),
        )


@dataclasses.dataclass(frozen=True)
class LaunchSample:
    """One confirmation launch of a contender: ``rates`` holds the tok/s per GPU of each trusted window, the first
    window first; a launch that failed (any status but ok, or no tok/s) has none and ``ok`` False."""

    trial: int
    repeat: int
    ok: bool
    rates: tuple[float, ...]
    headroom_gib: float | None
    unsettled: int = 0  # windows whose settle rule reached its cap (kept: a confirmation window is not a crown)


def launch_sample(run: ConfirmationRun) -> LaunchSample:
    """A confirmation run as a sample."""
    result = run.result
    first = per_gpu(result)
    ok = result.ok and first is not None and first > 0
    rates: list[float] = [first] if ok and first is not None else []
    unsettled = int(result.measurement is not None and result.measurement.settled is False)
    span = gpus_spanned(result)
    for window in (result.windows or ()) if ok else ():
        if window.ok and window.output_tok_s:
            # the score, divided as the first window's: by the GPUs recorded, else those its config spans (a
            # result with no GPU group recorded, as an in-process prediction, still spans tp_size of them)
            rates.append(window.output_tok_s / span)
            unsettled += window.settled is False
    return LaunchSample(
        trial=run.trial,
        repeat=run.repeat,
        ok=ok,
        rates=tuple(rates),
        headroom_gib=headroom([result]),
        unsettled=unsettled,
    )


def launch_tok_s(run: ConfirmationRun) -> float | None:
    """The server's output tok/s in one confirmation launch: the mean of its trusted windows (None: it failed).
    What ``apply`` quotes per launch, so a launch of three windows counts as the confirmation counted it."""
    sample = launch_sample(run)
    if not sample.ok:
        return None
    return sum(sample.rates) / len(sample.rates) * gpus_spanned(run.result)


def by_contender(runs: Iterable[ConfirmationRun], order: Iterable[int]) -> dict[int, list[LaunchSample]]:
    """Every contender's launches in the order they ran (a contender not yet launched has an empty list)."""
    out: dict[int, list[LaunchSample]] = {n: [] for n in order}
    for run in runs:
        sample = launch_sample(run)
        out.setdefault(sample.trial, []).append(sample)
    return out


def search_rates(results: Mapping[int, TrialResult | None]) -> dict[int, float]:
    """Each contender's search run as tok/s per GPU (``decide``'s ``searched``); a failed run has none."""
    rates = {n: per_gpu(r) if r is not None and r.ok else None for n, r in results.items()}
    return {n: rate for n, rate in rates.items() if rate}


def headroom(results: list[TrialResult]) -> float | None:
    """Memory left on the device at peak: measured when the GPU monitor saw it, else the planner's figure."""
    seen = [r.gpu.headroom_gib for r in results if r.gpu and r.gpu.headroom_gib is not None]
    if seen:
        return min(seen)
    planned = [r.plan["gib"]["headroom"] for r in results if r.plan and r.plan.get("gib")]
    return min(planned) if planned else None


def least_headroom(samples: list[LaunchSample]) -> float | None:
    """The contender's least headroom over its launches (None when no launch saw or planned one)."""
    seen = [s.headroom_gib for s in samples if s.headroom_gib is not None]
    return min(seen) if seen else None
