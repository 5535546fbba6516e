"""SGLang 0.5.23's memory plan as a pure function (the arithmetic is written up in docs/sglang-memory.md).

``plan(model, gpu, flags)`` answers, without a GPU, what SGLang would allocate for a config and whether it
would start: the simulator runs on it, and the study uses it to skip configs that cannot start. It chains the
steps of ``autotune.sglang.memory_steps`` (resolve → weights → Mamba pool → KV pool → running cap → graphs →
headroom) and assembles their results into one ``MemoryPlan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.results.plan import PlanDetails
from autotune.sglang import adaptive as adaptive_spec
from autotune.sglang import memory_levers as levers
from autotune.sglang import memory_steps as step
from autotune.sglang import unified
from autotune.sglang.args import (
    PlanFailure,
    PlanStop,
    Spec,
    decode_bs_list,
    default_mem_fraction,
    prefill_token_buckets,
)
from autotune.sglang.envs import env_strings, split_env
from autotune.sglang.flags import FlagTable
from autotune.sglang.mamba_tree import TRACK_INTERVAL_DEFAULT, MambaTree, resolve_mamba_tree
from autotune.sglang.profiles import GIB, GpuProfile, ModelProfile

__all__ = [
    "MemoryGiB",
    "MemoryPlan",
    "PlanFailure",
    "decode_bs_list",
    "default_mem_fraction",
    "plan",
    "prefill_token_buckets",
]


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
    backend: float = 0.0  # the attention backend's buffers, taken after the pools, before capture
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
    extra: PlanDetails = field(default_factory=PlanDetails)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SPEC_SUBFLAGS = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "speculative_draft_kv_cache_dtype",
    "speculative_adaptive",
    "speculative_adaptive_config",
)
MAMBA_FLAGS = (
    "max_mamba_cache_size",
    "mamba_full_memory_ratio",
    "mamba_ssm_dtype",
    "mamba_radix_cache_strategy",
    "mamba_track_interval",
    "mamba_max_states_per_path",
    "enable_linear_replayssm_spec",
)
NEVER_READ = (
    "num_continuous_decode_steps",
)  # accepted by 0.5.23, read by nothing (no reader in the 0.5.23 source tree; docs/sglang-memory.md)
# Flags tested for inertness by re-planning without them: every effect they have shows in the plan's signature.
PLANNER_FLAGS = (
    "mem_fraction_static",
    "max_running_requests",
    "max_total_tokens",
    "max_mamba_cache_size",
    "mamba_full_memory_ratio",
    "mamba_radix_cache_strategy",
    "mamba_ssm_dtype",
    "disable_radix_cache",
    "disable_overlap_schedule",
    "page_size",
    "attention_backend",
    "chunked_prefill_size",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "kv_cache_dtype",
    "cuda_graph_max_bs_decode",
    "cuda_graph_bs_decode",
    "cuda_graph_max_bs_prefill",
    "cuda_graph_bs_prefill",
    "disable_cuda_graph",
    "disable_decode_cuda_graph",
    "disable_prefill_cuda_graph",
    "cuda_graph_backend_decode",
    "cuda_graph_backend_prefill",
    "context_length",
    "enable_linear_replayssm_spec",
    "speculative_adaptive",
    "speculative_adaptive_config",
    "enable_unified_memory",
)
_COERCED = PLANNER_FLAGS + (
    "tp_size",
    "pp_size",
    "dp_size",
    "attn_dp_size",
    "mamba_track_interval",
    "max_prefill_tokens",
)


@dataclass(frozen=True, kw_only=True)
class Corrections:
    """Knobs that move the planner's calibrated constants; the defaults reproduce SGLang 0.5.23's plan exactly.

    ``workspace_offset_gib`` is added to the modelled workspace (memory taken after the weights, before the
    pools are profiled): positive leaves less for the pools. ``activation_scale`` multiplies the activation
    bytes per prefill token, ``graph_scale`` the CUDA-graph memory. An online correction fits them from
    observed capacity (KV tokens, Mamba slots) and observed peaks.
    """

    workspace_offset_gib: float = 0.0
    activation_scale: float = 1.0
    graph_scale: float = 1.0


@dataclass
class _Trace:
    """The steps done so far: a plan that stops reports what SGLang had allocated when it stopped."""

    start: step.Start
    spec: Spec | None = None
    layout: step.Layout | None = None
    sizes: step.Sizes | None = None
    weights: step.Weights | None = None
    mamba: step.MambaPool | None = None
    kv: step.KvPool | None = None
    cap: step.RunningCap | None = None
    graphs: step.Graphs | None = None
    headroom: step.Headroom | None = None
    adaptive: adaptive_spec.AdaptiveSpec | None = None  # --speculative-adaptive's controller, when kept
    arena: unified.Arena | None = None  # --enable-unified-memory's buffer, when accepted
    notes: list[str] = field(default_factory=list)  # the levers' warnings (adaptive dropped, FULL prefill graph off)


def plan(
    model: ModelProfile,
    gpu: GpuProfile,
    flags: Mapping[str, Any],
    *,
    free_gib: float | None = None,
    workspace_offset_gib: float = 0.0,
    activation_scale: float = 1.0,
    graph_scale: float = 1.0,
    env: Mapping[str, str] | None = None,
    _inert: bool = True,
) -> MemoryPlan:
    """What SGLang 0.5.23 allocates for ``flags`` (dest-keyed, typed) on ``gpu``, and whether it starts.

    ``free_gib`` is the memory free on the device before this server loads (default: total − CUDA context).
    ``workspace_offset_gib``, ``activation_scale`` and ``graph_scale`` correct the planner's calibrated
    constants (see ``Corrections``); their defaults change nothing. ``env`` is the server's environment: the
    ``SGLANG_*`` variables 0.5.23 reads while planning (the decode-lock switch; docs/sglang-memory.md).
    """
    fix = Corrections(
        workspace_offset_gib=workspace_offset_gib, activation_scale=activation_scale, graph_scale=graph_scale
    )
    env = {**env_strings(flags), **(env or {})}  # a study's environment levers travel in its config as ``env:NAME``
    flags = split_env(flags)[0]
    f = {k: _typed(k, v) for k, v in flags.items() if v is not None}
    trace = _Trace(start=step.start(gpu, f, free_gib=free_gib))
    failure: PlanFailure | None = None
    message: str | None = None
    try:
        _chain(model, gpu, f, trace, fix, env)
    except PlanStop as stop:
        failure, message = stop.failure, stop.message
    result = _assemble(trace, f, failure, message)
    if _inert:
        result.inert.extend(_inert_flags(model, gpu, f, free_gib, fix, result, env))
    return result


def _chain(
    model: ModelProfile, gpu: GpuProfile, f: dict[str, Any], t: _Trace, fix: Corrections, env: Mapping[str, str] | None
) -> None:
    """Run the steps in SGLang's order, recording each; ``PlanStop`` ends the chain where SGLang stops."""
    step.check_parallel(model, t.start)
    f, t.adaptive, dropped = adaptive_spec.resolve(f, t.start.attn_dp)
    t.notes += dropped
    t.spec = sp = step.spec(model, f)
    t.layout = lay = step.layout(model, gpu, f, sp, env)
    limited = unified.check(
        model,
        f,
        algorithm=sp.algorithm if sp.on else None,
        topk=sp.topk,
        backend=lay.attention_backend,
        attn_tp=t.start.attn_tp,
    )
    if limited:  # the FULL prefill graph backend is turned off rather than refused
        t.notes += limited
        f = {**f, "cuda_graph_backend_prefill": "disabled"}
    uni = bool(f.get("enable_unified_memory")) and model.has_mamba
    t.sizes = sz = step.sizes(model, gpu, f, t.start, sp, lay)
    r = step.Resolved(start=t.start, spec=sp, layout=lay, sizes=sz)
    t.weights = w = step.weights(model, f, r, workspace_offset_gib=fix.workspace_offset_gib)
    step.check_weights(w, r)
    t.mamba = m = levers.scratch_allocation(
        model, f, r, step.mamba_pool(model, f, r, w), adaptive=t.adaptive, unified=uni
    )
    step.check_rest(w, m, r)
    t.kv = kv = step.kv_pool(model, f, r, m)
    step.check_kv(kv, r)
    if uni:
        t.arena, kv = levers.unified_arena(f, r, m, kv)
        t.kv = kv
    t.cap = cap = step.running_cap(f, r, m, kv)
    step.check_running(cap, m, r)
    t.graphs = g = levers.adaptive_graphs(
        step.graphs(r, cap, graph_scale=fix.graph_scale), r, t.adaptive, graph_scale=fix.graph_scale
    )
    t.headroom = h = step.headroom(model, r, w, m, kv, g, activation_scale=fix.activation_scale)
    step.check_headroom(h, r, g, gpu)


