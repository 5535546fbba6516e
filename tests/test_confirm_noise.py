"""The confirmation's two-level noise model, its stages and its stated resolution (``search.confirm``)."""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest
from test_study import PlannerRunner, write_study

from autotune.cli.sweep import render
from autotune.config import load_config
from autotune.harness.stress import StressStep
from autotune.harness.windows import WindowsStep
from autotune.report.page import build, figures_for
from autotune.report.page import render as page
from autotune.results import Metrics, Percentiles, TrialResult, Window
from autotune.search.confirm import confirm, decide, estimate_noise, next_launches
from autotune.search.confirm.samples import ConfirmationRun, by_contender, launch_tok_s
from autotune.search.study import run_study
from autotune.search.views.summary import summarize

P = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)


def launch(tok: list[float], headroom: float | None = None) -> dict:
    """A stored confirmation result: the first window in metrics, the rest as ``windows``."""
    m = Metrics(output_tok_s=tok[0], request_s=1.0, ttft_ms=P, itl_ms=P, e2e_ms=P)
    windows = [
        Window(
            index=i + 2,
            status="ok",
            output_tok_s=v,
            tok_s_per_gpu=v,
            output_tokens=int(v),
            window_s=1.0,
            settled=True,
            first_pass=i + 1,
            last_pass=i + 1,
        )
        for i, v in enumerate(tok[1:])
    ]
    return TrialResult(status="ok", config={}, metrics=m, windows=tuple(windows) or None).to_dict()


def synthetic(
    rates: dict[int, float], launches: dict[int, int], windows: int, window_cv: float, launch_cv: float, seed: int
) -> list[ConfirmationRun]:
    """Runs drawn from the model itself: log tok/s = log rate + launch term + window term."""
    rng = np.random.default_rng(seed)
    out = []
    for n, rate in rates.items():
        for k in range(launches[n]):
            shift = rng.normal(0.0, launch_cv)
            tok = [rate * math.exp(shift + rng.normal(0.0, window_cv)) for _ in range(windows)]
            out.append(ConfirmationRun.from_dict({"trial": n, "repeat": k, "result": launch(tok)}))
    return out


def test_the_noise_model_on_exact_numbers():
    # two launches of two contenders, two windows each: every term by hand
    runs = [
        ConfirmationRun.from_dict({"trial": n, "repeat": k, "result": launch([a, b])})
        for n, k, a, b in ((1, 0, 100, 110), (1, 1, 120, 120), (2, 0, 50, 50), (2, 1, 55, 60.5))
    ]
    noise = estimate_noise(by_contender(runs, [1, 2]).values())
    y = {key: np.log(v) for key, v in {"1a": [100, 110], "1b": [120, 120], "2a": [50, 50], "2b": [55, 60.5]}.items()}
    within = sum(((v - v.mean()) ** 2).sum() for v in y.values()) / 4  # 4 launches × (2 − 1) windows
    means = {k: v.mean() for k, v in y.items()}
    between = (np.var([means["1a"], means["1b"]], ddof=1) + np.var([means["2a"], means["2b"]], ddof=1)) / 2
    assert noise.window_df == 4 and noise.between_df == 2
    assert noise.window_var == pytest.approx(within) and noise.between_var == pytest.approx(between)
    assert noise.launch_var == pytest.approx(max(0.0, between - within / 2))
    assert noise.line() == f"window CV {math.sqrt(within):.1%}, launch CV {noise.launch_cv:.1%}".replace("%", " %")


def test_known_window_and_launch_terms_are_recovered():
    rates = {n: 1000.0 * (1 + 0.1 * n) for n in range(6)}
    runs = synthetic(rates, {n: 12 for n in rates}, windows=5, window_cv=0.04, launch_cv=0.03, seed=7)
    noise = estimate_noise(by_contender(runs, list(rates)).values())
    assert noise.window_df == 6 * 12 * 4 and noise.between_df == 6 * 11
    assert noise.window_cv == pytest.approx(0.04, rel=0.1)
    assert noise.launch_cv == pytest.approx(0.03, rel=0.25)
    # one window per launch: the terms cannot be told apart, and the line says so
    single = synthetic(rates, {n: 6 for n in rates}, windows=1, window_cv=0.04, launch_cv=0.03, seed=7)
    alone = estimate_noise(by_contender(single, list(rates)).values())
    assert not alone.separated and alone.launch_cv == pytest.approx(0.05, rel=0.3)  # √(0.04² + 0.03²)
    assert "not separated" in alone.line()


