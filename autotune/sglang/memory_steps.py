"""The planner's steps, in SGLang 0.5.23's order (docs/sglang-memory.md):

    resolve (start → spec → layout → sizes) → weights → Mamba pool → KV pool → running cap → graphs → headroom

Each step is a pure function of the model, the GPU, the typed flags and the earlier steps' results, and returns
a frozen dataclass. Where SGLang stops, a step raises ``PlanStop`` (arguments and Mamba slots) or its
``check_*`` function does, after the step's figures are recorded (they are what the dying process held).
``autotune.sglang.memory.plan`` chains them; ``extra()`` of each result is its part of ``MemoryPlan.extra``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotune.sglang.args import (
    SPEC_DEFAULT_MRR,
    PlanStop,
    Spec,
    decode_bs_list,
    default_mem_fraction,
    graph_settings,
    prefill_token_buckets,
    resolve_spec,
    resolve_strategy,
)
from autotune.sglang.parallel import pp_stage
from autotune.sglang.profiles import GIB, MIB, GpuProfile, ModelProfile

Flags = Mapping[str, Any]

LOAD_GIB_S = 0.45  # weight load from a warm page cache, per rank (seed: 27B + MTP restarts take ~150–180 s)
STARTUP_FIXED_S = 15.0  # spawn, NCCL/tokenizer init, KV allocation, warmup request
CAPTURE_S = 0.35  # per decode-phase graph
CAPTURE_PREFILL_S = 0.3  # per prefill token bucket
GRAPH_MIB_PER_TOKEN = 2.0  # SGLang's own reserve figure for decode graphs (memory_hook: 2 MiB per bs)
GRAPH_MIB_PER_PREFILL_BUCKET = 8.0
# FlashInfer's workspace, allocated after the pools and before capture (SGLANG_FLASHINFER_WORKSPACE_SIZE,
# srt/environ.py L1221; flashinfer_backend.py L455-469; 512 MiB for the Qwen2/Qwen3 architectures, L421-431, which
# are not hybrid). Real logs take 0.39-0.45 GiB there (docs/sglang-memory.md §12).
BACKEND_MIB = {"flashinfer": 384.0}
DEFAULT_FULL_MEMORY_RATIO = 0.9  # --mamba-full-memory-ratio unset (fields/schedule.py)


# -- resolve -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """The device before this server loads (``pre``, GiB) and the parallel layout."""

    pre_gib: float
    total_gib: float
    cuda_context_gib: float
    tp: int
    pp: int
    attn_dp: int

    @property
    def attn_tp(self) -> int:
        """Ranks one attention layer is split over: ``tp / attn_dp`` (``compute_dp_attention_world_info``). KV
        heads and linear-attention (Mamba) state shard over these, not over the whole TP group."""
        return max(1, self.tp // max(1, self.attn_dp))


def start(gpu: GpuProfile, f: Flags, *, free_gib: float | None) -> Start:
    """``pre`` = ``free_gib`` (memory free before this server loads) or total − CUDA context."""
    tp, pp = int(f.get("tp_size") or 1), int(f.get("pp_size") or 1)
    attn_dp = int(f.get("attn_dp_size") or (f.get("dp_size") if f.get("enable_dp_attention") else 1) or 1)
    pre = float(free_gib) if free_gib is not None else gpu.memory_gib - gpu.cuda_context_gib
    return Start(
        pre_gib=pre, total_gib=gpu.memory_gib, cuda_context_gib=gpu.cuda_context_gib, tp=tp, pp=pp, attn_dp=attn_dp
    )


def check_parallel(model: ModelProfile, s: Start) -> None:
    if model.num_heads % s.tp:
        raise PlanStop(
            "bad_args",
            f"AssertionError: Total number of attention heads ({model.num_heads}) must be "
            f"divisible by tensor parallel size ({s.tp}).",
        )


def spec(model: ModelProfile, f: Flags) -> Spec:
    return resolve_spec(model, f)


@dataclass(frozen=True)
class Layout:
    """Radix-cache strategy, overlap, attention backend, page size and the slots→requests ``ratio``
    (``srt/arg_groups/overrides.py``; ``srt/mem_cache/allocation_sizing.py``)."""

    strategy: str
    overlap: bool
    radix_off: bool
    attention_backend: str
    page_size: int
    ratio: int
    has_mamba: bool
    skip_decode_lock: bool = False  # SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK in the server's environment
    tracking_slots: int = 0  # extra_buffer's tracking copies per request (in ``ratio``)


def layout(model: ModelProfile, gpu: GpuProfile, f: Flags, sp: Spec, env: Mapping[str, str] | None = None) -> Layout:
    res = resolve_strategy(model, gpu, f, sp, env=env)
    return Layout(
        strategy=res.strategy,
        overlap=res.overlap,
        radix_off=res.radix_off,
        attention_backend=res.attention_backend,
        page_size=res.page_size,
        ratio=res.ratio,
        has_mamba=model.has_mamba,
        skip_decode_lock=res.skip_decode_lock,
        tracking_slots=res.tracking_slots,
    )


@dataclass(frozen=True)
class Sizes:
    """Chunk, context, CUDA-graph capture lists and the resolved ``--mem-fraction-static``
    (``srt/arg_groups/memory_hook.py``)."""

    chunk: int
    context_len: int
    prefill_tokens: int  # tokens of the largest prefill forward (the chunk, or max_prefill_tokens unchunked)
    decode_graph: bool
    decode_max_bs: int
    explicit_bs: tuple[int, ...]  # --cuda-graph-bs-decode (empty: SGLang's list)
    prefill_bs: tuple[int, ...]  # prefill graph token buckets (empty: prefill graph off)
    mfs: float
    mrr_dp: int | None  # requested running requests per DP worker (48 under spec when unset)


def sizes(model: ModelProfile, gpu: GpuProfile, f: Flags, s: Start, sp: Spec, lay: Layout) -> Sizes:
    tier_chunk, tier_bs = gpu.tier(s.tp)
    chunk = int(f.get("chunked_prefill_size") or tier_chunk)
    if chunk > 0 and chunk % lay.page_size:
        raise PlanStop(
            "bad_args", f"ValueError: chunked_prefill_size ({chunk}) must be divisible by page_size ({lay.page_size})"
        )
    if f.get("mem_fraction_static") is not None and not 0 < f["mem_fraction_static"] < 1:
        raise PlanStop(
            "bad_args", f"ValueError: --mem-fraction-static must be in (0, 1), got {f['mem_fraction_static']}"
        )
    prefill_tokens = chunk if chunk > 0 else int(f.get("max_prefill_tokens") or 16384)
    decode_graph, prefill_graph = graph_settings(f)
    explicit_bs = tuple(f.get("cuda_graph_bs_decode") or ())
    decode_max_bs = int(
        f.get("cuda_graph_max_bs_decode")
        or (max(explicit_bs) if explicit_bs else 0)
        or min(tier_bs, f.get("max_running_requests") or tier_bs)
    )
    prefill_max = int(f.get("cuda_graph_max_bs_prefill") or prefill_tokens)
    prefill_bs = (
        tuple(sorted(f.get("cuda_graph_bs_prefill") or prefill_token_buckets(prefill_max))) if prefill_graph else ()
    )
    mfs = f.get("mem_fraction_static")
    if mfs is None:
        mfs = default_mem_fraction(
            model,
            gpu,
            f,
            chunk=chunk,
            decode_max_bs=decode_max_bs,
            decode_graph=decode_graph,
            prefill_buckets=len(prefill_bs),
            tp=s.tp,
            pp=s.pp,
        )
    mrr_req = f.get("max_running_requests") or (SPEC_DEFAULT_MRR if sp.on else None)
    return Sizes(
        chunk=chunk,
        context_len=int(f.get("context_length") or model.context_len),
        prefill_tokens=prefill_tokens,
        decode_graph=decode_graph,
        decode_max_bs=decode_max_bs,
        explicit_bs=explicit_bs,
        prefill_bs=prefill_bs,
        mfs=float(mfs),
        mrr_dp=mrr_req // s.attn_dp if mrr_req else None,
    )


@dataclass(frozen=True)
class Resolved:
    """Everything argument resolution decides, before any memory is taken."""

    start: Start
    spec: Spec
    layout: Layout
    sizes: Sizes


# -- weights, then _profile_available_bytes ------------------------------------------------------------------
@dataclass(frozen=True)
class Weights:
    """Weights and what ``_profile_available_bytes`` leaves for the pools (``rest``, bytes)."""

    weights_gib: float  # target + draft, per rank
    target_gib: float  # the target model's share of ``weights_gib`` (its pipeline stage's layers)
    workspace_gib: float  # taken before profiling besides the weights (+ the workspace_offset_gib knob)
    mm_reserve_gib: float  # SGLANG_VLM_CACHE_SIZE_MB for a multimodal model
    avail_gib: float  # free after weights and workspace
    rest_bytes: float  # avail − pre·(1 − mfs) − mm_reserve
    startup_s: float  # fixed cost + weight load
    held_gib: float  # what the process holds once the weights are in (CUDA context + weights)


def weights(model: ModelProfile, f: Flags, r: Resolved, *, workspace_offset_gib: float = 0.0) -> Weights:
    pre, mfs = r.start.pre_gib, r.sizes.mfs
    # A pipeline stage loads only its layers (the draft stays whole: it runs after the last stage).
    stage_layers, _ = pp_stage(model.num_layers, model.full_layers, r.start.pp)
    target = model.weights_gib(with_draft=False, tp=r.start.tp) * stage_layers / max(1, model.num_layers)
    w = (
        target
        + model.weights_gib(with_draft=r.spec.draft_model, tp=r.start.tp)
        - model.weights_gib(with_draft=False, tp=r.start.tp)
    )
    # 0.5.23 takes nothing between the weights and the pools' profile: rest = free after load − pre·(1 − mfs)
    # (``_profile_available_bytes``, kv_cache_configurator.py L2990-3060; docs/sglang-memory.md §3, §12).
    workspace = workspace_offset_gib
    mm_reserve = 100 / 1024 if model.multimodal and not f.get("language_only") else 0.0
    avail = pre - w - workspace
    return Weights(
        weights_gib=w,
        target_gib=target,
        workspace_gib=workspace,
        mm_reserve_gib=mm_reserve,
        avail_gib=avail,
        rest_bytes=(avail - pre * (1 - mfs) - mm_reserve) * GIB,
        startup_s=round(STARTUP_FIXED_S + w / LOAD_GIB_S, 1),
        held_gib=round(r.start.cuda_context_gib + min(w, pre), 4),
    )


def check_weights(w: Weights, r: Resolved) -> None:
    pre = r.start.pre_gib
    if w.weights_gib + w.workspace_gib > pre:
        raise PlanStop(
            "startup_oom",
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{min(w.weights_gib, 2.0):.2f} GiB while loading weights "
            f"({w.weights_gib:.2f} GiB of weights, {pre:.2f} GiB free).",
        )


# -- Mamba pool (_handle_max_mamba_cache) ------------------------------------------------------------------
@dataclass(frozen=True)
class MambaPool:
    """K state slots (+1 padding), the speculative scratch of ``scratch_requests`` (+1) requests, and the ``rest``
    left for the KV pool. ``slots`` is None for a model without linear-attention layers."""

    slots: int | None
    scratch_requests: int
    slot_bytes: int  # P
    full_memory_ratio: float | None
    ssm_dtype: str | None
    ssm_gib: float = 0.0
    conv_gib: float = 0.0
    intermediate_ssm_gib: float = 0.0
    intermediate_conv_gib: float = 0.0
    total_gib: float = 0.0
    rest_bytes: float = 0.0


def _slots(f: Flags, r: Resolved, *, slot: int, scratch: int, budget: float) -> tuple[int, int]:
    """(K, requests with speculative scratch) for SGLang's cases A–D (``srt/mem_cache/kv_cache_configurator.py``,
    ``_handle_max_mamba_cache``; docs/sglang-memory.md §3)."""
    mrr_dp, ratio = r.sizes.mrr_dp, r.layout.ratio
    if f.get("max_mamba_cache_size") is not None:  # A: explicit
        k = int(f["max_mamba_cache_size"]) // r.start.attn_dp
        return k, (min(mrr_dp or 0, k // ratio) if scratch else 0)
    if r.layout.radix_off and mrr_dp:  # B: radix cache off, one slot per request
        k = max(1, mrr_dp)
        return k, (k if scratch else 0)
    if scratch:  # C: auto with speculative scratch
        k = int((budget - slot * (1 + scratch)) // (slot * (1 + scratch / ratio)))
        return k, (min(mrr_dp or 0, k // ratio) if k > 0 else 0)
    return int((budget - slot) // slot), 0  # D: auto


def mamba_pool(model: ModelProfile, f: Flags, r: Resolved, w: Weights) -> MambaPool:
    rest = w.rest_bytes
    if not model.has_mamba:
        return MambaPool(
            slots=None, scratch_requests=0, slot_bytes=0, full_memory_ratio=None, ssm_dtype=None, rest_bytes=rest
        )
    # Linear-attention state shards over the attention TP group (``mamba2_cache_params``: get_attention_tp_size);
    # the charge P counts every linear layer (``mamba_cache_per_req``: len(layers) over all linear_layer_ids).
    tp, d = r.start.attn_tp, r.spec.d
    ssm_dtype = f.get("mamba_ssm_dtype") or model.ssm_dtype
    slot = model.mamba_slot_bytes(tp, ssm_dtype)
    conv, ssm = model.mamba_conv_bytes(tp), model.mamba_ssm_bytes(tp, ssm_dtype)
    scratch = 0 if f.get("enable_linear_replayssm_spec") else d
    ratio_r = float(f.get("mamba_full_memory_ratio") or DEFAULT_FULL_MEMORY_RATIO)
    k, n_inter = _slots(f, r, slot=slot, scratch=scratch, budget=rest * ratio_r / (1 + ratio_r))
    if k <= 0:
        raise PlanStop(
            "startup_oom",
            f"RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) "
            f"state cache. Computed max_mamba_cache_size={k} (total_rest_memory="
            f"{rest / GIB:.2f} GB, mamba_cache_per_req={slot / MIB:.2f} MB). Try: (1) "
            f"reduce --max-running-requests, (2) increase --mem-fraction-static, (3) "
            f"reduce --speculative-num-draft-tokens, or (4) use GPUs with more memory.",
        )
    rest -= slot * (n_inter + 1) * scratch if scratch else 0
    rest -= (k + 1) * slot
    conv_cols = (d + model.conv_kernel - 2) if r.spec.topk <= 1 else d * (model.conv_kernel - 1)
    inter_conv = model.linear_layers * (n_inter + 1) * (model.conv_dim // tp) * conv_cols * 2 if scratch else 0
    parts = (
        (k + 1) * ssm / GIB,
        (k + 1) * conv / GIB,
        (n_inter + 1) * scratch * ssm / GIB if scratch else 0.0,
        inter_conv / GIB,
    )
    return MambaPool(
        slots=k,
        scratch_requests=n_inter,
        slot_bytes=slot,
        full_memory_ratio=ratio_r,
        ssm_dtype=ssm_dtype,
        ssm_gib=parts[0],
        conv_gib=parts[1],
        intermediate_ssm_gib=parts[2],
        intermediate_conv_gib=parts[3],
        total_gib=sum(parts),
        rest_bytes=rest,
    )


# -- KV pool --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvPool:
    cell_bytes: int  # per token, all full-attention layers on this rank (+ the MTP draft's)
    tokens: int  # max_total_num_tokens
    gib: float
    warnings: tuple[str, ...] = ()


def check_rest(w: Weights, m: MambaPool, r: Resolved) -> None:
    """SGLang's "Loaded weights leave no GPU memory" fires when weights *or* the Mamba pool ate ``rest``."""
    if m.rest_bytes <= 0:
        need = 1 - w.avail_gib / r.start.pre_gib
        raise PlanStop(
            "startup_oom",
            f"ValueError: Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={r.sizes.mfs:g}. Raise --mem-fraction-static above "
            f"{math.ceil(need * 1000) / 1000:.3f} (minimum viable = 1 - available/pre = "
            f"{need:.4f}). If using speculative decoding, draft weights are now counted.",
        )


