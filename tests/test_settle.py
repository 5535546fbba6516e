"""The settle rule (``autotune.settle``) on exact slice series, the same rule inside the in-process evaluator, the
replay's ramp against a fake SSE server, and what an unsettled trial becomes downstream (its line, its strip, never
the winner)."""

from __future__ import annotations

import asyncio
import math

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState, create_trial

from autotune.cli.measure import measure
from autotune.config.sections import WorkloadSection
from autotune.errors import WorkloadError
from autotune.harness.workload import SliceTally, WorkloadSpec, replay
from autotune.progress import _fmt_result, settling_line, sparkline
from autotune.report.figures import stability_figure
from autotune.report.stability import stability_frame
from autotune.results import MeasurementVerdict, Metrics, Percentiles, TrialResult
from autotune.search.confirm import contenders
from autotune.search.views.summary import _best, unsettled
from autotune.settle import Settler, SettleRule, Settling, agree, half_width, settle, t975
from autotune.sim.evaluate import SimWorkload, _seed_prompts, evaluate
from tests.test_workload import _sample, sse_server  # noqa: F401 - the fake SSE server fixture

RULE = SettleRule(warmup_s=12, measure_s=30)  # 2 s slices: a 6-slice warm-up floor, a 15-slice window floor
MTP = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}
BASELINE = {**MTP, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4}


def tokens(rates: list[float], slice_s: float = 2.0) -> list[float]:
    return [r * slice_s for r in rates]


# -- the rule on exact series ----------------------------------------------------------------------------------
def test_a_steady_series_stops_at_its_floors():
    done = settle(tokens([1000.0] * 100), RULE)
    assert done is not None and done.settled and done.warmup_settled
    assert done.window == (12.0, 42.0) and done.half_width == 0.0 and done.reason is None
    assert len(done.tok_s) == 21 and done.tok_s[-1] == 1000.0


def test_a_warmup_that_is_still_rising_runs_on_until_the_load_levels():
    rising = [100.0 * (i + 1) for i in range(10)] + [1000.0] * 100  # the batch fills for 20 s, then holds
    done = settle(tokens(rising), RULE)
    assert done is not None and done.settled
    assert done.warmup_slices == 13  # the first boundary whose last two 3-slice runs agree within 20 %
    assert done.window == (26.0, 56.0)


def test_waves_extend_the_window_until_its_interval_is_narrow():
    """Prefill waves every 5 slices (10 s), ±60 % around 1,000 tok/s, over a slow drift of the wave's phase: the
    30 s floor's interval is far wider than 5 %, so the window runs on, and its mean lands on the steady rate."""
    wave = [1000.0 + 600.0 * math.sin(2 * math.pi * i / 5 + 0.05 * i * i / 50) for i in range(400)]
    floor_only = SettleRule(warmup_s=12, measure_s=30, measure_max_s=30)
    short = settle(tokens(wave), floor_only)
    long = settle(tokens(wave), SettleRule(warmup_s=12, measure_s=30, measure_max_s=400))
    assert short is not None and long is not None
    assert short.window_slices == 15 and short.half_width is not None and short.half_width > 0.05
    assert not short.settled and "half-width" in (short.reason or "")
    assert long.settled and long.window_slices > 15 and long.half_width is not None and long.half_width <= 0.05
    lo, hi = long.warmup_slices, long.warmup_slices + long.window_slices
    assert sum(wave[lo:hi]) / (hi - lo) == pytest.approx(1000.0, rel=0.05)


def test_a_series_that_never_settles_stops_at_its_caps_flagged():
    trend = [50.0 * (i + 1) for i in range(200)]  # rises for ever: no warm-up agrees, no interval narrows
    rule = SettleRule(warmup_s=12, measure_s=30, warmup_max_s=20, measure_max_s=60)
    done = settle(tokens(trend), rule)
    assert done is not None and not done.settled and not done.warmup_settled
    assert done.window == (20.0, 80.0)  # both caps
    assert "warm-up" in (done.reason or "") and "half-width" in (done.reason or "")


