"""``--enable-unified-memory`` in SGLang 0.5.23: one byte arena for the KV cache and the Mamba state. ``check``
mirrors where 0.5.23 refuses it (every refusal ``bad_args``, stopped before launch); ``arena`` says what the pools
become where it is accepted. The rules with their SGLang lines: docs/sglang-memory.md §1 and "Unified arena".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotune.results.plan import ArenaFigures
from autotune.sglang.args import PlanStop
from autotune.sglang.profiles import ModelProfile

__all__ = ["Arena", "arena", "check"]

# kv_cache_hook.py L813-819: the MHA/SWA page-major allow-list; L490: the MHA backends audited for EAGLE verify.
PAGE_MAJOR_BACKENDS = frozenset({"triton", "fa3", "fa4", "flashinfer", "trtllm_mha"})
SPEC_MHA_AUDITED = frozenset({"triton", "flashinfer", "fa3", "trtllm_mha"})
SPEC_VERIFY_AUDITED = frozenset({"triton", "trtllm_mla", "cutedsl_mla", "flashmla", "flashinfer", "fa3"})
LINEAR_DECODE = frozenset({"triton", "flashinfer"})  # L841 (GQA-hybrid: no KDA-only kernels)
LINEAR_PREFILL = frozenset({"triton", "flashkda", "flashinfer"})  # L842
UNIFIED_SPEC = (None, "DSPARK", "EAGLE", "EAGLE3", "DFLASH")  # L588-599
ENTRY_ALIGN = 32  # srt/mem_cache/layout/token_major.py L21 (ENTRY_ALIGN_BYTES)
ROW_ALIGN = 16  # L22 (ROW_ALIGN_BYTES)
KV_FLOOR_ALIGN = 4096  # kv_cache_configurator.py L3207-3211


def _stop(message: str) -> PlanStop:
    return PlanStop("bad_args", message)


def check(
    model: ModelProfile, f: Mapping[str, Any], *, algorithm: str | None, topk: int, backend: str, attn_tp: int
) -> list[str]:
    """Refuse ``--enable-unified-memory`` where 0.5.23 does; the warnings it logs where it limits instead.
    ``algorithm`` is the resolved speculative algorithm (NEXTN/MTP → EAGLE), ``backend`` the resolved attention
    backend (prefill and decode alike here)."""
    if not f.get("enable_unified_memory"):
        if f.get("enable_page_major_kv_layout"):  # L783-789
            raise _stop(
                "AssertionError: --enable-page-major-kv-layout without --enable-unified-memory is "
                "temporarily unsupported: the strided MHA K/V views were removed and the static-pool "
                "page-major layout awaits its per-layer-view reimplementation. Run with "
                "--enable-unified-memory, or drop --enable-page-major-kv-layout."
            )
        return []
    if str(f.get("kv_cache_dtype") or "") in ("nvfp4", "fp4_mx_block16"):  # L132-137
        raise _stop(
            "ValueError: FP4 KV cache does not yet support --enable-unified-memory: the unified MHA pool does "
            "not allocate FP4 block scales or the prefill dequant workspace."
        )
    _decode_host_pools(f)
    _page_major(f, backend)
    _pool(model, f, algorithm=algorithm, topk=topk, backend=backend)
    if not model.has_mamba:  # kv_cache_configurator.py L633-643 (the bundled profiles have no sliding window)
        raise _stop(
            f"ValueError: --enable-unified-memory only supports hybrid Mamba and hybrid sliding-window-"
            f"attention models (DeepSeek-V4 excluded); the current model (['{model.architecture}']) is "
            f"neither, so the unified memory pool cannot be built. Drop --enable-unified-memory for this "
            f"model."
        )
    heads = max(1, model.num_kv_heads // attn_tp)
    elem = 1 if str(f.get("kv_cache_dtype") or "auto").startswith("fp8") else 2
    for part, dim in (("K", model.head_dim), ("V", model.v_head_dim)):  # unified_memory_pool.py L83-93
        if heads * dim * elem % ROW_ALIGN:
            raise _stop(
                f"ValueError: --enable-unified-memory needs every per-rank KV row to be a multiple of "
                f"{ROW_ALIGN} bytes; sub-pool 'full' has a {heads * dim * elem}-byte {part} row. Run this "
                f"model without --enable-unified-memory."
            )
    if algorithm in ("EAGLE", "EAGLE3", "DFLASH"):
        _fused_draft(f, algorithm)
    warnings = []
    if f.get("cuda_graph_backend_prefill") == "full" and backend not in ("fa3", "fa4"):  # L689-716
        warnings.append(
            f"--enable-unified-memory: disabling the FULL prefill cuda-graph backend. It builds its block "
            f"table in _init_full_cg_prefill_metadata, which only ['fa3', 'fa4'] implement; the resolved "
            f"attention backends are ['{backend}']. Decode capture and the other prefill backends are "
            f"unaffected."
        )
    return warnings


def _page_major(f: Mapping[str, Any], backend: str) -> None:
    """``handle_page_major_kv_layout`` (L770-862): implied by the flag; backends that read strided views only."""
    if backend not in PAGE_MAJOR_BACKENDS:
        raise _stop(
            f"AssertionError: --enable-page-major-kv-layout: the resolved attention backends ['{backend}'] "
            f"are not in the allowed set {sorted(PAGE_MAJOR_BACKENDS)} for this configuration. Pass a "
            f"compatible --attention-backend."
        )
    linear = f.get("linear_attn_backend") or "triton"
    decode, prefill = f.get("linear_attn_decode_backend") or linear, f.get("linear_attn_prefill_backend") or linear
    if decode not in LINEAR_DECODE:
        raise _stop(
            f"AssertionError: --enable-page-major-kv-layout: linear-attention DECODE backend must be one of "
            f"{sorted(LINEAR_DECODE)} for the strided conv/SSM state; got {decode!r}."
        )
    if prefill not in LINEAR_PREFILL:
        raise _stop(
            f"AssertionError: --enable-page-major-kv-layout: linear-attention PREFILL backend must be one of "
            f"{sorted(LINEAR_PREFILL)} for the strided conv/SSM state; got {prefill!r}."
        )
    if f.get("mamba_backend") not in (None, "triton"):
        raise _stop(
            f"AssertionError: --enable-page-major-kv-layout requires the Triton Mamba kernels for the strided "
            f"conv/SSM state; got {f['mamba_backend']!r}. Pass --mamba-backend triton."
        )


def _decode_host_pools(f: Mapping[str, Any]) -> None:
    """``handle_cache_compatibility``'s checks of the PD decode flags the unified rules read (L351-400; the
    pipeline runs it before both unified hooks, ``pipeline.py`` L334-338)."""
    mode = f.get("disaggregation_mode") or "null"
    host_pool = f.get("disaggregation_decode_retraction_backup") == "host_pool"
    offload = bool(f.get("disaggregation_decode_enable_offload_kvcache"))
    if host_pool and mode != "decode":
        raise _stop(
            "ValueError: --disaggregation-decode-retraction-backup=host_pool is only supported on a PD decode server."
        )
    if offload and mode != "decode":
        raise _stop(
            "ValueError: The argument disaggregation-decode-enable-offload-kvcache is only supported for decode side."
        )
    if offload and f.get("hicache_storage_backend") is None:
        raise _stop(
            "ValueError: The argument disaggregation-decode-enable-offload-kvcache is only supported when "
            "hicache-storage-backend is provided."
        )
    if offload and host_pool:
        raise _stop(
            "ValueError: The arguments disaggregation-decode-enable-offload-kvcache and disaggregation-decode-"
            "retraction-backup=host_pool are mutually exclusive: both build a decode host pool."
        )


def _pd(model: ModelProfile, f: Mapping[str, Any], algorithm: str | None) -> None:
    """PD disaggregation (L533-586): the Mooncake transfer only, no pipeline parallelism, no speculative decoding
    over Mooncake, and on a hybrid Mamba model neither decode KV offload nor host-pool decode retraction."""
    if (f.get("disaggregation_mode") or "null") == "null":
        return
    host_pool = f.get("disaggregation_decode_retraction_backup") == "host_pool"
    offload = bool(f.get("disaggregation_decode_enable_offload_kvcache"))
    transfer = f.get("disaggregation_transfer_backend") or "mooncake"
    if transfer != "mooncake":  # ServerArgs._unified_memory_pd_transfer_backends, server_args.py L347-348
        raise _stop(
            f"AssertionError: --enable-unified-memory with PD disaggregation supports only these transfer "
            f"backends: mooncake; got {transfer!r}."
        )
    if int(f.get("pp_size") or 1) != 1:
        raise _stop(
            "AssertionError: --enable-unified-memory with PD disaggregation does not support pipeline "
            "parallelism (whole-envelope transfer has no per-layer entries to subset)."
        )
    if algorithm is not None:
        raise _stop(
            "AssertionError: --enable-unified-memory with PD disaggregation does not support speculative "
            "decoding with the Mooncake transfer backend."
        )
    if f.get("enable_hisparse"):
        raise _stop(
            "AssertionError: --enable-unified-memory with PD disaggregation is not compatible with "
            "--enable-hisparse: the decode-side HiSparse prealloc path ships host/C4 rows straight from the "
            "allocator, bypassing the virtual->physical translation the unified pool needs."
        )
    if offload and f.get("hicache_storage_backend") != "file":
        raise _stop(
            "AssertionError: --enable-unified-memory with decode KV offload currently supports "
            "--hicache-storage-backend=file only."
        )
    if offload and model.has_mamba:
        raise _stop("AssertionError: --enable-unified-memory decode KV offload does not support hybrid-Mamba models.")
    if host_pool and model.has_mamba:
        raise _stop(
            "AssertionError: --enable-unified-memory host-pool decode retraction does not support hybrid-Mamba models."
        )


def _pool(model: ModelProfile, f: Mapping[str, Any], *, algorithm: str | None, topk: int, backend: str) -> None:
    """``handle_unified_memory_pool`` (L528-702)."""
    _pd(model, f, algorithm)
    if algorithm not in UNIFIED_SPEC:
        raise _stop(
            f"AssertionError: --enable-unified-memory only supports --speculative-algorithm DSPARK, DFLASH, "
            f"EAGLE and EAGLE3; other speculative algorithms are not yet audited for the unified pool's "
            f"virtual-to-physical loc translation. Got --speculative-algorithm={algorithm!r}."
        )
    if algorithm is not None and topk > 1:  # the resolved topk: a model's auto choice counts too
        raise _stop(
            f"AssertionError: --enable-unified-memory supports a linear draft chain only "
            f"(--speculative-eagle-topk in {{None, 1}}); tree verify relocates accepted tokens one at a time "
            f"inside the target pool, which the unified pool's page-granular move_kv_cache cannot express. "
            f"Got --speculative-eagle-topk={topk!r}."
        )
    if algorithm in ("EAGLE", "EAGLE3"):
        if not model.has_mamba:  # L608-614 (the bundled profiles have no sliding window)
            raise _stop(
                "AssertionError: --enable-unified-memory + EAGLE/EAGLE3 requires a unified target (hybrid-SWA "
                "or a mamba hybrid): the draft's KV lives fused inside the target's sub-pool entries."
            )
        if backend not in SPEC_MHA_AUDITED:
            raise _stop(
                f"AssertionError: --enable-unified-memory + EAGLE/EAGLE3 requires the target on the "
                f"spec-verify-audited attention backends {sorted(SPEC_MHA_AUDITED)} (got ['{backend}'])."
            )
        draft = f.get("speculative_draft_attention_backend") or backend
        if draft not in SPEC_MHA_AUDITED:
            raise _stop(
                f"AssertionError: --enable-unified-memory + EAGLE/EAGLE3 runs the draft on ['{draft}'], but a "
                f"fused draft is MHA-shaped and reads its KV through the translated MHA rails "
                f"{sorted(SPEC_MHA_AUDITED)}. Set --speculative-draft-attention-backend to one of them."
            )
    audited = {"DSPARK": SPEC_VERIFY_AUDITED | {"fa4"}, "DFLASH": SPEC_MHA_AUDITED}.get(str(algorithm))
    if audited is not None and backend not in audited:  # L499-525, L641-652
        raise _stop(
            f"AssertionError: --enable-unified-memory + {algorithm} requires spec-verify-audited attention "
            f"backends {sorted(audited)} for both prefill and decode; got ['{backend}']. Other backends do "
            f"not translate speculative verify indices to the unified pool's physical ids yet."
        )
    if f.get("enable_two_batch_overlap"):
        raise _stop(
            "AssertionError: --enable-unified-memory does not support --enable-two-batch-overlap: the "
            "iteration's read tables are indexed by the whole batch's rows, and a TBO child's readers do not "
            "offset into them."
        )
    if f.get("enable_lmcache"):
        raise _stop(
            "AssertionError: --enable-unified-memory is not yet compatible with --enable-lmcache: the LMCache "
            "offload path indexes the device buffers with the ids it is handed, and under the unified pool "
            "those are VIRTUAL."
        )
    if algorithm in ("EAGLE", "EAGLE3") and f.get("enable_hierarchical_cache"):
        raise _stop(
            "AssertionError: --enable-unified-memory + EAGLE/EAGLE3 does not support --enable-hierarchical-"
            "cache: HiCache keeps the draft on a private pool, and would pack an MTP head's KV into the "
            "target's page-envelope host pool, which refuses per-layer draft loads."
        )
    if int(f.get("dcp_size") or 1) > 1:  # _validate_unified_memory_dcp, L719-732: MLA models only
        raise _stop(
            "AssertionError: --enable-unified-memory with decode context parallelism (--dcp-size > 1) "
            "supports MLA models only (e.g. kimi-linear): the MHA unified pool has no DCP-aware masked "
            "write path (UnifiedMHATokenToKVPool.set_kv_buffer asserts dcp_kv_mask is None)."
        )


def _fused_draft(f: Mapping[str, Any], algorithm: str) -> None:
    """``_fused_draft_for_mamba_factory`` (kv_cache_configurator.py L1385-1406): an EAGLE/DFLASH draft whose KV
    cannot ride in the target's pages is refused; the one decline a dense MHA MTP head meets here is a draft KV
    dtype other than the target's (``_fused_draft_decision`` L1195-1225)."""
    target = _kv_dtype(f.get("kv_cache_dtype"))
    draft = f.get("speculative_draft_kv_cache_dtype")
    if draft in (None, "auto") or _kv_dtype(draft) == target:
        return
    raise _stop(
        f"ValueError: --enable-unified-memory + EAGLE/EAGLE3/DFLASH on a mamba-hybrid target needs the draft's "
        f"KV fused into the target's pages, but this draft cannot fuse (the draft's KV cache dtype "
        f"({_kv_dtype(draft)}) differs from the host's ({target})). A private draft pool would overcommit the "
        f"KV budget the unified buffer already takes."
    )


