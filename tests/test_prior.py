"""The planner's starting points on the memory wall: where they sit, what they keep, and that they are queued once."""

from __future__ import annotations

import optuna

from autotune.config import load_config
from autotune.search.runner import prompt_texts
from autotune.search.space import Feasibility, Space
from autotune.search.starts import MEMORY_LEVERS, edge_configs, tokens_per_request
from autotune.search.study import Sweep, run_study


def _setup():
    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    wl = cfg.workload
    chars = [len(text) for text in prompt_texts(wl.prompts, wl.sample_size, wl.seed)]
    return cfg, Space.from_config(cfg), Feasibility.from_config(cfg), chars


def test_edges_fill_the_kv_pool_without_overcommitting_it():
    cfg, space, feasibility, chars = _setup()
    baseline = {**cfg.engine.fixed, **cfg.baseline.flags}
    configs = edge_configs(
        space,
        feasibility,
        prompt_chars=chars,
        max_tokens=cfg.workload.max_tokens,
        n=4,
        seed=0,
        exclude=[baseline],
        hold=baseline,
    )
    assert len(configs) == 4 and len({str(sorted(c.items())) for c in configs}) == 4
    base_plan = feasibility.predict(baseline, inert=False)
    caps = []
    for config, share in zip(configs, (0.5, 0.6, 0.7, 0.8), strict=True):
        memory_plan = feasibility.predict(config, inert=False)
        assert memory_plan.fits and memory_plan.gib.headroom >= feasibility.margin_gib
        per_request = tokens_per_request(chars, cfg.workload.max_tokens, share)
        assert memory_plan.max_running_requests * per_request <= memory_plan.kv_tokens
        # production's non-memory flags are kept: the starting point differs only where memory is decided
        for name in ("speculative_num_steps", "speculative_num_draft_tokens"):
            assert config[name] == baseline[name]
        caps.append(memory_plan.max_running_requests)
    assert caps == sorted(caps, reverse=True)  # a larger share of KV per request admits fewer requests
    assert caps[-1] > 4 * base_plan.max_running_requests  # the wall is far above production's 16
    assert "speculative_num_steps" not in MEMORY_LEVERS


def test_edges_are_placed_after_the_baseline_once_and_survive_resume(tmp_path):
    """Edge starts are placed one at a time once the baseline and enqueued configs have run (with the output
    lengths they measured), three in all, and a resumed sweep places no more."""
    from test_study import PlannerRunner

    cfg, *_ = _setup()
    study_cfg = cfg.study.model_copy(
        update={"storage": f"sqlite:///{tmp_path / 's.db'}", "edge_starts": 3, "trials": 5, "confirm_top_k": 0}
    )
    cfg = cfg.model_copy(update={"study": study_cfg, "path": tmp_path / "s.toml"})
    sweep = Sweep(cfg)
    sweep.prepare()
    waiting = sweep.study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["role"] for t in waiting] == ["baseline", "enqueued"]  # no edge before a measurement
    sweep.close()
    run_study(cfg, runner=PlannerRunner())
    more = cfg.model_copy(update={"study": study_cfg.model_copy(update={"trials": 7})})
    run_study(more, runner=PlannerRunner())  # a resume with a larger budget
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    trials = study.get_trials()
    assert [t.user_attrs["role"] for t in trials[:5]] == ["baseline", "enqueued", "prior", "prior", "prior"]
    assert [t.user_attrs["label"] for t in trials[2:5]] == ["memory edge 1", "memory edge 2", "memory edge 3"]
    assert sum(t.user_attrs["role"] == "prior" for t in trials) == 3
    # PlannerRunner measures no output lengths: the first placement falls back to a share of max_tokens
    assert trials[2].user_attrs["edge_output_tokens"] is None and trials[2].user_attrs["edge_kv_per_request"] > 2000