def test_unset_caps_are_four_times_the_floors_and_an_idle_window_runs_to_its_cap():
    assert RULE.warmup_slices == (6, 24) and RULE.window_slices == (15, 60)
    idle = settle(tokens([500.0] * 6 + [0.0] * 200), RULE)
    assert idle is not None and not idle.settled and idle.window[1] - idle.window[0] == 120.0  # the cap
    assert "no token" in (idle.reason or "")
    # a server whose first tokens come after the floor is measured, unsettled, not called idle
    late = settle(tokens([500.0] * 6 + [0.0] * 20 + [500.0] * 200), RULE)
    assert late is not None and not late.settled and "no token" not in (late.reason or "") and max(late.tok_s) > 0
    assert settle(tokens([1000.0] * 10), RULE) is None  # the series ends before the rule would stop


def test_the_interval_accounts_for_correlated_slices():
    """Slices in slow runs (each level held for 5 slices) carry less information than independent ones with the
    same spread: the long-run variance widens the interval."""
    blocks = [1000.0 + (200.0 if (i // 5) % 2 else -200.0) for i in range(30)]
    shuffled = [blocks[(7 * i) % 30] for i in range(30)]  # the same values, neighbours no longer alike
    assert half_width(blocks) > 1.5 * half_width(shuffled)
    assert t975(1) == pytest.approx(12.706) and t975(30) == pytest.approx(2.042, abs=2e-3)
    assert agree([1.0, 1.0, 1.0, 1.1, 1.1, 1.1], 3, 0.2) and not agree([1.0, 1.0, 1.0, 1.5, 1.5, 1.5], 3, 0.2)


def test_settling_round_trips_through_a_trial_result():
    done = settle(tokens([1000.0] * 40), RULE)
    assert done is not None
    result = TrialResult(status="ok", config={}, measurement=MeasurementVerdict(settled=True, settling=done.to_dict()))
    back = Settling.from_dict(TrialResult.from_dict(result.to_dict()).measurement.settling)
    assert back == done


def test_a_short_window_gets_shorter_slices():
    assert SettleRule(warmup_s=0.5, measure_s=1.0).slice_s == pytest.approx(0.2)
    assert SettleRule(warmup_s=10, measure_s=30).slice_s == 2.0
    tally = SliceTally(0.5)
    for t, n in ((0.1, 3), (0.49, 1), (1.7, 5)):
        tally.add(t, n)
    assert [tally.slice(i) for i in range(5)] == [4, 0, 0, 5, 0]


# -- the same rule in the in-process evaluator ------------------------------------------------------------------
def test_the_evaluator_stops_where_the_rule_stops_on_its_own_series():
    work = SimWorkload(prompts=_seed_prompts(256), warmup_s=10, measure_s=30)
    ev = evaluate(BASELINE, work)
    assert ev.status == "ok" and ev.settling is not None and ev.settling.settled
    again = settle(tokens(ev.settling.tok_s, ev.settling.slice_s), work.rule)
    assert again == ev.settling  # same series → same stop
    lo, hi = ev.settling.window
    assert ev.metrics is not None and ev.metrics.window_s == hi - lo
    window = ev.settling.tok_s[ev.settling.warmup_slices : ev.settling.warmup_slices + ev.settling.window_slices]
    assert ev.metrics.output_tok_s == pytest.approx(sum(window) / len(window))


def test_the_evaluator_ramps_its_streams_in():
    """With the streams ramped in over the warm-up the first slice carries fewer tokens than with all of them
    sent at once; once ramped in, both read the same load."""
    prompts = _seed_prompts(256)
    ramped = evaluate(BASELINE, SimWorkload(prompts=prompts, warmup_s=10, measure_s=30, ramp_s=10))
    at_once = evaluate(BASELINE, SimWorkload(prompts=prompts, warmup_s=10, measure_s=30, ramp_s=0))
    assert ramped.settling is not None and at_once.settling is not None
    assert ramped.settling.tok_s[0] < 0.7 * at_once.settling.tok_s[0]
    assert ramped.output_tok_s == pytest.approx(at_once.output_tok_s, rel=0.05)


# -- the replay over HTTP --------------------------------------------------------------------------------------
def test_the_replay_spreads_first_requests_over_the_ramp(tmp_path, sse_server):  # noqa: F811 - the fixture
    fake, url = sse_server
    rule = SettleRule.fixed(1.0, 1.0)
    records = asyncio.run(
        replay(
            url,
            _sample(tmp_path, [{"prompt": "a"}]),
            concurrency=4,
            max_tokens=100_000,
            warmup_s=1.0,
            measure_s=1.0,
            rule=rule,
            ramp_s=0.8,
        )
    )
    firsts = sorted(r.sent for r in records.requests)
    assert len(firsts) == 4  # long outputs: each stream's first request is its only one
    for k, sent in enumerate(firsts):
        # stream k starts at k / 4 × 0.8 s: never before (the spread), and late only by what a loaded host delays
        assert k * 0.2 - 0.01 <= sent <= k * 0.2 + 0.6
    assert records.settling is not None and records.window == records.settling.window == (1.0, 2.0)


def test_the_replay_runs_on_past_its_floor_until_the_rule_stops(tmp_path, sse_server):  # noqa: F811
    fake, url = sse_server
    records = asyncio.run(
        replay(
            url,
            _sample(tmp_path, [{"prompt": "a"}]),
            concurrency=4,
            max_tokens=40,
            warmup_s=0.4,
            measure_s=1.0,
            rule=SettleRule(warmup_s=0.4, measure_s=1.0),
        )
    )
    settling = records.settling
    assert settling is not None and records.window == settling.window
    assert settling.window[0] >= 1.2 - 1e-9  # two runs of three 0.2 s slices at least
    assert settling.window[1] - settling.window[0] >= 1.0
    # the decision used the tally of arrivals: the records' own tokens per slice are the same series
    per_slice = [0.0] * len(settling.tok_s)
    for rec in records.requests:
        for t, n in rec.chunks:
            if int(t / settling.slice_s) < len(per_slice):
                per_slice[int(t / settling.slice_s)] += n
    assert [round(r * settling.slice_s) for r in settling.tok_s] == per_slice


def test_settle_fields_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="measure_max_s"):
        WorkloadSpec(prompts=tmp_path, measure_s=30, measure_max_s=10)
    with pytest.raises(ValueError, match="target_half_width"):
        WorkloadSpec(prompts=tmp_path, target_half_width=0)
    with pytest.raises(ValueError, match="ramp_s"):
        WorkloadSection(warmup_s=5, ramp_s=8)
    with pytest.raises(ValueError, match="warmup_max_s"):
        WorkloadSection(warmup_s=10, warmup_max_s=5)
    spec = WorkloadSpec(prompts=tmp_path, **WorkloadSection(warmup_s=8, measure_s=20).model_dump(exclude={"prompts"}))
    assert spec.ramp == 4.0 and spec.settle_rule().window_slices == (10, 40)


# -- downstream: the trial line, the strip, the crown -------------------------------------------------------------
def _metrics(tok_s: float) -> Metrics:
    return Metrics(output_tok_s=tok_s, request_s=1.0, ttft_ms=Percentiles(), itl_ms=Percentiles(), e2e_ms=Percentiles())


def _result(tok_s: float, rates: list[float], rule: SettleRule) -> TrialResult:
    done = settle(tokens(rates), rule)
    assert done is not None
    return TrialResult(
        status="ok",
        config={"max_running_requests": int(tok_s)},
        metrics=_metrics(tok_s),
        measurement=MeasurementVerdict(settled=done.settled, settling=done.to_dict()),
    )


def test_the_trial_line_says_how_the_measurement_settled():
    steady = _result(1000, [1000.0] * 40, RULE)
    flagged = _result(2000, [50.0 * (i + 1) for i in range(200)], RULE)
    assert settling_line(steady.measurement) == "settled in 42 s (warm-up 12 s, window 30 s, ±0.0%) " + "█" * 21
    assert _fmt_result(steady).endswith("settled in 42 s (warm-up 12 s, window 30 s, ±0.0%) " + "█" * 21)
    line = _fmt_result(flagged)
    assert "unsettled: " in line and "never crowned" in line
    recorded = Settling.from_dict(flagged.measurement.settling)
    assert recorded is not None and line.endswith(sparkline(recorded.tok_s))  # the rise, up to the window's cap
    assert sparkline(recorded.tok_s).startswith("▁") and sparkline(recorded.tok_s).endswith("█")
    assert sparkline([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == "▁▂▃▄▅▆▇█"
    assert len(sparkline([1.0] * 100)) == 24
    assert settling_line(None) is None


def _study(results: dict[int, tuple[TrialResult, str]]) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    for _, (result, role) in sorted(results.items()):
        study.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                value=result.output_tok_s or 0.0,
                user_attrs={"status": "ok", "role": role, "result": result.to_dict(), "launch_key": str(result.config)},
            )
        )
    return study


def test_an_unsettled_trial_is_never_the_winner_on_its_figure_but_is_confirmed_above_the_baseline():
    base = _result(900, [900.0] * 40, RULE)
    settled = _result(1000, [1000.0] * 40, RULE)
    flagged = _result(5000, [50.0 * (i + 1) for i in range(200)], RULE)
    slow = _result(500, [5.0 * (i + 1) for i in range(200)], RULE)
    study = _study({0: (base, "baseline"), 1: (flagged, "search"), 2: (settled, "search"), 3: (slow, "search")})
    trials = study.get_trials(deepcopy=False)
    assert unsettled(trials[1]) and not unsettled(trials[2]) and not unsettled(trials[0]) and unsettled(trials[3])
    best, outcome, _ = _best(trials, trials[0], None)  # no finished confirmation
    assert best == 2 and outcome is None  # the faster figure is unsettled: not crowned on that number
    top, baseline, _ = contenders(study, top_k=4)  # but above the baseline: the confirmation measures it afresh
    assert [t.number for t in top] == [1, 2, 0] and baseline is not None and baseline.number == 0
    assert 3 not in [t.number for t in top]  # unsettled below the baseline: nothing to confirm


def test_the_report_draws_a_stability_strip_per_trial():
    study = _study(
        {
            0: (_result(1000, [1000.0] * 40, RULE), "baseline"),
            1: (_result(2000, [50.0 * (i + 1) for i in range(200)], RULE), "search"),
        }
    )
    frame = stability_frame(study)
    assert set(frame["trial"]) == {0, 1}
    first = frame[frame["trial"] == 0]
    assert len(first) == 21 and set(first["phase"]) == {"warm-up", "window"}
    assert first[first["phase"] == "window"]["relative"].tolist() == [1.0] * 15
    assert not frame[frame["trial"] == 1]["settled"].any()
    fig = stability_figure(frame)
    assert list(fig.data[0].y) == ["trial 0", "trial 1 (unsettled)"]
    assert fig.data[1].x[0] == 12.0  # trial 0's window starts after its 12 s warm-up


def test_a_settler_fed_one_slice_at_a_time_matches_the_series():
    rates = [100.0 * (i + 1) for i in range(10)] + [1000.0] * 100
    settler, stop, fed = Settler(RULE), None, 0
    for n in tokens(rates):
        fed += 1
        stop = settler.add(n)
        if stop is not None:
            break
    assert stop is not None and stop == settle(tokens(rates), RULE) and fed == stop.window[1] / 2.0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--ramp", "20"], "--ramp (20) must lie within the warm-up floor"),
        (["--window-max", "5"], "--window-max (5) is below --window (30)"),
        (["--warmup-max", "2"], "--warmup-max (2) is below --warmup (10)"),
    ],
)
def test_measure_checks_its_settle_options_before_any_server(args, words, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    result = CliRunner().invoke(measure, [*args, "--out", str(tmp_path / "trial")])
    assert isinstance(result.exception, WorkloadError) and words in str(result.exception)
    assert not (tmp_path / "trial").exists()  # nothing started