def _kv_dtype(value: Any) -> str:
    """The stored KV dtype of a ``--kv-cache-dtype`` value (auto and bf16 spellings are the bfloat16 checkpoint's)."""
    text = str(value or "auto")
    return "bfloat16" if text in ("auto", "bf16", "bfloat16") else text


@dataclass(frozen=True)
class Arena:
    """The unified buffer of a hybrid Mamba model (one rank), in bytes and in KV tokens."""

    total_bytes: int  # floor_4KiB(KV budget) + K·P, or max_total_tokens·entry + K·P when --max-total-tokens caps
    entry_bytes: int  # one KV token across the rank's full-attention layers (+ the fused MTP draft's)
    sink_bytes: int  # the slot-0 sink at the buffer's low end (the larger of one state and one KV page)
    state_tokens: int  # KV tokens one Mamba state displaces (mamba_slot_full_token_cost)
    tokens: int  # KV tokens the arena holds with no Mamba state in it

    def to_dict(self) -> ArenaFigures:
        return ArenaFigures(
            total_bytes=self.total_bytes,
            entry_bytes=self.entry_bytes,
            sink_bytes=self.sink_bytes,
            state_tokens=self.state_tokens,
            tokens=self.tokens,
            total_gib=round(self.total_bytes / 2**30, 4),
        )


