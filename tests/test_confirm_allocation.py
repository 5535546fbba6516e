"""The contention stage's windows per launch: the two-stage optimum from the study's own noise terms and times."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_confirm_noise import Windowed
from test_study import PlannerRunner, write_study

from autotune.config import load_config
from autotune.harness.windows import WindowsStep
from autotune.results import TrialResult, Window
from autotune.search.confirm import confirm
from autotune.search.confirm.allocation import MAX_FACTOR, LaunchCosts, launch_costs, windows_per_launch
from autotune.search.confirm.noise import NoiseModel
from autotune.search.confirm.samples import ConfirmationRun
from autotune.search.study import run_study


def noise(window_cv: float | None, launch_cv: float | None) -> NoiseModel:
    """A model with these terms (a launch mean of 3 windows each)."""
    wv = None if window_cv is None else window_cv**2
    between = None if launch_cv is None else launch_cv**2 + (wv or 0.0) / 3
    return NoiseModel(window_var=wv, window_df=10, between_var=between, between_df=4, mean_inverse_windows=1 / 3)


def test_the_optimum_follows_the_square_root_rule_and_stays_within_its_bounds():
    gpu = LaunchCosts(startup_s=152.0, window_s=40.0)
    # a long-prompt window (σW 5.8 %) against a 1 % relaunch on a GPU: W* = 5.8 × √3.8 ≈ 11.3
    assert windows_per_launch(noise(0.058, 0.01), gpu, base=3) == 11
    assert windows_per_launch(noise(0.058, 0.01), gpu, base=3) == round(math.sqrt(0.058**2 * 152 / (0.01**2 * 40)))
    assert windows_per_launch(noise(0.011, 0.01), gpu, base=3) == 3  # a quiet window: W* ≈ 2, never below base
    assert windows_per_launch(noise(0.2, 0.01), gpu, base=3) == MAX_FACTOR * 3  # capped
    assert windows_per_launch(noise(0.03, 0.0), gpu, base=3) == MAX_FACTOR * 3  # no launch term: windows are free
    sim = LaunchCosts(startup_s=0.5, window_s=10.0)  # the simulator restarts in half a second: relaunch instead
    assert windows_per_launch(noise(0.058, 0.01), sim, base=3) == 3


@pytest.mark.parametrize(
    "model, costs, base",
    [
        (noise(0.05, 0.01), None, 3),  # no times recorded
        (noise(None, 0.01), LaunchCosts(150, 40), 3),  # one window a launch: the terms are not apart
        (noise(0.05, None), LaunchCosts(150, 40), 3),  # one launch each: no launch term yet
        (noise(0.0, 0.01), LaunchCosts(150, 40), 3),  # windows that never scatter buy nothing
        (noise(0.05, 0.01), LaunchCosts(150, 40), 1),  # the study measures one window a launch
    ],
)
def test_without_a_term_or_a_time_the_study_s_own_windows_stand(model, costs, base):
    assert windows_per_launch(model, costs, base=base) == base


def _run(durations: dict[str, float], windows: int = 0, status: str = "ok") -> ConfirmationRun:
    """A confirmation run of ``windows`` later windows that took ``durations``."""
    more = tuple(
        Window(
            index=i + 2,
            status="ok",
            output_tok_s=1.0,
            tok_s_per_gpu=1.0,
            output_tokens=1,
            window_s=1.0,
            settled=True,
            first_pass=i + 1,
            last_pass=i + 1,
        )
        for i in range(windows)
    )
    return ConfirmationRun(
        trial=1, repeat=0, result=TrialResult(status=status, config={}, durations_s=durations, windows=more or None)
    )


def test_launch_costs_are_the_runs_own_medians():
    runs = [
        _run({"startup": s, "warmup": 10.0, "measure": 30.0, "windows": 80.0}, windows=2) for s in (140.0, 150.0, 170.0)
    ]
    # a launch of later windows pays its warm-up once (its loop goes on): the warm-up is the launch's, not a window's
    assert launch_costs(runs) == LaunchCosts(startup_s=160.0, window_s=40.0)
    one = [_run({"startup": 150.0, "warmup": 12.0, "measure": 30.0})]
    assert launch_costs(one) == LaunchCosts(startup_s=150.0, window_s=42.0)
    assert launch_costs([_run({}, status="startup_oom")]) is None


class Wavy(Windowed):
    """Windows that scatter ±6 % around a launch's figure (no launch term), GPU-like times: 150 s a startup, 40 s a
    window. Records each launch's repeat and window count."""

    def repeat(self, config: dict, number: int, k: int, *, after=(), warmup_s=None) -> TrialResult:
        (step,) = [s for s in after if isinstance(s, WindowsStep)]
        self.launches.append((number, k, step.count))
        result = PlannerRunner.__call__(self, config, number)
        if not result.ok:
            return result
        tok = result.output_tok_s
        more = [
            Window(
                index=i,
                status="ok",
                output_tok_s=tok * (1.06 if i % 2 else 0.94),
                tok_s_per_gpu=None,
                output_tokens=1,
                window_s=30.0,
                settled=True,
                first_pass=i,
                last_pass=i,
            )
            for i in range(2, step.count + 2)
        ]
        return dataclasses.replace(
            result,
            windows=tuple(more),
            durations_s={"startup": 150.0, "warmup": 10.0, "measure": 30.0, "windows": 40.0 * step.count},
        )


def test_contention_launches_measure_more_windows_where_windows_scatter_and_relaunches_cost_minutes(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=5))
    cfg = cfg.model_copy(update={"study": cfg.study.model_copy(update={"resolution": 1e-4})})  # keeps them open
    study = run_study(cfg, runner=PlannerRunner())
    runner = Wavy()
    conf = confirm(study, cfg, runner=runner).to_dict()  # the stored form
    base = cfg.study.confirm_windows - 1
    first = cfg.study.confirm_repeats
    staged = len(conf["order"]) + 2 * (first - 1)  # stage 1: each contender once; stage 2: the top two again
    early = [count for _, _, count in runner.launches[:staged]]
    late = [count for _, _, count in runner.launches[staged:]]
    assert early and all(count == base for count in early)  # stages 1 and 2: the study's own W
    assert late and all(count == MAX_FACTOR * cfg.study.confirm_windows - 1 for count in late)
    assert conf["stats"][str(conf["order"][0])]["windows"] > first * cfg.study.confirm_windows