def _stage(
    rates: dict[int, float], seed: int, cv: tuple[float, float] = (0.004, 0.002), **kw
) -> tuple[list[ConfirmationRun], dict]:
    """The first stage as the confirmation runs it: each contender once, then the top two again (``cv``: the
    window and launch terms drawn)."""
    order = list(rates)
    runs = synthetic(rates, {n: 1 for n in order}, 3, *cv, seed=seed)
    verdict = decide(runs, order, 0, **kw)
    plan = next_launches(order, {n: 1 for n in order}, verdict, first=2, most=8)
    top_two = sorted(rates, key=lambda n: -rates[n])[:2]
    assert sorted(n for n, _ in plan) == sorted(top_two) and all(k == 1 for _, k in plan)
    runs += [
        dataclasses.replace(r, trial=n, repeat=1)
        for n in top_two
        for r in synthetic({n: rates[n]}, {n: 1}, 3, *cv, seed=seed + 1 + n)
    ]
    verdict = decide(runs, order, 0, **kw)
    launched = {n: 1 + (n in top_two) for n in order}
    return runs, {
        **verdict.to_dict(),
        "next": next_launches(order, launched, verdict, first=2, most=8),
    }  # the stored form


def test_a_clear_gap_resolves_in_the_first_stage():
    _, verdict = _stage({0: 1000.0, 3: 1500.0, 5: 1300.0}, seed=1)
    assert verdict["winner_trial"] == 3 and verdict["resolved"] and verdict["decided"]
    assert verdict["next"] == [] and verdict["note"] == ""
    assert verdict["ci_low"] > 1.4 and verdict["noise"]["launch_df"] == 2
    assert verdict["noise"]["line"].startswith("window CV ")


def test_a_pair_within_the_resolution_is_tied_without_further_launches():
    # at a launch CV of 0.1 % two launches (t on 2 degrees of freedom: 4.3) bound the pair within ±2 %
    _, verdict = _stage({0: 1000.0, 3: 1500.0, 5: 1501.0}, seed=2, cv=(0.002, 0.001), resolution=0.02)
    assert verdict["decided"] and not verdict["resolved"] and verdict["next"] == []
    assert verdict["note"].startswith("tied within 2 %: trial ")
    assert verdict["winner_trial"] in (3, 5) and verdict["outcome"] == "winner"
    # at a resolution finer than the interval the same runs are open: both are relaunched, nothing else
    _, finer = _stage({0: 1000.0, 3: 1500.0, 5: 1501.0}, seed=2, cv=(0.002, 0.001), resolution=0.001)
    assert not finer["decided"] and sorted(n for n, _ in finer["next"]) == [3, 5]


def test_a_best_at_most_the_resolution_slower_stops_without_a_tie():
    # 1.5 % apart at 0.4 % noise: not resolved after the first stage, yet the interval's low end is above 0.98, so no
    # launch could show the runner-up 2 % faster; the runner-up, maybe far slower, is no candidate for the tie-break
    _, verdict = _stage({0: 1000.0, 3: 1500.0, 5: 1478.0}, seed=1, cv=(0.004, 0.004), resolution=0.02)
    low, high = verdict["runner_up_ci"]
    assert 0.98 <= low < 1.0 and high > 1.02
    assert verdict["decided"] and not verdict["resolved"] and verdict["next"] == [] and verdict["winner_trial"] == 3
    assert verdict["note"].startswith("settled within 2 %: trial 3's gain over trial 5")


def test_a_demoted_contender_never_wins():
    runs, verdict = _stage({0: 1000.0, 3: 1500.0, 5: 1300.0}, seed=1)
    again = decide(runs, [0, 3, 5], 0, demoted={3: "runtime OOM in the stress phase"})
    assert again.winner_trial == 5 and "trial 3 demoted: runtime OOM in the stress phase" in again.note