def arena(
    *, kv_budget_bytes: float, kv_tokens: int, capped: bool, cell_bytes: int, slot_bytes: int, slots: int, page: int
) -> Arena:
    """The arena's size and its token view. ``kv_budget_bytes`` is what the static KV pool would be cut from (the
    budget left after the Mamba pool), ``capped`` whether --max-total-tokens set ``kv_tokens``; raises SGLang's
    bs=1 floor error (``_check_bs1_feasibility_floor``, L1546-1568; called at L1696-1703) when one request's three
    state slots and the
    sink do not fit."""
    entry = -(-cell_bytes // ENTRY_ALIGN) * ENTRY_ALIGN
    if capped:  # config_from_budget re-derives from the token cap without the byte budget (L3219-3228)
        total = kv_tokens * entry + slots * slot_bytes
    else:
        budget = int(kv_budget_bytes)
        total = budget - budget % KV_FLOOR_ALIGN + slots * slot_bytes
    sink = max(slot_bytes, page * entry)  # _reserved_floor_bytes, L388-409
    floor = 3 * slot_bytes + sink
    if total < floor:
        raise PlanStop(
            "startup_oom",
            f"RuntimeError: [unified-memory-pool] init_unified_mamba_pools: byte budget "
            f"{total} cannot fit ONE worst-case request (bs=1 floor {floor} = "
            f"bs1_state_slots={3 * slot_bytes} + sink={sink}). A pool this size "
            f"retract-livelocks at runtime. Raise --mem-fraction-static, lower the model "
            f"context length, or reduce reserved memory.",
        )
    usable = total - math.ceil(sink / entry) * entry
    return Arena(
        total_bytes=total,
        entry_bytes=entry,
        sink_bytes=sink,
        state_tokens=math.ceil(slot_bytes / entry),
        tokens=usable // entry // page * page,
    )
