"""SGLang 0.5.23's JSON bodies that autotune reads (``inspect``) and the simulator writes, as TypedDicts that name
their keys: the keys are SGLang's, so these stay plain JSON, and mypy checks every key either side uses.

Sources: ``/model_info`` (``srt/entrypoints/http_server.py`` ``model_info``), ``/server_info``'s
``internal_states[0].memory_usage`` (``srt/managers/scheduler_components/memory_usage.py``
``build_memory_usage``) and its ``startup_time`` split (``srt/observability/startup_time.py``; the tokenizer's
``tokenizer_e2e`` joins it at the top level).
"""

from __future__ import annotations

from typing import TypedDict


class ModelInfo(TypedDict, total=False):
    """``/model_info`` (every key is SGLang's; a reader must not assume any, since older servers lack some)."""

    model_path: str | None
    served_model_name: str | None
    tokenizer_path: str | None
    is_generation: bool
    preferred_sampling_params: str | None
    weight_version: str
    load_format: str | None
    reasoning_parser: str | None
    tool_call_parser: str | None
    disaggregation_mode: str
    has_image_understanding: bool
    has_audio_understanding: bool
    model_type: str | None
    architectures: list[str] | None


class MemoryUsage(TypedDict):
    """``internal_states[0].memory_usage``: GiB of the weights and the KV pool (K + V only, no Mamba pool), what
    was free at startup, the KV token capacity, and the CUDA graphs' GiB per phase."""

    weight: float
    kvcache: float
    startup_available: float
    token_capacity: int
    token_capacity_swa: int | None
    graph: dict[str, float]


class StartupTime(TypedDict):
    """``startup_time``: seconds of each startup phase (CUDA-graph capture per phase)."""

    load_weight: float
    kv_cache_allocation: float
    scheduler_e2e: float
    cuda_graph: dict[str, float]
    tokenizer_e2e: float
