"""Confirmation: interleaved re-measurement, the estimate's winner and interval, headroom tie-break, reuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_study import PlannerRunner, write_study

from autotune.cli.sweep import render
from autotune.cli.trials import rows as trial_rows
from autotune.config import load_config
from autotune.results import GpuPeaks, Metrics, Percentiles, TrialResult
from autotune.search.confirm import confirm, decide, defaults_config
from autotune.search.confirm.decision import Verdict
from autotune.search.confirm.record import ConfirmationRun, DefaultsRun
from autotune.search.objective import open_study
from autotune.search.runner import DEFAULTS_RUN
from autotune.search.study import run_study
from autotune.search.sweep import run_sweep
from autotune.search.views.summary import summarize

P = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)


def ok(tok: float, headroom: float | None = None) -> dict:
    gpu = GpuPeaks(headroom_gib=headroom) if headroom is not None else None
    m = Metrics(output_tok_s=tok, request_s=1.0, ttft_ms=P, itl_ms=P, e2e_ms=P)
    return TrialResult(status="ok", config={}, metrics=m, gpu=gpu).to_dict()


def runs(values: dict[int, list[float]], headroom: dict[int, float] | None = None) -> list[ConfirmationRun]:
    out = []
    for n, vs in values.items():
        out += [{"trial": n, "repeat": k, "result": ok(v, (headroom or {}).get(n))} for k, v in enumerate(vs)]
    return [ConfirmationRun.from_dict(r) for r in out]


def gmean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def test_winner_by_estimate_with_gain_interval():
    data = {3: [5000, 5100, 4900, 5050], 7: [4000, 4100, 3900, 4050], 0: [2000, 2050, 1950, 2010]}
    verdict = decide(runs(data), [3, 7, 0], baseline=0)
    assert verdict.winner_trial == 3
    # one window per launch (a plain runner): the estimate is the mean log tok/s of the launches
    assert verdict.gain == pytest.approx(gmean(data[3]) / gmean(data[0]))
    assert verdict.ci_low <= verdict.gain <= verdict.ci_high
    assert verdict.ci_low > 2.0 and verdict.note == ""
    assert decide(runs(data), [3, 7, 0], baseline=0) == verdict  # analytic: reproducible


def test_confirmation_ranks_by_tok_s_per_gpu():
    def on(tok: float, gpus: list[int]) -> dict:
        m = Metrics(output_tok_s=tok, request_s=1.0, ttft_ms=P, itl_ms=P, e2e_ms=P)
        return TrialResult(status="ok", config={"tp_size": len(gpus)}, metrics=m, gpus=gpus).to_dict()

    # trial 3: the fastest server (5,000 tok/s) over two GPUs; trial 7: 3,000 tok/s on one GPU, the better fleet
    rs = [
        ConfirmationRun.from_dict({"trial": n, "repeat": k, "result": on(v * (1 + 0.01 * k), g)})
        for n, v, g in ((3, 5000.0, [0, 1]), (7, 3000.0, [2]), (0, 1000.0, [3]))
        for k in range(3)
    ]
    verdict = decide(rs, [3, 7, 0], baseline=0)
    assert verdict.winner_trial == 7
    assert verdict.stats["3"].median == pytest.approx(2525.0, rel=1e-4)  # per GPU: 5,050 ÷ 2
    assert verdict.gain == pytest.approx(3030.0 / 1010.0, rel=1e-4)


def test_a_tie_goes_to_the_config_with_more_headroom():
    data = {3: [5000, 5200, 4800], 7: [4990, 5150, 4850], 0: [2000, 2000, 2000]}
    verdict = decide(runs(data, headroom={3: 2.0, 7: 9.0, 0: 20.0}), [3, 7, 0], baseline=0)
    assert verdict.winner_trial == 7
    assert "tied" in verdict.note and "headroom" in verdict.note


def test_a_tie_keeps_the_fastest_median_when_it_has_room_enough():
    data = {3: [5000, 5200, 4800], 7: [4990, 5150, 4850], 0: [2000, 2000, 2000]}
    verdict = decide(runs(data, headroom={3: 6.0, 7: 20.0, 0: 20.0}), [3, 7, 0], baseline=0)
    assert verdict.winner_trial == 3
    assert "tied" in verdict.note and "headroom does not decide" in verdict.note


def test_a_contender_that_fails_a_repeat_cannot_win():
    failed = TrialResult(status="runtime_oom", config={}, reason="CUDA out of memory").to_dict()
    rs = runs({3: [9000, 9000], 0: [2000, 2000]}) + [
        ConfirmationRun.from_dict({"trial": 3, "repeat": 2, "result": failed})
    ]
    verdict = decide(rs, [3, 0], baseline=0)
    # the baseline is then the fastest clean config: that is no winner (and no 1.00× "gain")
    assert verdict.winner_trial is None and verdict.gain is None and verdict.outcome == "baseline"
    assert verdict.note.startswith("no config beat the baseline")


def test_confirm_interleaves_stores_and_is_reused(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=6))
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    runner.calls.clear()
    conf = confirm(study, cfg, runner=runner).to_dict()  # the stored form
    order = conf["order"]
    # the baseline (1,600 tok/s) is under half the leader's 4,800: not relaunched, its search run stands in
    assert 0 not in order and [r["trial"] for r in conf["given"]] == [0]
    assert conf["stats"]["0"]["from_search"] and conf["stats"]["0"]["windows"] == 1
    numbers = [n for n, _ in runner.calls]
    assert cfg.study.confirm_repeats == 2
    # A B C once each, then the top two again (the launch term); the fake has no noise: decided there
    stats = conf["stats"]
    top_two = sorted(order, key=lambda n: -stats[str(n)]["median"])[:2]
    assert numbers == order + [n for n in order if n in top_two]
    assert conf["decided"] and conf["noise"]["launch_df"] == 2
    stored = study.user_attrs["confirmation"]
    assert stored["winner_trial"] == conf["winner_trial"] and len(stored["runs"]) == len(numbers)
    assert stored["baseline_trial"] == 0 and stored["gain"] > 1
    # resuming a finished study re-uses the stored confirmation
    runner.calls.clear()
    assert confirm(study, cfg, runner=runner).to_dict()["winner_trial"] == conf["winner_trial"]
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
    assert summary.confirmed and summary.n_trials == 5
    assert summary.baseline.output_tok_s == pytest.approx(1600.0)  # 16 running × 100 in the fake
    assert summary.best.output_tok_s >= summary.enqueued[0].output_tok_s
    assert summary.gain_over_baseline == pytest.approx(summary.best.output_tok_s / 1600.0)
    assert summary.defaults.how.startswith("predicted")
    assert sum(summary.statuses.values()) == 5
    assert summary.launched == 5 - summary.statuses.get("skipped_infeasible", 0)
    assert summary.launched_oom == 0
    assert summarize(run_study(cfg, runner=PlannerRunner()), cfg).best == summary.best
    # ``autotune sweep --json`` prints the record's ``asdict``: the keys, in the order, it always printed
    assert list(dataclasses.asdict(summary)) == [
        "study",
        "storage",
        "n_trials",
        "statuses",
        "launched",
        "launched_oom",
        "launched_interrupted",
        "confirmed",
        "baseline",
        "best",
        "outcome",
        "gain_over_baseline",
        "gain_ci",
        "enqueued",
        "defaults",
        "gain_over_defaults",
        "multi_gpu",
        "unexpected",
        "confirmation",
        "search_stop",
        "note",
        "error",
        "above_baseline",
        "job",
        "interrupted",
        "origin",
        "spend",
        "twins",
        "defaults_lead",
    ]  # new keys only ever join at the end
    assert dataclasses.asdict(summary)["best"] == dataclasses.asdict(summary.best) and summary.interrupted is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary.outcome = "none"  # built once: nothing changes it after summarize


class Scaled(PlannerRunner):
    """Trial ``trial`` (1: the hand-tuned config, enqueued; 0: the baseline) measures ``factor`` × what the fake
    planner gives it."""

    def __init__(self, factor: float, *, trial: int = 1):
        super().__init__()
        self.factor, self.trial = factor, trial

    def __call__(self, config: dict, number: int) -> TrialResult:
        result = super().__call__(config, number)
        if result.metrics is None or number != self.trial:
            return result
        m = result.metrics
        return TrialResult.from_dict(
            {**result.to_dict(), "metrics": {**dataclasses.asdict(m), "output_tok_s": m.output_tok_s * self.factor}}
        )


@pytest.mark.parametrize("factor, confirmed", [(0.3, False), (1.0, True)])
def test_an_enqueued_config_far_behind_the_leader_costs_no_confirmation_launch(tmp_path, factor, confirmed):
    cfg = load_config(write_study(tmp_path, trials=5))
    runner = Scaled(factor)
    study = run_study(cfg, runner=runner)
    lead = max(t.values[0] for t in study.trials if t.values)
    hand = study.trials[1]
    assert hand.user_attrs["role"] == "enqueued"
    assert (hand.values[0] >= 0.5 * lead) is confirmed
    runner.calls.clear()
    conf = confirm(study, cfg, runner=runner).to_dict()  # the stored form
    assert (1 in conf["order"]) is confirmed and (1 in [n for n, _ in runner.calls]) is confirmed
    shown = summarize(study, cfg).enqueued[0]
    assert shown.trial == 1 and shown.confirmed_runs == (1 if confirmed else 0)
    assert shown.output_tok_s == pytest.approx(hand.values[0]) or confirmed  # its search figure when not confirmed


def test_a_given_baseline_run_gives_the_gain_its_interval_and_adds_nothing_to_the_noise():
    data = {3: [5000, 5100, 4900, 5050], 7: [4000, 4100, 3900, 4050]}
    given = [ConfirmationRun.from_dict({"trial": 0, "repeat": -1, "search": True, "result": ok(2000)})]
    verdict = decide(runs(data), [3, 7], baseline=0, given=given)
    assert verdict.winner_trial == 3 and verdict.outcome == "winner"
    assert verdict.gain == pytest.approx(gmean(data[3]) / 2000)
    assert verdict.ci_low < verdict.gain < verdict.ci_high and verdict.ci_low > 2.0
    assert verdict.noise == decide(runs(data), [3, 7], baseline=None).noise  # one window, one launch: no df
    assert verdict.stats["0"].from_search and not verdict.stats["3"].from_search
    assert "from_search" not in verdict.to_dict()["stats"]["3"]  # stored only when set
    # a given baseline is never a candidate: if it read fastest, no config beat it and nothing is decided
    fast = [dataclasses.replace(given[0], result=TrialResult.from_dict(ok(9000)))]
    held = decide(runs(data), [3, 7], baseline=0, given=fast)
    assert held.winner_trial is None and held.outcome == "baseline" and not held.decided
    assert held.contention == (0,)  # the one reading that blocks the decision is what a launch must settle


class LuckySearch(PlannerRunner):
    """The fake planner's figures, but trial ``lucky``'s search launch read ``factor`` × its rate (a window that
    caught a good phase); a confirmation launch reads the rate 1 % high or low, by turns (launch noise)."""

    def __init__(self, lucky: int, factor: float):
        super().__init__()
        self.lucky, self.factor = lucky, factor

    def __call__(self, config: dict, number: int) -> TrialResult:
        before = sum(n == number for n, _ in self.calls)
        result = super().__call__(config, number)
        if result.metrics is None:
            return result
        scale = (self.factor if number == self.lucky else 1.0) if not before else 1.0 + 0.01 * (-1) ** before
        m = result.metrics
        return TrialResult.from_dict(
            {**result.to_dict(), "metrics": {**dataclasses.asdict(m), "output_tok_s": m.output_tok_s * scale}}
        )


def test_a_stand_in_baseline_that_blocks_the_decision_is_relaunched(tmp_path):
    """The leader's lucky search reading put the baseline out of reach; confirmed, the leader runs near the
    baseline's one search reading, which alone cannot say whether it beat the baseline: the baseline is relaunched
    (its launch settles it) rather than named because nothing was resolved against it."""
    cfg = load_config(write_study(tmp_path, trials=5))
    plain = run_study(cfg, runner=PlannerRunner())
    base = plain.trials[0].values[0]
    leader = max((t for t in plain.trials if t.values), key=lambda t: t.values[0])
    (tmp_path / "lucky").mkdir()
    cfg = load_config(write_study(tmp_path / "lucky", trials=5))
    runner = LuckySearch(leader.number, factor=3.0)
    study = run_study(cfg, runner=runner)
    assert study.trials[0].values[0] == base and max(t.values[0] for t in study.trials if t.values) > 2 * base / 0.5
    searched = len(runner.calls)
    conf = confirm(study, cfg, runner=runner).to_dict()
    assert 0 in conf["order"] and not conf.get("given")  # relaunched, its search run no longer standing in
    assert 0 in [n for n, _ in runner.calls[searched:]]
    assert conf["decided"] and conf["outcome"] == "winner" and conf["ci_low"] > 1


@pytest.mark.parametrize("factor, relaunched", [(1.0, False), (2.5, True)])
def test_a_baseline_far_behind_the_leader_is_not_relaunched(tmp_path, factor, relaunched):
    cfg = load_config(write_study(tmp_path, trials=5))
    runner = Scaled(factor, trial=0)  # the baseline
    study = run_study(cfg, runner=runner)
    lead, base = max(t.values[0] for t in study.trials if t.values), study.trials[0].values[0]
    assert (base >= 0.5 * lead) is relaunched  # 1,600 against 4,800 at 1×; 4,000 at 2.5×
    runner.calls.clear()
    conf = confirm(study, cfg, runner=runner).to_dict()  # the stored form
    assert (0 in conf["order"]) is relaunched and (0 in [n for n, _ in runner.calls]) is relaunched
    assert bool(conf.get("given")) is not relaunched and conf["gain"] > 1
    assert conf["ci_low"] <= conf["gain"] <= conf["ci_high"]  # the fake has no noise
    summary = summarize(study, cfg)
    assert summary.baseline.from_search is not relaunched
    assert summary.baseline.output_tok_s == pytest.approx(base) or relaunched  # its search figure
    windows = sum(s["windows"] for s in conf["stats"].values() if not s.get("from_search"))
    assert summary.confirmation.startswith(f"{len(runner.calls)} launches, {windows} windows")
    assert ("its search run: far behind the leader, not relaunched" in render(summary)) is not relaunched
    shown = next(r for r in trial_rows(study) if r.number == 0)  # autotune trials: nothing confirmed for it
    assert (shown.confirmed_tok_s is not None) is relaunched


# --- the SGLang-defaults run ----------------------------------------------------------------------------------
def measured(cfg):
    """The study as run on a real engine: its defaults are measured by the runner, not predicted."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kind": "sglang"})})


