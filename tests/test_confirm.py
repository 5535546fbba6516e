"""Confirmation: interleaved re-measurement, median winner, bootstrap interval, headroom tie-break, reuse."""

from __future__ import annotations

import numpy as np
import pytest
from test_study import PlannerRunner, write_study

from autotune.config import load_config
from autotune.confirm import confirm, decide, run_sweep, summarize
from autotune.results import GpuPeaks, Metrics, Percentiles, TrialResult
from autotune.study import run_study

P = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)


def ok(tok: float, headroom: float | None = None) -> dict:
    gpu = GpuPeaks(headroom_gib=headroom) if headroom is not None else None
    m = Metrics(output_tok_s=tok, request_s=1.0, ttft_ms=P, itl_ms=P, e2e_ms=P)
    return TrialResult(status="ok", config={}, metrics=m, gpu=gpu).to_dict()


def runs(values: dict[int, list[float]], headroom: dict[int, float] | None = None) -> list[dict]:
    out = []
    for n, vs in values.items():
        out += [{"trial": n, "repeat": k, "result": ok(v, (headroom or {}).get(n))} for k, v in enumerate(vs)]
    return out


def test_winner_by_median_with_gain_interval():
    data = {3: [5000, 5100, 4900, 5050], 7: [4000, 4100, 3900, 4050], 0: [2000, 2050, 1950, 2010]}
    verdict = decide(runs(data), [3, 7, 0], baseline=0, seed=0)
    assert verdict["winner_trial"] == 3
    assert verdict["gain"] == pytest.approx(np.median(data[3]) / np.median(data[0]))
    assert verdict["ci_low"] <= verdict["gain"] <= verdict["ci_high"]
    assert verdict["ci_low"] > 2.0 and verdict["note"] == ""
    assert decide(runs(data), [3, 7, 0], baseline=0, seed=0) == verdict  # seeded: reproducible


def test_a_tie_goes_to_the_config_with_more_headroom():
    data = {3: [5000, 5200, 4800], 7: [4990, 5150, 4850], 0: [2000, 2000, 2000]}
    verdict = decide(runs(data, headroom={3: 2.0, 7: 9.0, 0: 20.0}), [3, 7, 0], baseline=0, seed=1)
    assert verdict["winner_trial"] == 7
    assert "tied" in verdict["note"] and "headroom" in verdict["note"]


def test_a_contender_that_fails_a_repeat_cannot_win():
    failed = TrialResult(status="runtime_oom", config={}, reason="CUDA out of memory").to_dict()
    rs = runs({3: [9000, 9000], 0: [2000, 2000]}) + [{"trial": 3, "repeat": 2, "result": failed}]
    verdict = decide(rs, [3, 0], baseline=0, seed=0)
    assert verdict["winner_trial"] == 0 and verdict["gain"] == pytest.approx(1.0)


def test_confirm_interleaves_stores_and_is_reused(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=6))
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    runner.calls.clear()
    conf = confirm(study, cfg, runner=runner)
    order = conf["order"]
    assert order[-1] == 0 or 0 in order  # the baseline is measured alongside
    numbers = [n for n, _ in runner.calls]
    repeats = cfg.study.confirm_repeats
    assert len(numbers) == repeats * len(order)
    assert numbers == order * repeats  # A B C base A B C base ...
    stored = study.user_attrs["confirmation"]
    assert stored["winner_trial"] == conf["winner_trial"] and len(stored["runs"]) == len(numbers)
    assert stored["baseline_trial"] == 0 and stored["gain"] > 1
    # resuming a finished study re-uses the stored confirmation
    runner.calls.clear()
    assert confirm(study, cfg, runner=runner)["winner_trial"] == conf["winner_trial"]
    assert runner.calls == []
    # ... unless more trials were added
    cfg7 = load_config(write_study(tmp_path, trials=7))
    study = run_study(cfg7, runner=runner)
    runner.calls.clear()
    confirm(study, cfg7, runner=runner)
    assert runner.calls


def test_run_sweep_summary(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=5))
    summary = run_sweep(cfg, runner=PlannerRunner())
    assert summary["confirmed"] and summary["n_trials"] == 5
    assert summary["baseline"]["output_tok_s"] == pytest.approx(1600.0)  # 16 running × 100 in the fake
    assert summary["best"]["output_tok_s"] >= summary["enqueued"][0]["output_tok_s"]
    assert summary["gain_over_baseline"] == pytest.approx(summary["best"]["output_tok_s"] / 1600.0)
    assert summary["defaults"]["how"].startswith("predicted")
    assert sum(summary["statuses"].values()) == 5
    assert summary["launched"] == 5 - summary["statuses"].get("skipped_infeasible", 0)
    assert summary["launched_oom"] == 0
    assert summarize(run_study(cfg, runner=PlannerRunner()), cfg)["best"] == summary["best"]
