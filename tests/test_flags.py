"""The flag table: argparse's lookup rules, renames, typed coercion, and config → argv → config."""

from __future__ import annotations

import argparse

import pytest

from autotune.errors import ConfigError
from autotune.sglang.flags import FlagSpec, FlagTable, parse_sets


@pytest.fixture(scope="module")
def table() -> FlagTable:
    return FlagTable.bundled()


def test_bundled_table_is_cached_and_complete(table):
    assert FlagTable.bundled() is table
    assert table.version == "0.5.23"
    assert len(table) > 500
    assert "max_mamba_cache_size" in table.dests


@pytest.mark.parametrize(
    "name, dest",
    [
        ("max_mamba_cache_size", "max_mamba_cache_size"),
        ("--max-mamba-cache-size", "max_mamba_cache_size"),
        ("max-mamba-cache-size", "max_mamba_cache_size"),
        ("--model", "model_path"),  # alias
        ("--tensor-parallel-size", "tp_size"),  # alias
        ("--tp", "tp_size"),  # unique prefix, as argparse allows
        ("--ep", "ep_size"),
        ("--mamba-radix", "mamba_radix_cache_strategy"),
        ("disable_cuda_graph", "disable_cuda_graph"),  # deprecated but still a flag of 0.5.23
    ],
)
def test_lookup_accepts_every_spelling(table, name, dest):
    assert table.lookup(name).dest == dest


@pytest.mark.parametrize("name", ["--cuda-graph-max-bs", "cuda_graph_bs"])
def test_removed_prefixes_are_ambiguous_not_matched(table, name):
    with pytest.raises(ConfigError, match="ambiguous option") as err:
        table.lookup(name)
    assert "-decode" in str(err.value) and "-prefill" in str(err.value)


def test_renamed_flag_points_to_its_successor(table):
    with pytest.raises(ConfigError, match="not a flag of sglang 0.5.23") as err:
        table.lookup("mamba_scheduler_strategy")
    assert "--mamba-radix-cache-strategy" in str(err.value)


def test_renamed_flag_missing_from_a_smaller_table_mentions_the_replacement():
    small = FlagTable([FlagSpec(dest="tp_size", option_strings=["--tp-size"], type="int")], version="9.9")
    with pytest.raises(ConfigError, match="--disable-decode-cuda-graph"):
        small.lookup("--disable-cuda-graph")
    with pytest.raises(ConfigError, match="--attn-dp-size"):
        small.lookup("enable_dp_attention")


def test_deprecated_flags_are_accepted_with_a_pointer(table):
    assert "--disable-decode-cuda-graph" in table.deprecation("--disable-cuda-graph")
    assert "--attn-dp-size" in table.deprecation("enable_dp_attention")
    assert table.deprecation("max_mamba_cache_size") is None


def test_typo_gets_did_you_mean(table):
    with pytest.raises(ConfigError, match=r"did you mean --max-mamba-cache-size\?"):
        table.lookup("--max-mamba-cache-sise")


def test_unknown_flag_without_close_match_says_where_to_look(table):
    with pytest.raises(ConfigError, match="--help"):
        table.lookup("--zzz-not-a-thing")


@pytest.mark.parametrize(
    "dest, raw, expected",
    [
        ("max_mamba_cache_size", "200", 200),
        ("mem_fraction_static", "0.93", 0.93),
        ("mem_fraction_static", 1, 1.0),
        ("disable_radix_cache", "true", True),
        ("disable_radix_cache", "false", False),
        ("disable_radix_cache", True, True),
        ("max_total_tokens", "32k", 32_000),  # SGLang's human_readable_int
        ("max_total_tokens", "32K", 32_768),
        ("mamba_radix_cache_strategy", "extra_buffer", "extra_buffer"),
        ("cuda_graph_bs_decode", "1,2,4", [1, 2, 4]),
        ("cuda_graph_bs_decode", [8, 16], [8, 16]),
        ("speculative_algorithm", "EAGLE", "EAGLE"),
    ],
)
def test_coerce_types_values(table, dest, raw, expected):
    value = table.coerce(dest, raw)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "dest, raw, phrase",
    [
        ("max_running_requests", "1.5", "expects an integer, got '1.5'"),
        ("max_running_requests", True, "expects an integer"),
        ("mem_fraction_static", "lots", "expects a number"),
        ("disable_radix_cache", "maybe", "takes no value"),
        ("mamba_radix_cache_strategy", "fancy", "allowed: auto, no_buffer, extra_buffer, extra_buffer_lazy"),
    ],
)
def test_coerce_rejects_bad_values_naming_flag_and_value(table, dest, raw, phrase):
    with pytest.raises(ConfigError, match=phrase) as err:
        table.coerce(dest, raw)
    assert "--" + dest.replace("_", "-") in str(err.value)


def test_check_normalises_keys_and_types(table):
    out = table.check({"--max-mamba-cache-size": "200", "mem-fraction-static": "0.93", "tp": "2"})
    assert out == {"max_mamba_cache_size": 200, "mem_fraction_static": 0.93, "tp_size": 2}


def test_check_rejects_the_same_flag_twice(table):
    with pytest.raises(ConfigError, match="given twice"):
        table.check({"tp_size": 1, "--tp": 2})