def _extra(t: _Trace, f: Mapping[str, Any]) -> PlanDetails:
    """``MemoryPlan.extra``: each finished step's details, in the order the steps ran."""
    s = t.start
    ex = PlanDetails(
        pre_gib=round(s.pre_gib, 4),
        total_gib=round(s.total_gib, 4),
        cuda_context_gib=s.cuda_context_gib,
        tp_size=s.tp,
        pp_size=s.pp,
        attn_tp_size=s.attn_tp,
        spec=False,
        draft_tokens=0,
        spec_steps=0,
        spec_topk=0,
        requested_mrr=f.get("max_running_requests"),
        binding=None,
        startup_s=0.0,
        runtime_oom_tokens=None,
        static_gib=0.0,
        peak_gib=0.0,
        rest_gib=0.0,
    )
    if t.spec:
        ex.update(
            {
                "spec": t.spec.on,
                "spec_algorithm": t.spec.algorithm,
                "draft_tokens": t.spec.draft_tokens,
                "spec_steps": t.spec.steps,
                "spec_topk": t.spec.topk,
            }
        )
    if t.layout:
        lay, tree = t.layout, _mamba_tree(f, t)
        ex.update(
            {
                "strategy": lay.strategy,
                "overlap": lay.overlap,
                "radix_cache": not lay.radix_off,
                "attention_backend": lay.attention_backend,
                "page_size": lay.page_size,
                "ratio": lay.ratio if lay.has_mamba else None,
                "skip_decode_lock": lay.skip_decode_lock,
                "tracking_slots": lay.tracking_slots,
                "mamba_tree": tree.mamba_tree,
                "mamba_checkpoint_grid": tree.mamba_checkpoint_grid,
                "mamba_track_interval": tree.mamba_track_interval,
                "mamba_track_grid": tree.mamba_track_grid,
                "mamba_max_states_per_path": tree.mamba_max_states_per_path,
            }
        )
    if t.sizes:
        ex.update({"chunked_prefill_size": t.sizes.chunk, "context_len": t.sizes.context_len})
    if t.weights:
        ex.update(
            {
                "startup_s": t.weights.startup_s,
                "static_gib": t.weights.held_gib,
                "peak_gib": t.weights.held_gib,
                "target_weights_gib": round(t.weights.target_gib, 4),
            }
        )
    if t.mamba:
        m = t.mamba
        ex["mamba_slot_bytes"] = m.slot_bytes
        if m.slots is not None:
            ex.update({"mamba_full_memory_ratio": m.full_memory_ratio, "ssm_dtype": m.ssm_dtype})
        ex["rest_gib"] = round(m.rest_bytes / GIB, 4)
    if t.kv:
        ex["kv_cell_bytes"] = t.kv.cell_bytes
    if t.cap:
        ex["binding"] = t.cap.binding
    ex["adaptive"] = t.adaptive.to_dict() if t.adaptive else None
    ex["unified"] = t.arena.to_dict() if t.arena else None
    if t.graphs and t.weights and t.headroom:
        g, w, h = t.graphs, t.weights, t.headroom
        static = s.cuda_context_gib + h.static_gib + g.backend_gib + g.gib
        ex.update(
            {
                "decode_graph_bs": list(g.decode_bs),
                "prefill_graph_tokens": max(g.prefill_bs, default=0),
                "static_gib": round(static, 4),
                "peak_gib": round(static + h.activations_gib, 4),
                "workspace_gib": round(w.workspace_gib, 4),
                "mm_reserve_gib": round(w.mm_reserve_gib, 4),
            }
        )
        ex["startup_s"] = round(w.startup_s + g.decode_capture_s + g.prefill_capture_s, 1)
        if h.runtime_oom_tokens is not None:
            ex["runtime_oom_tokens"] = h.runtime_oom_tokens
    return ex


