"""The search's stopping rule and the slice pruner, through the study loop with an injected runner (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_study import ok, write_toml

from autotune.cli.sweep import render
from autotune.config import load_config
from autotune.harness.workload import settling_figures
from autotune.results import MeasurementVerdict, TrialResult
from autotune.search.confirm.ranking import contenders
from autotune.search.pruning import PRUNED, PruningSettler, SlicePruner, pruned
from autotune.search.seeding import launched
from autotune.search.stopping import STOP_ATTR, Patience
from autotune.search.study import run_study
from autotune.search.views.summary import summarize
from autotune.settle import SettleRule, settle

STUDY = """
[study]
name = "t"
trials = {trials}
seed = 1
patience = {patience}
confirm_top_k = 0

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1

[space]
max_mamba_cache_size = {{ type = "int", low = 64, high = 512, step = 64 }}
speculative_num_steps = {{ type = "int", low = 1, high = 4 }}

[space.derived]
speculative_num_draft_tokens = "speculative_num_steps + 1"

[workload]
prompts = "prompts.jsonl"
sample_size = 4

[baseline]
flags = {{ speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 80 }}

[[enqueue]]
label = "hand-tuned"
flags = {{ speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 192 }}
"""


def study_file(tmp_path: Path, *, trials: int, patience: int) -> Path:
    return write_toml(tmp_path, STUDY.format(trials=trials, patience=patience))


class Flat:
    """Every launch measures ``tok_s`` × (1 + ``step``)^launch: ``step`` 0 is a search that has stopped paying."""

    def __init__(self, tok_s: float = 1000.0, step: float = 0.0):
        self.tok_s, self.step, self.calls = tok_s, step, 0

    def __call__(self, config: dict, number: int) -> TrialResult:
        self.calls += 1
        return ok(config, self.tok_s * (1 + self.step) ** self.calls)


def test_the_search_stops_on_patience_and_says_why(tmp_path):
    cfg = load_config(study_file(tmp_path, trials=20, patience=3))
    study = run_study(cfg, runner=Flat())
    # baseline (the best), then the hand-tuned config and two search launches without a gain: 3 in a row
    assert len(launched(study.get_trials())) == 4
    record = study.user_attrs[STOP_ATTR]
    assert record["rule"] == "patience" and record["launches"] == 4 and record["budget"] == 20
    assert "3 launches in a row found no gain beyond 2 % over the best so far (patience 3)" in record["why"]
    text = render(summarize(study, cfg))
    assert "search: stopped after 4 of 20 launches: 3 launches in a row found no gain" in text


def test_a_search_that_keeps_gaining_spends_its_budget_and_says_so(tmp_path):
    cfg = load_config(study_file(tmp_path, trials=6, patience=2))
    study = run_study(cfg, runner=Flat(step=0.05))  # 5 % better every launch: beyond the 2 % resolution
    assert len(launched(study.get_trials())) == 6
    assert study.user_attrs[STOP_ATTR]["rule"] == "budget"
    assert "search: ran its whole budget of 6 launches" in render(summarize(study, cfg))


def test_patience_off_and_before_the_given_configs_never_stops():
    assert Patience(0, 0.02).why([]) is None
    rule = Patience(1, 0.02, after=5)
    assert rule.launches == 1 and rule.why([]) is None  # nothing launched: nothing to judge


RULE = SettleRule(warmup_s=4, measure_s=30)  # 2 s slices; the window floor is 15 of them


def test_the_pruner_stops_a_clearly_losing_window_on_exact_slices():
    slices = [1200.0] * 40  # tokens per 2 s slice: exactly 600 tok/s
    pruner = SlicePruner(incumbent=1000.0, resolution=0.02)
    settler = PruningSettler(RULE, pruner)
    done = next(s for s in (settler.add(x) for x in slices) if s is not None)
    # warm-up: 6 slices (two agreeing runs of 3); then the pruner's 5 window slices, not the window floor's 15
    assert (done.warmup_slices, done.window_slices) == (6, 5)
    assert not done.settled and done.reason.startswith(PRUNED) and "600 tok/s" in done.reason
    assert pruned(MeasurementVerdict.from_dict(settling_figures(done))) and settling_figures(done)["settled"] is False
    # Within the resolution of the incumbent (990 > 1000 × 0.98): the settle rule ends it, settled, as without.
    close = PruningSettler(RULE, SlicePruner(incumbent=1000.0, resolution=0.02))
    kept = next(s for s in (close.add(x) for x in [1980.0] * 40) if s is not None)
    assert (
        kept.settled
        and not pruned(MeasurementVerdict.from_dict(settling_figures(kept)))
        and kept == settle([1980.0] * 40, RULE)
    )


@pytest.mark.parametrize("noisy", [False, True])
def test_a_pruned_trial_keeps_its_figure_and_is_never_crowned(tmp_path, noisy):
    """The hand-tuned config is pruned (its window stopped early): recorded with its figure, never a contender,
    never the unconfirmed best, even when its figure would rank it first."""
    cfg = load_config(study_file(tmp_path, trials=4, patience=0))
    wave = [1200.0, 2400.0] * 20 if noisy else [1200.0] * 40

    class Runner(Flat):
        def __call__(self, config: dict, number: int) -> TrialResult:
            if config.get("max_mamba_cache_size") != 192:
                return ok(config, 500.0)
            settler = PruningSettler(RULE, SlicePruner(incumbent=5000.0, resolution=0.02))
            done = next(s for s in (settler.add(x) for x in wave) if s is not None)
            window = done.tok_s[done.warmup_slices :]
            return ok(
                config, sum(window) / len(window), measurement=MeasurementVerdict.from_dict(settling_figures(done))
            )

    study = run_study(cfg, runner=Runner())
    trial = next(t for t in study.get_trials() if t.user_attrs.get("role") == "enqueued")
    assert pruned(TrialResult.of(trial).measurement) and trial.values[0] > 500.0  # its figure, recorded
    top, _, _ = contenders(study, 3)
    assert trial.number not in [t.number for t in top]
    assert (summarize(study, cfg).best or {}).get("trial") != trial.number
