"""The Optuna loop through its public surface, with an injected runner (no servers)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import load_config
from autotune.results import PORT_TAKEN, Capacity, Metrics, Percentiles, TrialResult
from autotune.search.seeding import NOT_LAUNCHED, launched, recover
from autotune.search.study import Sweep, run_study
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model

STUDY = """
[study]
name = "t"
trials = {trials}
seed = 1
sampler = "{sampler}"

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1

[space]
max_mamba_cache_size = {{ type = "int", low = 64, high = 512, step = 64 }}
mem_fraction_static = {{ type = "float", low = 0.80, high = 0.94, step = 0.02 }}
speculative_num_steps = {{ type = "int", low = 1, high = 4 }}
mamba_full_memory_ratio = {{ type = "float", low = 0.2, high = 1.0 }}

[space.derived]
speculative_num_draft_tokens = "speculative_num_steps + 1"

[workload]
prompts = "prompts.jsonl"
sample_size = 4

[baseline]
flags = {{ speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 80 }}

[[enqueue]]
label = "hand-tuned"
flags = {{ speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 200, \
mem_fraction_static = 0.93 }}
{extra}
"""


def write_toml(tmp_path: Path, text: str, *, name: str = "t") -> Path:
    """Write ``<name>.toml`` (``text``) and the 8-row ``prompts.jsonl`` the in-process studies read; the path."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(8)))
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def write_study(tmp_path: Path, *, trials: int = 6, sampler: str = "tpe", extra: str = "") -> Path:
    return write_toml(tmp_path, STUDY.format(trials=trials, sampler=sampler, extra=extra))


P = Percentiles(p50=1.0, p90=2.0, p99=3.0, mean=1.0)


def ok(config: dict, tok_s: float, **fields) -> TrialResult:
    """A measured trial of ``tok_s`` (one request per 2,500 tokens, flat latencies); ``fields``: the rest."""
    return TrialResult(
        status="ok",
        config=config,
        **fields,
        metrics=Metrics(output_tok_s=tok_s, request_s=tok_s / 2500, ttft_ms=P, itl_ms=P, e2e_ms=P),
    )


class PlannerRunner:
    """A fake engine: the planner decides the outcome, throughput grows with running requests.

    ``oom`` lists max_mamba_cache_size values that OOM at runtime even though the planner says they fit.
    """

    def __init__(self, oom: tuple[int, ...] = (), status: str | None = None):
        self.model, self.gpu = load_model("qwen3.6-27b"), load_gpu("b200")
        self.calls: list[tuple[int, dict]] = []
        self.oom, self.status = oom, status

    def __call__(self, config: dict, number: int) -> TrialResult:
        self.calls.append((number, dict(config)))
        if self.status:
            return TrialResult(status=self.status, config=config, reason="boom", log_path=f"/logs/{number}")
        mp = plan(self.model, self.gpu, config)
        if config.get("max_mamba_cache_size") in self.oom:
            return TrialResult(status="runtime_oom", config=config, reason="CUDA out of memory")
        if not mp.fits:
            return TrialResult(status=mp.failure, config=config, reason=mp.message)
        cap = Capacity(
            max_running_requests=mp.max_running_requests, kv_tokens=mp.kv_tokens, mamba_slots=mp.max_mamba_cache_size
        )
        return ok(config, 100.0 * mp.max_running_requests, capacity=cap)


