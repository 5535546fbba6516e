"""Twins: one server launched at two memory fractions is one contender of the confirmation, not two."""

from __future__ import annotations

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import create_trial

from autotune.results import Capacity, Metrics, Percentiles, TrialResult
from autotune.search.confirm.ranking import contenders, ranked
from autotune.search.confirm.twins import held_tokens, twin_key, twins_of
from autotune.search.space import key_of

BASE = {"max_running_requests": 128, "max_mamba_cache_size": 128, "speculative_num_steps": 3}


def _trial(
    tok_s: float, fraction: float, *, running: int = 128, kv: int = 400_000, role: str = "search", **flags: object
) -> optuna.trial.FrozenTrial:
    config = {**BASE, "max_running_requests": running, "mem_fraction_static": fraction, **flags}
    p = Percentiles()
    result = TrialResult(
        status="ok",
        config=config,
        capacity=Capacity(max_running_requests=running, kv_tokens=kv, mem_fraction_static=fraction),
        metrics=Metrics(output_tok_s=tok_s, request_s=1.0, ttft_ms=p, itl_ms=p, e2e_ms=p),
    )
    return create_trial(
        value=tok_s,
        params={"x": fraction},
        distributions={"x": FloatDistribution(0.5, 1.0)},
        user_attrs={
            "status": "ok",
            "role": role,
            "config": config,
            "launch_key": key_of(config),
            "result": result.to_dict(),
        },
    )


def test_a_request_is_taken_to_hold_its_prompt_and_half_its_answer_budget():
    assert held_tokens(270.0, 4096) == 270.0 + 2048.0


def test_two_fractions_whose_pools_hold_the_batch_are_twins():
    held = held_tokens(270.0, 4096)  # 2,318 tokens a request; 128 requests: 296,704
    a, b = _trial(100.0, 0.92, kv=345_280), _trial(99.0, 0.95, kv=410_000)
    assert twin_key(a, held) == twin_key(b, held)
    assert twin_key(a, None) != twin_key(b, None)  # without the bound, each launch is its own


def test_a_pool_too_small_for_the_batch_is_its_own_config():
    held = held_tokens(270.0, 4096)
    small = _trial(100.0, 0.86, kv=215_841)  # 1,686 tokens a request: the pool decides what runs
    assert twin_key(small, held) != twin_key(_trial(99.0, 0.92, kv=345_280), held)


def test_another_running_cap_or_another_flag_is_another_config():
    held = held_tokens(270.0, 4096)
    a = _trial(100.0, 0.92, kv=500_000)
    assert twin_key(a, held) != twin_key(_trial(99.0, 0.95, running=112, kv=500_000), held)
    assert twin_key(a, held) != twin_key(_trial(99.0, 0.95, kv=500_000, chunked_prefill_size=8192), held)


def _six(study: optuna.Study) -> None:
    """The baseline, one server at three fractions (trials 1–3), two other configs."""
    for t in [
        _trial(2000.0, 0.95, running=16, kv=900_000, role="baseline"),
        _trial(5100.0, 0.93, kv=400_000),
        _trial(5000.0, 0.92, kv=345_280),
        _trial(4990.0, 0.94, kv=380_000),
        _trial(4900.0, 0.95, running=144, kv=500_000),
        _trial(4800.0, 0.9, running=112, kv=400_000),
    ]:
        study.add_trial(t)


def test_the_confirmation_takes_the_best_twin_and_the_next_distinct_config():
    study = optuna.create_study(direction="maximize")
    _six(study)
    held = held_tokens(270.0, 4096)
    numbers = [t.number for t in contenders(study, 3, held=held)[0]]
    assert numbers == [1, 4, 5]  # trials 2 and 3 are trial 1 at other fractions
    assert [t.number for t in contenders(study, 3)[0]] == [1, 2, 3]  # without the bound: three launches of one server
    trials = study.get_trials()
    assert twins_of(trials, numbers, held) == {1: (2, 3)}  # what the summary says trial 1 stood for
    assert twins_of(trials, [1, 2, 5], held) == {1: (3,), 2: (3,)}  # a confirmed twin is not stood for
    assert twins_of(trials, numbers, None) == {}


def test_a_twin_the_confirmation_could_not_take_was_not_stood_for():
    """A launch of the same server that broke a constraint (or was pruned) was left out on its own: only the trials
    the confirmation could rank (``ranked``) are named as stood for."""
    study = optuna.create_study(direction="maximize")
    _six(study)
    over = _trial(5050.0, 0.91, kv=340_000)
    study.add_trial(
        create_trial(
            value=5050.0,
            params=over.params,
            distributions=over.distributions,
            user_attrs={**over.user_attrs, "constraint": [0.2]},
        )
    )  # trial 6: infeasible
    held = held_tokens(270.0, 4096)
    numbers = [t.number for t in contenders(study, 3, held=held)[0]]
    assert numbers == [1, 4, 5]
    assert twins_of(study.get_trials(), numbers, held) == {1: (2, 3, 6)}  # every launch of the server
    assert [t.number for t in ranked(study)] == [1, 2, 3, 4, 5, 0]
    assert twins_of(ranked(study), numbers, held) == {1: (2, 3)}  # what the summary passes


def test_the_sweep_summary_says_which_launches_a_contender_stood_for(tmp_path):
    from test_study import PlannerRunner, write_study

    from autotune.cli.sweep import render
    from autotune.config import load_config
    from autotune.search.confirm import confirm
    from autotune.search.objective import open_study
    from autotune.search.views.summary import summarize

    cfg = load_config(write_study(tmp_path, trials=6))  # its prompts are a few tokens: the bound is max_tokens / 2
    study = open_study(cfg)
    _six(study)
    assert confirm(study, cfg, runner=PlannerRunner()) is not None
    summary = summarize(study, cfg)
    assert summary.twins == {1: (2, 3)}
    line = next(x for x in render(summary).splitlines() if "one server" in x)
    assert line.startswith("  confirmed as one server: trial 1 for 2, 3 (the same config at another")
