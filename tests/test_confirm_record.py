"""The stored confirmation as one typed record: a real sweep's confirmation reads into ``Confirmation`` and writes
back exactly the plain data the study holds; an old study's shape (before warm-ups, stand-in search runs, windows,
the stress stage and the noise model) still reads, and writes back no key it did not hold but the verdict's own."""

from __future__ import annotations

import json

import optuna
import pytest
from tinystudy import write_tiny_study

from autotune.config import load_config
from autotune.results import GpuPeaks, Metrics, Percentiles, StressResult, TrialResult
from autotune.search.confirm.decision import Verdict
from autotune.search.confirm.record import (
    VERDICT_KEYS,
    Confirmation,
    ConfirmationRun,
    DefaultsRun,
    Demotion,
    LaunchCost,
    StressRecord,
    StressRun,
)
from autotune.search.sweep import run_sweep

P = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)


def test_a_real_sweeps_confirmation_round_trips_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.chdir(tmp_path)
    path = write_tiny_study(tmp_path, name="rec", trials=2, top_k=1, measure_s=0.5)
    # two launches of the top two (the second runs the stress phase after its windows), two windows a launch
    path.write_text(
        path.read_text().replace(
            "confirm_repeats = 1\nconfirm_windows = 1",
            "confirm_repeats = 2\nconfirm_max_repeats = 2\nconfirm_windows = 2",
        )
    )
    cfg = load_config(path)
    run_sweep(cfg)
    study = optuna.load_study(study_name="rec", storage=cfg.storage_url)
    stored = study.user_attrs["confirmation"]
    record = Confirmation.of(study)
    assert record is not None and record == Confirmation.from_dict(stored)
    assert record.to_dict() == stored  # every key, every value, as the study holds them
    assert json.loads(json.dumps(record.to_dict())) == stored  # plain data: what the storage writes
    # every part typed: the runs' results and windows, the verdict, SGLang's defaults, the stress stage
    assert record.complete and record.n_trials == len(study.trials) and set(record.order) <= set(record.warmup_s or {})
    assert record.runs and all(isinstance(r.result, TrialResult) for r in record.runs)
    assert any(r.result.windows for r in record.runs)
    assert record.verdict is not None and record.verdict.outcome in ("winner", "baseline")
    assert isinstance(record.defaults, DefaultsRun) and record.defaults.how
    assert record.stress is not None and record.stress.complete and record.stress.runs
    assert all(isinstance(r.result, StressResult) for r in record.stress.runs if r.result is not None)
    assert record.confirmed is record.verdict


def _result(tok: float) -> dict:
    """A result as a study stored it before windows, stress phases, measurement verdicts and host peaks."""
    m = Metrics(output_tok_s=tok, request_s=1.0, ttft_ms=P, itl_ms=P, e2e_ms=P)
    full = TrialResult(
        status="ok", config={"max_running_requests": 8}, metrics=m, gpu=GpuPeaks(headroom_gib=6.0)
    ).to_dict()
    return {k: v for k, v in full.items() if k not in ("windows", "stress", "measurement", "host", "fidelity")}


OLD = {  # a confirmation stored before warm-ups, stand-in search runs, the stress stage and the noise model
    "order": [2, 0],
    "n_trials": 4,
    "complete": True,
    "runs": [
        {"trial": n, "repeat": k, "result": _result(tok)} for k in range(3) for n, tok in ((2, 3000.0), (0, 1000.0))
    ],
    "winner_trial": 2,
    "baseline_trial": 0,
    "gain": 3.0,
    "ci_low": 2.9,
    "ci_high": 3.1,
    "note": "",
    "outcome": "winner",
    "resolved": True,
    "runner_up_trial": None,
    "runner_up_gain": None,
    "runner_up_ci": None,
    "stats": {
        "2": {"median": 3000.0, "ci": [2950.0, 3050.0], "runs": 3, "failed": 0, "headroom_gib": 6.0},
        "0": {"median": 1000.0, "ci": [990.0, 1010.0], "runs": 3, "failed": 0, "headroom_gib": 6.0},
    },
    "defaults": {"output_tok_s": 1200.0, "how": "measured"},
}


def test_an_old_shaped_confirmation_reads_and_writes_back_what_it_held():
    record = Confirmation.from_dict(OLD)
    assert record.order == (2, 0) and record.n_trials == 4 and record.complete
    assert record.given == () and record.warmup_s is None and record.stress is None  # keys it never held
    assert [(r.trial, r.repeat) for r in record.runs] == [(2, 0), (0, 0), (2, 1), (0, 1), (2, 2), (0, 2)]
    assert record.runs[0].result.output_tok_s == 3000.0 and record.runs[0].result.windows is None
    assert record.verdict is not None and record.verdict.winner_trial == 2 and record.verdict.decided
    assert record.verdict.stat(2) is not None and record.verdict.stat(2).ci == (2950.0, 3050.0)
    assert record.defaults == DefaultsRun(output_tok_s=1200.0, how="measured")
    out = record.to_dict()
    # nothing it never held is invented but what the verdict always writes (decided, contention, resolution, noise)
    assert set(out) - set(OLD) == {"decided", "contention", "resolution", "noise"}
    assert {k: out[k] for k in OLD if k not in ("runs", "stats", "defaults")} == {
        k: v for k, v in OLD.items() if k not in ("runs", "stats", "defaults")
    }
    assert out["stats"] == {n: {**s, "windows": 0, "unsettled_windows": 0} for n, s in OLD["stats"].items()}
    for old, new in zip(OLD["runs"], out["runs"], strict=True):  # every stored key of every result kept as it was
        assert {k: new["result"][k] for k in old["result"]} == old["result"]
    assert {k: out["defaults"][k] for k in OLD["defaults"]} == OLD["defaults"]
    assert Confirmation.from_dict(out) == record  # and it reads back the same