def test_baseline_first_then_enqueued_then_search_and_resume_continues(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=5))
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    trials = study.get_trials()
    assert [t.user_attrs["role"] for t in trials[:3]] == ["baseline", "enqueued", "search"]
    assert trials[0].user_attrs["result"]["config"]["max_mamba_cache_size"] == 80
    assert trials[1].user_attrs["label"] == "hand-tuned"
    assert len(trials) == 5 and all(t.state == TrialState.COMPLETE for t in trials)
    assert all("result" in t.user_attrs for t in trials)
    # every searched config carries the derived flag
    search = [t.user_attrs["config"] for t in trials if t.user_attrs["role"] == "search"]
    assert all(c["speculative_num_draft_tokens"] == c["speculative_num_steps"] + 1 for c in search)
    # the study is plain Optuna storage
    again = optuna.load_study(study_name="t", storage=cfg.storage_url)
    assert again.user_attrs["autotune"]["engine"]["model"] == "qwen3.6-27b"
    # `trials` is the total: re-running with a larger target adds only the difference, without re-seeding
    cfg8 = load_config(write_study(tmp_path, trials=8))
    study = run_study(cfg8, runner=runner)
    trials = study.get_trials()
    assert len(trials) == 8
    assert sum(t.user_attrs["role"] == "baseline" for t in trials) == 1
    assert len(runner.calls) <= 8


def test_inert_flag_is_not_searched(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    sweep = Sweep(cfg, runner=PlannerRunner())
    space = sweep.prepare().space
    sweep.close()
    # max_mamba_cache_size is always set, so the ratio cannot matter
    assert "mamba_full_memory_ratio" not in space.names
    assert "max_mamba_cache_size" in space.names
    assert "mamba_full_memory_ratio" in sweep.parts.space.names  # the study file's space, as given


def test_planner_skips_a_config_that_cannot_start_without_launching(tmp_path):
    extra = """
[[enqueue]]
label = "too-big"
flags = { speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 4000 }
"""
    cfg = load_config(write_study(tmp_path, trials=3, extra=extra))
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    skipped = study.trials[2]
    assert skipped.user_attrs["label"] == "too-big"
    assert skipped.state == TrialState.COMPLETE
    assert skipped.user_attrs["status"] == "skipped_infeasible"
    assert skipped.values == [0.0] and skipped.user_attrs["constraint"][0] > 0
    assert skipped.user_attrs["reason"]
    assert skipped.user_attrs["result"]["plan"]["fits"] is False
    assert all(c["max_mamba_cache_size"] != 4000 for _, c in runner.calls)


@pytest.mark.slow
def test_an_oom_config_is_never_launched_twice(tmp_path):
    extra = """
[[enqueue]]
label = "oom-once"
flags = { speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 192 }

[[enqueue]]
label = "oom-again"
flags = { speculative_num_steps = 3, speculative_num_draft_tokens = 4, max_mamba_cache_size = 192 }
"""
    cfg = load_config(write_study(tmp_path, trials=4, extra=extra))
    runner = PlannerRunner(oom=(192,))
    study = run_study(cfg, runner=runner)
    first, second = study.trials[2], study.trials[3]
    assert first.user_attrs["status"] == "runtime_oom" and first.state == TrialState.COMPLETE
    assert first.values == [0.0] and first.user_attrs["constraint"][0] > 0
    assert second.user_attrs["status"] == "skipped_infeasible"
    assert second.user_attrs["reused_from"] == first.number
    assert sum(c.get("max_mamba_cache_size") == 192 for _, c in runner.calls) == 1


def test_crash_is_fail_with_class_and_log(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=2))
    study = run_study(cfg, runner=PlannerRunner(status="crash"))
    t = study.trials[0]
    assert t.state == TrialState.FAIL
    assert t.user_attrs["failure"] == "crash" and t.user_attrs["log_path"] == "/logs/0"
    assert len(study.trials) == 2  # crashes count toward the target: they are finished trials


class PortTakenRunner(PlannerRunner):
    """The ports of trials ``numbers`` (all: None) were taken by another process before their servers bound them
    (``launch.base.PortTaken``)."""

    def __init__(self, numbers: set[int] | None = None):
        super().__init__()
        self.numbers = numbers

    def __call__(self, config: dict, number: int) -> TrialResult:
        if self.numbers is not None and number not in self.numbers:
            return super().__call__(config, number)
        self.calls.append((number, dict(config)))
        return TrialResult(
            status=PORT_TAKEN,
            config=config,
            reason="http://127.0.0.1:20001 answers /health but "
            "no process of this server listens there: another process holds the port",
        )