def _gib(t: _Trace) -> MemoryGiB:
    parts: dict[str, float] = {}
    if t.weights:
        parts["weights"] = t.weights.weights_gib
    if t.mamba and t.mamba.slots is not None:
        m = t.mamba
        parts.update(
            mamba_ssm=m.ssm_gib,
            mamba_conv=m.conv_gib,
            intermediate_ssm=m.intermediate_ssm_gib,
            intermediate_conv=m.intermediate_conv_gib,
            mamba_total=m.total_gib,
        )
    if t.kv and t.kv.tokens > 0:
        parts["kv"] = t.kv.gib
    if t.graphs and t.headroom:
        parts.update(
            backend=t.graphs.backend_gib,
            graphs=t.graphs.gib,
            activations=t.headroom.activations_gib,
            headroom=t.headroom.headroom_gib,
        )
    return MemoryGiB(**{k: round(v, 4) for k, v in parts.items()})


def _mamba_tree(f: Mapping[str, Any], t: _Trace) -> MambaTree:
    """The radix cache's Mamba-state levers as resolved (``sglang.mamba_tree``; validated in the layout step)."""
    assert t.layout is not None
    return resolve_mamba_tree(f, strategy=t.layout.strategy, page=t.layout.page_size, has_mamba=t.layout.has_mamba)