def test_to_argv_renders_switches_lists_and_omits_false(table):
    argv = table.to_argv(
        {
            "max_mamba_cache_size": 200,
            "disable_radix_cache": True,
            "enable_metrics": False,
            "cuda_graph_bs_decode": [1, 2, 4],
            "max_total_tokens": None,
        }
    )
    assert argv == ["--max-mamba-cache-size", "200", "--disable-radix-cache", "--cuda-graph-bs-decode", "1", "2", "4"]


def test_boolean_optional_flag_renders_both_ways(table):
    assert table.to_argv({"enable_tf32_matmul": True}) == ["--enable-tf32-matmul"]
    assert table.to_argv({"enable_tf32_matmul": False}) == ["--no-enable-tf32-matmul"]


def _argparse_from(table: FlagTable, dests: list[str]) -> argparse.ArgumentParser:
    """A parser built the way SGLang declares these flags, to check that argv means what the config says."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    types = {"int": int, "float": float, "human_readable_int": int}
    for dest in dests:
        spec = table.lookup(dest)
        if spec.store_true:
            parser.add_argument(*spec.option_strings, dest=dest, action="store_true")
        else:
            parser.add_argument(
                *spec.option_strings, dest=dest, type=types.get(spec.type, str), nargs=spec.nargs, choices=spec.choices
            )
    return parser


def test_argv_round_trip_through_argparse(table):
    config = {
        "max_mamba_cache_size": 200,
        "mem_fraction_static": 0.93,
        "disable_radix_cache": True,
        "speculative_algorithm": "EAGLE",
        "cuda_graph_bs_decode": [1, 2, 4, 8],
        "mamba_radix_cache_strategy": "extra_buffer",
        "max_running_requests": 64,
    }
    parsed = vars(_argparse_from(table, list(config)).parse_args(table.to_argv(config)))
    assert parsed == config


def test_parse_sets_accepts_dashes_or_not_and_switches(table):
    out = parse_sets(
        [
            "max-mamba-cache-size=200",
            "--disable-radix-cache=true",
            "mem_fraction_static=0.93",
            "cuda-graph-bs-decode=1,2,4",
        ],
        table,
    )
    assert out == {
        "max_mamba_cache_size": 200,
        "disable_radix_cache": True,
        "mem_fraction_static": 0.93,
        "cuda_graph_bs_decode": [1, 2, 4],
    }


@pytest.mark.parametrize(
    "item, phrase",
    [
        ("max-mamba-cache-size", "FLAG=VALUE"),
        ("=3", "FLAG=VALUE"),
        ("cuda-graph-max-bs=16", "ambiguous"),
        ("max-running-requests=lots", "expects an integer"),
    ],
)
def test_parse_sets_errors(table, item, phrase):
    with pytest.raises(ConfigError, match=phrase):
        parse_sets([item], table)


def test_table_from_dumped_specs_works_like_the_bundled_one():
    small = FlagTable(
        [
            FlagSpec(dest="tp_size", option_strings=["--tp-size", "--tensor-parallel-size"], type="int", default=1),
            FlagSpec(dest="disable_radix_cache", option_strings=["--disable-radix-cache"], nargs=0, store_true=True),
        ]
    )
    assert small.lookup("--tp").dest == "tp_size"
    assert small.check({"tp": "2", "disable-radix-cache": "yes"}) == {"tp_size": 2, "disable_radix_cache": True}
    assert small.to_argv({"tp_size": 2, "disable_radix_cache": True}) == ["--tp-size", "2", "--disable-radix-cache"]


def test_dumped_rows_carry_action_kind_and_suppression_without_changing_meaning(table):
    row = {
        "flags": ["--disable-cuda-graph"],
        "dest": "disable_cuda_graph",
        "default": False,
        "type": None,
        "choices": None,
        "nargs": 0,
        "is_store_true": True,
    }
    plain = FlagTable.from_json([row]).lookup("disable_cuda_graph")
    dumped = FlagTable.from_json([{**row, "action": "store_true", "help_suppressed": True}]).lookup(
        "disable_cuda_graph"
    )
    assert dumped.suppressed and dumped.action == "store_true" and not plain.suppressed
    assert dumped == plain == table.lookup("disable_cuda_graph")  # what only a dump knows is not part of the spec
    assert table.specs[0].dest == "model_path" and len(table.specs) == 531  # every option but --help


def test_other_no_value_actions_are_switches_and_append_repeats():
    small = FlagTable(
        [
            FlagSpec(dest="use_x", option_strings=["--no-x"], nargs=0, action="store_false"),
            FlagSpec(dest="old", option_strings=["--old-shim"], nargs=0, action="other"),
            FlagSpec(dest="urls", option_strings=["--url"], type="str", action="append"),
        ]
    )
    assert small.check({"no-x": "true", "old-shim": True, "url": "a,b"}) == {
        "use_x": True,
        "old": True,
        "urls": ["a", "b"],
    }
    assert small.to_argv({"use_x": True, "old": False, "urls": ["a", "b"]}) == ["--no-x", "--url", "a", "--url", "b"]
