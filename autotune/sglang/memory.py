"""SGLang 0.5.23's memory plan as a pure function (the arithmetic is written up in docs/sglang-memory.md).

``plan(model, gpu, flags)`` answers, without a GPU, what SGLang would allocate for a config and whether it
would start: the simulator runs on it, and the study uses it to skip configs that cannot start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.sglang.flags import FlagTable
from autotune.sglang.args import (
    SPEC_DEFAULT_MRR,
    PlanFailure,
    PlanStop,
    decode_bs_list,
    default_mem_fraction,
    graph_settings,
    prefill_token_buckets,
    resolve_spec,
    resolve_strategy,
)
from autotune.sglang.profiles import GIB, MIB, GpuProfile, ModelProfile

__all__ = ["MemoryGiB", "MemoryPlan", "PlanFailure", "decode_bs_list", "default_mem_fraction", "plan",
           "prefill_token_buckets"]


@dataclass(frozen=True, kw_only=True)
class MemoryGiB:
    """Where the GPU's memory goes, in GiB (2**30 bytes, what SGLang's logs call GB)."""

    weights: float = 0.0  # target + draft weights
    kv: float = 0.0  # target + draft KV pools
    mamba_ssm: float = 0.0  # (K+1) ssm states
    mamba_conv: float = 0.0  # (K+1) conv states
    intermediate_ssm: float = 0.0  # speculative per-request scratch
    intermediate_conv: float = 0.0
    mamba_total: float = 0.0  # ssm + conv + intermediates
    graphs: float = 0.0  # CUDA graphs captured at startup
    activations: float = 0.0  # peak activation memory of a full prefill chunk
    headroom: float = 0.0  # what is left on the device after all of the above at peak (negative → OOM)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What SGLang would allocate. ``to_dict()`` is the JSON of ``autotune plan --json``."""

    fits: bool
    failure: PlanFailure | None
    message: str | None  # SGLang's own message for the failure (or a warning such as the mamba cap)
    mem_fraction_static: float  # resolved (SGLang's default formula when unset)
    max_mamba_cache_size: int | None  # slots K (None for models without a Mamba pool)
    max_running_requests: int  # effective, per DP worker
    kv_tokens: int  # max_total_num_tokens
    inert: list[str]  # flags given that change nothing under the others
    gib: MemoryGiB
    # Resolution details the simulator and the report use.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return data


SPEC_SUBFLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                 "speculative_draft_model_path", "speculative_draft_kv_cache_dtype")
MAMBA_FLAGS = ("max_mamba_cache_size", "mamba_full_memory_ratio", "mamba_ssm_dtype", "mamba_radix_cache_strategy",
               "mamba_track_interval", "enable_linear_replayssm_spec")
NEVER_READ = ("num_continuous_decode_steps",)  # accepted by 0.5.23, read by nothing (FACTS §6)
# Flags tested for inertness by re-planning without them: every effect they have shows in the plan's signature.
PLANNER_FLAGS = (
    "mem_fraction_static", "max_running_requests", "max_total_tokens", "max_mamba_cache_size",
    "mamba_full_memory_ratio", "mamba_radix_cache_strategy", "mamba_ssm_dtype",
    "disable_radix_cache", "disable_overlap_schedule", "page_size", "attention_backend", "chunked_prefill_size",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "kv_cache_dtype",
    "cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_max_bs_prefill", "cuda_graph_bs_prefill",
    "disable_cuda_graph", "disable_decode_cuda_graph", "disable_prefill_cuda_graph", "cuda_graph_backend_decode",
    "cuda_graph_backend_prefill", "context_length", "enable_linear_replayssm_spec",
)
LOAD_GIB_S = 0.45  # weight load from a warm page cache, per rank (seed: 27B + MTP restarts take ~150–180 s)
STARTUP_FIXED_S = 15.0  # spawn, NCCL/tokenizer init, KV allocation, warmup request
CAPTURE_S = 0.35  # per decode-phase graph
CAPTURE_PREFILL_S = 0.3  # per prefill token bucket
GRAPH_MIB_PER_TOKEN = 2.0  # SGLang's own reserve figure for decode graphs (memory_hook: 2 MiB per bs)
GRAPH_MIB_PER_PREFILL_BUCKET = 8.0


