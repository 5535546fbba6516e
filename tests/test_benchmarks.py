"""Smoke tests for the benchmarks: tiny spaces, budgets and seeds; they check the machinery, never timings."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import ground_truth as gt  # noqa: E402
import measurement_noise as mn  # noqa: E402
import search_efficiency as se  # noqa: E402
import search_figure as fig  # noqa: E402
import search_table as tab  # noqa: E402
import strategies as st  # noqa: E402

from autotune.config import load_config  # noqa: E402
from autotune.errors import AutotuneError  # noqa: E402

TINY = """
[study]
name = "tiny"
[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"
sim_options = {{ noise = 0.02 }}
[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1
context_length = 8192
[space]
max_mamba_cache_size = {{ type = "int", low = 64, high = 256, step = 64 }}
mamba_full_memory_ratio = {{ type = "float", low = 0.2, high = 1.5 }}
mem_fraction_static = {{ type = "float", low = 0.85, high = 0.95, step = 0.05 }}
max_running_requests = {{ type = "int", low = 16, high = 64, step = 16 }}
speculative_num_steps = {{ type = "int", low = 2, high = 3 }}
[space.derived]
speculative_num_draft_tokens = "speculative_num_steps + 1"
[workload]
prompts = "{prompts}"
sample_size = 30
warmup_s = 2
measure_s = 3
[baseline]
flags = {{ speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 80 }}
"""


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> st.Case:
    path = tmp_path_factory.mktemp("study") / "tiny.toml"
    path.write_text(TINY.format(prompts=ROOT / "examples" / "prompts.jsonl"))
    return se.case_from_config("tiny", load_config(path))


@pytest.fixture(scope="module")
def oracle(case) -> st.Oracle:
    return st.Oracle(case, noise_cv=0.01)


def test_exhaustive_matches_brute_force(case, oracle):
    """The grid shortcuts (top fitting memory fraction, one simulation per signature) lose nothing here."""
    truth = gt.exhaustive(case, oracle, jobs=1)
    space = case.space.without({"mamba_full_memory_ratio"})  # inert: the planner prunes it
    values = [gt.grid_values(p) for p in space.params]
    brute = 0.0
    for combo in itertools.product(*values):
        config = space.complete({**space.fixed, **dict(zip(space.names, combo, strict=True))})
        brute = max(brute, oracle.outcome(config).tok_s)
    assert truth["grid"] == 4 * 3 * 4 * 2
    assert truth["groups"] <= truth["families"] < truth["grid"]
    assert brute > truth["baseline_tok_s"] > 0
    assert truth["tok_s"] == pytest.approx(brute)


def test_launch_costs(case, oracle):
    ok = oracle.outcome(case.baseline)
    startup = ok.result.modelled_startup_s
    assert ok.status == "ok" and 100 < startup < 300
    assert ok.cost_s == pytest.approx(startup + case.workload.warmup_s + case.workload.measure_s)
    oom = oracle.outcome({**case.baseline, "max_mamba_cache_size": 4096, "mem_fraction_static": 0.95})
    assert oom.status == "startup_oom" and oom.tok_s == 0.0
    assert 0 < oom.cost_s <= startup  # it failed while loading: no warm-up, no window


def test_a_confirmation_launch_is_evaluated_and_costed_at_its_own_warmup(case, oracle):
    short = oracle.outcome(case.baseline)
    warm = oracle.outcome(case.baseline, case.workload.warmup_s + 20.0)
    assert warm is not short and warm is oracle.outcome(case.baseline, case.workload.warmup_s + 20.0)  # memoised
    assert oracle.outcome(case.baseline, case.workload.warmup_s) is short  # not longer: the study's own launch
    assert warm.cost_s - short.cost_s == pytest.approx(20.0 * case.tp)
    # the warm-up is the launch's, paid once: a later window of the same loop costs its window alone
    assert warm.window_s == short.window_s == pytest.approx(case.workload.measure_s * case.tp)
    assert warm.result.durations_s["warmup"] == case.workload.warmup_s + 20.0
    launch, result = oracle.launch(
        case.baseline, np.random.default_rng(0), windows=3, warmup_s=case.workload.warmup_s + 20.0
    )
    assert launch.cost_s == pytest.approx(warm.cost_s + 2 * warm.window_s) and len(result.windows) == 2


@pytest.mark.parametrize("name", list(st.STRATEGIES))
def test_strategies_spend_the_budget(case, oracle, name):
    launches = st.STRATEGIES[name](case, oracle, 6, 0)
    # the budget counts launches (a skipped trial is free); the first edge start alone stops after it
    assert sum(x.launched for x in launches) == (2 + len(case.cfg.enqueue) if name == "first-edge-alone" else 6)
    assert all(x.cost_s > 0 for x in launches if x.launched)
    assert all(x.cost_s == 0 for x in launches if not x.launched)
    best = st.best_so_far(launches)
    for i, value in enumerate(best):  # the pick is always a config measured so far
        assert value == 0.0 or value in {x.true for x in launches[: i + 1] if x.status == "ok"}
    assert any(x.status == "ok" for x in launches)
    assert all(x.true == oracle.outcome(x.config).tok_s for x in launches if x.launched)


def test_ours_starts_from_the_baseline_and_skips_what_cannot_start(case, oracle):
    launches = st.ours(case, oracle, 8, 1)
    assert launches[0].config == case.baseline
    skipped = [x for x in launches if not x.launched]
    assert all(oracle.outcome(x.config).status != "ok" for x in skipped)


def test_figures_from_launches():
    def launch(status, true, cost, observed=None):
        return st.Launch({}, status, true if observed is None else observed, true, cost)

    runs = [
        launch("startup_oom", 0, 3600),
        launch("ok", 90, 3600),
        launch("skipped_infeasible", 0, 0),
        launch("ok", 99, 1800, observed=80),
        launch("ok", 98.5, 1800),
    ]
    # The 99 config measured low (80), so the pick stays at 90 until 98.5 is measured.
    assert st.best_so_far(runs) == [0.0, 90, 90, 90, 98.5]
    summary = tab.summarise(runs, 100.0)
    assert summary["trials"] == 5 and summary["gpu_h98"] == pytest.approx(3.0)
    assert summary["launches"] == 4 and summary["ooms"] == 1 and summary["oom_h"] == pytest.approx(1.0)
    assert summary["pct"] == pytest.approx(98.5)
    assert tab.to_target(runs[:2], 100.0) == (float("inf"), float("inf"))
    assert tab.med_iqr([1.0, 2.0, float("inf")], ".0f", 40) == "2 [2–>40]"


@pytest.mark.slow
def test_run_case_writes_table_and_figure(case, tmp_path, monkeypatch):
    import steady_truth as stt

    for module in (stt, tab):  # a 30 s steady state: the table's machinery is the claim, and it names its window
        monkeypatch.setattr(module, "STEADY_S", 30.0)
    result = se.run_case(case, seeds=2, budgets=[4, 6], say=lambda text: None, cache_dir=tmp_path, proposals=True)
    cached = list(tmp_path.glob("ground-truth-tiny-*.cache.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["tok_s"] == result["truth"]["tok_s"]
    result.pop("case")
    text = tab.markdown([result], seeds=2, budgets=[4, 6], seconds=1.0)
    for name in [*st.STRATEGIES, *st.PROPOSALS]:
        assert f"| {name} |" in text
    assert "## tiny" in text and "% of the optimum" in text and "Hidden truth" in text
    assert set(tab.ABLATIONS) < set(st.STRATEGIES)  # every ablation is a row; the rest are the rival strategies
    assert "ahead of every other strategy" in text and "ours minus each ablation" in text
    assert "Steady-state optimum (30 s warm-up + 30 s window" in text and "window-scored % @6" in text
    assert "equal GPU-h" in text and "Calibration, pooled" in text
    # Every "% of opt." is a pick's steady rate over the steady optimum, which no pick exceeds.
    steady = result["steady"]
    picks = [r.steady for rs in [*result["runs"].values(), *result["equal"].values()] for r in rs]
    assert steady["tok_s"] > 0 and max(picks) <= steady["tok_s"] and steady["grid_examined"] >= 1
    assert list(tmp_path.glob("steady-tiny-*.cache.json"))
    # The rivals at equal GPU-hours launch more than at equal launches when ours confirmed (never fewer).
    for (name, b), runs in result["equal"].items():
        for seed, run in enumerate(runs):
            assert len(run) >= len(result["runs"][name, b][seed])
    assert len(result["calibration"]) == 2  # one study per seed at the top budget
    fig.figure([result], [4, 6], tmp_path / "fig.html")
    html = (tmp_path / "fig.html").read_text()
    assert "ours" in html and "modelled GPU-hours" in html


def test_space_hash_follows_the_space(case):
    narrower = case.cfg.space["max_running_requests"].model_copy(update={"high": 48.0})
    other = case.cfg.model_copy(update={"space": {**case.cfg.space, "max_running_requests": narrower}})
    assert gt.space_hash(case) == gt.space_hash(case)
    assert gt.space_hash(case) != gt.space_hash(se.case_from_config("tiny", other))


def test_unknown_case_is_a_one_line_error(capsys):
    assert se.main(["--cases", "nope"]) == 1
    assert "unknown case 'nope'" in capsys.readouterr().err
    assert se.main(["--window", "90"]) == 1
    assert "--window must be WARMUP,MEASURE" in capsys.readouterr().err


def test_window_overrides_the_study_trial_window():
    default, settled = (
        se.make_case("qwen3.6-27b-b200", "seed"),
        se.make_case("qwen3.6-27b-b200", "seed", window=(90, 30)),
    )
    assert (settled.workload.warmup_s, settled.workload.measure_s) == (90, 30)
    assert (default.workload.warmup_s, default.workload.measure_s) != (90, 30)
    assert settled.workload.prompts == default.workload.prompts and settled.truth == default.truth


def test_window_rates_from_records(tmp_path):
    rows = [
        {
            "row": 0,
            "sent": 0.0,
            "chunks": [[1.0, 10], [2.5, 10], [4.0, 10]],
            "finish_reason": "length",
            "error": None,
            "ended": 4.0,
            "accept_length": None,
        },
        {
            "row": 1,
            "sent": 0.0,
            "chunks": [[1.5, 5], [3.5, 5]],
            "finish_reason": None,
            "error": None,
            "ended": None,
            "accept_length": None,
        },
    ]
    (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rates = mn.window_rates(tmp_path, 1.0, [1.0, 3.0], concurrency=2)
    assert rates[1.0] == pytest.approx(15.0)  # [1, 2): 10 + 5 tokens
    assert rates[3.0] == pytest.approx(10.0)  # [1, 4): 10 + 5 + 10 + 5; the chunk at 4.0 is outside


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_noise_through_the_real_harness(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    cfg = load_config(mn.STUDY)
    cfg = cfg.model_copy(update={"workload": cfg.workload.model_copy(update={"warmup_s": 1.0, "sample_size": 40})})
    config = {**cfg.engine.fixed, **cfg.enqueue[0].flags}
    runs = mn.harness_runs(
        config, cfg=cfg, repeats=2, windows=[1.0, 2.0], noise=0.02, workdir=tmp_path, say=lambda text: None
    )
    assert len(runs) == 2 and all(r[1.0] > 0 and r[2.0] > 0 for r in runs)
    virtual = mn.evaluator_runs(config, cfg=cfg, repeats=2, windows=[1.0, 2.0], noise=0.02)
    text = mn.report(
        config,
        {"same seed": runs, "new seed": runs},
        virtual,
        windows=[1.0, 2.0],
        warmup_s=1.0,
        noise=0.02,
        default_s=12,
        seconds=5,
    )
    assert "| 1 |" in text and "| 2 |" in text and "same seed: CV %" in text


def test_ours_budget_counts_launches_not_skipped_trials(case, oracle):
    launches = st.ours(case, oracle, 5, 2)
    assert sum(x.launched for x in launches) == 5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_noise_reports_failed_launches(tmp_path, monkeypatch):
    """A launch that fails is data, listed as such; too few good launches is one clear error."""
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    cfg = load_config(mn.STUDY)
    config = {**cfg.engine.fixed, **cfg.enqueue[0].flags, "max_mamba_cache_size": 100_000}
    failures: list[str] = []
    with pytest.raises(AutotuneError, match="only 0 of 2 launches measured"):
        mn.harness_runs(
            config,
            cfg=cfg,
            repeats=2,
            windows=[1.0],
            noise=0.02,
            workdir=tmp_path,
            say=lambda text: None,
            failures=failures,
        )
    assert len(failures) == 2 and all("startup_oom" in f for f in failures)


def test_truth_is_a_seeded_draw_in_the_declared_ranges():
    for workload, (_, max_tokens, (lo, hi)) in se.WORKLOADS.items():
        truth = se.draw_truth("qwen3.6-27b-b200", workload)
        assert truth == se.draw_truth("qwen3.6-27b-b200", workload)  # the same in every run and process
        d = truth.deviation
        assert -3 <= d.free_gib <= 3 and 0.7 <= d.activation_scale <= 1.3 and 0.7 <= d.graph_scale <= 1.3
        assert 0.85 <= d.decode_efficiency <= 1.15 and abs(truth.acceptance - 0.825) <= 0.1
        assert 0.9 <= d.unified_efficiency <= 1.05 and 0.9 <= d.adaptive_efficiency <= 1.05  # the levers' own
        assert lo * max_tokens <= truth.output_mean <= hi * max_tokens and 0.2 <= lo < hi <= 0.95
    assert se.draw_truth("qwen3.6-27b-b200", "seed") != se.draw_truth("qwen3.6-27b-h200", "seed")
    assert se.draw_truth("qwen3.6-27b-b200", "seed", hidden=False).deviation.memory_is_exact
    other = se.draw_truth("qwen3.6-27b-b200", "seed", seed=se.TRUTH_SEED + 1)  # --truth-seed: another truth
    assert other != se.draw_truth("qwen3.6-27b-b200", "seed") and other == se.draw_truth(
        "qwen3.6-27b-b200", "seed", seed=se.TRUTH_SEED + 1
    )
    assert se.make_case("qwen3.6-27b-b200", truth_seed=se.TRUTH_SEED + 1).truth == other


def test_workload_prompts_span_the_declared_lengths():
    from autotune.prompts import PromptSample

    long = [len(r.as_text()) / 4 for r in PromptSample.load(se.workload_prompts("long-prompt"), 200, 0).rows]
    mixed = [len(r.as_text()) / 4 for r in PromptSample.load(se.workload_prompts("mixed"), 200, 0).rows]
    assert 5000 < sum(long) / len(long) < 7000 and max(long) <= 7800
    assert min(mixed) < 200 and max(mixed) > 4000


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_run_is_reproducible(tmp_path):
    """Two runs with the same seeds print the same table (each run re-executes under PYTHONHASHSEED=0), the first on
    an empty cache of its own (the ground truth and the steady rates computed), the second reading it. Short trial
    windows (``--window 2,4``) keep the first run's grid and every strategy's launches cheap: the claim is that the
    table is a function of its seeds, whatever the window and the cache; the test writes nothing under
    benchmarks/."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    tables = []
    for i in range(2):
        out = tmp_path / str(i)
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "search_efficiency.py"),
                "--quick",
                "--seeds",
                "1",
                "--no-figure",
                "--window",
                "2,4",
                "--out",
                str(out),
                "--cache",
                str(tmp_path / "cache"),
            ],
            check=True,
            env=env,
            capture_output=True,
            timeout=1500,
        )
        text = (out / "search_efficiency.md").read_text()
        tables.append([line for line in text.splitlines() if not line.startswith("Generated by")])
    assert tables[0] == tables[1]