def test_a_port_another_process_took_is_run_again_and_not_counted(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=3))
    runner = PortTakenRunner({1})
    study = run_study(cfg, runner=runner)
    trials = study.get_trials()
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["status"] == PORT_TAKEN
    again = [t for t in trials if t.user_attrs.get("requeued_from") == 1]
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE and again[0].user_attrs["status"] == "ok"
    assert again[0].user_attrs["config"] == trials[1].user_attrs["config"]  # the same config, launched afresh
    assert len(launched(trials)) == 3 and trials[1] not in launched(trials)  # the host's failure costs no budget
    assert [n for n, _ in runner.calls].count(again[0].number) == 1


def test_a_host_where_every_port_is_taken_still_ends_its_study(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=2))
    study = run_study(cfg, runner=PortTakenRunner())
    trials = study.get_trials()
    assert all(t.user_attrs["status"] == PORT_TAKEN for t in trials)
    # each config once more on a fresh port; that second one counts, so two budget units take four launches
    assert len(trials) == 4 and [t.user_attrs.get("requeued_from") is not None for t in trials].count(True) == 2


def test_stale_running_trial_is_failed_and_requeued_once(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=3))
    sweep = Sweep(cfg, runner=PlannerRunner())
    sweep.prepare()
    # a sweep killed mid-trial leaves its trial RUNNING
    dead = sweep.study.ask()
    dead.set_user_attr("config", {"max_mamba_cache_size": 80})
    dead.set_user_attr("role", "baseline")
    dead.set_user_attr("label", "baseline")
    sweep.close()  # the killed process's lock died with it
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    trials = study.get_trials()
    assert trials[dead.number].state == TrialState.FAIL
    assert trials[dead.number].user_attrs["status"] == "interrupted"
    requeued = [t for t in trials if t.user_attrs.get("requeued_from") == dead.number]
    assert len(requeued) == 1 and requeued[0].state == TrialState.COMPLETE
    # the budget counts launches: a config the planner skipped is recorded but free
    assert sum(t.state == TrialState.COMPLETE and t.user_attrs["status"] not in NOT_LAUNCHED for t in trials) == 3
    assert recover(study) == []  # idempotent: nothing left running, nothing queued twice
    assert not study.get_trials(states=(TrialState.WAITING,))


def test_interrupt_records_trial_and_resume_reruns_it(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=3))
    stop = threading.Event()

    def interrupted(config, number):
        stop.set()  # what Ctrl-C does: the harness stops the server and reports "interrupted"
        return TrialResult(status="interrupted", config=config, reason="interrupted while measuring")

    study = run_study(cfg, runner=interrupted, stop_event=stop)
    first = study.trials[0]
    assert len(study.get_trials(states=(TrialState.FAIL, TrialState.COMPLETE))) == 1
    assert first.state == TrialState.FAIL
    assert first.user_attrs["status"] == "interrupted"
    runner = PlannerRunner()
    study = run_study(cfg, runner=runner)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert sum(t.user_attrs["status"] not in NOT_LAUNCHED for t in done) == 3  # the budget counts launches
    rerun = [t for t in done if t.user_attrs.get("requeued_from") == 0]
    assert len(rerun) == 1 and rerun[0].user_attrs["role"] == "baseline"
    assert rerun[0].user_attrs["result"]["config"]["max_mamba_cache_size"] == 80


def test_slo_constraint_marks_violations(tmp_path):
    extra = '\n[objective]\nconstraints = ["p99_ttft_ms <= 2"]\n'
    cfg = load_config(write_study(tmp_path, trials=2, extra=extra))
    study = run_study(cfg, runner=PlannerRunner())
    c = study.trials[0].user_attrs["constraint"]
    assert c[0] <= 0 and c[1] == pytest.approx(1.0)  # p99 TTFT 3 ms against a 2 ms limit