def kv_pool(model: ModelProfile, f: Flags, r: Resolved, m: MambaPool) -> KvPool:
    sp, page = r.spec, r.layout.page_size
    with_draft = sp.on and sp.draft_model and sp.algorithm != "NGRAM"
    cell = kv_cell(model, r.start, str(f.get("kv_cache_dtype") or "auto"), with_draft=with_draft)
    tokens = int(m.rest_bytes // cell) // page * page
    warnings: list[str] = []
    cap = f.get("max_total_tokens")
    if cap is not None:
        if cap > tokens:
            warnings.append(
                f"max_total_tokens={cap} is larger than the profiled value {tokens}. The profiled value will be used."
            )
        else:
            tokens = int(cap) // page * page
    if 0 < tokens < r.sizes.context_len:
        warnings.append(f"KV pool holds {tokens} tokens, fewer than --context-length {r.sizes.context_len}.")
    return KvPool(cell_bytes=cell, tokens=tokens, gib=tokens * cell / GIB, warnings=tuple(warnings))


def kv_cell(model: ModelProfile, s: Start, kv_dtype: str, *, with_draft: bool) -> int:
    """KV bytes per token on the plan's rank: KV heads over the attention TP group (``attn_tp_size`` in
    ``_compute_cell_size``), the full-attention layers of its pipeline stage, plus the draft's layers."""
    target = model.kv_cell_bytes(s.attn_tp, kv_dtype)
    draft = model.kv_cell_bytes(s.attn_tp, kv_dtype, with_draft=True) - target if with_draft else 0
    if s.pp > 1 and model.full_layers:
        target = target * pp_stage(model.num_layers, model.full_layers, s.pp)[1] // model.full_layers
    return target + draft


def check_kv(kv: KvPool, r: Resolved) -> None:
    if kv.tokens <= 0:
        raise PlanStop(
            "startup_oom",
            f"RuntimeError: Not enough memory. Please try to increase "
            f"--mem-fraction-static. Current value: mem_fraction_static={r.sizes.mfs:g}",
        )


# -- resolve_max_num_reqs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunningCap:
    requests: int  # effective max_running_requests per DP worker
    binding: str  # explicit | spec_default | est | kv | mamba
    warnings: tuple[str, ...] = ()


def running_cap(f: Flags, r: Resolved, m: MambaPool, kv: KvPool) -> RunningCap:
    est = min(4096, max(2048, int(kv.tokens / r.sizes.context_len * 512)))
    mrr = r.sizes.mrr_dp if r.sizes.mrr_dp else est
    binding = "explicit" if f.get("max_running_requests") else "spec_default" if r.spec.on else "est"
    warnings: list[str] = []
    if kv.tokens // 2 < mrr:
        if f.get("max_running_requests"):
            warnings.append(
                f"max_running_requests was reduced from the requested {mrr} to {kv.tokens // 2} "
                f"(per dp worker) due to the available KV cache capacity."
            )
        mrr, binding = kv.tokens // 2, "kv"
    ratio = r.layout.ratio
    if m.slots is not None and m.slots // ratio < mrr:
        mrr, binding = m.slots // ratio, "mamba"
        warnings.append(
            f"max_running_requests is capped to {mrr} by the mamba state cache (max_mamba_cache_size={m.slots}, "
            f"{ratio} state slots per request). To raise it: increase --mamba-full-memory-ratio or "
            f"--max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype bfloat16."
        )
    return RunningCap(requests=mrr, binding=binding, warnings=tuple(warnings))


def check_running(cap: RunningCap, m: MambaPool, r: Resolved) -> None:
    if cap.requests <= 0:
        raise PlanStop(
            "startup_oom",
            f"RuntimeError: Hybrid (mamba/linear-attention) state cache is too small to "
            f"serve any requests. max_mamba_cache_size={m.slots}, mamba_ratio="
            f"{r.layout.ratio}, resulting max_num_reqs={cap.requests}. Try: (1) reduce "
            f"--max-running-requests, (2) increase --mem-fraction-static, or (3) use GPUs "
            f"with more memory.",
        )


# -- CUDA graphs --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Graphs:
    decode_bs: tuple[int, ...]  # captured decode batch sizes, clamped to the running cap (which becomes one)
    phase_tokens: tuple[int, ...]  # tokens per captured max-bs graph: decode/verify [, draft decode, draft extend]
    prefill_bs: tuple[int, ...]
    gib: float
    decode_capture_s: float
    prefill_capture_s: float
    backend_gib: float = 0.0  # the attention backend's buffers, taken between the pools and capture

    @property
    def capture_tokens(self) -> int:
        """Tokens of the largest forward captured (its activations are live at capture)."""
        return max(self.prefill_bs) if self.prefill_bs else self.phase_tokens[0]


def graphs(r: Resolved, cap: RunningCap, *, graph_scale: float = 1.0) -> Graphs:
    sp, sz = r.spec, r.sizes
    bs = (
        sorted({min(b, cap.requests) for b in (sz.explicit_bs or decode_bs_list(sz.decode_max_bs))})
        if sz.decode_graph
        else []
    )
    max_bs = max(bs, default=0)
    phases = [max_bs * (sp.d or 1)]  # target decode, or verify with D tokens per request
    if sp.on and sp.draft_model:
        phases += [max_bs * sp.topk * sp.steps, max_bs * sp.d]  # draft decode steps, draft extend
    mib = GRAPH_MIB_PER_TOKEN * sum(phases) + GRAPH_MIB_PER_PREFILL_BUCKET * len(sz.prefill_bs)
    return Graphs(
        decode_bs=tuple(bs),
        phase_tokens=tuple(phases),
        prefill_bs=sz.prefill_bs,
        gib=mib * MIB / GIB * graph_scale,
        decode_capture_s=CAPTURE_S * len(bs) * len(phases),
        prefill_capture_s=CAPTURE_PREFILL_S * len(sz.prefill_bs),
        backend_gib=BACKEND_MIB.get(r.layout.attention_backend, 0.0) * MIB / GIB,
    )


# -- headroom: graph capture, then the first full prefill chunk ---------------------------------------------
@dataclass(frozen=True)
class Headroom:
    static_gib: float  # weights + workspace + Mamba pool + KV pool (without the CUDA context)
    activations_gib: float  # peak activations of the largest prefill forward
    headroom_gib: float  # pre − static − graphs − activations (negative → OOM)
    free_after_pools_gib: float
    capture_gib: float  # graphs + the activations live while the largest graph is captured
    runtime_oom_tokens: int | None  # started, then OOMs at this many prefill tokens in one batch


def headroom(
    model: ModelProfile, r: Resolved, w: Weights, m: MambaPool, kv: KvPool, g: Graphs, *, activation_scale: float = 1.0
) -> Headroom:
    act_tok = model.activation_bytes(1, r.start.tp) * activation_scale
    activations = r.sizes.prefill_tokens * act_tok / GIB
    static = w.weights_gib + w.workspace_gib + m.total_gib + kv.gib
    pre = r.start.pre_gib
    free_after_pools = pre - static
    capture = g.backend_gib + g.gib + g.capture_tokens * act_tok / GIB
    free_at_run = free_after_pools - g.backend_gib - g.gib
    starts = capture <= free_after_pools
    oom_tokens = max(1, int(free_at_run * GIB // act_tok)) if starts and activations > free_at_run else None
    return Headroom(
        static_gib=static,
        activations_gib=activations,
        headroom_gib=free_at_run - activations,
        free_after_pools_gib=free_after_pools,
        capture_gib=capture,
        runtime_oom_tokens=oom_tokens,
    )


def check_headroom(h: Headroom, r: Resolved, g: Graphs, gpu: GpuProfile) -> None:
    if h.capture_gib > h.free_after_pools_gib:
        raise PlanStop(
            "startup_oom",
            f"Capture cuda graph failed: torch.OutOfMemoryError: CUDA out of memory. "
            f"Tried to allocate {min(h.capture_gib, 2.0):.2f} GiB. GPU 0 has a total "
            f"capacity of {gpu.memory_gib:.2f} GiB of which "
            f"{max(h.free_after_pools_gib, 0.0):.2f} GiB is free. Possible solutions: 1. "
            f"set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7) 2. set "
            f"--cuda-graph-max-bs-decode to a smaller value (e.g., 16) 3. disable decode "
            f"CUDA graph by --cuda-graph-backend-decode=disabled.",
        )
    if h.runtime_oom_tokens is not None:
        free_at_run = h.free_after_pools_gib - g.backend_gib - g.gib
        raise PlanStop(
            "runtime_oom",
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{min(h.activations_gib, 2.0):.2f} GiB (a prefill batch of "
            f"{r.sizes.prefill_tokens} tokens needs {h.activations_gib:.2f} GiB of "
            f"activations; {free_at_run:.2f} GiB is free).",
        )
