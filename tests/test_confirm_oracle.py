"""The benchmark's oracle measures the confirmation as the harness does: W windows of one loop a launch, two noise
terms, the windows' correlated."""

from __future__ import annotations

import numpy as np
import pytest
from test_benchmarks import case, st  # noqa: F401  (the fixture is used by name)

from autotune.harness.windows import WindowsStep


def test_a_confirmation_launch_of_three_windows_costs_one_startup_and_draws_the_launch_term_once(case):  # noqa: F811
    oracle = st.Oracle(case, noise_cv=0.0, launch_cv=0.05)
    config = case.baseline
    out = oracle.outcome(config)
    assert out.status == "ok" and 0 < out.window_cv < 0.2 and out.window_s > 0
    confirm_runs: list = []
    runner = st._SweepRunner(oracle, np.random.default_rng(0), {}, confirm_runs)
    result = runner.repeat(dict(config), 0, 0, after=[WindowsStep(2)])
    windows = list(result.windows)
    rates = [result.output_tok_s, *(w.output_tok_s for w in windows)]
    assert len(rates) == 3 and len(set(rates)) == 3  # each window its own draw
    # one startup and warm-up, three windows of one loop: a later window costs its window only
    assert confirm_runs[0].cost_s == pytest.approx(out.cost_s + 2 * out.window_s)
    assert out.window_s == pytest.approx(case.workload.measure_s * case.tp)
    # the launch term is shared by a launch's windows, and the window terms of one loop are correlated
    # (``window_corr``): over many launches, windows spread within a launch and launch means across as modelled
    corr = st.window_corr(3, case.workload.measure_s, out.request_life_s)
    assert out.request_life_s > 0 and np.all(corr >= 0) and corr[0, 1] >= corr[0, 2]
    logs = np.log(
        [
            [r.output_tok_s, *(w.output_tok_s for w in r.windows)]
            for r in (runner.repeat(dict(config), 0, k, after=[WindowsStep(2)]) for k in range(400))
        ]
    )
    within = float(np.sqrt(np.mean(np.var(logs, axis=1, ddof=1))))
    assert within == pytest.approx(out.window_cv * np.sqrt((3 - corr.sum() / 3) / 2), rel=0.2)
    across = np.sqrt(0.05**2 + out.window_cv**2 * corr.sum() / 9)
    assert float(np.std(logs.mean(axis=1), ddof=1)) == pytest.approx(across, rel=0.2)


def test_windows_correlate_by_the_requests_they_share():
    corr = st.window_corr(4, 10.0, 40.0)  # a request lives four windows
    assert corr[0, 1] == pytest.approx(0.75) and corr[0, 3] == pytest.approx(0.25) and np.allclose(corr, corr.T)
    assert np.allclose(st.window_corr(3, 30.0, 10.0), np.eye(3))  # windows longer than a life: independent
    assert np.allclose(st.window_corr(3, 30.0, 0.0), np.eye(3))  # no rate: no sharing known
    np.linalg.cholesky(st.window_corr(12, 4.0, 600.0))  # nearly one term for all: still a valid correlation
