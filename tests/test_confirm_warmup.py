"""The confirmation's warm-up: each window waits for the search launch's first wave of requests to turn over
(``search.confirm.warmup``), and the runners carry that floor into every window of the launch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_confirm_noise import Windowed
from test_study import write_study

from autotune.config import load_config
from autotune.harness.workload import WorkloadSpec
from autotune.results import TrialResult
from autotune.search.confirm import confirm
from autotune.search.confirm.warmup import TURNOVER_CAP_S, steady_warmup, turnover_s
from autotune.search.runner import GivenRunner, HarnessRunner
from autotune.search.study import run_study
from autotune.settle import with_warmup


def measured(tok_s: float, streams: int, running: int | None) -> TrialResult:
    return TrialResult.from_dict(
        {
            "status": "ok",
            "config": {},
            "metrics": {"output_tok_s": tok_s, "concurrency": streams, "request_s": 0.0},
            "capacity": {"max_running_requests": running} if running else None,
        }
    )


def test_turnover_is_max_tokens_at_the_per_request_rate_of_the_requests_running_at_once():
    # 176 requests run at once (the replay sends 352 streams): 12,000 tok/s is 68.2 tok/s per request
    assert turnover_s(measured(12_000, 352, 176), 4096) == pytest.approx(4096 * 176 / 12_000)
    assert turnover_s(measured(12_000, 100, 176), 4096) == pytest.approx(4096 * 100 / 12_000)  # fewer streams
    assert turnover_s(measured(12_000, 0, 176), 4096) == pytest.approx(4096 * 176 / 12_000)  # no stream count
    assert turnover_s(measured(0, 352, 176), 4096) is None  # nothing measured
    assert turnover_s(None, 4096) is None


def test_the_steady_warmup_is_the_ramp_plus_one_turnover_in_whole_slices_within_floor_and_cap():
    workload = WorkloadSpec(prompts=Path("p.jsonl"), max_tokens=4096, warmup_s=10.0)  # ramp: 5 s
    # 5 + 60.07 s = 65.07 s, rounded up to the 2 s slice
    assert steady_warmup(measured(12_000, 352, 176), workload) == 66.0
    assert steady_warmup(measured(1e6, 352, 176), workload) == 10.0  # turns over at once: the study's floor
    assert steady_warmup(measured(10, 352, 176), workload) == TURNOVER_CAP_S  # too slow: capped
    assert steady_warmup(None, workload) == 10.0
    ramped = workload.model_copy(update={"ramp_s": 1.0})
    assert steady_warmup(measured(12_000, 352, 176), ramped) == 62.0


def test_with_warmup_raises_the_floor_and_keeps_the_ramp_and_a_cap_above_it():
    workload = WorkloadSpec(prompts=Path("p.jsonl"), warmup_s=10.0, warmup_max_s=20.0)
    longer = with_warmup(workload, 66.0)
    assert (longer.warmup_s, longer.ramp, longer.warmup_max_s) == (66.0, 5.0, 66.0)
    assert longer.settle_rule().warmup_slices[0] == 33
    assert with_warmup(workload, 8.0) is workload and with_warmup(workload, None) is workload
    free = with_warmup(workload.model_copy(update={"warmup_max_s": None}), 66.0)
    assert free.warmup_max_s is None and free.ramp == 5.0


class Warmed(Windowed):
    """``Windowed`` at 10 tok/s per running request, recording the warm-up floor each confirmation launch got."""

    def __init__(self):
        super().__init__()
        self.warmups: dict[int, set[float | None]] = {}

    def __call__(self, config: dict, number: int) -> TrialResult:
        result = super().__call__(config, number)
        if result.ok and result.metrics and result.capacity:
            metrics = dataclasses.replace(result.metrics, output_tok_s=10.0 * result.capacity.max_running_requests)
            result = dataclasses.replace(result, metrics=metrics)
        return result

    def repeat(self, config: dict, number: int, k: int, *, after=(), warmup_s=None) -> TrialResult:
        self.warmups.setdefault(number, set()).add(warmup_s)
        return super().repeat(config, number, k, after=after)


def test_every_confirmation_launch_warms_up_for_its_contenders_turnover(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=5))
    runner = Warmed()
    study = run_study(cfg, runner=runner)
    conf = confirm(study, cfg, runner=runner).to_dict()  # the stored form
    by_number = {t.number: t for t in study.get_trials()}
    expected = {n: steady_warmup(TrialResult.of(by_number[n]), cfg.workload) for n in conf["order"]}
    # at 10 tok/s per request a 4,096-token answer takes 410 s: far past the study's 10 s floor
    assert all(w > cfg.workload.warmup_s for w in expected.values())
    assert runner.warmups == {n: {w} for n, w in expected.items()}
    assert conf["warmup_s"] == {str(n): w for n, w in expected.items()}


class Recording:
    def __init__(self):
        self.seen: list[float | None] = []

    def __call__(self, config, number):
        raise AssertionError("a runner with repeat is asked to repeat")

    def repeat(self, config, number, k, *, after=(), warmup_s=None):
        self.seen.append(warmup_s)
        return TrialResult(status="ok", config=config)


def test_a_given_runner_passes_the_warmup_on():
    inner = Recording()
    GivenRunner(inner).repeat({}, 3, 0, warmup_s=66.0)
    assert inner.seen == [66.0]


def test_the_harness_runner_measures_a_confirmation_launch_with_the_longer_warmup(tmp_path, monkeypatch):
    cfg = load_config(write_study(tmp_path, trials=5))
    runner = HarnessRunner(cfg, stop_event=__import__("threading").Event())
    seen: list[WorkloadSpec | None] = []
    monkeypatch.setattr(
        runner,
        "_run",
        lambda config, trial_dir, probe, workload=None, *, after=(): (
            seen.append(workload) or TrialResult(status="ok", config=config)
        ),
    )
    monkeypatch.setattr(runner, "trial_dir", lambda number, repeat=None: tmp_path / f"{number}-{repeat}")
    runner.repeat({}, 2, 1, warmup_s=66.0)
    runner.repeat({}, 2, 2)
    assert seen[0] is not None and seen[0].warmup_s == 66.0 and seen[0].ramp == runner.workload.ramp
    assert seen[1] is runner.workload
