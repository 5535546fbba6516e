"""The study's bill (``search.views.spend``): launches and GPU-hours by phase, measured and modelled."""

from __future__ import annotations

import pytest

from autotune.results import TrialResult
from autotune.search.confirm.record import Confirmation, LaunchCost
from autotune.search.views.spend import launch_seconds, phase_spend, spend, study_spend


def _launch(
    startup: float = 2.0, *, modelled: float | None = 170.0, gpus: list[int] | None = None, **more: float
) -> TrialResult:
    durations = {"startup": startup, "warmup": 4.0, "measure": 4.0, "teardown": 1.0, **more}
    return TrialResult(status="ok", config={}, durations_s=durations, modelled_startup_s=modelled, gpus=gpus)


def test_a_launch_costs_its_wall_times_its_gpus_and_the_modelled_startup_replaces_the_measured():
    measured, modelled = launch_seconds(_launch(gpus=[0, 1], windows=8.0))
    assert measured == pytest.approx((2 + 4 + 4 + 1 + 8) * 2)
    assert modelled == pytest.approx((170 + 4 + 4 + 1 + 8) * 2)
    # a real engine whose log reports less startup than the health wait took: the measured bill stands
    assert launch_seconds(_launch(30.0, modelled=25.0)) == (39.0, 39.0)
    assert launch_seconds(_launch(modelled=None)) == (11.0, 11.0)
    assert launch_seconds(TrialResult(status="interrupted", config={})) is None


def test_an_untimed_launch_counts_as_a_launch_not_as_hours():
    phase = phase_spend("search", [_launch(), None, TrialResult(status="crash", config={})])
    assert (phase.launches, phase.untimed) == (3, 2)
    assert phase.gpu_h == pytest.approx(11 / 3600) and phase.modelled_gpu_h == pytest.approx(179 / 3600)


def test_phases_keep_their_order_leave_out_empty_ones_and_the_line_says_the_modelled_bill_on_the_sim():
    bill = spend({"confirmation": [_launch()] * 4, "search": [_launch()] * 8, "stress": []}, simulated=True)
    assert [p.phase for p in bill.phases] == ["search", "confirmation"] and bill.launches == 12
    line = bill.line()
    assert line.startswith("spent: 8 search launches 1.5 GPU-min, 4 confirmation launches 0.7 GPU-min; ")
    assert line.endswith("2.2 GPU-min in all, 35.8 GPU-min with the startups the modelled GPU takes")
    real = spend({"search": [_launch(modelled=None)] * 400})
    assert real.line() == "spent: 400 search launches 1.22 GPU-h; 1.22 GPU-h in all"
    cpu = spend({"search": [_launch(modelled=None)] * 8}, cpu=True)  # SGLang's CPU backend: no GPU time to speak of
    assert cpu.line() == "spent: 8 search launches 1.5 server-min; 1.5 server-min in all on SGLang's CPU backend"


def test_a_stored_confirmation_bills_its_runs_its_own_stress_launches_and_a_measured_defaults_run():
    costed = {"durations_s": {"startup": 3.0, "stress": 20.0}, "modelled_startup_s": 100.0, "gpus": [0, 1]}
    confirmation = {
        "runs": [
            {"trial": 0, "repeat": 0, "result": _launch().to_dict()},
            {"trial": 1, "repeat": 0, "result": TrialResult(status="interrupted", config={}).to_dict()},
        ],
        "stress": {
            "runs": [
                {"trial": 0, "in_confirmation": True, "result": {"survived": True}},
                {"trial": 1, "status": "ok", **costed},
                {"trial": 2, "status": "not_run", "result": None},
                {"trial": 3, "status": "ok"},
            ]
        },  # stored before its launch was costed
        "defaults": {"how": "measured once during confirmation", **costed},
    }
    bill = {p.phase: p for p in study_spend([], Confirmation.from_dict(confirmation), simulated=False).phases}
    assert (bill["confirmation"].launches, bill["confirmation"].untimed) == (2, 1)
    assert (bill["stress"].launches, bill["stress"].untimed) == (2, 1)
    assert bill["stress"].gpu_h == pytest.approx(46 / 3600) and bill["stress"].modelled_gpu_h == pytest.approx(
        240 / 3600
    )
    assert bill["defaults"].launches == 1 and "search" not in bill
    predicted = {"defaults": {"how": "predicted by the simulator's virtual clock"}}
    assert study_spend([], Confirmation.from_dict(predicted), simulated=True).phases == ()
    assert study_spend([], None, simulated=True).phases == ()
    assert launch_seconds(LaunchCost(durations_s={})) is None  # a cost that stored no durations: untimed
    assert launch_seconds(LaunchCost(durations_s={"startup": 3.0}, gpus=[0, 1])) == (6.0, 6.0)