def test_a_confirmation_in_progress_round_trips_exactly_and_has_no_verdict():
    partial = {
        "order": [1, 0],
        "n_trials": 3,
        "complete": False,
        "warmup_s": {"1": 40.0, "0": 10.0},
        "given": [{"trial": 5, "repeat": -1, "search": True, "result": TrialResult(status="ok", config={}).to_dict()}],
        "runs": [{"trial": 1, "repeat": 0, "result": TrialResult(status="ok", config={}).to_dict()}],
    }
    record = Confirmation.from_dict(partial)
    assert record.verdict is None and record.confirmed is None and record.defaults is None
    assert record.warmup_s == {1: 40.0, 0: 10.0} and record.given[0].search and not record.runs[0].search
    assert record.to_dict() == partial


def test_the_stress_record_keeps_the_keys_each_kind_of_run_stored():
    survived = StressResult(survived=True, ended="peak reached", peak_used_gib=171.0, total_gib=179.1)
    stored = {
        "runs": [
            StressRun(
                trial=1, repeat=2, status="ok", result=survived, trial_dir="/t/1/repeat-2", in_confirmation=True
            ).to_dict(),
            {
                "trial": 2,
                "repeat": 3,
                "status": "not_run",
                "result": None,
                "reason": "this study's runner runs no follow-up steps",
            },
            {
                "trial": 3,
                "repeat": 3,
                "status": "runtime_oom",
                "reason": None,
                "trial_dir": "/t/3/repeat-3",
                "result": StressResult(survived=False, failure="runtime_oom", ended="server exited").to_dict(),
                "durations_s": {"startup": 3.0, "stress": 20.0},
                "modelled_startup_s": 100.0,
                "gpus": [0],
            },
        ],
        "demoted": [{"trial": 3, "reason": "worst case: FAILED"}],
        "decided_trial": 1,
    }
    record = StressRecord.from_dict(stored)
    assert record.to_dict() == stored and not record.complete  # ``complete`` is written once it finished
    assert [r.failed for r in record.runs] == [False, False, True]
    assert record.demoted == (Demotion(3, "worst case: FAILED"),)
    assert record.of(1)[0].in_confirmation and record.of(1)[0].result == survived
    # a launch of its own keeps what it took (the study's bill); one in a confirmation launch or never run, nothing
    assert [r.cost for r in record.runs] == [
        None,
        None,
        LaunchCost(durations_s={"startup": 3.0, "stress": 20.0}, modelled_startup_s=100.0, gpus=[0]),
    ]


def test_a_measured_defaults_run_keeps_its_cost_and_a_predicted_one_has_none():
    predicted = {
        "status": "ok",
        "output_tok_s": 900.0,
        "tok_s_per_gpu": 900.0,
        "reason": None,
        "how": "predicted by the simulator's virtual clock",
        "config": {"speculative_algorithm": "EAGLE"},
        "trial_dir": None,
        "log_path": None,
    }
    measured = {
        **predicted,
        "how": "measured once during confirmation",
        "trial_dir": "/t/defaults",
        "durations_s": {"startup": 90.0, "measure": 30.0},
        "modelled_startup_s": 85.0,
        "gpus": [0, 1],
    }
    for stored in (predicted, measured):
        assert DefaultsRun.from_dict(stored).to_dict() == stored
    assert DefaultsRun.from_dict(predicted).cost is None
    assert DefaultsRun.from_dict(measured).cost == LaunchCost(
        durations_s={"startup": 90.0, "measure": 30.0}, modelled_startup_s=85.0, gpus=[0, 1]
    )


@pytest.mark.parametrize("attrs", [{}, {"confirmation": None}, {"confirmation": {}}])
def test_no_confirmation_stored_reads_as_none(attrs):
    assert Confirmation.of(attrs) is None


def test_the_reader_takes_a_study_or_its_user_attrs():
    study = optuna.create_study()
    assert Confirmation.of(study) is None
    record = Confirmation(
        order=(1,), n_trials=2, runs=(ConfirmationRun(trial=1, repeat=0, result=TrialResult(status="ok", config={})),)
    )
    assert record.store(study) is record
    assert Confirmation.of(study) == record == Confirmation.of(study.user_attrs)


def test_a_verdict_is_told_apart_by_the_keys_it_writes():
    full = Verdict(outcome="winner", winner_trial=1, baseline_trial=0, demoted={"2": "failed its stress phase"})
    assert set(full.to_dict()) == VERDICT_KEYS  # every key a verdict may write marks one as stored
    held = {"order": [1, 0], "n_trials": 2, "complete": False, "runs": [], "winner_trial": 1}  # decided, still running
    assert Confirmation.from_dict(held).verdict is not None
    assert Confirmation.from_dict({**held, "complete": True}).confirmed is not None
    assert Confirmation.from_dict({k: v for k, v in held.items() if k != "winner_trial"}).verdict is None
