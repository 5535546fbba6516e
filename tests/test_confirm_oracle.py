"""The benchmark's oracle measures the confirmation as the harness does: W windows a launch, two noise terms."""

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
    assert confirm_runs[0].cost_s == pytest.approx(out.cost_s + 2 * out.window_s)  # one startup, three windows
    # the launch term is shared by a launch's windows: over many launches, launch means spread by ~5 %, windows less
    logs = np.log([[r.output_tok_s, *(w.output_tok_s for w in r.windows)]
                   for r in (runner.repeat(dict(config), 0, k, after=[WindowsStep(2)]) for k in range(200))])
    within = float(np.sqrt(np.mean(np.var(logs, axis=1, ddof=1))))
    assert within == pytest.approx(out.window_cv, rel=0.2)
    assert float(np.std(logs.mean(axis=1), ddof=1)) == pytest.approx(0.05, rel=0.25)
