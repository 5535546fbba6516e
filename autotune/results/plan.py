"""The details of the memory planner's prediction (``autotune.sglang.memory.MemoryPlan.extra``), stored inside
``TrialResult.plan`` and ``autotune plan --json``: the keys the planner writes, named here so every reader's keys
are checked.

TypedDicts rather than records: the details are stored and read back as this very JSON (old studies included),
and hold a key only for the planner steps that ran (a plan that stopped early has fewer), so which keys are present
is part of what is stored. Here, below the planner, because ``results`` may not import it.
"""

from __future__ import annotations

from typing import TypedDict


class AdaptiveSlot(TypedDict):
    """One batch-size slot of ``--speculative-adaptive``'s table (``AdaptiveSpec.to_dict``)."""

    candidate_steps: list[int]
    up_hysteresis: float
    down_hysteresis: float
    ceiling_coeff: float


class AdaptiveFigures(TypedDict):
    """``--speculative-adaptive``'s controller as the planner kept it: its table by slot (batch size as text)."""

    initial_steps: int
    candidates: list[int]
    max_draft_tokens: int
    slots: dict[str, AdaptiveSlot]


class ArenaFigures(TypedDict):
    """``--enable-unified-memory``'s buffer (``unified.Arena``), in bytes and KV tokens, and its size in GiB."""

    total_bytes: int
    entry_bytes: int
    sink_bytes: int
    state_tokens: int
    tokens: int
    total_gib: float


class PlanDetails(TypedDict, total=False):
    """``MemoryPlan.extra``: each finished planner step's details, in the order the steps ran (the first block is
    always there; the rest only once its step ran), then what the simulator or the correction added."""

    pre_gib: float  # the start: free memory, device, parallelism
    total_gib: float
    cuda_context_gib: float
    tp_size: int
    pp_size: int
    attn_tp_size: int
    spec: bool
    draft_tokens: int
    spec_steps: int
    spec_topk: int
    requested_mrr: int | None
    binding: str | None  # what bound the running cap: explicit | spec_default | est | kv | mamba
    startup_s: float
    runtime_oom_tokens: int | None
    static_gib: float
    peak_gib: float
    rest_gib: float
    spec_algorithm: str | None  # speculative decoding, as resolved
    strategy: str  # the layout: radix-cache strategy, overlap, backend, page, slots per request
    overlap: bool
    radix_cache: bool
    attention_backend: str
    page_size: int
    ratio: int | None
    skip_decode_lock: bool
    tracking_slots: int
    mamba_tree: bool  # the radix cache's Mamba-state levers (``sglang.mamba_tree.MambaTree``)
    mamba_checkpoint_grid: int | None
    mamba_track_interval: int | None
    mamba_track_grid: int | None
    mamba_max_states_per_path: int | None
    chunked_prefill_size: int  # sizes
    context_len: int
    target_weights_gib: float  # weights
    mamba_slot_bytes: int  # the Mamba pool
    mamba_full_memory_ratio: float | None
    ssm_dtype: str | None
    kv_cell_bytes: int  # the KV pool
    adaptive: AdaptiveFigures | None  # the levers, None where not kept
    unified: ArenaFigures | None
    decode_graph_bs: list[int]  # graphs and headroom
    prefill_graph_tokens: int
    workspace_gib: float
    mm_reserve_gib: float
    warnings: list[str]
    truth: dict[str, float]  # the simulated machine's deviation from the planner (``sim.truth.Deviation``)
    room_correction_gib: float  # the online correction's shift of the room (``search.correction``)