def test_observed_output_reads_the_window_with_most_turnover():
    from autotune.results import Metrics, Percentiles, TrialResult
    from autotune.search.edges import observed_output

    p = Percentiles()

    def trial(tokens: int, completed: int, concurrency: int):
        m = Metrics(
            output_tok_s=1.0,
            request_s=1.0,
            ttft_ms=p,
            itl_ms=p,
            e2e_ms=p,
            output_tokens=tokens,
            completed=completed,
            concurrency=concurrency,
        )
        result = TrialResult(status="ok", config={}, metrics=m).to_dict()
        return optuna.trial.create_trial(value=1.0, user_attrs={"result": result})

    # 32 in flight, 16 done: 2,200 per request; 352 in flight, 40 done: inflated by the requests still running
    trials = [trial(35_200, 16, 32), trial(160_000, 40, 352)]
    assert observed_output(trials, 4096) == 2200.0
    assert observed_output([trial(10_000, 1, 1)], 4096) == 4096.0  # never above max_tokens
    assert observed_output([], 4096) is None


def _ok(role: str, tok_s: float) -> optuna.trial.FrozenTrial:
    from autotune.results import Metrics, Percentiles, TrialResult

    p = Percentiles()
    m = Metrics(
        output_tok_s=tok_s, request_s=1.0, ttft_ms=p, itl_ms=p, e2e_ms=p, output_tokens=100, completed=1, concurrency=8
    )
    result = TrialResult(status="ok", config={}, metrics=m).to_dict()
    return optuna.trial.create_trial(value=tok_s, user_attrs={"result": result, "role": role})


def test_a_starved_edge_start_doubles_the_kv_the_next_ones_assume():
    """An edge start that started but measured a fraction of the baseline (SGLang retracting and re-prefilling a
    pool it overfilled) was past the wall: the next start assumes twice the KV per request."""
    from autotune.search.edges import STARVED_SHARE, EdgeStarts, starved_starts

    cfg, space, feasibility, _ = _setup()
    edges = EdgeStarts(cfg, space, feasibility)
    given = [_ok("baseline", 2000.0), _ok("enqueued", 4000.0)]
    assert starved_starts(given) == 0
    healthy = [*given, _ok("prior", 9000.0)]
    starved = [*given, _ok("prior", STARVED_SHARE * 4000.0 - 1.0)]
    assert starved_starts(healthy) == 0 and starved_starts(starved) == 1
    assert starved_starts([*starved, _ok("prior", 3.0)]) == 2
    assert starved_starts([_ok("prior", 3.0)]) == 0  # nothing to compare with: no verdict
    base, _ = edges.per_request(healthy, 1)
    backed_off, _ = edges.per_request(starved, 1)
    assert abs(backed_off - 2 * base) <= 1  # doubled, to int rounding


def test_the_radix_cache_holds_a_shared_prefix_once():
    from autotune.search.starts import _held_per_request, shared_prefix_tokens

    system = "You are a careful assistant. " * 40  # 1,160 characters every prompt starts with
    texts = [system + "question one", system + "question two?", "unrelated " * 10]
    shared = shared_prefix_tokens(texts)
    assert shared == (2 * (len(system) + len("question ")) + 0) / 3 / 4
    assert shared_prefix_tokens(["only one"]) == 0.0
    assert _held_per_request({"disable_radix_cache": True}, 1000, shared) == 1000
    assert _held_per_request({}, 1000, shared) == 1000 - shared


def test_edges_with_a_shared_prefix_admit_more_requests_when_the_radix_cache_is_on():
    cfg, space, feasibility, chars = _setup()
    baseline = {**cfg.engine.fixed, **cfg.baseline.flags}
    kw = dict(
        prompt_chars=chars,
        max_tokens=cfg.workload.max_tokens,
        n=1,
        seed=0,
        exclude=[baseline],
        hold=baseline,
        per_request=[6000],
    )
    plain = edge_configs(space, feasibility, **kw)[0]
    shared = edge_configs(space, feasibility, shared_prefix=5000.0, **kw)[0]
    cap = lambda c: feasibility.predict(c, inert=False).max_running_requests  # noqa: E731
    assert not shared.get("disable_radix_cache")
    assert cap(shared) > cap(plain)  # 1,000 tokens of its own per request instead of 6,000
