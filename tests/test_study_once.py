"""Each config launches once per study: a search never relaunches a measured config, and the baseline and the
enqueued configs run once however many workers share the study (in-process runner, no servers)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from optuna.trial import TrialState
from test_study import PlannerRunner, write_toml

from autotune.config import load_config
from autotune.search.objective import open_study
from autotune.search.scaleout.workers import on_gpu
from autotune.search.seeding import launched, seed_trials
from autotune.search.space import key_of
from autotune.search.study import Sweep, run_study

SMALL = """
[study]
name = "once"
trials = {trials}
seed = 3
sampler = "{sampler}"

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1
speculative_num_steps = 3
speculative_num_draft_tokens = 4

[space]
max_mamba_cache_size = {{ choices = [80, 160] }}
{space}

[workload]
prompts = "prompts.jsonl"
sample_size = 4

[baseline]
flags = {{ max_mamba_cache_size = 80 }}
{extra}
"""


def write_small(tmp_path: Path, *, trials: int, sampler: str = "tpe", extra: str = "", space: str = "") -> Path:
    return write_toml(tmp_path, SMALL.format(trials=trials, sampler=sampler, extra=extra, space=space), name="once")


def test_a_space_that_can_only_repeat_never_relaunches_a_measured_config(tmp_path, monkeypatch):
    # Two configs exist (the baseline's 80 slots and 160): a budget of 4 launches can only repeat them, until the
    # sweep's bound on proposals per launch of the budget ends it (kept small here: each proposal is a stored trial).
    monkeypatch.setattr("autotune.search.study.MAX_ASKS_PER_LAUNCH", 4)
    cfg = load_config(write_small(tmp_path, trials=4, sampler="random"))
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    keys = [key_of(config) for _, config in runner.calls]
    assert len(keys) == len(set(keys)) == 2  # each config launched once, the baseline's included
    trials = study.get_trials()
    repeats = [t for t in trials if t.user_attrs.get("status") == "repeat"]
    assert repeats, "the sampler proposed no repeat: the test space is not small enough"
    by_number = {t.number: t for t in trials}
    for t in repeats:
        first = by_number[t.user_attrs["reused_from"]]
        assert t.state == TrialState.COMPLETE and t.values == first.values  # the sampler is told the figure
        assert t.user_attrs["launch_key"] == first.user_attrs["launch_key"]
        assert first.user_attrs["status"] == "ok" and "not launched again" in t.user_attrs["reason"]
    assert any(by_number[t.user_attrs["reused_from"]].user_attrs["role"] == "baseline" for t in repeats)
    assert len(launched(trials)) == 2  # a repeat costs no launch of the budget


class SlowRunner(PlannerRunner):
    """The planner's figures, a little wall time per launch (so two workers overlap), thread-safe call log."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s, self.lock = delay_s, threading.Lock()

    def __call__(self, config: dict, number: int):
        time.sleep(self.delay_s)
        with self.lock:
            return super().__call__(config, number)


MEM_FRACTIONS = "mem_fraction_static = { choices = [0.86, 0.88, 0.90] }"  # search configs the given ones are not
HAND_TUNED = """
[[enqueue]]
label = "hand-tuned"
flags = { max_mamba_cache_size = 160 }
"""


def test_two_workers_on_one_study_launch_the_baseline_and_each_enqueued_config_once(tmp_path):
    path = write_small(tmp_path, trials=4, extra=HAND_TUNED, space=MEM_FRACTIONS)
    first = load_config(path)
    second = on_gpu(first, 1, None)  # the second worker, on GPU 1
    runner = SlowRunner(0.2)
    # Two nodes seeding at the same moment: each saw an empty study and queued the given configs, so each is queued
    # twice. The claim still runs each once.
    study = open_study(first)
    seed_trials(study, first)
    for role, label, config in first.given():
        params = {k: v for k, v in config.items() if k in first.space}
        study.enqueue_trial(params, user_attrs={"role": role, "label": label, "config": config})
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 4
    errors: list[BaseException] = []

    def work(cfg):
        try:
            run_study(cfg, runner=runner)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(cfg,)) for cfg in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    trials = open_study(first, create=False).get_trials()
    for role, label, config in first.given():
        runs = [c for _, c in runner.calls if key_of(c) == key_of(config)]
        assert len(runs) == 1, f"{role} {label} launched {len(runs)} times"
        done = [
            t
            for t in trials
            if (t.user_attrs.get("role"), t.user_attrs.get("label")) == (role, label) and t.state == TrialState.COMPLETE
        ]
        assert len(done) == 1
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    dropped = [t for t in trials if t.user_attrs.get("status") == "duplicate"]
    assert len(dropped) == 2 and all(t.state == TrialState.PRUNED for t in dropped)  # the later copies, unrun
    workers = {t.user_attrs["gpu"] for t in trials if t.state == TrialState.COMPLETE and "worker" in t.user_attrs}
    assert len(workers) == 2  # both workers ran trials


def test_a_sweep_alone_still_runs_the_baseline_first(tmp_path):
    cfg = load_config(write_small(tmp_path, trials=2, extra=HAND_TUNED))
    sweep = Sweep(cfg, runner=PlannerRunner())
    try:
        sweep.run()
    finally:
        sweep.close()
    trials = sweep.study.get_trials()
    assert [t.user_attrs["role"] for t in trials[:2]] == ["baseline", "enqueued"]