def test_the_80b_rows_score_per_gpu_as_the_tool_does():
    from autotune.results import TrialResult
    from autotune.search.objective import per_gpu

    big = se.make_case("qwen3-next-80b-a3b-h200", window=(1.0, 2.0))
    assert big.tp == 2 and se.gpus_of(big.baseline) == 2
    config = dict(big.baseline)
    launches = st.Launches(
        [st.Launch(config, "ok", 3000.0, 3100.0, 10.0), st.Launch(config, "startup_oom", 0.0, 0.0, 5.0)]
    )
    launches.named, launches.named_config, launches.confirm_launches = 3100.0, config, 3
    scored = se.per_gpu_launches(launches)
    assert [(x.observed, x.true, x.cost_s) for x in scored] == [(1500.0, 1550.0, 10.0), (0.0, 0.0, 5.0)]
    assert (scored.named, scored.confirm_launches) == (1550.0, 3)
    # The tool's own score of the same measurement: the study's objective divides by the same count.
    assert (
        per_gpu(
            TrialResult.from_dict(
                {"status": "ok", "config": config, "metrics": {"output_tok_s": 3000.0, "request_s": 1.0}}
            )
        )
        == 1500.0
    )
    one = se.per_gpu_launches([st.Launch({"tp_size": 1}, "ok", 2000.0, 2000.0, 1.0)])
    assert one[0].observed == 2000.0 and one.named is None  # a 1-GPU case is unchanged


