"""``--enable-unified-memory`` in the planner, ``autotune plan``, the numerics table and the simulator.

Mirrors SGLang 0.5.23: ``srt/arg_groups/kv_cache_hook.py`` ``handle_page_major_kv_layout`` (L770-862) and
``handle_unified_memory_pool`` (L528-702), FP4 in ``handle_kv4_compatibility`` (L132-137); the pool build in
``srt/mem_cache/kv_cache_configurator.py`` (L595-649: hybrid Mamba or hybrid SWA only; L1385-1406: an EAGLE draft
must fuse) and ``config_from_budget`` (L3207-3228: the 4 KiB-floored budget); the arena in
``srt/mem_cache/unified_memory_pool.py`` ``init_unified_mamba_pools`` (L1593-1842: budget + K·P, bs=1 floor) and
``srt/mem_cache/allocator/unified_mamba.py`` (L136-153: the KV side's dynamic size; L179-190: one state's token cost).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from simserver import sim_server

from autotune.cli import cli
from autotune.sglang.memory import plan
from autotune.sglang.numerics import changes_numerics, not_numerics_reason, numerics_flag
from autotune.sglang.profiles import GIB, load_gpu, load_model
from autotune.sim import args as sim_args
from autotune.sim.evaluate import SimWorkload, _seed_prompts, evaluate
from autotune.sim.limits import SchedulerLimits
from autotune.sim.truth import Deviation

CONFIGS = Path(__file__).parent / "data" / "configs"
MTP = {"speculative_algorithm": "EAGLE"}
UNI = {"enable_unified_memory": True}
QWEN, B200, H200 = load_model("qwen3.6-27b"), load_gpu("b200"), load_gpu("h200")


@pytest.mark.parametrize(
    ("gpu", "flags"),
    [
        (B200, {**MTP, "max_mamba_cache_size": 96}),  # trtllm_mha, extra_buffer + overlap (ratio 5)
        (H200, {**MTP}),  # fa3, auto-sized Mamba pool
        (B200, {**MTP, "mamba_radix_cache_strategy": "extra_buffer_lazy", "max_mamba_cache_size": 96}),
        (B200, {"mamba_radix_cache_strategy": "no_buffer", "attention_backend": "triton", "max_mamba_cache_size": 90}),
        (B200, {**MTP, "disable_radix_cache": True, "max_running_requests": 32}),
        (B200, {"speculative_algorithm": "NEXTN", "max_mamba_cache_size": 96}),  # NEXTN resolves to EAGLE first
    ],
)
def test_accepted_for_every_strategy_with_the_same_cap_and_one_arena(gpu, flags):
    static, uni = plan(QWEN, gpu, flags), plan(QWEN, gpu, {**flags, **UNI})
    assert static.fits and uni.fits, uni.message
    # Sizing is the static path's: K, the running cap and the boot label max_total_num_tokens (L3119-3172).
    assert (uni.max_running_requests, uni.max_mamba_cache_size, uni.kv_tokens, uni.extra["ratio"]) == (
        static.max_running_requests,
        static.max_mamba_cache_size,
        static.kv_tokens,
        static.extra["ratio"],
    )
    arena, k = uni.extra["unified"], uni.max_mamba_cache_size
    slot, cell = uni.extra["mamba_slot_bytes"], uni.extra["kv_cell_bytes"]
    budget = int(static.extra["rest_gib"] * GIB)  # the KV budget after the Mamba pool, as the planner rounds it
    assert abs(arena["total_bytes"] - k * slot - budget) < 0.0001 * GIB + 4096  # floor_4KiB(budget) + K·P
    assert (arena["total_bytes"] - k * slot) % 4096 == 0
    assert arena["state_tokens"] == math.ceil(slot / arena["entry_bytes"]) and arena["entry_bytes"] % 32 == 0
    assert arena["entry_bytes"] == -(-cell // 32) * 32  # the fused MTP draft rides in the full entry
    # The arena holds the label's tokens plus the K states' worth (less the sink): KV may take idle state bytes.
    assert arena["tokens"] > uni.kv_tokens
    assert abs(uni.gib.kv + (k + 1) * slot / GIB - arena["total_gib"]) < 0.001
    assert static.extra["unified"] is None and "enable_unified_memory" not in uni.inert


def test_seed_case_figures():
    uni = plan(QWEN, B200, {**MTP, "max_mamba_cache_size": 96, **UNI})
    assert uni.max_running_requests == 19 and uni.extra["binding"] == "mamba"  # 96 // 5, as without the flag
    assert uni.extra["unified"]["state_tokens"] == 2211  # ceil(153,944,064 / 69,632)
    assert uni.extra["unified"]["entry_bytes"] == 69_632  # 65,536 target + 4,096 fused MTP draft


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"speculative_algorithm": "NGRAM"}, "only supports --speculative-algorithm DSPARK, DFLASH, EAGLE and EAGLE3"),
        (
            {
                **MTP,
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 2,
                "speculative_num_draft_tokens": 4,
                "attention_backend": "fa3",
                "page_size": 1,
            },
            "supports a linear draft chain only",
        ),  # L601-607
        ({**MTP, "attention_backend": "fa4"}, "+ EAGLE/EAGLE3 requires the target on the spec-verify-audited"),
        ({**MTP, "speculative_draft_attention_backend": "fa4"}, "runs the draft on ['fa4']"),  # L634-640
        ({"attention_backend": "flex_attention"}, "--enable-page-major-kv-layout: the resolved attention backends"),
        ({"linear_attn_decode_backend": "cutedsl"}, "linear-attention DECODE backend must be one of"),  # L843-852
        ({"mamba_backend": "flashinfer"}, "requires the Triton Mamba kernels"),  # L858-862
        ({"kv_cache_dtype": "nvfp4"}, "FP4 KV cache does not yet support --enable-unified-memory"),
        ({**MTP, "speculative_draft_kv_cache_dtype": "fp8_e4m3"}, "this draft cannot fuse"),  # L1395-1405
        ({"enable_two_batch_overlap": True}, "does not support --enable-two-batch-overlap"),  # L653-657
        ({"dcp_size": 2}, "supports MLA models only"),  # _validate_unified_memory_dcp L719-732
        # PD disaggregation (L533-586): Mooncake only; no speculative decoding over it; Mamba-specific refusals.
        ({"disaggregation_mode": "decode", "disaggregation_transfer_backend": "nixl"}, "transfer backends: mooncake"),
        ({**MTP, "disaggregation_mode": "prefill"}, "does not support speculative decoding with the Mooncake"),
        (
            {
                "disaggregation_mode": "decode",
                "disaggregation_decode_enable_offload_kvcache": True,
                "hicache_storage_backend": "file",
            },
            "decode KV offload does not support hybrid-Mamba models",
        ),
        (
            {"disaggregation_mode": "decode", "disaggregation_decode_retraction_backup": "host_pool"},
            "host-pool decode retraction does not support hybrid-Mamba models",
        ),
    ],
)
def test_refused_before_launch_with_sglangs_message(flags, words):
    p = plan(QWEN, B200, {**flags, **UNI})
    assert not p.fits and p.failure == "bad_args" and words in p.message, p.message
    assert p.kv_tokens == 0 and p.gib.weights == 0.0  # stopped at argument resolution, before any memory


def test_refused_for_a_model_without_hybrid_pools():
    dense = load_model(str(CONFIGS / "llama_8b.json"))
    p = plan(dense, B200, UNI)
    assert p.failure == "bad_args" and "only supports hybrid Mamba and hybrid sliding-window" in p.message
    eagle = {**UNI, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d"}
    assert "linear draft chain only" in plan(dense, B200, eagle).message  # Llama's auto topk is 4 (L601-607)
    eagle = plan(dense, B200, {**eagle, "speculative_num_steps": 3, "speculative_eagle_topk": 1})
    assert eagle.failure == "bad_args" and "requires a unified target" in eagle.message  # L608-614


def test_page_major_layout_alone_is_refused():
    p = plan(QWEN, B200, {"enable_page_major_kv_layout": True})
    assert p.failure == "bad_args" and "without --enable-unified-memory is temporarily unsupported" in p.message


def test_full_prefill_graph_is_turned_off_not_refused():
    # L689-716: FULL prefill capture only on fa3/fa4; trtllm_mha gets a warning and no prefill graphs.
    flags = {**MTP, "max_mamba_cache_size": 96, "cuda_graph_backend_prefill": "full"}
    uni = plan(QWEN, B200, {**flags, **UNI})
    assert uni.fits and uni.extra["prefill_graph_tokens"] == 0
    assert any("disabling the FULL prefill cuda-graph backend" in w for w in uni.extra["warnings"])
    assert plan(QWEN, B200, flags).extra["prefill_graph_tokens"] > 0


def test_plan_cli_shows_the_arena():
    argv = [
        "plan",
        "--model",
        "qwen3.6-27b",
        "--gpu",
        "b200",
        "--set",
        "speculative_algorithm=EAGLE",
        "--set",
        "max_mamba_cache_size=96",
        "--set",
        "enable_unified_memory=true",
    ]
    table = CliRunner().invoke(cli, argv).output
    assert "unified arena" in table and "2,211" in table
    data = json.loads(CliRunner().invoke(cli, [*argv, "--json"]).output)
    assert data["extra"]["unified"]["state_tokens"] == 2211 and data["max_running_requests"] == 19


def test_not_a_numerics_flag():
    assert numerics_flag("enable_unified_memory") is None and "memory layout only" in not_numerics_reason(
        "enable_unified_memory"
    )
    assert changes_numerics({"enable_unified_memory": True}) == []


def test_simulator_kv_room_floats_against_held_states():
    uni = plan(QWEN, B200, {**MTP, "max_mamba_cache_size": 96, **UNI})
    lim = SchedulerLimits.from_plan(uni)
    assert lim.arena_tokens == uni.extra["unified"]["tokens"] and lim.state_tokens == 2211
    assert SchedulerLimits.from_plan(plan(QWEN, B200, {**MTP, "max_mamba_cache_size": 96})).arena_tokens is None


@pytest.mark.timeout(120)
def test_simulator_unified_arena_lends_idle_state_bytes_to_kv():
    """A KV pool capped at 60K tokens retracts 40 running requests; in one arena the 200 state slots' idle bytes
    hold their KV (the simulator's claim of how the floating split serves, docs/sglang-memory.md §3)."""
    work = SimWorkload(prompts=_seed_prompts(128), max_tokens=4096, warmup_s=40, measure_s=90)
    flags = {**MTP, "max_mamba_cache_size": 200, "max_running_requests": 40, "max_total_tokens": 60_000}
    static, uni = evaluate(flags, work), evaluate({**flags, **UNI}, work)
    assert static.status == uni.status == "ok" and static.kv_tokens == uni.kv_tokens
    assert static.retractions > 0 and uni.retractions == 0
    assert uni.output_tok_s > 1.1 * static.output_tok_s
    slower = evaluate({**flags, **UNI}, work, deviation=Deviation(unified_efficiency=0.9))
    assert slower.output_tok_s < uni.output_tok_s  # the hidden truth's lever factor applies with the lever
    same = evaluate(flags, work, deviation=Deviation(unified_efficiency=0.9))
    assert same.output_tok_s == pytest.approx(static.output_tok_s)  # and only with it


def test_sim_options_carry_the_lever_factors():
    parsed = sim_args.parse(
        [
            "--model-path",
            "qwen3.6-27b",
            "--enable-unified-memory",
            "--speculative-adaptive",
            "--sim-unified-efficiency",
            "0.93",
            "--sim-adaptive-efficiency",
            "0.97",
        ]
    )
    assert parsed.flags["enable_unified_memory"] is True and parsed.flags["speculative_adaptive"] is True
    dev = Deviation.from_sim(parsed.sim)
    assert (dev.unified_efficiency, dev.adaptive_efficiency) == (0.93, 0.97)
    assert dev.efficiency({"unified": {"tokens": 1}, "adaptive": None}) == pytest.approx(0.93)
    assert dev.efficiency({"unified": None, "adaptive": {"initial_steps": 3}}) == pytest.approx(0.97)
    assert Deviation().efficiency({"unified": {"tokens": 1}, "adaptive": {"initial_steps": 3}}) == 1.0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_simulated_server_runs_both_levers_and_refuses_before_loading(tmp_path):
    flags = [
        "--speculative-algorithm",
        "EAGLE",
        "--max-mamba-cache-size",
        "96",
        "--enable-unified-memory",
        "--speculative-adaptive",
    ]
    expected = plan(QWEN, B200, {**MTP, "max_mamba_cache_size": 96, **UNI, "speculative_adaptive": True})
    with sim_server(tmp_path, flags, dict(os.environ)) as url:
        state = httpx.get(f"{url}/server_info", timeout=5).json()["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == expected.max_running_requests == 19
    log = (tmp_path / "sim.log").read_text()
    assert f"UnifiedKVPool allocated: total_bytes={expected.extra['unified']['total_gib']:.2f} GB" in log
    assert "AdaptiveSpeculativeParams initialized: steps=3, candidate_steps=[1, 3, 5, 7]" in log
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.sim",
            "--model-path",
            "qwen3.6-27b",
            "--port",
            "0",
            "--speculative-algorithm",
            "NGRAM",
            "--enable-unified-memory",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert refused.returncode != 0 and "only supports --speculative-algorithm DSPARK" in refused.stdout + refused.stderr
    assert "Load weight" not in refused.stdout + refused.stderr
