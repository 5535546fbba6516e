"""The planner's steps for two levers that reshape the pools without changing SGLang's sizing rules: the memory
of ``--speculative-adaptive`` (``autotune.sglang.adaptive``) and the arena of ``--enable-unified-memory``
(``autotune.sglang.unified``). Each takes a step's result and returns it as 0.5.23 allocates it under the lever
(docs/sglang-memory.md §1, §3, §5)."""

from __future__ import annotations

import dataclasses

from autotune.sglang import memory_steps as step
from autotune.sglang.adaptive import AdaptiveSpec, slot_for
from autotune.sglang.profiles import GIB, MIB, ModelProfile
from autotune.sglang.unified import Arena, arena

__all__ = ["adaptive_graphs", "scratch_allocation", "unified_arena"]


def scratch_allocation(
    model: ModelProfile,
    f: step.Flags,
    r: step.Resolved,
    m: step.MambaPool,
    *,
    adaptive: AdaptiveSpec | None,
    unified: bool,
) -> step.MambaPool:
    """The speculative Mamba scratch as allocated. SGLang charges it at the resolved D either way
    (``_handle_max_mamba_cache``), but the static pool allocates it for ``max_speculative_num_draft_tokens`` —
    max(candidates) + 1 under adaptive (``_build_hybrid_req_pool``, kv_cache_configurator.py L1718-1734) — while
    the unified pool allocates D draft tokens with an undeduplicated conv window of D·(k−1) columns
    (``UnifiedMambaPool``, unified_memory_pool.py L1132-1170, sized at D by kv_cache_configurator.py L930). The charge,
    and so ``rest``, stays as it was."""
    if m.slots is None or not r.spec.on or f.get("enable_linear_replayssm_spec") or (adaptive is None and not unified):
        return m
    tp, k = r.start.attn_tp, model.conv_kernel
    d = r.spec.d if unified else max(r.spec.d, adaptive.max_draft_tokens if adaptive else 0)
    conv_cols = d * (k - 1) if unified or r.spec.topk > 1 else d + k - 2
    ssm = model.mamba_ssm_bytes(tp, m.ssm_dtype)
    n = m.scratch_requests + 1
    inter_ssm = n * d * ssm / GIB
    inter_conv = model.linear_layers * n * (model.conv_dim // tp) * conv_cols * 2 / GIB
    return dataclasses.replace(
        m,
        intermediate_ssm_gib=inter_ssm,
        intermediate_conv_gib=inter_conv,
        total_gib=m.ssm_gib + m.conv_gib + inter_ssm + inter_conv,
    )


def unified_arena(f: step.Flags, r: step.Resolved, m: step.MambaPool, kv: step.KvPool) -> tuple[Arena, step.KvPool]:
    """The arena that replaces the KV pool and the K state slots, and the KV pool reported as the arena less the
    states' (K+1)·P (so the plan's pools still add up to what the process holds)."""
    assert m.slots is not None
    cap = f.get("max_total_tokens")
    a = arena(
        kv_budget_bytes=m.rest_bytes,
        kv_tokens=kv.tokens,
        capped=cap is not None and cap <= kv.tokens,
        cell_bytes=kv.cell_bytes,
        slot_bytes=m.slot_bytes,
        slots=m.slots,
        page=r.layout.page_size,
    )
    kv_gib = (a.total_bytes - (m.slots + 1) * m.slot_bytes) / GIB
    return a, dataclasses.replace(kv, gib=kv_gib)


def adaptive_graphs(
    g: step.Graphs, r: step.Resolved, adaptive: AdaptiveSpec | None, *, graph_scale: float = 1.0
) -> step.Graphs:
    """One more set of draft and verify graphs per candidate other than the initial steps, each over the capture
    sizes that can route to it (``AdaptiveController.init_states`` and ``build_adaptive_runtime_state``:
    adaptive_runtime_state.py L103-120, eagle_worker_v2.py L1777-1840), at the planner's 2 MiB per captured token."""
    if adaptive is None or not g.decode_bs:
        return g
    keys = sorted(adaptive.table)
    mib, captures = 0.0, 0.0
    for steps in adaptive.candidates:
        if steps == adaptive.initial_steps:
            continue
        sizes = [b for b in g.decode_bs if steps in adaptive.table[slot_for(b, keys, g.decode_bs)].candidates]
        if not sizes:
            continue
        phases = [
            p for p in (max(sizes) * (steps + 1), max(sizes) * r.spec.topk * steps, max(sizes) * (steps + 1)) if p
        ]
        mib += step.GRAPH_MIB_PER_TOKEN * sum(phases)
        captures += step.CAPTURE_S * len(sizes) * len(phases)
    return dataclasses.replace(
        g, gib=g.gib + mib * MIB / GIB * graph_scale, decode_capture_s=g.decode_capture_s + captures
    )
