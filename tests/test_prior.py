"""The planner's starting points on the memory wall: where they sit, what they keep, and that they are queued once."""

from __future__ import annotations

import optuna

from autotune.config import load_config
from autotune.search.starts import MEMORY_LEVERS, edge_configs, tokens_per_request
from autotune.search.space import Feasibility, Space
from autotune.search.study import Sweep, _prompt_texts


def _setup():
    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    wl = cfg.workload
    chars = [len(text) for text in _prompt_texts(wl.prompts, wl.sample_size, wl.seed)]
    return cfg, Space.from_config(cfg), Feasibility.from_config(cfg), chars


def test_edges_fill_the_kv_pool_without_overcommitting_it():
    cfg, space, feasibility, chars = _setup()
    baseline = {**cfg.engine.fixed, **cfg.baseline.flags}
    configs = edge_configs(space, feasibility, prompt_chars=chars, max_tokens=cfg.workload.max_tokens, n=4, seed=0,
                           exclude=[baseline], hold=baseline)
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


def test_edges_are_enqueued_once_and_survive_resume(tmp_path):
    cfg, *_ = _setup()
    study_cfg = cfg.study.model_copy(update={"storage": f"sqlite:///{tmp_path / 's.db'}", "edge_starts": 3})
    cfg = cfg.model_copy(update={"study": study_cfg, "path": tmp_path / "s.toml"})
    for _ in range(2):  # the second prepare is a resume
        sweep = Sweep(cfg)
        sweep.prepare()
        sweep.close()
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["role"] for t in waiting] == ["baseline", "enqueued", "prior", "prior", "prior"]
    assert [t.user_attrs["label"] for t in waiting[2:]] == ["memory edge 1", "memory edge 2", "memory edge 3"]
