"""The report's numbers: trials → DataFrames, checked against what the study stored."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import optuna
import pytest
import studyfactory as sf
from optuna.distributions import IntDistribution

from autotune.report import data as rd
from autotune.report import headline as rh
from autotune.report import importance as ri
from autotune.report import latency as rl
from autotune.results import TrialResult
from autotune.search.views.settings import device_name

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def trials_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("study")


@pytest.fixture(scope="module")
def study(trials_dir) -> optuna.Study:
    return sf.make_study(n_trials=60, seed=1, trials_dir=trials_dir)


@pytest.fixture(scope="module")
def frame(study):
    return rd.trials_frame(study)


def _results(study) -> dict[int, TrialResult]:
    return {t.number: TrialResult.from_dict(t.user_attrs["result"]) for t in study.trials}


def test_every_trial_is_kept_and_failures_are_labelled(study, frame):
    results = _results(study)
    assert list(frame["trial"]) == [t.number for t in study.trials]
    for _, row in frame.iterrows():
        status = results[row["trial"]].status
        assert row["status"] == status
        assert row["outcome"] == rd.OUTCOMES[status][0]
        if status in ("crash", "timeout"):
            assert row["state"] == "FAIL" and math.isnan(row["tok_s"]) and row["reason"]
        elif status in ("startup_oom", "runtime_oom", "skipped_infeasible"):
            assert row["state"] == "COMPLETE" and row["tok_s"] == 0.0 and not row["feasible"]
        else:
            assert row["feasible"] and row["tok_s"] == pytest.approx(results[row["trial"]].output_tok_s)
    groups = set(frame["group"])
    assert {"ok", "oom", "failed"} <= groups  # the synthetic study has each kind, and none was dropped


def test_best_so_far_is_monotone_and_ignores_failures(frame):
    best = frame["best_so_far"].to_numpy()
    seen = best[~np.isnan(best)]
    assert len(seen) > 0 and np.all(np.diff(seen) >= 0)
    running = -math.inf
    for _, row in frame.iterrows():
        if row["feasible"]:
            running = max(running, row["tok_s"])
        if running > -math.inf:
            assert row["best_so_far"] == pytest.approx(running)
    assert frame["best_so_far"].iloc[-1] == pytest.approx(frame.loc[frame["feasible"], "tok_s"].max())


def test_role_label_and_params_come_from_the_trial(study, frame):
    assert frame.loc[0, "role"] == "baseline" and frame.loc[1, "label"] == "hand-tuned"
    assert rd.tuned_flags(study) == list(sf.DISTRIBUTIONS)
    assert frame.loc[1, "params_max_mamba_cache_size"] == 200
    assert frame.loc[1, "max_running_requests"] == 40  # 200 slots // 5 per request under extra_buffer
    assert frame.loc[0, "spec_steps"] == 3


def test_memory_parts_add_up_to_the_planner_total(study, frame):
    memory = rd.memory_frame(frame, study)
    results = _results(study)
    assert len(memory) == len(frame)  # every trial has a plan, failures included
    for _, row in memory.iterrows():
        plan = results[row["trial"]].plan
        gib = plan["gib"]
        assert row["mamba_states"] + row["spec_intermediates"] == pytest.approx(gib["mamba_total"])
        assert row["headroom"] == pytest.approx(gib["headroom"])
        parts = sum(row[p] for p in rd.MEMORY_PARTS)
        if plan["failure"] == "startup_oom":  # the pools may over-commit the device: the stack can exceed it
            assert parts == pytest.approx(max(row["total_gib"], parts - row["other"]))
        else:
            assert parts == pytest.approx(plan["extra"]["total_gib"], abs=1e-9)
            assert row["predicted_peak_gib"] == pytest.approx(row["total_gib"] - row["headroom"])
        gpu = results[row["trial"]].gpu
        if gpu is not None:
            assert row["observed_peak_gib"] == pytest.approx(gpu.peak_used_gib)
    assert (memory.loc[memory["group"] == "oom", "headroom"] < 0).any()  # a predicted OOM shows as negative


def test_latency_uses_records_for_baseline_and_top_three(study, frame, trials_dir):
    latency = rl.latency_frame(frame, study)
    fastest = frame[frame["feasible"]].sort_values("tok_s", ascending=False)["trial"].tolist()
    expected = [0] + [n for n in fastest if n != 0][:3]
    assert list(dict.fromkeys(latency["trial"])) == expected
    assert set(latency["source"]) == {"records"}
    quantiles = latency[list(rl.QUANTILES)].to_numpy()
    assert np.all(np.diff(quantiles, axis=1) >= 0)
    stored = _results(study)
    for _, row in latency.iterrows():  # the studyfactory's stored percentiles come from the same records
        pct = stored[row["trial"]].metrics.ttft_ms if row["metric"] == "ttft" else stored[row["trial"]].metrics.itl_ms
        assert row["p50"] == pytest.approx(pct.p50) and row["p99"] == pytest.approx(pct.p99)


def test_latency_falls_back_to_stored_percentiles(tmp_path):
    study = sf.make_study(n_trials=12, seed=2, trials_dir=tmp_path, with_records=False)
    frame = rd.trials_frame(study)
    latency = rl.latency_frame(frame, study)
    assert len(latency) and set(latency["source"]) == {"stored percentiles"}
    base = _results(study)[0].metrics
    row = latency[(latency["trial"] == 0) & (latency["metric"] == "itl")].iloc[0]
    assert row["p90"] == pytest.approx(base.itl_ms.p90) and math.isnan(row["p25"])


def test_record_formats_replay_chunks_and_precomputed(tmp_path):
    replay = [
        {"row": 0, "sent": 1.0, "chunks": [[1.5, 1], [1.6, 2], [1.7, 1]], "error": None},
        {"row": 1, "sent": 0.0, "chunks": [[9.0, 3]], "error": "aborted"},
    ]
    assert rl._record_values(replay, "ttft").tolist() == pytest.approx([500.0])
    assert rl._record_values(replay, "itl").tolist() == pytest.approx([50.0, 50.0, 100.0])
    precomputed = [{"ttft_s": 0.2, "itl_s": [0.01, 0.02]}]
    assert rl._record_values(precomputed, "itl").tolist() == pytest.approx([10.0, 20.0])


def test_pareto_front_of_a_two_objective_study():
    study = sf.make_study(n_trials=40, seed=4, multi_objective=True, name="mo")
    frame = rd.trials_frame(study)
    pareto = rd.pareto_frame(study, frame)
    assert set(pareto["trial"]) == set(frame.loc[frame["feasible"], "trial"])  # OOMs never reach the front
    front, rest = pareto[pareto["on_front"]], pareto[~pareto["on_front"]]
    assert len(front) >= 1
    for _, p in front.iterrows():  # tok/s maximised, p99 ITL minimised
        assert not (
            (pareto["tok_s"] >= p["tok_s"])
            & (pareto["second"] <= p["second"])
            & ((pareto["tok_s"] > p["tok_s"]) | (pareto["second"] < p["second"]))
        ).any()
    for _, p in rest.iterrows():
        assert ((front["tok_s"] >= p["tok_s"]) & (front["second"] <= p["second"])).any()
    assert rd.second_objective(rd.study_config(study)) == "p99_itl_ms"
    single = sf.make_study(n_trials=6, seed=4)
    assert rd.pareto_frame(single, rd.trials_frame(single)).empty


def test_importance_covers_tuned_flags_and_finds_the_binding_one(study):
    importance = ri.importance_frame(study)
    assert set(importance["param"]) == set(sf.DISTRIBUTIONS)
    assert importance["importance"].sum() == pytest.approx(1.0)
    # In the synthetic world Mamba slots cap concurrency, which drives throughput.
    assert importance.iloc[0]["param"] == "max_mamba_cache_size"
    tiny = sf.make_study(n_trials=2, seed=1, confirm=False)
    assert ri.importance_frame(tiny).empty


def test_headline_uses_the_confirmation_stage(study, frame):
    confirmation = study.user_attrs["confirmation"]
    headline = rh.headline_frame(frame, study)
    winner = confirmation["winner_trial"]
    repeats = [r for r in confirmation["runs"] if r["trial"] == winner]
    assert headline.loc["winner", "trial"] == winner and headline.loc["baseline", "trial"] == 0
    median = confirmation["stats"][str(winner)]["median"]
    assert headline.loc["winner", "tok_s"] == pytest.approx(median)  # the confirmed estimate, as the summary's
    assert headline.loc["winner", "repeats"] == len(repeats)
    assert headline.loc["winner", "tok_s_low"] == pytest.approx(median * 0.99)  # the stage's interval
    assert headline.loc["winner", "max_running_requests"] == frame.loc[winner, "max_running_requests"]
    gain = rh.gain(study, headline)
    assert gain.gain == pytest.approx(confirmation["gain"]) and gain.ci_low < gain.gain < gain.ci_high
    assert gain.over_defaults == pytest.approx(headline.loc["winner", "tok_s"] / (1.2 * median_of(study, 0)))


def median_of(study, number):
    return study.user_attrs["confirmation"]["stats"][str(number)]["median"]


def test_headline_without_confirmation_picks_the_fastest_feasible():
    study = sf.make_study(n_trials=20, seed=5, confirm=False)
    frame = rd.trials_frame(study)
    headline = rh.headline_frame(frame, study)
    best = frame.loc[frame.loc[frame["feasible"], "tok_s"].idxmax()]
    assert headline.loc["winner", "trial"] == best["trial"] and headline.loc["winner", "repeats"] == 0
    assert math.isnan(headline.loc["winner", "tok_s_low"])
    gain = rh.gain(study, headline)
    assert gain.gain == pytest.approx(best["tok_s"] / frame.loc[0, "tok_s"]) and gain.ci_low is None


def test_a_study_over_gpu_groups_is_ranked_and_shown_per_gpu():
    from autotune.report.figures import _hover

    study = optuna.create_study(direction="maximize")
    p = {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}
    for tok_s, gpus, role in ((1000.0, [0], "baseline"), (5000.0, [0, 1], "search"), (3000.0, [2], "search")):
        result = TrialResult.from_dict(
            {
                "status": "ok",
                "config": {"tp_size": len(gpus)},
                "gpus": gpus,
                "metrics": {"output_tok_s": tok_s, "request_s": 1.0, "ttft_ms": p, "itl_ms": p, "e2e_ms": p},
            }
        )
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE,
                value=tok_s / len(gpus),
                user_attrs={"result": result.to_dict(), "status": "ok", "role": role, "constraint": [-1.0]},
            )
        )
    frame = rd.trials_frame(study)
    assert frame["gpus"].tolist() == [1, 2, 1] and frame["tok_s_per_gpu"].tolist() == [1000.0, 2500.0, 3000.0]
    assert rd.winner_trial(frame, study) == 2  # the faster server (trial 1) spans two GPUs: 2,500 per GPU
    headline = rh.headline_frame(frame, study)
    assert headline.loc["winner", "tok_s_per_gpu"] == 3000.0 and rh.gain(study, headline).gain == 3.0
    hover = _hover(frame)
    assert "on 2 GPUs (2,500 tok/s per GPU)" in hover[1] and "per GPU" not in hover[2]


def test_flag_diff_lists_only_changes():
    diff = rh.flag_diff(
        {"max_mamba_cache_size": 80, "speculative_algorithm": "EAGLE", "enable_metrics": False},
        {
            "max_mamba_cache_size": 200,
            "speculative_algorithm": "EAGLE",
            "mem_fraction_static": 0.93,
            "enable_metrics": None,
            "disable_radix_cache": True,
        },
    )
    assert diff.to_dict("records") == [
        {"flag": "--disable-radix-cache", "baseline": "default", "winner": "on"},
        {"flag": "--max-mamba-cache-size", "baseline": "80", "winner": "200"},
        {"flag": "--mem-fraction-static", "baseline": "default", "winner": "0.93"},
    ]


def test_failures_link_to_logs_relative_to_the_report(frame, trials_dir):
    reports = trials_dir / "reports"
    failures = rd.failures_frame(frame, base_dir=reports)
    assert len(failures) == int((frame["status"] != "ok").sum())
    for _, row in failures.iterrows():
        assert not Path(row["log"]).is_absolute()
        assert (reports / row["log"]).resolve() == (trials_dir / "trials" / str(row["trial"]) / "server.log").resolve()
        assert row["reason"]


def test_slo_violation_and_fail_without_result():
    study = optuna.create_study()
    ok = TrialResult.from_dict(
        {
            "status": "ok",
            "config": {},
            "metrics": {"output_tok_s": 900.0, "request_s": 1.0, "ttft_ms": {}, "itl_ms": {}, "e2e_ms": {}},
        }
    )
    study.add_trial(optuna.trial.create_trial(value=900.0, user_attrs={"result": ok.to_dict(), "constraint": [-1.0]}))
    study.add_trial(
        optuna.trial.create_trial(value=1200.0, user_attrs={"result": ok.to_dict(), "constraint": [0.0, 35.0]})
    )
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
    frame = rd.trials_frame(study)
    assert frame["group"].tolist() == ["ok", "slo", "failed"]
    assert frame["best_so_far"].tolist()[:2] == [900.0, 900.0]  # the faster SLO violator never counts
    assert frame.loc[2, "status"] == "interrupted"


def test_compare_frame_summarises_each_study():
    b200, h200 = sf.make_study(n_trials=15, name="b"), sf.make_study(n_trials=15, name="h", gpu="h200")
    frames = {"b": rd.trials_frame(b200), "h": rd.trials_frame(h200)}
    table = rh.compare_frame(frames, {"b": rd.study_config(b200), "h": rd.study_config(h200)})
    assert table["gpu"].tolist() == ["b200", "h200"]
    for _, row in table.iterrows():
        f = frames[row["study"]]
        assert row["best_tok_s"] == pytest.approx(f.loc[f["feasible"], "tok_s"].max())
        assert row["gain"] == pytest.approx(row["best_tok_s"] / f.loc[0, "tok_s"])
    assert table.loc[0, "best_tok_s"] > table.loc[1, "best_tok_s"]  # B200 has more bandwidth and memory


def test_records_file_is_read_from_the_trial_dir(study, frame, trials_dir):
    winner = rd.winner_trial(frame, study)
    lines = (trials_dir / "trials" / str(winner) / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert rl._records(str(trials_dir / "trials" / str(winner)), None) == records


def test_importance_ranks_the_search_flags_even_when_the_baseline_sets_few():
    study = optuna.create_study(direction="maximize")
    dists = {"slots": IntDistribution(1, 10), "steps": IntDistribution(1, 5)}
    study.add_trial(
        optuna.trial.create_trial(
            value=1.0, params={"steps": 3}, distributions={"steps": dists["steps"]}, user_attrs={"role": "baseline"}
        )
    )
    for slots, steps in [(1, 1), (3, 5), (5, 2), (7, 4), (9, 3), (10, 1), (2, 2), (8, 5)]:
        study.add_trial(
            optuna.trial.create_trial(
                value=100.0 * slots,
                params={"slots": slots, "steps": steps},
                distributions=dists,
                user_attrs={"role": "search"},
            )
        )
    importance = ri.importance_frame(study)
    assert importance["param"].tolist()[0] == "slots" and set(importance["param"]) == {"slots", "steps"}


@pytest.mark.parametrize(
    "settings, label",
    [
        ({"engine": {"kind": "sim", "sim_gpu": "h200"}}, "h200"),
        ({"engine": {"kind": "sglang", "device": "cpu", "sim_gpu": "b200"}}, "CPU"),  # not the simulator's default GPU
        ({"engine": {"kind": "sglang", "device": "cuda", "sim_gpu": "h200"}}, "GPU (planner profile h200)"),
        ({"engine": "sglang", "device": "cpu"}, "CPU"),  # a flat record (provenance.json)
        ({"engine": "sim", "gpu_name": "b200"}, "b200"),
        ({"engine": {"kind": "sim", "device": "cpu", "sim_gpu": "h200"}}, "CPU (simulated, paced as h200)"),
    ],
)
def test_device_label_follows_the_engine_and_device(settings, label):
    assert device_name(settings) == label


def test_launch_settings_are_the_studys_engine():
    settings = {
        "engine": {"kind": "sglang", "python": "/opt/sgl/bin/python", "device": "cpu", "env": {"OMP_NUM_THREADS": "2"}}
    }
    assert rd.launch_settings(settings) == rd.LaunchSettings(
        python="/opt/sgl/bin/python", device="cpu", env={"OMP_NUM_THREADS": "2"}
    )
    assert rd.launch_settings({}) == rd.LaunchSettings(python=None, device="cuda", env={})
