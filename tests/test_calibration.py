"""The planner against real SGLang startup logs of hybrid models on real GPUs (tests/data/calibration/cases.json;
docs/sglang-memory.md §12 has the table). Each case's state and KV sizes per slot and per token must match the
log's within rounding; where the log gives the memory before load and the weights, the pools it sized (Mamba
slots, KV tokens, the running cap) must be within 2 % of the planner's, except where the case names the rule its
SGLang version computes differently from 0.5.23."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autotune.sglang.memory import plan
from autotune.sglang.profiles import GIB, ModelProfile, from_hf_config, load_gpu, load_model

ROOT = Path(__file__).parent.parent
CASES = json.loads((Path(__file__).parent / "data" / "calibration" / "cases.json").read_text())


def model_of(case: dict[str, Any]) -> ModelProfile:
    cfg = case["config"]
    if isinstance(cfg, dict):
        return from_hf_config(cfg, name=case["name"])
    return load_model(ROOT / cfg if (ROOT / cfg).exists() else cfg)


def planned(case: dict[str, Any]):
    model = model_of(case)
    tp = int(case["flags"].get("tp_size") or 1)
    if case["weights_gib_per_rank"] is not None:  # the logged weights: the comparison is of the pool rules
        with_draft = bool(case["flags"].get("speculative_algorithm")) and model.mtp_layers
        draft = model.draft_weights_gib if with_draft else 0.0
        model = replace(model, target_weights_gib=case["weights_gib_per_rank"] * tp - draft)
    gpu = load_gpu(case["gpu"]["profile"], memory_mib=case["gpu"].get("memory_mib"))
    return model, plan(model, gpu, case["flags"], free_gib=case["free_gib"])


def test_the_set_spans_gpus_families_and_precisions():
    assert len(CASES) >= 12
    assert len({c["gpu"]["profile"] for c in CASES}) >= 4
    assert {model_of(c).family_name for c in CASES} >= {"qwen3_5", "granitemoehybrid", "nemotron_h"}
    assert {model_of(c).quant_method for c in CASES} >= {"none", "fp8-block", "nvfp4"}
    assert all(c["source"] and c["sglang"] and c["log"] for c in CASES)


@pytest.mark.parametrize("case", [c for c in CASES if "weights_gib" in c["logged"]], ids=lambda c: c["name"])
def test_weights_from_config_arithmetic_are_within_two_percent_of_the_log(case):
    """Without a safetensors index the weights are config.json arithmetic (docs/sglang-memory.md §12)."""
    model = model_of(case)
    tp = int(case["flags"].get("tp_size") or 1)
    assert model.weights_gib(with_draft=False, tp=tp) == pytest.approx(case["logged"]["weights_gib"], rel=0.02)


def within_rounding(*gb: float) -> float:
    """The relative error the log's two-decimal GB figures allow (0.005 each), and never less than 1 %."""
    return max(0.01, 0.005 * len(gb) / sum(gb))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_state_and_kv_sizes_match_the_log(case):
    logged = case["logged"]
    model = model_of(case)
    tp = int(case["flags"].get("tp_size") or 1)
    ssm_dtype = case["flags"].get("mamba_ssm_dtype")
    if "ssm_gb" in logged:  # the pool holds slots + 1 (a padding slot); GB in the log is GiB
        parts = [logged["ssm_gb"]] + ([logged["conv_gb"]] if "conv_gb" in logged else [])
        per_slot = sum(parts) * GIB / (logged["slots"] + 1)
        ours = model.mamba_slot_bytes(tp, ssm_dtype) if "conv_gb" in logged else model.mamba_ssm_bytes(tp, ssm_dtype)
        assert ours == pytest.approx(per_slot, rel=within_rounding(*parts))
    if "k_gb" in logged:
        per_token = (logged["k_gb"] + logged["v_gb"]) * GIB / logged["kv_tokens"]
        tolerance = within_rounding(logged["k_gb"], logged["v_gb"])
        assert model.kv_cell_bytes(tp, case["kv_dtype"]) == pytest.approx(per_token, rel=tolerance)


POOLED = [c for c in CASES if c["free_gib"] is not None or c["weights_gib_per_rank"] is not None]


@pytest.mark.parametrize("case", POOLED, ids=[c["name"] for c in POOLED])
def test_pools_are_within_two_percent_where_the_rule_is_the_same(case):
    _, p = planned(case)
    assert p.fits, p.message
    got = {"slots": p.max_mamba_cache_size, "kv_tokens": p.kv_tokens, "max_running_requests": p.max_running_requests}
    for key, value in case["logged"].items():
        if key not in got:
            continue
        if key in case["differences"]:
            assert abs(got[key] / value - 1) > 0.02, f"{key}: the named difference is gone; drop it from the case"
        else:
            assert got[key] == pytest.approx(value, rel=0.02), key


def free_before_capture(logged: dict[str, Any]) -> float | None:
    """The log's free memory once the pools are made and before any graph: "Capture cuda graph begin", or the
    server's last figure when it captured none."""
    if "capture_begin_gib" in logged:
        return float(logged["capture_begin_gib"])
    return float(logged["after_graphs_gib"]) if logged.get("graphs_gib") == 0 else None


def test_the_attention_backend_takes_what_the_logs_show_between_the_pools_and_capture():
    """FlashInfer's workspace: the drop from "Memory pool end" to the next figure before any graph is captured."""
    measured = {}
    for case in CASES:
        logged = case["logged"]
        before_capture = free_before_capture(logged) if "pool_end_gib" in logged else None
        if before_capture is None:
            continue
        _, p = planned(case)
        measured[case["name"]] = (round(logged["pool_end_gib"] - before_capture, 2), p.gib.backend)
    assert len(measured) >= 2
    for drop, planned_gib in measured.values():
        assert planned_gib == pytest.approx(drop, abs=0.1)


def test_free_memory_after_graph_capture_is_what_the_docs_table_says():
    """The planner's free memory after the pools, the backend's buffers and the graphs against the log's, per
    case that logs both ends: docs/sglang-memory.md §12 quotes these figures."""
    errors = {}
    for case in CASES:
        if case["free_gib"] is None or "after_graphs_gib" not in case["logged"]:
            continue
        _, p = planned(case)
        g = p.gib
        free_after_graphs = case["free_gib"] - (g.weights + g.mamba_total + g.kv) - g.backend - g.graphs
        errors[case["name"]] = round(free_after_graphs - case["logged"]["after_graphs_gib"], 2)
    assert errors == {
        "qwen3.5-9b-tp2-rtx4090": pytest.approx(0.25, abs=0.05),
        "qwen3.6-27b-class-fp8-h100": pytest.approx(2.47, abs=0.05),
        "qwen3.5-397b-a17b-fp8-tp2-rtx4090": pytest.approx(-0.48, abs=0.05),
    }