def test_the_stress_phase_is_its_own_phase_in_a_confirmation_launch_and_in_one_of_its_own():
    import numpy as np

    from autotune.harness.stress import DEFAULT_CAP_S, StressStep
    from autotune.harness.windows import WindowsStep

    case = se.make_case("qwen3.6-27b-b200", window=(1.0, 2.0))
    oracle = st.Oracle(case, noise_cv=0.01, launch_cv=0.01)
    runner = st._SweepRunner(oracle, np.random.default_rng(0), {}, confirm_runs := [])
    config = dict(case.baseline)
    out = oracle.outcome(config)
    phase = oracle.stress_s(config)
    running = out.result.capacity.max_running_requests
    assert 0 < phase == pytest.approx(min(DEFAULT_CAP_S, running * case.workload.max_tokens / out.tok_s) * case.tp)
    # In a confirmation launch: the launch is the confirmation's, its stress phase the stress's.
    result = runner.repeat(config, 0, 1, after=[WindowsStep(2), StressStep()])
    assert len(confirm_runs) == 1 and confirm_runs[0].cost_s == pytest.approx(out.cost_s + 2 * out.window_s)
    assert runner.stress_runs == [pytest.approx(phase)] and runner.stress_launches == 0
    stress = result.stress
    assert stress.survived and stress.running_cap == running and len(result.windows) == 2
    # A launch of its own: all of it is the stress's, none the confirmation's.
    runner.repeat(config, 0, 2, after=[StressStep()])
    assert len(confirm_runs) == 1 and runner.stress_launches == 1
    assert runner.stress_runs[1] == pytest.approx(out.cost_s + phase)


