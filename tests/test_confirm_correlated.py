"""The confirmation's noise model stays calibrated when a launch's windows are consecutive spans of one closed loop
(``harness.windows``): their window terms are then correlated, the within-launch spread understates one window's
term, and the launch term, estimated from the spread of launch means, carries what it leaves out."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_confirm_noise import launch

from autotune.search.confirm.noise import estimates, ratio
from autotune.search.confirm.samples import ConfirmationRun, by_contender

WINDOWS, LAUNCHES, WINDOW_CV, LAUNCH_CV = 3, 2, 0.03, 0.01  # the confirmation's top two: 2 launches × 3 windows
RATES = {0: 1000.0, 1: 1030.0}


def correlated_runs(rng: np.random.Generator, life_windows: float) -> list[ConfirmationRun]:
    """Runs drawn with windows i and j of a launch correlated max(0, 1 − |i − j| / life): a request lives
    ``life_windows`` windows, so neighbouring windows share most of theirs."""
    lag = np.abs(np.subtract.outer(np.arange(WINDOWS), np.arange(WINDOWS)))
    factor = np.linalg.cholesky(np.clip(1.0 - lag / life_windows, 0.0, None) + 1e-12 * np.eye(WINDOWS))
    out = []
    for n, rate in RATES.items():
        for k in range(LAUNCHES):
            shift = rng.normal(0.0, LAUNCH_CV)
            tok = [rate * math.exp(shift + WINDOW_CV * z) for z in factor @ rng.standard_normal(WINDOWS)]
            out.append(ConfirmationRun.from_dict({"trial": n, "repeat": k, "result": launch(tok)}))
    return out


@pytest.mark.parametrize("life_windows", [3.0, 14.0])  # 14: the quick start's 4 s windows of ~56 s requests
def test_the_gain_interval_holds_the_true_gain_when_a_launchs_windows_are_correlated(life_windows):
    held, within = 0, []
    for seed in range(400):
        runs = correlated_runs(np.random.default_rng(seed), life_windows)
        noise, est = estimates(by_contender(runs, list(RATES)))
        gain = ratio(est[1], est[0], noise)
        held += gain.low <= RATES[1] / RATES[0] <= gain.high
        within.append(noise.window_cv)
    assert held / 400 >= 0.92  # a 95 % interval, on 400 draws
    # the within-launch spread reads below the window term the draws carry: the correlation is real here
    assert float(np.median(within)) < 0.9 * WINDOW_CV
