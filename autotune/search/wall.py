"""The memory fraction at the wall: a sampled config launches at the highest fraction its corrected plan starts.

Behind a running cap the search sets, a higher fraction only grows the pools, so its one price is an OOM, which is
the planner's to judge; the sampler keeps the fraction without a planner, without the running cap in the user's
hands, or with ``[study] memory_fraction = "sampled"``. Why, and what it measured: docs/search.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optuna.distributions import FloatDistribution

from autotune.config import StudyConfig
from autotune.search.space import Feasibility, Space

FRACTION = "mem_fraction_static"
RUNNING_CAP = "max_running_requests"
STEP = 0.01  # the values tried on a range without a step of its own
PLACED_ATTR = "placed_flags"  # the study's flags the sweep placed, not the sampler (the report shows them as tuned)


@dataclass(frozen=True)
class Wall:
    """Places a proposal's memory fraction; ``values``: the fraction's range, highest first."""

    space: Space  # the study's space with the fraction in it (its derived flags are recomputed at each value)
    feasibility: Feasibility
    values: tuple[float, ...]

    @classmethod
    def of(cls, cfg: StudyConfig, space: Space, feasibility: Feasibility | None) -> Wall | None:
        """The wall for this study, or None where the sampler keeps the fraction (see the module docstring)."""
        param = next((p for p in space.params if p.name == FRACTION), None)
        if (
            cfg.study.memory_fraction != "wall"
            or feasibility is None
            or param is None
            or param.when is not None
            or param.spec.condition is not None
            or not isinstance(param.distribution, FloatDistribution)
        ):
            return None
        if RUNNING_CAP not in space.names and RUNNING_CAP not in space.fixed:
            return None
        dist = param.distribution
        step = dist.step or STEP
        count = int(round((dist.high - dist.low) / step)) + 1
        values = tuple(v for v in (round(dist.high - i * step, 6) for i in range(count)) if v >= dist.low - 1e-9)
        return cls(space, feasibility, values)

    def place(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` at the highest fraction whose corrected plan starts clear of the wall
        (``Feasibility.clear``); at the lowest when none does (the planner's pre-check then says why it is skipped)."""
        for value in self.values:
            placed = self.space.complete({**config, FRACTION: value})
            if self.feasibility.clear(self.feasibility.predict(placed, inert=False)):
                return placed
        return self.space.complete({**config, FRACTION: self.values[-1]})
