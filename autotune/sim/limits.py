"""What bounds the simulated scheduler: the plan's limits, SGLang's admission constants, and the live counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.errors import ConfigError
from autotune.sglang.adaptive import AdaptiveSpec

__all__ = ["SchedulerLimits", "SchedulerStats", "largest_graph_bs"]

# SGLang's admission estimate of the tokens running requests will still need (global_config defaults).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20
ACTIVATION_BYTES_PER_TOKEN = 1.5 * 2**20  # what one prefill token's activations take (docs/sglang-memory.md §4)


def largest_graph_bs(value: Any) -> int:
    """The largest captured decode batch from the plan's ``decode_graph_bs`` (the list, or just its largest)."""
    if isinstance(value, list | tuple):
        return max(value) if value else 0
    return int(value or 0)


@dataclass(frozen=True, kw_only=True)
class SchedulerLimits:
    """The plan's numbers that bound scheduling (per DP worker, as SGLang reports them)."""

    max_running_requests: int
    kv_tokens: int  # max_total_num_tokens
    chunked_prefill_size: int = 8192  # ≤ 0: no chunking
    page_size: int = 1
    spec: bool = False
    draft_tokens: int = 1  # D, tokens per request per verify pass
    runtime_oom_tokens: int | None = None  # a prefill batch with more new tokens dies with CUDA OOM
    mamba_slots: int | None = None  # K; None for models without a Mamba pool
    ratio: int = 1  # Mamba slots per running request in SGLang's cap (``sglang.args.mamba_slots_per_request``)
    decode_log_interval: int = 40
    decode_graph_bs: int = 256  # largest decode batch with a captured CUDA graph
    prefill_graph_tokens: int = 0  # largest prefill batch with a captured graph
    radix_cache: bool = False  # SGLang's prefix cache (on unless --disable-radix-cache)
    # The radix cache's Mamba states (``sglang.mamba_tree``): extra_buffer saves a prefill's state on this grid
    # (None: no_buffer, at the prompt's end), decoding copies one every ``mamba_track_grid`` tokens, and at most
    # ``mamba_max_states_per_path`` stay on one root-to-leaf path (None: unlimited).
    mamba_checkpoint_grid: int | None = None
    mamba_track_grid: int | None = None
    mamba_max_states_per_path: int | None = None
    tracking_slots: int | None = None  # extra_buffer's tracking copies per request (None: read from ``ratio``)
    graph_bs: tuple[int, ...] = ()  # the captured decode batch sizes (a batch pads to one before its adaptive slot)
    adaptive: AdaptiveSpec | None = None  # --speculative-adaptive: steps chosen per batch size (D is then the max)
    arena_tokens: int | None = None  # --enable-unified-memory: KV tokens the shared arena holds with no Mamba state
    state_tokens: int = 0  # KV tokens one Mamba state displaces in that arena

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "kv_tokens", "page_size", "draft_tokens", "decode_log_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"must be at least 1, got {getattr(self, name)}",
                    key=name,
                    fix="the plan that produced these limits does not fit",
                )

    @property
    def hybrid(self) -> bool:
        return self.mamba_slots is not None

    @property
    def mamba_slots_per_req(self) -> int:
        """Slots one running request holds: its state plus extra_buffer's tracking copies (the slots reserved
        per request, ``sglang.args.mamba_slots_per_request``, less the 3 every radix-cached request reserves)."""
        if self.tracking_slots is not None:
            return 1 + self.tracking_slots
        return 1 + max(0, self.ratio - 3)

    @classmethod
    def from_plan(cls, plan: Any, *, decode_log_interval: int = 40) -> SchedulerLimits:
        """From a fitting ``planner.MemoryPlan`` (its fields plus the ``extra`` resolution details)."""
        extra = plan.extra
        extra_buffer = str(extra.get("strategy") or "").startswith("extra_buffer")
        spec = bool(extra.get("spec"))
        oom = extra.get("runtime_oom_tokens")
        adaptive = AdaptiveSpec.from_dict(extra["adaptive"]) if spec and extra.get("adaptive") else None
        arena = extra.get("unified") or {}
        graph_bs = extra.get("decode_graph_bs")
        return cls(
            max_running_requests=int(plan.max_running_requests),
            kv_tokens=int(plan.kv_tokens),
            chunked_prefill_size=int(extra.get("chunked_prefill_size") or -1),
            page_size=int(extra.get("page_size") or 1),
            spec=spec,
            draft_tokens=int(extra.get("draft_tokens") or 1) if spec else 1,
            runtime_oom_tokens=None if oom is None else int(oom),
            mamba_slots=plan.max_mamba_cache_size,
            ratio=int(extra.get("ratio") or 1),
            decode_log_interval=decode_log_interval,
            decode_graph_bs=largest_graph_bs(extra.get("decode_graph_bs")),
            prefill_graph_tokens=int(extra.get("prefill_graph_tokens") or 0),
            radix_cache=bool(extra.get("radix_cache")),
            mamba_checkpoint_grid=_int_or_none(extra.get("mamba_checkpoint_grid")) if extra_buffer else None,
            mamba_track_grid=_int_or_none(extra.get("mamba_track_grid")) if extra_buffer else None,
            mamba_max_states_per_path=_int_or_none(extra.get("mamba_max_states_per_path")),
            tracking_slots=None if extra.get("tracking_slots") is None else int(extra["tracking_slots"]),
            graph_bs=tuple(int(b) for b in graph_bs) if isinstance(graph_bs, list | tuple) else (),
            adaptive=adaptive,
            arena_tokens=int(arena["tokens"]) if arena else None,
            state_tokens=int(arena.get("state_tokens") or 0),
        )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass
class SchedulerStats:
    """Live counters for /metrics, /server_info and log lines. Spec counters reset on /flush_cache."""

    kv_total: int = 0
    mamba_total: int = 0
    num_running: int = 0
    num_queue: int = 0
    kv_used: int = 0
    mamba_used: int = 0
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0  # includes the bonus token of every verify pass, like SGLang
    retractions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_total: int = 0  # finished (length or stop)
    aborted_total: int = 0
    cached_tokens_total: int = 0  # prompt tokens served by the radix cache (device hits)
    input_tokens_total: int = 0  # prompt tokens prefilled (computed)
    last_gen_throughput: float = 0.0
    new_token_ratio: float = INIT_NEW_TOKEN_RATIO
    clock_s: float = 0.0  # Σ step durations so far

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0

    @property
    def mamba_usage(self) -> float:
        return self.mamba_used / self.mamba_total if self.mamba_total else 0.0

    @property
    def avg_spec_accept_length(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_verify_ct if self.spec_verify_ct else None

    def reset_spec(self) -> None:
        self.spec_verify_ct = self.spec_accepted_tokens = 0
