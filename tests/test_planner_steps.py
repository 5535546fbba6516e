"""Each step of the memory planner (autotune.sglang.memory_steps) against the calibration figures it produces
(docs/sglang-memory.md; C# = its calibration targets). b200 + qwen3.6-27b, TP1, MTP D=4 unless stated otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.sglang import memory_steps as step
from autotune.sglang.args import PlanStop
from autotune.sglang.flags import parse_sets
from autotune.sglang.memory import plan
from autotune.sglang.parallel import pp_stage
from autotune.sglang.profiles import GIB, MIB, load_gpu, load_model

MTP = [
    "speculative-algorithm=EAGLE",
    "speculative-num-steps=3",
    "speculative-eagle-topk=1",
    "speculative-num-draft-tokens=4",
]
BASELINE = [*MTP, "max-mamba-cache-size=80", "mamba-full-memory-ratio=0.4"]
HAND_TUNED = [
    *MTP,
    "max-mamba-cache-size=200",
    "mamba-full-memory-ratio=0.6",
    "mem-fraction-static=0.93",
    "max-running-requests=64",
]
QWEN = load_model("qwen3.6-27b")


def chain(*sets: str, gpu: str = "b200", upto: str = "headroom") -> dict[str, Any]:
    """Run the steps by hand, as ``plan()`` does, and return every result by name."""
    f, g = parse_sets(sets), load_gpu(gpu)
    out: dict[str, Any] = {"start": step.start(g, f, free_gib=None)}
    out["spec"] = step.spec(QWEN, f)
    out["layout"] = step.layout(QWEN, g, f, out["spec"])
    out["sizes"] = step.sizes(QWEN, g, f, out["start"], out["spec"], out["layout"])
    r = out["r"] = step.Resolved(start=out["start"], spec=out["spec"], layout=out["layout"], sizes=out["sizes"])
    out["weights"] = w = step.weights(QWEN, f, r)
    out["mamba"] = m = step.mamba_pool(QWEN, f, r, w)
    out["kv"] = kv = step.kv_pool(QWEN, f, r, m)
    out["cap"] = cap = step.running_cap(f, r, m, kv)
    out["graphs"] = g_ = step.graphs(r, cap)
    out["headroom"] = step.headroom(QWEN, r, w, m, kv, g_)
    return out


@pytest.fixture(scope="module")
def baseline() -> dict[str, Any]:
    return chain(*BASELINE)


@pytest.fixture(scope="module")
def hand_tuned() -> dict[str, Any]:
    return chain(*HAND_TUNED)


def test_resolve_default_mem_fraction_and_layout(baseline):
    start, sp, lay, sz = baseline["start"], baseline["spec"], baseline["layout"], baseline["sizes"]
    assert start.pre_gib == pytest.approx(183_359 / 1024 - 0.5)  # nvidia-smi total − CUDA context
    assert (sp.steps, sp.topk, sp.draft_tokens, sp.d) == (3, 1, 4, 4)
    assert (lay.strategy, lay.overlap, lay.ratio) == (
        "extra_buffer",
        True,
        5,
    )  # ratio = 3 + 2 (docs/sglang-memory.md §1)
    assert (lay.attention_backend, lay.page_size) == ("trtllm_mha", 64)  # SM100 override for Qwen3.5
    assert (sz.chunk, sz.decode_max_bs, len(sz.prefill_bs)) == (16384, 512, 74)  # B200 tier
    assert sz.mfs == pytest.approx(0.790, abs=0.0005)  # 0.854 text-only × ViT factor 0.925 (§2)
    assert sz.mrr_dp == 48  # the spec default
    h200 = chain(*BASELINE, gpu="h200")
    assert h200["sizes"].mfs == pytest.approx(0.835, abs=0.0005)
    assert (h200["sizes"].chunk, len(h200["sizes"].prefill_bs)) == (8192, 58)
    assert h200["layout"].attention_backend == "fa3"


def test_resolve_stops_on_bad_args():
    f = parse_sets(["chunked-prefill-size=1000"])
    g = load_gpu("b200")
    s, sp = step.start(g, f, free_gib=None), step.spec(QWEN, f)
    with pytest.raises(PlanStop, match="must be divisible by page_size"):
        step.sizes(QWEN, g, f, s, sp, step.layout(QWEN, g, f, sp))
    with pytest.raises(PlanStop, match="divisible by tensor parallel size"):
        step.check_parallel(QWEN, step.start(g, {"tp_size": 5}, free_gib=None))


def test_weights_and_workspace(baseline):
    w, start = baseline["weights"], baseline["start"]
    assert w.weights_gib == pytest.approx(51.05 + 5.53)  # target + MTP draft, as SGLang logs them
    assert w.workspace_gib == 0.0  # 0.5.23 profiles the pools right after the weights (docs/sglang-memory.md §12)
    assert w.mm_reserve_gib == pytest.approx(100 / 1024)  # SGLANG_VLM_CACHE_SIZE_MB
    assert w.avail_gib == pytest.approx(start.pre_gib - w.weights_gib - w.workspace_gib)
    rest_gib = w.avail_gib - start.pre_gib * (1 - 0.79) - w.mm_reserve_gib
    assert w.rest_bytes / GIB == pytest.approx(rest_gib)
    assert w.startup_s == pytest.approx(15 + 56.58 / 0.45, abs=0.05)
    step.check_weights(w, baseline["r"])  # fits


def test_mamba_pool_c1_c2_c3(baseline):
    m = baseline["mamba"]
    assert m.slot_bytes == 153_944_064  # P ≈ 146.8 MiB (§3)
    assert (m.slots, m.scratch_requests) == (80, 16)  # case A: R = min(48, 80 // 5)
    assert m.ssm_gib == pytest.approx(11.39, rel=0.005)  # C1: 81 × 48 × 3 MiB
    assert m.intermediate_ssm_gib == pytest.approx(9.56, rel=0.005)  # C2: 17 × 4 × 48 × 3 MiB
    assert m.total_gib == pytest.approx(21.36, rel=0.03)  # C3
    charged = baseline["weights"].rest_bytes - m.rest_bytes
    assert charged == (16 + 1) * 4 * m.slot_bytes + (80 + 1) * m.slot_bytes  # P·(R+1)·D + P·(K+1)


def test_mamba_pool_c4_and_bf16(hand_tuned):
    assert hand_tuned["mamba"].total_gib == pytest.approx(52.33, rel=0.03)  # C4
    bf16 = chain(*HAND_TUNED, "mamba-ssm-dtype=bfloat16")["mamba"]
    assert bf16.slot_bytes / MIB == pytest.approx(74.8, abs=0.05)


def test_mamba_pool_auto_case_c_h200():
    m = chain("speculative-algorithm=EAGLE", gpu="h200")["mamba"]
    assert m.slots is not None and 104 <= m.slots <= 111  # ≈111 by hand with 54 GiB of weights (§7)


def test_kv_pool_c6_c7(hand_tuned):
    kv = hand_tuned["kv"]
    assert kv.cell_bytes == 65536 + 4096  # C6: 64 KiB target + 4 KiB MTP draft per token
    assert kv.tokens == 879_744  # C7 under 0.5.23's rule; the seed's older server logged 798K
    assert kv.tokens % 64 == 0
    assert kv.tokens == int(hand_tuned["mamba"].rest_bytes // kv.cell_bytes) // 64 * 64


def test_running_cap_c5(baseline, hand_tuned):
    assert (baseline["cap"].requests, baseline["cap"].binding) == (16, "mamba")  # C5: 80 // 5
    assert (hand_tuned["cap"].requests, hand_tuned["cap"].binding) == (40, "mamba")  # C5: 200 // 5 < 64
    assert "capped to 40 by the mamba state cache" in hand_tuned["cap"].warnings[0]


def test_graphs(hand_tuned):
    g = hand_tuned["graphs"]
    assert g.decode_bs[-1] == 40  # clamped to the running cap, which becomes a bucket
    assert g.phase_tokens == (40 * 4, 40 * 1 * 3, 40 * 4)  # verify, draft decode, draft extend
    assert g.gib == pytest.approx((2 * 440 + 8 * 74) / 1024)  # 1.44 GiB
    assert g.capture_tokens == 16384


def test_headroom_seed_093_fits_and_095_fails(hand_tuned):
    h = hand_tuned["headroom"]
    assert hand_tuned["start"].pre_gib * (1 - 0.93) == pytest.approx(12.5, abs=0.05)
    assert h.activations_gib == pytest.approx(8.56, abs=0.01)  # 16384 tokens × 1.7 × live bytes per token
    assert h.free_after_pools_gib > h.capture_gib and h.runtime_oom_tokens is None
    step.check_headroom(h, hand_tuned["r"], hand_tuned["graphs"], load_gpu("b200"))
    tight = chain(*HAND_TUNED[:-2], "mem-fraction-static=0.95", "max-running-requests=64")  # C18
    assert tight["headroom"].capture_gib > tight["headroom"].free_after_pools_gib
    with pytest.raises(PlanStop, match="Capture cuda graph failed"):
        step.check_headroom(tight["headroom"], tight["r"], tight["graphs"], load_gpu("b200"))
    threshold = chain(*HAND_TUNED[:-2], "mem-fraction-static=0.946", "max-running-requests=64")["headroom"]
    assert abs(threshold.capture_gib - threshold.free_after_pools_gib) < 0.5  # the wall is ≈ 0.946


def test_corrections_default_to_identity_and_move_the_plan():
    model, gpu, flags = QWEN, load_gpu("b200"), parse_sets(HAND_TUNED)
    base = plan(model, gpu, flags)
    same = plan(model, gpu, flags, workspace_offset_gib=0.0, activation_scale=1.0, graph_scale=1.0)
    assert same == base
    shifted = plan(model, gpu, flags, workspace_offset_gib=2.0)
    assert base.kv_tokens - shifted.kv_tokens == pytest.approx(2 * GIB / 69632, abs=64)
    assert shifted.max_mamba_cache_size == 200
    assert plan(model, gpu, flags, graph_scale=2.0).gib.graphs == pytest.approx(2 * base.gib.graphs, abs=1e-4)
    heavy = plan(model, gpu, flags, activation_scale=1.5)
    assert heavy.failure == "startup_oom" and "Capture cuda graph failed" in (heavy.message or "")


# -- parallel layouts: the plan is for one GPU of the group (docs/sglang-memory.md §9) ---------------------------
NEXT = load_model("qwen3-next-80b-a3b")


def test_pp_stage_splits_layers_as_get_pp_indices_and_counts_its_full_attention_layers():
    assert pp_stage(QWEN.num_layers, QWEN.full_layers, 1) == (64, 16)
    assert pp_stage(QWEN.num_layers, QWEN.full_layers, 2) == (32, 8)  # every 4th layer is full attention
    assert pp_stage(QWEN.num_layers, QWEN.full_layers, 3) == (22, 6)  # 21/21/22: the last stage takes one more
    assert pp_stage(NEXT.num_layers, NEXT.full_layers, 4) == (12, 3)
    assert pp_stage(10, 10, 3) == (4, 4)  # dense: every layer holds KV


def test_pp_halves_the_weights_and_the_kv_cell_per_rank():
    one, two = chain(*MTP), chain(*MTP, "pp-size=2")
    assert two["weights"].target_gib == pytest.approx(one["weights"].target_gib / 2)
    draft = one["weights"].weights_gib - one["weights"].target_gib
    assert draft > 5  # the MTP draft is loaded whole by the stage that runs it
    assert two["weights"].weights_gib == pytest.approx(two["weights"].target_gib + draft)
    target_cell = QWEN.kv_cell_bytes()
    assert two["kv"].cell_bytes == target_cell // 2 + QWEN.draft_kv_cell_bytes
    assert two["kv"].tokens > one["kv"].tokens


def test_pp_without_draft_matches_tp_for_weights_but_keeps_every_kv_head():
    pp, tp = plan(NEXT, load_gpu("h200"), {"pp_size": 2}), plan(NEXT, load_gpu("h200"), {"tp_size": 2})
    assert pp.fits and tp.fits
    assert pp.gib.weights == pytest.approx(tp.gib.weights)
    # pp 2: 6 full layers × 2 KV heads; tp 2: 12 full layers × 1 KV head: the same bytes per token
    assert pp.extra["kv_cell_bytes"] == tp.extra["kv_cell_bytes"] == 2 * 512 * 6 * 2
    # the Mamba charge counts every linear layer (mamba_cache_per_req), sharded over the attention TP group only
    assert pp.extra["mamba_slot_bytes"] == 2 * tp.extra["mamba_slot_bytes"]


def test_attention_dp_shards_kv_and_mamba_over_the_attention_tp_group_only():
    tp4 = chain("tp-size=4")
    dp = chain("tp-size=4", "dp-size=2", "enable-dp-attention=true")
    assert dp["start"].attn_tp == 2 and tp4["start"].attn_tp == 4
    assert dp["kv"].cell_bytes == QWEN.kv_cell_bytes(2)  # 2 KV heads per rank, not 1 (no draft here)
    assert dp["kv"].cell_bytes == 2 * tp4["kv"].cell_bytes
    assert dp["mamba"].slot_bytes == QWEN.mamba_slot_bytes(2) == 2 * tp4["mamba"].slot_bytes
    assert dp["weights"].weights_gib == pytest.approx(tp4["weights"].weights_gib)  # see §9: a known deviation


def test_attention_dp_splits_running_requests_and_mamba_slots_per_worker():
    dp = chain(
        *MTP,
        "tp-size=4",
        "dp-size=2",
        "enable-dp-attention=true",
        "max-running-requests=64",
        "max-mamba-cache-size=400",
    )
    assert dp["sizes"].mrr_dp == 32  # resolve_max_num_reqs: requested // attn_dp_size
    assert dp["mamba"].slots == 200  # _handle_max_mamba_cache: max_mamba_cache_size // attn_dp_size
    assert dp["cap"].requests == min(32, 200 // dp["layout"].ratio)
