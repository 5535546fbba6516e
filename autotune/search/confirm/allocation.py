"""How many windows a contention launch measures: the split between windows and relaunches that buys the most
precision per second, W* = √(σW² · c_L / (σL² · c_W)) from the study's own noise terms and launch and window times
(two-stage sampling, Cochran §10.6), within [``confirm_windows``, ``MAX_FACTOR`` × ``confirm_windows``]; the third
stage's only. docs/search.md ("The confirmation").
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable

from autotune.search.confirm.noise import NoiseModel
from autotune.search.confirm.samples import ConfirmationRun

MAX_FACTOR = 4  # a contention launch measures at most this many times confirm_windows


@dataclasses.dataclass(frozen=True)
class LaunchCosts:
    """What the confirmation's launches took so far (medians, seconds): a startup, and one window."""

    startup_s: float
    window_s: float


def launch_costs(runs: Iterable[ConfirmationRun]) -> LaunchCosts | None:
    """The medians of the stored runs' own ``durations_s``: per launch its ``startup`` (and its warm-up, paid once
    where later windows continue its loop: ``harness.windows``), and per window the later windows' share of
    ``windows``, or the first's warm-up and window; None until a run recorded both."""
    startups: list[float] = []
    windows: list[float] = []
    for run in runs:
        durations = run.result.durations_s or {}
        later = len(run.result.windows or ())
        if durations.get("startup"):
            startups.append(float(durations["startup"]) + (float(durations.get("warmup") or 0.0) if later else 0.0))
        first = float(durations.get("warmup") or 0.0) + float(durations.get("measure") or 0.0)
        if later and durations.get("windows"):
            windows.append(float(durations["windows"]) / later)
        elif first > 0:
            windows.append(first)
    if not startups or not windows:
        return None
    return LaunchCosts(startup_s=statistics.median(startups), window_s=statistics.median(windows))


def windows_per_launch(noise: NoiseModel, costs: LaunchCosts | None, *, base: int) -> int:
    """W* for the next contention launch (see the module docstring), within [``base``, ``MAX_FACTOR`` × ``base``];
    ``base`` while a term or a cost is unknown, or when the windows do not scatter at all."""
    if base < 2 or costs is None or costs.window_s <= 0 or not noise.window_var or noise.launch_var is None:
        return base
    most = MAX_FACTOR * base
    if noise.launch_var <= 0:
        return most
    best = math.sqrt(noise.window_var * costs.startup_s / (noise.launch_var * costs.window_s))
    return max(base, min(most, round(best)))
