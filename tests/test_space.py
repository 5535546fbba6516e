"""The search space: safe expressions, conditions, derived flags, enqueued values, the planner's verdicts."""

from __future__ import annotations

import json
import warnings

import optuna
import pytest

from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.search.space import Expr, Feasibility, Missing, Space, config_diff

STUDY = """
[engine]
model = "qwen3.6-27b"
sim_gpu = "b200"

[engine.fixed]
speculative_eagle_topk = 1

[space]
speculative_algorithm = {{ choices = ["unset", "EAGLE"] }}
speculative_num_steps = {{ type = "int", low = 1, high = 4, \
condition = {{ flag = "speculative_algorithm", in = ["EAGLE"] }} }}
max_mamba_cache_size = {{ type = "int", low = 64, high = 512, step = 64 }}
mamba_full_memory_ratio = {{ type = "float", low = 0.2, high = 1.0 }}
num_continuous_decode_steps = {{ type = "int", low = 1, high = 4 }}
mamba_radix_cache_strategy = {{ choices = ["auto", "extra_buffer_lazy"], when = "speculative_algorithm != none" }}
{extra}

[space.derived]
speculative_num_draft_tokens = "speculative_num_steps + 1"

[workload]
prompts = "prompts.jsonl"

[baseline]
flags = {{ speculative_algorithm = "EAGLE", speculative_num_steps = 3, speculative_num_draft_tokens = 4, \
max_mamba_cache_size = 80 }}
"""


def load(tmp_path, extra: str = ""):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    path = tmp_path / "s.toml"
    path.write_text(STUDY.format(extra=extra))
    return load_config(path)


def test_expressions_evaluate_without_eval():
    assert Expr("speculative_num_steps + 1")({"speculative_num_steps": 3}) == 4
    assert Expr("max(16, a // 5) * 2")({"a": 200}) == 80
    assert Expr("algo != none and algo in ['EAGLE', 'NEXTN']")({"algo": "eagle"}) is True
    assert Expr("algo != none")({}) is False
    assert Expr("not disable_radix_cache")({}) is True
    with pytest.raises(Missing):
        Expr("steps + 1")({})


@pytest.mark.parametrize(
    "text",
    ["__import__('os').system('true')", "a.b", "(lambda: 1)()", "a[0]", "open('x')", "[x for x in a]", "max(a, key=b)"],
)
def test_expressions_reject_anything_but_arithmetic(text):
    with pytest.raises(ValueError):
        Expr(text)


def test_conditions_and_derived_flags_shape_each_config(tmp_path):
    space = Space.from_config(load(tmp_path))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    configs = []
    for _ in range(30):
        trial = study.ask()
        configs.append((trial.params, space.suggest(trial)))
        study.tell(trial, 1.0)
    with_spec = [c for p, c in configs if c.get("speculative_algorithm") == "EAGLE"]
    without = [c for p, c in configs if "speculative_algorithm" not in c]
    assert with_spec and without
    assert all(c["speculative_num_draft_tokens"] == c["speculative_num_steps"] + 1 for c in with_spec)
    assert all("speculative_num_steps" not in c and "speculative_num_draft_tokens" not in c for c in without)
    assert all("mamba_radix_cache_strategy" not in c for c in without)
    assert all(c["speculative_eagle_topk"] == 1 for _, c in configs)  # fixed flags ride along


def test_record_keeps_in_space_values_and_skips_the_rest_quietly(tmp_path):
    space = Space.from_config(load(tmp_path))
    study = optuna.create_study()
    # 80 is off the 64-step grid, so it cannot be recorded as a parameter (Optuna would warn)
    config = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "max_mamba_cache_size": 80}
    study.enqueue_trial({k: v for k, v in config.items()})
    trial = study.ask()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        space.record(trial, config)
    assert trial.params == {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}


def test_condition_on_an_undeclared_flag_is_a_config_error(tmp_path):
    cfg = load(tmp_path, extra='chunked_prefill_size = { choices = [4096, 8192], when = "page_size > 1" }')
    with pytest.raises(ConfigError, match="space.chunked_prefill_size.*page_size"):
        Space.from_config(cfg)


def test_bad_expression_is_a_config_error(tmp_path):
    cfg = load(tmp_path, extra='chunked_prefill_size = { choices = [4096], when = "os.system(1)" }')
    with pytest.raises(ConfigError, match="space.chunked_prefill_size.when"):
        Space.from_config(cfg)


def test_planner_prunes_flags_that_can_change_nothing(tmp_path):
    cfg = load(tmp_path)
    space = Space.from_config(cfg)
    feas = Feasibility.from_config(cfg)
    inert = feas.inert_everywhere(space, [{**cfg.engine.fixed, **cfg.baseline.flags}])
    # the slot count is always explicit, so the ratio is dead; nothing in 0.5.23 reads continuous decode steps
    assert set(inert) == {"mamba_full_memory_ratio", "num_continuous_decode_steps"}


def test_planner_is_sure_only_about_clear_failures(tmp_path):
    cfg = load(tmp_path)
    feas = Feasibility.from_config(cfg)
    base = {
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 1,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 4,
    }
    assert not feas.sure_failure(feas.predict({**base, "max_mamba_cache_size": 80}))
    assert feas.sure_failure(feas.predict({**base, "max_mamba_cache_size": 5000}))  # the pools cannot fit


def test_learning_a_capacity_offset_corrects_predictions(tmp_path):
    cfg = load(tmp_path)
    feas = Feasibility.from_config(cfg)
    config = {
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 1,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 4,
        "max_mamba_cache_size": 200,
        "mem_fraction_static": 0.9,
    }
    predicted = feas.predict(config).kv_tokens
    # this machine reports 30k fewer KV tokens than the planner expects (e.g. a bigger CUDA context)
    offset = feas.learn(config, predicted - 30_000)
    assert offset is not None and offset > 0
    assert abs(feas.predict(config).kv_tokens - (predicted - 30_000)) < 2_000


def test_config_diff():
    assert config_diff({"a": 1, "b": 2}, {"a": 1, "c": 3}) == {"b": 2, "c": None}


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"disable_radix_cache": True},
        {"mamba_radix_cache_strategy": "extra_buffer_lazy"},
        {"disable_overlap_schedule": True},
        {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 1},
        {"speculative_algorithm": "EAGLE", "disable_radix_cache": True},
    ],
)
@pytest.mark.parametrize("gpu", ["b200", "h200"])
def test_mamba_ratio_matches_the_planners_slots_per_request(flags, gpu):
    from autotune.search.space import mamba_ratio, planner_ratio
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model

    model, device = load_model("qwen3.6-27b"), load_gpu(gpu)
    expected = plan(model, device, flags).extra["ratio"]
    assert planner_ratio(model, device)(flags) == expected
    if not (gpu == "b200" and flags.get("disable_overlap_schedule")):  # B200 pages by 64 only under spec
        assert mamba_ratio(flags) == expected


def test_derived_slots_follow_the_running_cap(tmp_path):
    from autotune.search.space import Space

    space = Space([], {"max_mamba_cache_size": Expr("max_running_requests * mamba_ratio")}, {})
    assert space.complete({"max_running_requests": 40})["max_mamba_cache_size"] == 200
    assert space.complete({"max_running_requests": 40, "disable_radix_cache": True})["max_mamba_cache_size"] == 40
    assert "max_mamba_cache_size" not in space.complete({})  # no cap → SGLang sizes the slots itself
    assert space.complete({"max_mamba_cache_size": 80})["max_mamba_cache_size"] == 80  # a given value stays
