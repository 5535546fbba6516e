"""The memory fraction at the wall: a proposal launches at the highest fraction the corrected planner expects to
start, the sampler never sees the fraction, and an OOM moves the wall down."""

from __future__ import annotations

import optuna
from test_study import PlannerRunner, write_toml

from autotune.config import load_config
from autotune.report.data import PARAM_PREFIX, trials_frame, tuned_flags
from autotune.results import TrialResult
from autotune.search.correction import CorrectedFeasibility
from autotune.search.space import Space
from autotune.search.study import Sweep
from autotune.search.wall import FRACTION, Wall
from autotune.sglang.profiles import load_gpu

STUDY = """
[study]
name = "w"
trials = {trials}
seed = 1
{study}

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "h200"

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1

[space]
mem_fraction_static = {{ type = "float", low = 0.80, high = 0.95, step = 0.01 }}
{running}
speculative_num_steps = {{ type = "int", low = 1, high = 4 }}
chunked_prefill_size = {{ choices = [4096, 16384] }}

[space.derived]
speculative_num_draft_tokens = "speculative_num_steps + 1"

[workload]
prompts = "prompts.jsonl"
sample_size = 4

[baseline]
flags = {{ speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 80 }}
"""
RUNNING = 'max_running_requests = { type = "int", low = 16, high = 48, step = 16 }'


def _study(tmp_path, *, trials: int = 4, study: str = "", running: str = RUNNING):
    return load_config(write_toml(tmp_path, STUDY.format(trials=trials, study=study, running=running), name="w"))


def _clear(feasibility: CorrectedFeasibility, config: dict, fraction: float) -> bool:
    return feasibility.clear(feasibility.predict({**config, FRACTION: fraction}, inert=False))


def test_a_proposal_takes_the_highest_fraction_the_planner_expects_to_start(tmp_path):
    cfg = _study(tmp_path)
    space, feasibility = Space.from_config(cfg), CorrectedFeasibility.from_config(cfg)
    wall = Wall.of(cfg, space, feasibility)
    assert wall is not None and wall.values[0] == 0.95 and wall.values[-1] == 0.80 and len(wall.values) == 16
    proposal = space.complete(
        {
            **space.fixed,
            "max_running_requests": 32,
            "speculative_num_steps": 4,
            "chunked_prefill_size": 16384,
            FRACTION: 0.80,
        }
    )
    placed = wall.place(proposal)
    fraction = placed[FRACTION]
    assert 0.80 < fraction < 0.95  # the planner's wall lies inside the range here: the check below bites
    assert _clear(feasibility, proposal, fraction) and not _clear(feasibility, proposal, round(fraction + 0.01, 2))
    assert {k: v for k, v in placed.items() if k != FRACTION} == {k: v for k, v in proposal.items() if k != FRACTION}

    # an OOM there is the planner's correction: the wall moves down for the proposals after it
    oom = TrialResult(status="runtime_oom", config=placed, reason="CUDA out of memory")
    assert "planner_oom_headroom_gib" in feasibility.learn_trial(placed, oom)
    assert wall.place(proposal)[FRACTION] < fraction


def test_the_sampler_keeps_the_fraction_without_a_running_cap_or_when_told(tmp_path):
    space_of = Space.from_config
    sampled = _study(tmp_path, study='memory_fraction = "sampled"')
    assert Wall.of(sampled, space_of(sampled), CorrectedFeasibility.from_config(sampled)) is None
    uncapped = _study(tmp_path, running="")  # the pools set the running cap: the fraction changes what runs
    assert Wall.of(uncapped, space_of(uncapped), CorrectedFeasibility.from_config(uncapped)) is None
    cfg = _study(tmp_path)
    assert Wall.of(cfg, space_of(cfg), None) is None  # no planner, no wall


def test_a_sweep_launches_every_proposal_at_the_wall_and_the_sampler_never_sees_the_fraction(tmp_path):
    cfg = _study(tmp_path, trials=6)
    runner = PlannerRunner()
    runner.gpu = load_gpu("h200")  # outcomes as the planner expects: it learns no offset, so a fresh one agrees
    sweep = Sweep(cfg, runner=runner)
    try:
        study = sweep.run()
    finally:
        sweep.close()
    search = [
        t
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("role") == "search" and t.state == optuna.trial.TrialState.COMPLETE
    ]
    assert len(search) >= 3
    feasibility = CorrectedFeasibility.from_config(cfg)
    for t in search:
        assert FRACTION not in t.params
        config = t.user_attrs["config"]
        fraction = config[FRACTION]
        assert _clear(feasibility, config, fraction)
        assert fraction == 0.95 or not _clear(feasibility, config, round(fraction + 0.01, 2))
    assert {t.user_attrs["config"][FRACTION] for t in search} != {0.95}  # the wall moved with the config
    # the report still shows the fraction among the tuned flags, each trial's as launched
    frame = trials_frame(study)
    assert FRACTION in tuned_flags(study)
    shown = dict(zip(frame.trial, frame[PARAM_PREFIX + FRACTION], strict=True))
    assert all(shown[t.number] == t.user_attrs["config"][FRACTION] for t in search)
