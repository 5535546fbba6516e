"""The numerics table: which SGLang 0.5.23 flags change outputs, their reference values, and ``changes_numerics``."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.sglang.flags import FlagTable
from autotune.sglang.numerics import (
    NOT_NUMERICS,
    NUMERICS_FLAGS,
    changes_numerics,
    not_numerics_reason,
    numerics_flag,
    reference_config,
)
from autotune.sglang.profiles import load_model

TABLE = FlagTable.bundled()


def test_every_table_flag_is_a_flag_of_sglang_with_its_default_as_reference():
    for flag in NUMERICS_FLAGS:
        spec = TABLE.lookup(flag.dest)
        assert spec.dest == flag.dest and flag.why
        if spec.default is not None:
            assert flag.reference == spec.default, flag.dest
    # SGLang leaves --mamba-ssm-dtype unset and reads the model config: float32 for the bundled hybrids.
    for name in ("qwen3.6-27b", "qwen3-next-80b-a3b"):
        assert numerics_flag("mamba_ssm_dtype").reference == load_model(name).ssm_dtype


def test_listed_values_are_exactly_the_non_reference_choices():
    for flag in NUMERICS_FLAGS:
        spec = TABLE.lookup(flag.dest)
        if flag.values is None:  # free-form (a path, a method name): any value differs
            continue
        if spec.choices is None:  # a switch: only True differs
            assert flag.values == (True,) and flag.reference is False, flag.dest
            continue
        assert set(flag.aliases) <= set(spec.choices), flag.dest
        canonical = {flag.canonical(choice) for choice in spec.choices}
        assert set(flag.values) == canonical - {flag.reference}, flag.dest


@pytest.mark.parametrize("flag", NUMERICS_FLAGS, ids=lambda f: f.dest)
def test_each_listed_value_is_reported_against_the_defaults(flag):
    values = flag.values or TABLE.lookup(flag.dest).choices or ("/path/or/name",)  # None: any value differs
    for value in values:
        (change,) = changes_numerics({flag.dest: value})
        assert (change.flag, change.value, change.reference) == (flag.dest, flag.canonical(value), flag.reference)
        assert change.to_dict() == {
            "flag": flag.dest,
            "value": change.value,
            "reference": flag.reference,
            "why": flag.why,
        }


def test_reference_values_and_synonyms_change_nothing():
    assert changes_numerics({}) == [] and changes_numerics({}, {}) == []
    assert changes_numerics(reference_config()) == []
    assert (
        changes_numerics({"mamba_ssm_dtype": "float32", "kv_cache_dtype": "auto", "enable_fp32_lm_head": False}) == []
    )
    assert changes_numerics({"dtype": "half"}, {"dtype": "float16"}) == []
    assert changes_numerics({"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "bf16"}) == []
    assert changes_numerics({"flashinfer_a2a_dispatch_type": "auto"}) == []
    assert changes_numerics({"enable_fp32_lm_head": "true"})[0].value is True  # values are coerced like flags


def test_compares_two_configs_flag_by_flag():
    baseline = {"mamba_ssm_dtype": "bfloat16", "max_running_requests": 64}
    trial = {"mamba_ssm_dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "quantization": "fp8"}
    changes = changes_numerics(trial, baseline)
    assert [(c.flag, c.value, c.reference) for c in changes] == [
        ("kv_cache_dtype", "fp8_e4m3", "auto"),
        ("quantization", "fp8", None),
    ]
    back = changes_numerics(baseline, trial)  # the other way round names the same flags
    assert [c.flag for c in back] == ["kv_cache_dtype", "quantization"]
    assert changes_numerics({}, {"mamba_ssm_dtype": "float16"})[0].value == "float32"


def test_scheduling_memory_and_speculative_flags_are_not_numerics():
    config = {
        "speculative_algorithm": "NEXTN",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "speculative_draft_kv_cache_dtype": "fp8_e4m3",
        "max_running_requests": 208,
        "chunked_prefill_size": 4096,
        "schedule_policy": "lpm",
        "disable_radix_cache": True,
        "mamba_radix_cache_strategy": "extra_buffer",
        "max_mamba_cache_size": 208,
        "mem_fraction_static": 0.93,
        "enable_deterministic_inference": True,
    }
    assert changes_numerics(config) == []
    for dest in config:
        assert numerics_flag(dest) is None and not_numerics_reason(dest), dest


def test_the_not_in_the_table_list_names_real_flags_and_none_of_the_table():
    table_dests = {flag.dest for flag in NUMERICS_FLAGS}
    for key, reason in NOT_NUMERICS.items():
        assert reason
        if key.endswith("*"):
            matches = [d for d in TABLE.dests if d.startswith(key[:-1])]
            assert matches and not table_dests & set(matches), key
        elif key == "torchao_config":  # a candidate that 0.5.23 does not have at all
            assert key not in TABLE
        else:
            assert TABLE.lookup(key).dest == key and key not in table_dests


def test_a_model_that_stores_its_ssm_state_in_bfloat16_moves_the_reference():
    bf16_model = {"mamba_ssm_dtype": "bfloat16"}
    assert changes_numerics({"mamba_ssm_dtype": "bfloat16"}, defaults=bf16_model) == []
    (change,) = changes_numerics({"mamba_ssm_dtype": "float32"}, defaults=bf16_model)
    assert (change.value, change.reference) == ("float32", "bfloat16")
    assert reference_config(bf16_model)["mamba_ssm_dtype"] == "bfloat16"


def test_bad_input_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*--kv-cache-dtype got 'fp9'.*fp8_e4m3"):
        changes_numerics({"kv_cache_dtype": "fp9"})
    with pytest.raises(ConfigError, match=r"reference: reference must be a mapping.*got list"):
        changes_numerics({}, ["kv_cache_dtype"])
    with pytest.raises(ConfigError, match=r"defaults: max_running_requests is not in the numerics table.*use flags"):
        changes_numerics({}, defaults={"max_running_requests": 8})
    with pytest.raises(ConfigError, match=r"mamba_ssm_dtype"):
        reference_config({"mamba_ssm_dtype": "float64"})


def test_the_docs_table_names_every_flag():
    doc = (Path(__file__).parents[1] / "docs" / "numerics.md").read_text()
    for flag in NUMERICS_FLAGS:
        assert f"| `{flag.dest}` |" in doc, flag.dest