class Windowed(PlannerRunner):
    """A runner with ``repeat``: the planner's figure, each window a little apart; counts launches and windows."""

    def __init__(self, stop: threading.Event | None = None, stop_after: int | None = None):
        super().__init__()
        self.launches: list[tuple[int, int, int]] = []
        self.stressed: list[tuple[int, int]] = []  # the launches that ran the stress phase after their windows
        self.stop, self.stop_after = stop, stop_after

    def repeat(self, config: dict, number: int, k: int, *, after=(), warmup_s=None) -> TrialResult:
        if self.stop is not None and len(self.launches) == self.stop_after:
            self.stop.set()
            return TrialResult(status="interrupted", config=config, reason="interrupted while measuring")
        (step,) = [s for s in after if isinstance(s, WindowsStep)]
        self.launches.append((number, k, step.count))
        if any(isinstance(s, StressStep) for s in after):
            self.stressed.append((number, k))
        result = self(config, number)
        if not result.ok:
            return result
        tok = result.output_tok_s
        more = [
            Window(
                index=i,
                status="ok",
                output_tok_s=tok * (1 + 0.002 * (i % 2)),
                tok_s_per_gpu=None,
                output_tokens=1,
                window_s=1.0,
                settled=True,
                first_pass=i,
                last_pass=i,
            )
            for i in range(2, step.count + 2)
        ]
        return dataclasses.replace(result, windows=tuple(more))


def test_each_confirmation_launch_measures_its_windows_and_a_killed_one_resumes(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=5))
    study = run_study(cfg, runner=PlannerRunner())
    stop = threading.Event()
    first = Windowed(stop=stop, stop_after=3)
    assert confirm(study, cfg, runner=first, stop_event=stop) is None  # killed in its fourth launch
    assert len(study.user_attrs["confirmation"]["runs"]) == 3
    again = Windowed()
    conf = confirm(study, cfg, runner=again).to_dict()  # the stored form
    order = conf["order"]
    launches = first.launches + again.launches
    # W = 3 windows in every launch (the step adds 2), each contender once, the top two twice: no more
    assert all(count == cfg.study.confirm_windows - 1 == 2 for _, _, count in launches)
    assert len(launches) == len(order) + 2 and len({(n, k) for n, k, _ in launches}) == len(launches)
    # the top two's second launch runs the stress phase after its windows: the winner's costs no launch of its own
    assert sorted(first.stressed + again.stressed) == sorted((n, k) for n, k, _ in launches if k == 1)
    assert conf["decided"] and conf["stats"][str(conf["winner_trial"])]["windows"] == 6
    assert conf["noise"]["window_df"] > 0 and "window CV" in conf["noise"]["line"]
    windows = sum(s["windows"] for s in conf["stats"].values() if not s.get("from_search"))  # a given baseline's
    assert windows == len(launches) * cfg.study.confirm_windows
    line = f"  confirmation: {len(launches)} launches, {windows} windows; {conf['noise']['line']}"
    assert line in render(summarize(study, cfg)).splitlines()[-2:]  # the sweep's summary says what it rests on
    built = build(study, base_dir=tmp_path)  # and the report's headline
    assert f"Confirmation: {line.strip().removeprefix('confirmation: ')}." in page(built, figures_for(built))


@pytest.mark.parametrize("gpus", [None, [0, 1]], ids=["no-group-recorded", "group-recorded"])
def test_every_window_of_a_tp2_launch_is_scored_per_gpu_alike(gpus):
    """A TP-2 launch's later windows are divided by the GPUs its first is divided by, recorded or not (an
    in-process prediction records none): a launch at one steady rate has no window spread."""
    m = Metrics(output_tok_s=6000.0, request_s=1.0, ttft_ms=P, itl_ms=P, e2e_ms=P)
    later = [
        Window(
            index=i,
            status="ok",
            output_tok_s=6000.0,
            tok_s_per_gpu=3000.0,
            output_tokens=1,
            window_s=1.0,
            settled=True,
            first_pass=i - 1,
            last_pass=i - 1,
        )
        for i in (2, 3)
    ]
    result = TrialResult(status="ok", config={"tp_size": 2}, engine="sim", metrics=m, gpus=gpus, windows=tuple(later))
    sample = by_contender([ConfirmationRun(trial=4, repeat=0, result=result)], [4])[4][0]
    assert sample.rates == (3000.0, 3000.0, 3000.0)
    assert launch_tok_s(ConfirmationRun(trial=4, repeat=0, result=result)) == pytest.approx(6000.0)