def _assemble(t: _Trace, f: Mapping[str, Any], failure: PlanFailure | None, message: str | None) -> MemoryPlan:
    warnings = [
        *t.notes,
        *(t.spec.warnings if t.spec else ()),
        *(t.kv.warnings if t.kv else ()),
        *(t.cap.warnings if t.cap else ()),
    ]
    if message is None and warnings:
        message = next((w for w in warnings if "capped" in w or "reduced" in w), warnings[0])
    mfs = t.sizes.mfs if t.sizes else f.get("mem_fraction_static")
    kv_ok = t.kv is not None and t.kv.tokens > 0
    return MemoryPlan(
        fits=failure is None,
        failure=failure,
        message=message,
        mem_fraction_static=float(mfs) if mfs is not None else 0.0,
        max_mamba_cache_size=t.mamba.slots if t.mamba else None,
        max_running_requests=int(t.cap.requests) if t.cap and t.cap.requests > 0 else 0,
        kv_tokens=int(t.kv.tokens) if t.kv and kv_ok else 0,
        inert=[],
        gib=_gib(t),
        extra={**_extra(t, f), "warnings": warnings},
    )


def _typed(dest: str, value: Any) -> Any:
    """Configs should arrive typed; a string for a flag the planner does arithmetic on is coerced (or rejected)."""
    if isinstance(value, str) and dest in _COERCED:
        return FlagTable.bundled().coerce(dest, value)
    return value


def _signature(p: MemoryPlan) -> tuple[Any, ...]:
    keys = (
        "ratio",
        "strategy",
        "overlap",
        "radix_cache",
        "draft_tokens",
        "spec_steps",
        "spec_topk",
        "page_size",
        "attention_backend",
        "chunked_prefill_size",
        "decode_graph_bs",
        "prefill_graph_tokens",
        "context_len",
        "adaptive",
        "unified",
    )
    return (
        p.failure,
        p.mem_fraction_static,
        p.max_mamba_cache_size,
        p.max_running_requests,
        p.kv_tokens,
        tuple(round(v, 6) for v in asdict(p.gib).values()),
        tuple(str(p.extra.get(k)) for k in keys),
    )


def _inert_tree_levers(f: Mapping[str, Any], result: MemoryPlan) -> list[str]:
    """The radix cache's Mamba-state levers where 0.5.23 reads nothing of them: the track interval outside the
    extra-buffer strategies, the per-path cap without a Mamba radix tree, either at its default (no memory effect
    either way: ``sglang.mamba_tree``)."""
    if result.failure == "bad_args":
        return []
    out = []
    for key, default in (("mamba_track_interval", TRACK_INTERVAL_DEFAULT), ("mamba_max_states_per_path", None)):
        if key in f and result.extra.get(key) in (None, default):
            out.append(key)
    return out


def _inert_flags(
    model: ModelProfile,
    gpu: GpuProfile,
    f: dict[str, Any],
    free_gib: float | None,
    fix: Corrections,
    result: MemoryPlan,
    env: Mapping[str, str] | None,
) -> list[str]:
    """Flags whose removal changes nothing the planner can see, among the flags it reads (plus never-read ones)."""
    out = [k for k in NEVER_READ if k in f]
    if not f.get("speculative_algorithm"):
        out += [k for k in SPEC_SUBFLAGS if k in f]
    if not model.has_mamba:
        out += [k for k in MAMBA_FLAGS if k in f and k not in out and result.failure != "bad_args"]
    out += _inert_tree_levers(f, result)
    base = _signature(result)
    for key in PLANNER_FLAGS:
        if key in f and key not in out:
            rest = {k: v for k, v in f.items() if k != key}
            again = plan(
                model,
                gpu,
                rest,
                free_gib=free_gib,
                workspace_offset_gib=fix.workspace_offset_gib,
                activation_scale=fix.activation_scale,
                graph_scale=fix.graph_scale,
                env=env,
                _inert=False,
            )
            if _signature(again) == base:
                out.append(key)
    return sorted(set(out))