def test_steady_rates_are_memoised_on_disk(case, oracle, tmp_path, monkeypatch):
    """The steady-state optimum's rates are evaluated once: a second run reads them back and simulates nothing."""
    import steady_truth as stt

    monkeypatch.setattr(stt, "STEADY_S", 30.0)  # memoisation is the claim here, not the 300 s rate itself
    truth = gt.exhaustive(case, oracle, jobs=1)
    ranked = [config for _, config in truth["top"]]
    assert len(ranked) >= 2 and truth["top"][0][0] >= truth["top"][-1][0]  # best window score first
    first = stt.SteadyRates(case, tmp_path)
    best = stt.steady_optimum(first, ranked, [case.baseline], se.gpus_of)
    assert first.evaluated >= min(stt.TOP, len(ranked)) and best["tok_s"] > 0
    assert best["tok_s"] == max(first.rate(c) for c in [*ranked[: best["grid_examined"]], case.baseline])
    first.save()

    def no_simulation(*args, **kwargs):
        raise AssertionError("a memoised steady rate was evaluated again")

    monkeypatch.setattr(stt, "simulate", no_simulation)
    second = stt.SteadyRates(case, tmp_path)
    assert stt.steady_optimum(second, ranked, [case.baseline], se.gpus_of) == best and second.evaluated == 0