def test_second_objective_makes_a_pareto_study(tmp_path):
    extra = '\n[objective.second]\nmetric = "p99_itl_ms"\ndirection = "minimize"\n'
    cfg = load_config(write_study(tmp_path, trials=3, extra=extra))
    study = run_study(cfg, runner=PlannerRunner())
    assert len(study.directions) == 2
    assert study.trials[0].values[1] == pytest.approx(3.0)
    assert study.best_trials


def test_unreachable_storage_is_one_line_with_the_password_redacted(tmp_path):
    from autotune.errors import StorageError

    cfg = load_config(write_study(tmp_path), storage="postgresql+psycopg2://tuner:s3cret@127.0.0.1:1/studies")
    with pytest.raises(StorageError) as info:
        run_study(cfg, runner=PlannerRunner())
    assert "s3cret" not in str(info.value) and "tuner:***@127.0.0.1" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_second_sweep_of_the_same_study_is_refused(tmp_path):
    from autotune.errors import StudyError

    cfg = load_config(write_study(tmp_path, trials=2))
    first = Sweep(cfg, runner=PlannerRunner())
    first.prepare()
    with pytest.raises(StudyError, match="being swept"):
        Sweep(cfg, runner=PlannerRunner()).prepare()
    first.close()
    assert len(run_study(cfg, runner=PlannerRunner()).trials) == 2  # free again once the first sweep ends


@pytest.fixture(params=["sqlite", "postgres"])
def storage(request, tmp_path):
    """Every storage a study may live in; PostgreSQL comes from AUTOTUNE_TEST_POSTGRES (CI starts one)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'contract.db'}"
        return
    import os

    url = os.environ.get("AUTOTUNE_TEST_POSTGRES")
    if not url:
        if os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1":
            pytest.fail("AUTOTUNE_TEST_POSTGRES is not set")
        pytest.skip("no PostgreSQL (set AUTOTUNE_TEST_POSTGRES)")
    yield url


@pytest.mark.postgres
def test_resume_contract_holds_on_every_storage(tmp_path, storage):
    import uuid

    name = f"contract-{uuid.uuid4().hex[:8]}"
    cfg = load_config(write_study(tmp_path, trials=3), name=name, storage=storage)
    sweep = Sweep(cfg, runner=PlannerRunner())
    sweep.prepare()
    dead = sweep.study.ask()  # the trial a killed sweep left RUNNING
    sweep.close()
    try:
        study = run_study(cfg, runner=PlannerRunner())
        trials = study.get_trials()
        assert trials[dead.number].user_attrs["status"] == "interrupted"
        assert sum(t.state == TrialState.COMPLETE for t in trials) == 3
        assert sum(t.user_attrs.get("role") == "baseline" and t.state == TrialState.COMPLETE for t in trials) == 1
        again = optuna.load_study(study_name=name, storage=storage)
        assert again.user_attrs["autotune"]["study"]["name"] == name
    finally:
        optuna.delete_study(study_name=name, storage=storage)


def test_launches_count_interrupted_trials_and_not_skipped_or_rejected_ones():
    from autotune.search.seeding import finished, launches

    def trial(state, status, **result):
        attrs = {"status": status, "result": {"status": status, "config": {}, **result}} if status else {}
        return optuna.trial.create_trial(
            state=state, value=1.0 if state == TrialState.COMPLETE else None, user_attrs=attrs
        )

    trials = [
        trial(TrialState.COMPLETE, "ok"),
        trial(TrialState.COMPLETE, "skipped_infeasible"),  # the planner: no server
        trial(TrialState.COMPLETE, "bad_args", trial_dir="/t/2"),  # the engine's check: no server
        trial(TrialState.COMPLETE, "bad_args", trial_dir="/t/3", durations_s={"startup": 2.0}),  # SGLang exited
        trial(TrialState.FAIL, "interrupted"),  # a killed sweep's trial: its server was up
        trial(TrialState.FAIL, None),  # failed by Optuna's heartbeat after its worker died
        trial(TrialState.FAIL, "crash"),
    ]
    assert len(launches(trials)) == 5
    assert len(finished(trials)) == 5  # the budget: interrupted trials run again and count once