def plan(model: ModelProfile, gpu: GpuProfile, flags: Mapping[str, Any], *, free_gib: float | None = None,
         _inert: bool = True) -> MemoryPlan:
    """What SGLang 0.5.23 allocates for ``flags`` (dest-keyed, typed) on ``gpu``, and whether it starts.

    ``free_gib`` is the memory free on the device before this server loads (default: total − CUDA context).
    """
    f = {k: _typed(k, v) for k, v in flags.items() if v is not None}
    tp, pp = int(f.get("tp_size") or 1), int(f.get("pp_size") or 1)
    attn_dp = int(f.get("attn_dp_size") or (f.get("dp_size") if f.get("enable_dp_attention") else 1) or 1)
    st: dict[str, Any] = {"warnings": [], "gib": {}, "mfs": f.get("mem_fraction_static"), "K": None, "mrr": 0,
                          "tokens": 0, "extra": {}}
    failure: PlanFailure | None = None
    message: str | None = None
    try:
        _compute(model, gpu, f, st, tp=tp, pp=pp, attn_dp=attn_dp, free_gib=free_gib)
    except PlanStop as stop:
        failure, message = stop.failure, stop.message
    warnings = st["warnings"]
    if message is None and warnings:
        message = next((w for w in warnings if "capped" in w or "reduced" in w), warnings[0])
    gib = MemoryGiB(**{k: round(v, 4) for k, v in st["gib"].items()})
    extra = {**st["extra"], "warnings": warnings}
    mfs = st["mfs"] if st["mfs"] is not None else 0.0
    result = MemoryPlan(
        fits=failure is None, failure=failure, message=message, mem_fraction_static=float(mfs),
        max_mamba_cache_size=st["K"], max_running_requests=int(st["mrr"]), kv_tokens=int(st["tokens"]),
        inert=[], gib=gib, extra=extra,
    )
    if _inert:
        result.inert.extend(_inert_flags(model, gpu, f, free_gib, result))
    return result


def _typed(dest: str, value: Any) -> Any:
    """Configs should arrive typed; a string for a flag the planner does arithmetic on is coerced (or rejected)."""
    if isinstance(value, str) and dest in PLANNER_FLAGS + ("tp_size", "pp_size", "dp_size", "attn_dp_size",
                                                           "mamba_track_interval", "max_prefill_tokens"):
        return FlagTable.bundled().coerce(dest, value)
    return value


def _signature(p: MemoryPlan) -> tuple:
    keys = ("ratio", "strategy", "overlap", "radix_cache", "draft_tokens", "spec_steps", "spec_topk", "page_size",
            "attention_backend", "chunked_prefill_size", "decode_graph_bs", "prefill_graph_tokens", "context_len")
    return (p.failure, p.mem_fraction_static, p.max_mamba_cache_size, p.max_running_requests, p.kv_tokens,
            tuple(round(v, 6) for v in asdict(p.gib).values()), tuple(str(p.extra.get(k)) for k in keys))


def _inert_flags(model: ModelProfile, gpu: GpuProfile, f: dict[str, Any], free_gib: float | None,
                 result: MemoryPlan) -> list[str]:
    """Flags whose removal changes nothing the planner can see, among the flags it reads (plus never-read ones)."""
    out = [k for k in NEVER_READ if k in f]
    if not f.get("speculative_algorithm"):
        out += [k for k in SPEC_SUBFLAGS if k in f]
    if not model.has_mamba:
        out += [k for k in MAMBA_FLAGS if k in f and k not in out and result.failure != "bad_args"]
    base = _signature(result)
    for key in PLANNER_FLAGS:
        if key in f and key not in out:
            rest = {k: v for k, v in f.items() if k != key}
            if _signature(plan(model, gpu, rest, free_gib=free_gib, _inert=False)) == base:
                out.append(key)
    return sorted(set(out))