class DefaultsFail(PlannerRunner):
    """Bare defaults (and here SGLang's defaults for the tuned flags) cannot start: a CPU backend's bad_args."""

    def __call__(self, config: dict, number: int) -> TrialResult:
        if number == DEFAULTS_RUN:
            self.calls.append((number, dict(config)))
            return TrialResult(
                status="bad_args",
                config=config,
                reason="unrecognized arguments: --nope",
                trial_dir="/w/trials/defaults",
            )
        return super().__call__(config, number)


def test_defaults_run_keeps_the_fixed_flags_and_gets_its_own_run_number(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    # speculative_num_steps is searched: SGLang then picks topk and draft tokens with it (a fixed topk would be
    # its assertion error), so only the algorithm stays
    assert cfg.engine.fixed == {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1}
    assert defaults_config(cfg) == {"speculative_algorithm": "EAGLE"}
    fixed = {**cfg.engine.fixed, "speculative_num_steps": 2, "context_length": 8192}
    pinned = cfg.model_copy(
        update={
            "engine": cfg.engine.model_copy(update={"fixed": fixed}),
            "derived": {},
            "space": {k: v for k, v in cfg.space.items() if k != "speculative_num_steps"},
        }
    )
    assert defaults_config(pinned) == fixed  # nothing fixed depends on a tuned flag: every fixed flag is kept
    runner = PlannerRunner()
    summary = run_sweep(measured(cfg), runner=runner)
    calls = [(n, c) for n, c in runner.calls if n == DEFAULTS_RUN]
    assert len(calls) == 1  # once, under its own number: never a repeat of a real trial
    assert calls[0][1] == {"speculative_algorithm": "EAGLE"}  # not {}: the fixed flags, tuned ones at SGLang's
    assert not set(calls[0][1]) & (set(cfg.space) | set(cfg.derived))
    stored = open_study(cfg).user_attrs["confirmation"]["defaults"]
    assert stored["status"] == "ok" and stored["output_tok_s"] > 0 and stored["config"] == calls[0][1]
    assert stored["how"] == "measured once during confirmation"
    assert summary.defaults.output_tok_s == stored["output_tok_s"]
    assert "gain over SGLang 0.5.23 defaults" in render(summary)
    # on the sim the same config is predicted, not bare defaults
    assert (
        run_sweep(load_config(write_study(tmp_path, trials=5)), runner=PlannerRunner()).defaults.config == calls[0][1]
    )


def test_a_failed_defaults_run_is_reported_as_failed_not_as_zero(tmp_path):
    cfg = measured(load_config(write_study(tmp_path, trials=4)))
    summary = run_sweep(cfg, runner=DefaultsFail())
    stored = open_study(cfg).user_attrs["confirmation"]["defaults"]
    assert stored["status"] == "bad_args" and stored["output_tok_s"] is None
    assert stored["reason"] == "unrecognized arguments: --nope" and stored["trial_dir"] == "/w/trials/defaults"
    assert summary.defaults.status == "bad_args" and summary.defaults.output_tok_s is None
    assert summary.gain_over_defaults is None
    line = next(x for x in render(summary).splitlines() if "SGLang 0.5.23 defaults" in x)
    assert line == (
        "  SGLang 0.5.23 defaults (fixed flags kept) failed, measured once during confirmation: "
        "bad_args: unrecognized arguments: --nope; no gain over defaults"
    )


def test_older_studies_stored_a_failed_defaults_run_as_zero(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    study = run_study(cfg, runner=PlannerRunner())
    confirm(
        study,
        cfg,
        runner=PlannerRunner(),
        defaults=lambda: DefaultsRun(output_tok_s=0.0, status="bad_args", how="measured once during confirmation"),
    )
    summary = summarize(study, cfg)
    assert summary.defaults.output_tok_s is None and summary.gain_over_defaults is None
    assert "defaults (fixed flags kept) failed" in render(summary)


def test_an_interrupted_defaults_run_leaves_the_confirmation_to_finish_on_resume(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    study = run_study(cfg, runner=PlannerRunner())
    runner = PlannerRunner()
    stop = lambda: DefaultsRun(status="interrupted", output_tok_s=None)  # noqa: E731
    assert confirm(study, cfg, runner=runner, defaults=stop) is None
    assert not study.user_attrs["confirmation"]["complete"]
    runner.calls.clear()
    done = confirm(study, cfg, runner=runner, defaults=lambda: DefaultsRun(status="ok", output_tok_s=1.0, how="x"))
    assert done.complete and runner.calls == []  # the runs are reused; only the defaults ran again


def test_harness_writes_the_defaults_run_under_trials_defaults(tmp_path):
    import threading

    from autotune.search.runner import HarnessRunner

    cfg = load_config(write_study(tmp_path, trials=4))
    harness = HarnessRunner(cfg, stop_event=threading.Event())
    where = harness.trial_dir(DEFAULTS_RUN)
    assert where == cfg.work_dir / "trials" / "defaults"
    where.mkdir(parents=True)
    assert harness.trial_dir(DEFAULTS_RUN) == where.with_name("defaults.2")  # measured again: beside, never in 0/
    assert harness.trial_dir(0) == cfg.work_dir / "trials" / "0"


# --- a winner equal to the baseline ---------------------------------------------------------------------------
def test_a_best_config_with_the_baseline_flags_is_no_winner():
    data = {3: [2160, 2170, 2150], 7: [1500, 1510, 1490], 0: [2000, 2010, 1990]}
    assert decide(runs(data), [3, 7, 0], baseline=0).winner_trial == 3  # other flags: a winner
    verdict = decide(runs(data), [3, 7, 0], baseline=0, same_as_baseline=[3, 0])
    assert verdict.winner_trial is None and verdict.outcome == "baseline"
    assert verdict.gain is None and verdict.ci_low is None
    assert (
        verdict.note == "no config beat the baseline: the fastest confirmed config (trial 3) runs the "
        "baseline's own flags"
    )


def test_a_best_config_within_the_baseline_noise_is_no_winner():
    data = {3: [2050, 1990, 2100], 0: [2000, 2040, 1980]}
    verdict = decide(runs(data), [3, 0], baseline=0)
    assert verdict.winner_trial is None and verdict.outcome == "baseline"
    assert "within the baseline's run-to-run noise" in verdict.note
    # a twin of the baseline tied with the best is not picked for its headroom either
    data = {3: [3000, 3100, 2900], 5: [2990, 3050, 2950], 0: [2000, 2000, 2000]}
    verdict = decide(runs(data, headroom={3: 1.0, 5: 9.0, 0: 9.0}), [3, 5, 0], baseline=0, same_as_baseline=[5])
    assert verdict.winner_trial == 3 and verdict.outcome == "winner"


class Twin(PlannerRunner):
    """Trial 2 is enqueued with the baseline's exact flags and measures 8 % faster every time: pure noise."""

    FACTOR = {1: 0.3, 2: 1.08}

    def __call__(self, config: dict, number: int) -> TrialResult:
        result = super().__call__(config, number)
        if result.metrics is None or number not in self.FACTOR:
            return result
        m = result.metrics
        return TrialResult.from_dict(
            {
                **result.to_dict(),
                "metrics": {**dataclasses.asdict(m), "output_tok_s": m.output_tok_s * self.FACTOR[number]},
            }
        )


TWIN = """
[[enqueue]]
label = "baseline again"
flags = { speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 80 }
"""


def test_winner_with_the_baseline_flags_prints_no_config_beat_the_baseline_and_apply_refuses(tmp_path, capsys):
    from autotune.cli import main
    from autotune.deploy.apply import load_winner
    from autotune.errors import StudyError

    cfg = load_config(write_study(tmp_path, trials=3, extra=TWIN))
    study = run_study(cfg, runner=Twin())
    trials = study.get_trials()
    assert trials[2].user_attrs["launch_key"] == trials[0].user_attrs["launch_key"]
    unconfirmed = summarize(study, cfg)  # single measurements: the best is the baseline's flags too
    assert unconfirmed.best is None and unconfirmed.outcome == "baseline"
    assert unconfirmed.note.startswith("no config beat the baseline")

    conf = confirm(study, cfg, runner=Twin()).to_dict()  # the stored form
    assert conf["order"][0] == 2 and 0 in conf["order"]  # the twin was the top contender
    assert conf["winner_trial"] is None and conf["outcome"] == "baseline" and conf["gain"] is None
    assert conf["note"].startswith("no config beat the baseline")
    assert open_study(cfg).user_attrs["confirmation"]["winner_trial"] is None

    summary = summarize(study, cfg)
    assert summary.confirmed and summary.best is None and summary.outcome == "baseline"
    assert summary.gain_over_baseline is None and summary.gain_ci is None
    text = render(summary)
    assert "no config beat the baseline" in text and "gain over baseline" not in text and "1.08" not in text

    with pytest.raises(StudyError, match="no winner to apply: no config beat the baseline"):
        load_winner(cfg.storage_url, "t")
    assert load_winner(cfg.storage_url, "t", trial=1).trial == 1  # an explicit trial still deploys
    with pytest.raises(SystemExit) as info:
        main(["apply", "--storage", cfg.storage_url, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "no config beat the baseline" in err
    assert not (tmp_path / "out").exists()


# --- launches across sessions ---------------------------------------------------------------------------------
class StopsOnce(PlannerRunner):
    """Ctrl-C during trial 1: the server was up, the trial is interrupted and the sweep ends."""

    def __init__(self, stop):
        super().__init__()
        self.stop = stop

    def __call__(self, config: dict, number: int) -> TrialResult:
        if number == 1:
            self.calls.append((number, dict(config)))
            self.stop.set()
            return TrialResult(
                status="interrupted", config=config, reason="interrupted while measuring", durations_s={"startup": 1.0}
            )
        return super().__call__(config, number)


def test_resumed_sweep_counts_launches_of_every_session(tmp_path):
    import threading

    cfg = load_config(write_study(tmp_path, trials=3))
    stop = threading.Event()
    run_study(cfg, runner=StopsOnce(stop), stop_event=stop)
    again = PlannerRunner()
    study = run_study(cfg, runner=again)  # a new session: the interrupted config runs again
    summary = summarize(study, cfg)
    started = 2 + len(again.calls)  # trials 0 and 1 in the first session
    skipped = summary.statuses.get("skipped_infeasible", 0)
    assert summary.launched == started == summary.n_trials - skipped + 1
    assert summary.launched_interrupted == 1
    assert f"launched {started} servers (1 interrupted and run again)" in render(summary)


def test_a_stored_confirmation_from_before_is_decided_again_without_rerunning(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=3, extra=TWIN))
    study = run_study(cfg, runner=Twin())
    conf = confirm(study, cfg, runner=Twin()).to_dict()  # the stored form
    legacy = {k: v for k, v in conf.items() if k != "outcome"}
    study.set_user_attr("confirmation", {**legacy, "winner_trial": 2, "gain": 1.08, "note": ""})  # the old verdict
    runner = Twin()
    again = confirm(study, cfg, runner=runner).to_dict()  # the stored form
    assert runner.calls == [] and again["runs"] == conf["runs"]
    assert again["winner_trial"] is None and again["outcome"] == "baseline" and again["gain"] is None
    assert study.user_attrs["confirmation"]["winner_trial"] is None


# --- no winner without a measured baseline ----------------------------------------------------------------------
class BaselineFails(PlannerRunner):
    """The baseline's config cannot start (e.g. a tenant holds the GPU); ``in_confirmation``: it measures in the
    search and fails every confirmation run instead."""

    def __init__(self, *, in_confirmation: bool = False):
        super().__init__()
        self.in_confirmation, self.baseline_runs = in_confirmation, 0

    def __call__(self, config: dict, number: int) -> TrialResult:
        if number == 0:
            self.baseline_runs += 1
            if not self.in_confirmation or self.baseline_runs > 1:
                self.calls.append((number, dict(config)))
                return TrialResult(
                    status="startup_oom", config=config, reason="17.81 GiB free", log_path="/logs/0/server.log"
                )
        return super().__call__(config, number)


def test_a_failed_baseline_says_so_and_names_no_winner(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    runner = BaselineFails()
    summary = run_sweep(cfg, runner=runner)
    assert summary.best is None and summary.outcome == "no_baseline" and summary.gain_over_baseline is None
    assert summary.baseline.trial == 0 and summary.baseline.status == "startup_oom"
    assert summary.error.startswith("the baseline (trial 0) failed: startup_oom: 17.81 GiB free")
    assert "/logs/0/server.log" in summary.error
    numbers = [n for n, _ in runner.calls]
    assert not summary.confirmed and len(numbers) == len(set(numbers))  # no repeats: nothing to confirm over
    text = render(summary)
    assert "baseline (trial 0) failed: startup_oom: 17.81 GiB free" in text
    assert "winner: trial" not in text and "winner: none, no measured baseline" in text


def test_a_baseline_that_fails_every_confirmation_run_names_no_winner(tmp_path, monkeypatch):
    from autotune.search.confirm import ranking

    monkeypatch.setattr(ranking, "IN_REACH", 0.0)  # relaunched however far behind (the fake's is at a third)
    cfg = load_config(write_study(tmp_path, trials=4))
    summary = run_sweep(cfg, runner=BaselineFails(in_confirmation=True))
    assert summary.confirmed and summary.best is None and summary.outcome == "no_baseline"
    assert "(trial 0) failed in every confirmation run" in summary.error
    assert "winner: trial" not in render(summary)
    # the same study with a measured baseline crowns its winner
    (tmp_path / "ok").mkdir()
    ok = load_config(write_study(tmp_path / "ok", trials=4))
    assert run_sweep(ok, runner=PlannerRunner()).outcome == "winner"


def test_the_verdict_is_stored_with_the_keys_studies_hold_and_read_back_as_it_was():
    """``Verdict`` crosses the layers typed; the study stores its ``to_dict`` (the keys stored studies hold,
    per outcome) and every reader takes it back through ``from_dict``."""
    data = {3: [5000, 5100, 4900, 5050], 7: [4000, 4100, 3900, 4050], 0: [2000, 2050, 1950, 2010]}
    failed = TrialResult(status="runtime_oom", config={}, reason="CUDA out of memory").to_dict()
    common = {
        "baseline_trial",
        "resolution",
        "noise",
        "stats",
        "winner_trial",
        "gain",
        "ci_low",
        "ci_high",
        "outcome",
        "note",
        "decided",
        "contention",
    }
    kinds = {
        "winner": (
            decide(runs(data), [3, 7, 0], baseline=0, demoted={7: "failed its stress phase"}),
            common | {"resolved", "runner_up_trial", "runner_up_gain", "runner_up_ci", "demoted"},
        ),
        "baseline": (decide(runs(data), [3, 7, 0], baseline=0, same_as_baseline=[3, 0]), common | {"resolved"}),
        "none": (
            decide([ConfirmationRun.from_dict({"trial": 3, "repeat": 0, "result": failed})], [3], baseline=None),
            common,
        ),
    }
    for outcome, (verdict, keys) in kinds.items():
        stored = verdict.to_dict()
        assert verdict.outcome == outcome and set(stored) == keys, outcome
        assert Verdict.from_dict(stored) == verdict
        assert Verdict.from_dict({**stored, "runs": [], "complete": True}) == verdict  # as the study holds it
    assert isinstance(kinds["winner"][0].to_dict()["contention"], list)
    assert Verdict.from_dict(None) is None and Verdict.from_dict({}) is None


def test_a_stored_contenders_figures_read_as_a_record_and_store_as_they_were():
    from autotune.search.confirm.decision import ContenderStat, Verdict

    older = {"median": 2500.0, "ci": [2400.0, 2600.0], "runs": 3, "windows": 9, "failed": 0}  # before headroom
    given = {
        "median": 1000.0,
        "ci": [900.0, 1100.0],
        "runs": 1,
        "windows": 1,
        "failed": 0,
        "headroom_gib": None,
        "unsettled_windows": 0,
        "from_search": True,
    }
    verdict = Verdict.from_dict({"outcome": "winner", "winner_trial": 3, "stats": {"3": older, "0": given}})
    assert verdict.stat(3) == ContenderStat(median=2500.0, ci=(2400.0, 2600.0), runs=3, windows=9)
    assert verdict.stat(0).from_search and verdict.stat(7) is None
    stored = verdict.to_dict()["stats"]
    assert stored["0"] == given and {k: stored["3"][k] for k in older} == older
    assert "from_search" not in stored["3"]
