"""``--speculative-adaptive`` in the planner, ``autotune plan``, the numerics table and the simulator's pacing.

Mirrors SGLang 0.5.23: ``srt/arg_groups/speculative_hook.py`` (L261-264 the order; L1159 auto parameters skipped;
L1374-1389 ``_maybe_disable_adaptive``; L1392-1426 ``_init_adaptive_speculative_params``),
``srt/speculative/adaptive_spec_params.py`` (L28-53 the default table, L56-104 ``adaptive_unsupported_reason``,
L103-139 the config file, L153-271 ``AdaptiveStepSlot``, L342-358 routing), ``spec_info.py`` L268-289 (the buffers'
draft-token bound), ``kv_cache_configurator.py`` L1718-1734 (scratch allocated at that bound) against
``_handle_max_mamba_cache`` L3300-3378 (charged at D), and ``adaptive_runtime_state.py`` L103-120 (a runtime state,
with its graphs, per other candidate).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.sglang.adaptive import DEFAULT_TABLE, AdaptiveSpec, settled_steps, slot_for
from autotune.sglang.memory import plan
from autotune.sglang.numerics import changes_numerics, not_numerics_reason
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim.evaluate import SimWorkload, _seed_prompts, evaluate
from autotune.sim.truth import Deviation

QWEN, B200 = load_model("qwen3.6-27b"), load_gpu("b200")
MTP = {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 96}
AD = {"speculative_adaptive": True}


def test_resolution_starts_at_the_middle_candidate():
    p = plan(QWEN, B200, {**MTP, **AD})
    assert p.fits and (p.extra["spec_steps"], p.extra["spec_topk"], p.extra["draft_tokens"]) == (3, 1, 4)
    ad = p.extra["adaptive"]
    assert ad["candidates"] == [0, 1, 3, 5, 7] and ad["max_draft_tokens"] == 8 and ad["initial_steps"] == 3
    five = plan(QWEN, B200, {**MTP, **AD, "speculative_num_steps": 5, "speculative_num_draft_tokens": 2})
    assert five.extra["draft_tokens"] == 6  # D = steps + 1 whatever was asked (L1423-1426)
    # topk without steps is fine here: the EAGLE family's "must be unset" rule is skipped under adaptive (L1159).
    assert plan(QWEN, B200, {**MTP, **AD, "speculative_eagle_topk": 1}).extra["spec_steps"] == 3


def test_steps_outside_the_candidates_are_refused_with_sglangs_message():
    p = plan(QWEN, B200, {**MTP, **AD, "speculative_num_steps": 2})
    assert p.failure == "bad_args" and p.message == (
        "ValueError: --speculative-num-steps=2 is not in the adaptive config candidate_steps [0, 1, 3, 5, 7]. "
        "Pass one of those values."
    )


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ({}, "speculative_algorithm=None (only EAGLE/EAGLE3 are supported)"),
        ({"speculative_algorithm": "NGRAM"}, "speculative_algorithm=NGRAM"),
        (
            {
                **MTP,
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 2,
                "speculative_num_draft_tokens": 4,
                "attention_backend": "fa3",
                "page_size": 1,
            },
            "speculative_eagle_topk=2 (only topk=1 is supported)",
        ),
        ({**MTP, "tp_size": 2, "enable_dp_attention": True, "dp_size": 2}, "attention DP is not supported"),
    ],
)
def test_dropped_with_a_warning_where_0523_does(flags, reason):
    p = plan(QWEN, B200, {**flags, **AD})
    assert p.extra["adaptive"] is None and "speculative_adaptive" in p.inert
    assert any(w.startswith("speculative_adaptive disabled") and reason in w for w in p.extra["warnings"])


def test_scratch_is_charged_at_d_and_allocated_for_the_largest_candidate():
    static, ad = plan(QWEN, B200, MTP), plan(QWEN, B200, {**MTP, **AD})
    assert (ad.kv_tokens, ad.max_running_requests, ad.extra["rest_gib"]) == (
        static.kv_tokens,
        static.max_running_requests,
        static.extra["rest_gib"],
    )  # the charge is unchanged
    assert ad.gib.intermediate_ssm == pytest.approx(2 * static.gib.intermediate_ssm, rel=1e-3)  # D 8 against 4
    more = ad.gib.mamba_total - static.gib.mamba_total + ad.gib.graphs - static.gib.graphs
    assert ad.gib.headroom == pytest.approx(static.gib.headroom - more, abs=0.01)
    assert ad.gib.graphs > static.gib.graphs and ad.extra["startup_s"] > static.extra["startup_s"]
    # The seed's hand-tuned config fits without the flag and not with it: 41 requests' scratch at D = 8.
    tuned = {**MTP, "max_mamba_cache_size": 200, "mem_fraction_static": 0.93, "max_running_requests": 64}
    assert plan(QWEN, B200, tuned).fits
    assert plan(QWEN, B200, {**tuned, **AD}).failure == "startup_oom"


def test_a_config_file_is_read_and_checked(tmp_path):
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"down_hysteresis": 0.0, "1": {"candidate_steps": [2, 4]}}))
    p = plan(QWEN, B200, {**MTP, **AD, "speculative_adaptive_config": str(path)})
    assert p.extra["adaptive"]["initial_steps"] == 4 and p.extra["adaptive"]["max_draft_tokens"] == 5
    assert p.extra["adaptive"]["slots"]["1"]["down_hysteresis"] == 0.0
    path.write_text(json.dumps({"ema_alpha": 0.3}))
    assert (
        "at least one integer-string"
        in plan(QWEN, B200, {**MTP, **AD, "speculative_adaptive_config": str(path)}).message
    )
    missing = plan(QWEN, B200, {**MTP, **AD, "speculative_adaptive_config": str(tmp_path / "no.json")})
    assert missing.failure == "bad_args" and "No such file" in missing.message


def test_routing_pads_to_the_graph_size_then_takes_the_slot_below():
    keys, graphs = list(DEFAULT_TABLE), [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert [slot_for(b, keys, graphs) for b in (1, 5, 7, 8, 25, 31, 33, 40, 64)] == [1, 8, 8, 8, 32, 32, 32, 32, 64]
    assert slot_for(5, keys, None) == 1  # no graphs: no padding


@pytest.mark.parametrize(
    ("alpha", "steps"),
    [(0.95, {1: 5, 8: 3, 32: 1, 64: 0}), (0.825, {1: 3, 8: 3, 32: 1, 64: 0}), (0.2, {1: 1, 8: 1, 32: 1, 64: 0})],
)
def test_settled_steps_follow_the_slot_rule(alpha, steps):
    spec = AdaptiveSpec(DEFAULT_TABLE, 3)
    # bs 1: E[accepted | 3 steps] = .95 + .90 + .86 = 2.71 > 3 − .5 → 5; at .825 it is 2.07: stays at 3.
    assert {k: settled_steps(DEFAULT_TABLE[k], spec.slot_initial(k), alpha) for k in DEFAULT_TABLE} == steps


def test_plan_cli_and_numerics():
    out = (
        CliRunner()
        .invoke(
            cli,
            [
                "plan",
                "--model",
                "qwen3.6-27b",
                "--gpu",
                "b200",
                "--set",
                "speculative_algorithm=EAGLE",
                "--set",
                "speculative_adaptive=true",
            ],
        )
        .output
    )
    assert "adaptive steps" in out and "D=8" in out
    dropped = (
        CliRunner()
        .invoke(cli, ["plan", "--model", "qwen3.6-27b", "--gpu", "b200", "--set", "speculative_adaptive=true"])
        .output
    )
    assert "speculative_adaptive disabled" in dropped
    assert changes_numerics({"speculative_algorithm": "EAGLE", "speculative_adaptive": True}) == []
    assert "speculation depth only" in not_numerics_reason("speculative_adaptive")


@pytest.mark.timeout(120)
def test_simulator_paces_the_steps_of_the_batch_size():
    """At 40 running (slot 32: one step) the verify holds 2 tokens, not 4; at 4 running and α = .95 (slot 1 climbs
    to 5 steps) it holds 6: the accept length and speed move with the batch size (the simulator's claim)."""
    work = SimWorkload(prompts=_seed_prompts(128), max_tokens=4096, warmup_s=40, measure_s=90)
    big = {**MTP, "max_mamba_cache_size": 200, "max_running_requests": 40, "mem_fraction_static": 0.8}
    static, ad = evaluate(big, work), evaluate({**big, **AD}, work)
    assert static.status == ad.status == "ok" and static.max_running_requests == ad.max_running_requests == 40
    assert static.metrics.accept_length == pytest.approx(3.09, abs=0.15)
    assert ad.metrics.accept_length == pytest.approx(1.825, abs=0.1)  # 1 + α with one step
    assert ad.output_tok_s < static.output_tok_s
    small = {**MTP, "max_running_requests": 4}
    s_static, s_ad = evaluate(small, work, acceptance=0.95), evaluate({**small, **AD}, work, acceptance=0.95)
    assert s_ad.metrics.accept_length > s_static.metrics.accept_length + 0.5
    slower = evaluate({**big, **AD}, work, deviation=Deviation(adaptive_efficiency=0.9))
    assert slower.output_tok_s < ad.output_tok_s  # the hidden truth's lever factor