def _compute(model: ModelProfile, gpu: GpuProfile, f: dict[str, Any], st: dict[str, Any], *, tp: int, pp: int,
             attn_dp: int, free_gib: float | None) -> None:
    """Fill ``st`` step by step, raising ``PlanStop`` where SGLang stops (FACTS §1.5–1.7, §2, §6)."""
    ex = st["extra"]
    ctx_gib = gpu.cuda_context_gib
    pre = float(free_gib) if free_gib is not None else gpu.memory_gib - ctx_gib
    ex.update(pre_gib=round(pre, 4), total_gib=round(gpu.memory_gib, 4), cuda_context_gib=ctx_gib, tp_size=tp,
              spec=False, draft_tokens=0, spec_steps=0, spec_topk=0, requested_mrr=f.get("max_running_requests"),
              binding=None, startup_s=0.0, runtime_oom_tokens=None, static_gib=0.0, peak_gib=0.0, rest_gib=0.0)
    # -- argument resolution (main process: a failure here is exit 1 with a Python error) -------------------
    if model.num_heads % tp:
        raise PlanStop("bad_args", f"AssertionError: Total number of attention heads ({model.num_heads}) must be "
                                f"divisible by tensor parallel size ({tp}).")
    spec = resolve_spec(model, f)
    st["warnings"].extend(spec.pop("warnings", []))
    ex.update(spec=spec["spec"], spec_algorithm=spec["algorithm"], draft_tokens=spec["draft_tokens"],
              spec_steps=spec["steps"], spec_topk=spec["topk"])
    res = resolve_strategy(model, gpu, f, spec)
    page, ratio = res["page_size"], res["ratio"]
    ex.update(strategy=res["strategy"], overlap=res["overlap"], radix_cache=not res["radix_off"], attention_backend=res["attention_backend"],
              page_size=page, ratio=ratio if model.has_mamba else None)
    tier_chunk, tier_bs = gpu.tier(tp)
    chunk = int(f.get("chunked_prefill_size") or tier_chunk)
    if chunk > 0 and chunk % page:
        raise PlanStop("bad_args", f"ValueError: chunked_prefill_size ({chunk}) must be divisible by page_size ({page})")
    if f.get("mem_fraction_static") is not None and not 0 < f["mem_fraction_static"] < 1:
        raise PlanStop("bad_args", f"ValueError: --mem-fraction-static must be in (0, 1), got {f['mem_fraction_static']}")
    context_len = int(f.get("context_length") or model.context_len)
    prefill_tokens = chunk if chunk > 0 else int(f.get("max_prefill_tokens") or 16384)
    ex.update(chunked_prefill_size=chunk, context_len=context_len)
    decode_graph, prefill_graph = graph_settings(f)
    explicit_bs = f.get("cuda_graph_bs_decode")
    decode_max_bs = int(f.get("cuda_graph_max_bs_decode") or (max(explicit_bs) if explicit_bs else 0)
                        or min(tier_bs, f.get("max_running_requests") or tier_bs))
    prefill_max = int(f.get("cuda_graph_max_bs_prefill") or prefill_tokens)
    prefill_bs = sorted(f.get("cuda_graph_bs_prefill") or prefill_token_buckets(prefill_max)) if prefill_graph else []
    mfs = f.get("mem_fraction_static")
    if mfs is None:
        mfs = default_mem_fraction(model, gpu, f, chunk=chunk, decode_max_bs=decode_max_bs, decode_graph=decode_graph,
                                   prefill_buckets=len(prefill_bs), tp=tp, pp=pp)
    st["mfs"] = float(mfs)
    # -- weights, then _profile_available_bytes -------------------------------------------------------------
    weights = model.weights_gib(with_draft=spec["draft_model"], tp=tp)
    workspace = model.workspace_bytes(prefill_tokens, tp) / GIB
    st["gib"].update(weights=weights)
    ex["startup_s"] = round(STARTUP_FIXED_S + weights / LOAD_GIB_S, 1)
    ex["static_gib"] = ex["peak_gib"] = round(ctx_gib + min(weights, pre), 4)  # held while a failed start dies
    if weights + workspace > pre:
        raise PlanStop("startup_oom", f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                   f"{min(weights, 2.0):.2f} GiB while loading weights ({weights:.2f} GiB of weights, "
                                   f"{pre:.2f} GiB free).")
    mm_reserve = 100 / 1024 if model.multimodal and not f.get("language_only") else 0.0
    avail = pre - weights - workspace
    rest = (avail - pre * (1 - mfs) - mm_reserve) * GIB
    # -- Mamba pool (_handle_max_mamba_cache) ----------------------------------------------------------------
    d = spec["draft_tokens"] if spec["spec"] else 0
    mrr_req = f.get("max_running_requests") or (SPEC_DEFAULT_MRR if spec["spec"] else None)
    mrr_dp = mrr_req // attn_dp if mrr_req else None
    ssm_dtype = f.get("mamba_ssm_dtype") or model.ssm_dtype
    n_inter = 0
    if model.has_mamba:
        P = model.mamba_slot_bytes(tp, ssm_dtype)
        conv, ssm = model.mamba_conv_bytes(tp), model.mamba_ssm_bytes(tp, ssm_dtype)
        scratch = 0 if f.get("enable_linear_replayssm_spec") else d
        r = float(f.get("mamba_full_memory_ratio") or 0.9)
        budget = rest * r / (1 + r)
        if f.get("max_mamba_cache_size") is not None:  # A
            K = int(f["max_mamba_cache_size"]) // attn_dp
            n_inter = min(mrr_dp or 0, K // ratio) if scratch else 0
        elif res["radix_off"] and mrr_dp:  # B
            K = max(1, mrr_dp)
            n_inter = K if scratch else 0
        elif scratch:  # C
            K = int((budget - P * (1 + scratch)) // (P * (1 + scratch / ratio)))
            n_inter = min(mrr_dp or 0, K // ratio) if K > 0 else 0
        else:  # D
            K = int((budget - P) // P)
        if K <= 0:
            raise PlanStop("startup_oom", f"RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) state "
                                       f"cache. Computed max_mamba_cache_size={K} (total_rest_memory={rest / GIB:.2f} GB, "
                                       f"mamba_cache_per_req={P / MIB:.2f} MB). Try: (1) reduce --max-running-requests, "
                                       f"(2) increase --mem-fraction-static, (3) reduce --speculative-num-draft-tokens, "
                                       f"or (4) use GPUs with more memory.")
        rest -= P * (n_inter + 1) * scratch if scratch else 0
        rest -= (K + 1) * P
        st["K"] = K
        inter_conv_cols = (d + model.conv_kernel - 2) if spec["topk"] <= 1 else d * (model.conv_kernel - 1)
        inter_conv = (model.linear_layers * (n_inter + 1) * (model.conv_dim // tp) * inter_conv_cols * 2
                      if scratch else 0)
        st["gib"].update(mamba_ssm=(K + 1) * ssm / GIB, mamba_conv=(K + 1) * conv / GIB,
                         intermediate_ssm=(n_inter + 1) * scratch * ssm / GIB if scratch else 0.0,
                         intermediate_conv=inter_conv / GIB)
        st["gib"]["mamba_total"] = sum(st["gib"][k] for k in ("mamba_ssm", "mamba_conv", "intermediate_ssm",
                                                              "intermediate_conv"))
        ex.update(mamba_slot_bytes=P, mamba_full_memory_ratio=r, ssm_dtype=ssm_dtype)
    else:
        ex.update(mamba_slot_bytes=0)
    ex["rest_gib"] = round(rest / GIB, 4)
    if rest <= 0:
        need = 1 - avail / pre
        raise PlanStop("startup_oom", f"ValueError: Loaded weights leave no GPU memory for the KV cache under "
                                   f"--mem-fraction-static={mfs:g}. Raise --mem-fraction-static above "
                                   f"{math.ceil(need * 1000) / 1000:.3f} (minimum viable = 1 - available/pre = "
                                   f"{need:.4f}). If using speculative decoding, draft weights are now counted.")
    # -- KV pool ----------------------------------------------------------------------------------------------
    with_draft = spec["spec"] and spec["draft_model"] and spec["algorithm"] != "NGRAM"
    cell = model.kv_cell_bytes(tp, str(f.get("kv_cache_dtype") or "auto"), with_draft=with_draft)
    tokens = int(rest // cell) // page * page
    cap = f.get("max_total_tokens")
    if cap is not None:
        if cap > tokens:
            st["warnings"].append(f"max_total_tokens={cap} is larger than the profiled value {tokens}. "
                                  f"The profiled value will be used.")
        else:
            tokens = int(cap) // page * page
    ex["kv_cell_bytes"] = cell
    if tokens <= 0:
        raise PlanStop("startup_oom", f"RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                                   f"Current value: mem_fraction_static={mfs:g}")
    st["tokens"] = tokens
    st["gib"]["kv"] = tokens * cell / GIB
    if tokens < context_len:
        st["warnings"].append(f"KV pool holds {tokens} tokens, fewer than --context-length {context_len}.")
    # -- resolve_max_num_reqs -----------------------------------------------------------------------------------
    est = min(4096, max(2048, int(tokens / context_len * 512)))
    mrr = mrr_dp if mrr_dp else est
    binding = "explicit" if f.get("max_running_requests") else "spec_default" if spec["spec"] else "est"
    if tokens // 2 < mrr:
        if f.get("max_running_requests"):
            st["warnings"].append(f"max_running_requests was reduced from the requested {mrr} to {tokens // 2} "
                                  f"(per dp worker) due to the available KV cache capacity.")
        mrr, binding = tokens // 2, "kv"
    if model.has_mamba and st["K"] // ratio < mrr:
        mrr, binding = st["K"] // ratio, "mamba"
        st["warnings"].append(
            f"max_running_requests is capped to {mrr} by the mamba state cache (max_mamba_cache_size={st['K']}, "
            f"{ratio} state slots per request). To raise it: increase --mamba-full-memory-ratio or "
            f"--max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype bfloat16.")
    ex.update(binding=binding)
    if mrr <= 0:
        raise PlanStop("startup_oom", f"RuntimeError: Hybrid (mamba/linear-attention) state cache is too small to serve "
                                   f"any requests. max_mamba_cache_size={st['K']}, mamba_ratio={ratio}, resulting "
                                   f"max_num_reqs={mrr}. Try: (1) reduce --max-running-requests, (2) increase "
                                   f"--mem-fraction-static, or (3) use GPUs with more memory.")
    st["mrr"] = mrr
    # -- CUDA graphs, then the first full prefill chunk ---------------------------------------------------------
    bs_list = sorted({min(b, mrr) for b in (explicit_bs or decode_bs_list(decode_max_bs))}) if decode_graph else []
    max_bs = max(bs_list, default=0)
    phases = [max_bs * (d or 1)]  # target decode, or verify with D tokens per request
    if spec["spec"] and spec["draft_model"]:
        phases += [max_bs * spec["topk"] * spec["steps"], max_bs * d]  # draft decode steps, draft extend
    graphs = (GRAPH_MIB_PER_TOKEN * sum(phases) + GRAPH_MIB_PER_PREFILL_BUCKET * len(prefill_bs)) * MIB / GIB
    act_tok = model.activation_bytes(1, tp)
    activations = prefill_tokens * act_tok / GIB
    static = weights + workspace + st["gib"].get("mamba_total", 0.0) + st["gib"]["kv"]
    st["gib"].update(graphs=graphs, activations=activations, headroom=pre - static - graphs - activations)
    ex.update(decode_graph_bs=bs_list, prefill_graph_tokens=max(prefill_bs, default=0),
              static_gib=round(ctx_gib + static + graphs, 4), peak_gib=round(ctx_gib + static + graphs + activations, 4),
              workspace_gib=round(workspace, 4), mm_reserve_gib=round(mm_reserve, 4))
    ex["startup_s"] = round(ex["startup_s"] + CAPTURE_S * len(bs_list) * len(phases)
                            + CAPTURE_PREFILL_S * len(prefill_bs), 1)
    free_after_pools = pre - static
    capture_act = (max(prefill_bs, default=0) if prefill_bs else max_bs * (d or 1)) * act_tok / GIB
    if graphs + capture_act > free_after_pools:
        raise PlanStop("startup_oom", f"Capture cuda graph failed: torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                   f"allocate {min(graphs + capture_act, 2.0):.2f} GiB. GPU 0 has a total capacity of "
                                   f"{gpu.memory_gib:.2f} GiB of which {max(free_after_pools, 0.0):.2f} GiB is free. "
                                   f"Possible solutions: 1. set --mem-fraction-static to a smaller value (e.g., 0.8 or "
                                   f"0.7) 2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16) 3. disable "
                                   f"decode CUDA graph by --cuda-graph-backend-decode=disabled.")
    free_at_run = free_after_pools - graphs
    if activations > free_at_run:
        ex["runtime_oom_tokens"] = max(1, int(free_at_run * GIB // act_tok))
        raise PlanStop("runtime_oom", f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                   f"{min(activations, 2.0):.2f} GiB (a prefill batch of {prefill_tokens} tokens needs "
                                   f"{activations:.2f} GiB of activations; {free_at_run:.2f} GiB is free).")