def test_equal_gpu_hours_extends_a_rival_by_what_ours_spent_after_its_search():
    import equal_cost

    ours = st.Launches([st.Launch({}, "ok", 1.0, 1.0, 100.0)])
    ours.confirm_cost_s, ours.stress_cost_s = 250.0, 50.0
    rival = [
        st.Launch({}, "ok", 1.0, 1.0, 100.0),
        st.Launch({}, "startup_oom", 0, 0, 20.0),
        st.Launch({}, "skipped_infeasible", 0, 0, 0.0),
    ]
    assert equal_cost.after_search_s(ours) == 300.0
    assert equal_cost.extra_launches(ours, rival) == 5  # 300 GPU-s at a mean launch of 60 GPU-s (skips not counted)
    rival[1] = st.Launch({}, "startup_oom", 0, 0, 30.0)
    assert equal_cost.extra_launches(ours, rival) == 5  # 300 / 65 = 4.6: a part launch is a whole one
    assert equal_cost.extra_launches(st.Launches(), rival) == 0


def test_calibration_checks_the_stated_gain_and_within_verdicts():
    import calibration

    run = st.Launches()
    run.trial_configs = {0: {"c": 0}, 3: {"c": 3}, 5: {"c": 5}}
    run.confirm = {
        "winner_trial": 3,
        "baseline_trial": 0,
        "gain": 1.5,
        "ci_low": 1.4,
        "ci_high": 1.6,
        "note": "tied within 2 %: trial 3's gain over trial 5 is 1.010× (CI 0.99–1.02×, inside ±2 %); x",
    }
    rates = {0: 100.0, 3: 145.0, 5: 150.0}
    out = calibration.check(run, lambda c: rates[c["c"]])
    assert out["gain"]["holds"] and out["gain"]["true"] == pytest.approx(1.45)
    assert out["verdicts"] == [("tied", pytest.approx(145 / 150), False)]  # 3.3 % apart: the tie was not true
    rates[0] = 80.0
    out = calibration.check(run, lambda c: rates[c["c"]])
    assert not out["gain"]["holds"]
    cov = calibration.coverage([out, out])
    assert (cov["gain_held"], cov["gains"], cov["verdicts_true"], cov["verdicts"]) == (0, 2, 0, 2)
    assert cov["median_width"] == pytest.approx(1.6 / 1.4 - 1) and calibration.width(cov) == "14.3 %"
    assert calibration.coverage([])["median_width"] is None and calibration.width(calibration.coverage([])) == "–"
    settled = {"baseline_trial": 0, "note": "settled within 2 %: trial 3's gain over trial 5 is 0.99×"}
    assert calibration.claims(settled) == [("settled", 3, 5, 0.02)]
    held = {
        "baseline_trial": 0,
        "note": "no config beat the baseline: trial 3's 1,000 tok/s against the baseline's "
        "990 is tied within 2 % (CI 0.99–1.03×)",
    }
    assert calibration.claims(held) == [("tied", 3, 0, 0.02)]


def test_warm_start_reach_follows_the_best_measured_config_at_steady_state():
    import warm_start as ws

    def launch(name: str, observed: float, status: str = "ok", cost_s: float = 360.0) -> st.Launch:
        return st.Launch({"name": name}, status, observed, observed, cost_s)

    steady = {"a": 90.0, "b": 98.0, "c": 99.0}
    run = [launch("a", 100.0), launch("skip", 0.0, "skipped_infeasible", 0.0), launch("b", 95.0), launch("c", 120.0)]
    rate = lambda config: steady.get(config["name"], 0.0)  # noqa: E731
    # "b" runs at 98 % but measured below "a": not yet picked; "c", measured best, is picked at the third launch
    assert ws.reach(run, rate, 100.0) == (3.0, 3 * 360.0 / 3600)
    assert ws.reach(run[:3], rate, 100.0) == (float("inf"), float("inf"))


def test_a_warm_run_measures_the_earlier_studys_configs_right_after_the_baseline(case, oracle):
    from autotune.search.views.origin import warm_record
    from autotune.sglang.flags import FlagTable

    earlier = st._sweep(case, oracle, 6, 0)
    record, lines = warm_record(
        earlier.study, "in memory", case.cfg, table=FlagTable.bundled(), version="0.5.23 (simulated)", name="tiny@0"
    )
    assert record["configs"] and lines[0].startswith("started from study tiny@0 (in memory;")
    warm = st._sweep(case, oracle, 6, 1, warm=record)
    trials = warm.study.get_trials()
    carried = [t.user_attrs["config"] for t in trials[1 : 1 + len(record["configs"])]]
    assert trials[0].user_attrs["role"] == "baseline"
    assert carried == [c["config"] for c in record["configs"]]
    assert sum(x.launched for x in warm) == 6  # the carried configs are launches of the same budget
