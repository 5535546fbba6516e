"""SGLang 0.5.23's argument resolution, as the planner needs it: speculative flags, the Mamba radix-cache
strategy with its attention backend and page size, CUDA-graph switches and capture lists, and the default
``--mem-fraction-static``. A combination SGLang rejects raises ``PlanStop("bad_args", …)``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from autotune.sglang.envs import parse_bool
from autotune.sglang.mamba_tree import MambaTree, mamba_tree_refusal, resolve_mamba_tree
from autotune.sglang.profiles import GpuProfile, ModelProfile, vit_factor

__all__ = [
    "PlanFailure",
    "PlanStop",
    "Spec",
    "Strategy",
    "decode_bs_list",
    "default_mem_fraction",
    "env_bool",
    "graph_settings",
    "mamba_slots_per_request",
    "mamba_tracking_slots",
    "prefill_token_buckets",
    "resolve_spec",
    "resolve_strategy",
]

PlanFailure = Literal["startup_oom", "runtime_oom", "bad_args"]


class PlanStop(Exception):
    """Ends the arithmetic where SGLang would stop (an exception in arg resolution or the scheduler)."""

    def __init__(self, failure: PlanFailure, message: str):
        super().__init__(message)
        self.failure, self.message = failure, message


EAGLE_FAMILY = {"EAGLE", "NEXTN", "MTP", "EAGLE3", "STANDALONE"}
SPEC_ALGORITHMS = EAGLE_FAMILY | {"NGRAM", "DFLASH", "DSPARK"}
SPEC_DEFAULT_MRR = 48


def decode_bs_list(max_bs: int) -> list[int]:
    """SGLang's default decode capture list up to ``max_bs``."""
    values = [1, 2, 4, 8, 12, *range(16, 256, 8), *range(256, 4097, 16)]
    out = [v for v in values if v <= max_bs]
    if max_bs not in out and max_bs > 0:
        out.append(max_bs)
    return out


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Prefill graph token buckets: 10 up to 1024, then 16 per doubling (58 for 8192, 74 for 16384)."""
    out = [4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]
    low = 1024
    while low < max_tokens:
        out.extend(range(low + low // 16, 2 * low + 1, low // 16))
        low *= 2
    return [v for v in out if v <= max_tokens] or [max_tokens]


def default_mem_fraction(
    model: ModelProfile,
    gpu: GpuProfile,
    f: Mapping[str, Any],
    *,
    chunk: int,
    decode_max_bs: int,
    decode_graph: bool,
    prefill_buckets: int,
    tp: int,
    pp: int,
) -> float:
    """SGLang's auto --mem-fraction-static: reserve for activations and graphs, then the VLM adjustment."""
    gpu_mem = gpu.memory_mib
    reserved = 512 + 1.5 * max(chunk, 2048) + tp * pp / 8 * 1024
    reserved += (2 * decode_max_bs if decode_graph else 0) + 8 * prefill_buckets
    if gpu_mem > 60 * 1024:
        reserved = max(reserved, 10240)
    mfs = round((gpu_mem - reserved) / gpu_mem, 3)
    if model.multimodal and not f.get("language_only") and not f.get("language_model_only"):
        mfs = round(mfs * vit_factor(model), 3)
    return mfs


SKIP_DECODE_LOCK = "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK"


def env_bool(env: Mapping[str, str] | None, name: str, default: bool = False) -> bool:
    """An ``EnvBool`` the way 0.5.23 reads it (``srt/environ.py`` L143-150, ``EnvField.get`` L67-86): true/1/yes/y,
    false/0/no/n, any other value warns and falls back to the default."""
    value = parse_bool((env or {}).get(name, ""))  # unset: "", which no EnvBool reads
    return default if value is None else value


def mamba_slots_per_request(strategy: str, *, overlap: bool, radix_off: bool, skip_decode_lock: bool = False) -> int:
    """SGLang 0.5.23's slots→requests rule: the Mamba state slots one running request reserves
    (``_calculate_mamba_ratio``, ``srt/mem_cache/kv_cache_configurator.py`` L3062-3088, with the tracking slots of
    ``srt/mem_cache/allocation_sizing.py`` L11-19). 1 without the radix cache; else a base of 3 plus the radix
    cache's tracking copies: 2 for ``extra_buffer`` with the overlap schedule (ping-pong), 1 for ``extra_buffer``
    without it or ``extra_buffer_lazy``, 0 for ``no_buffer``. ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1`` drops the
    base by one (L227-229, L3066-3069); ``no_buffer`` adds it back (L3081-3086), so only the extra-buffer
    strategies gain. ``strategy`` is the resolved one (never ``auto``)."""
    if radix_off:
        return 1
    base = 3 - (1 if skip_decode_lock else 0)
    if strategy.startswith("extra_buffer"):
        return base + mamba_tracking_slots(strategy, overlap=overlap)
    return base + (1 if skip_decode_lock else 0)


def mamba_tracking_slots(strategy: str, *, overlap: bool) -> int:
    """Tracking copies a radix-cached request holds (``get_mamba_tracking_slots``, ``allocation_sizing.py`` L11-19)."""
    if not strategy.startswith("extra_buffer"):
        return 0
    return 1 if strategy == "extra_buffer_lazy" or not overlap else 2


@dataclass(frozen=True)
class Spec:
    """Resolved speculative decoding (speculative_hook.py): D = ``draft_tokens``."""

    on: bool
    algorithm: str | None
    steps: int
    topk: int
    draft_tokens: int
    draft_model: bool  # a draft (MTP or separate) model is loaded
    warnings: tuple[str, ...] = ()

    @property
    def d(self) -> int:
        """D as the Mamba pool charges it (0 without speculative decoding)."""
        return self.draft_tokens if self.on else 0


def resolve_spec(model: ModelProfile, f: Mapping[str, Any]) -> Spec:
    """Resolve the speculative flags the way speculative_hook.py does."""
    algo = f.get("speculative_algorithm")
    if not algo:
        return Spec(on=False, algorithm=None, steps=0, topk=0, draft_tokens=0, draft_model=False)
    name = str(algo).upper()
    if name not in SPEC_ALGORITHMS:
        raise PlanStop(
            "bad_args",
            f"ValueError: Unknown speculative algorithm {algo!r}; choose one of {', '.join(sorted(SPEC_ALGORITHMS))}",
        )
    steps, topk, draft = (
        f.get("speculative_num_steps"),
        f.get("speculative_eagle_topk"),
        f.get("speculative_num_draft_tokens"),
    )
    warnings: list[str] = []
    if name == "NGRAM":
        return Spec(on=True, algorithm=name, steps=1, topk=1, draft_tokens=int(draft or 12), draft_model=False)
    if name in ("DFLASH", "DSPARK"):
        steps, topk = 1, 1
    elif steps is None:
        if topk is not None or draft is not None:
            raise PlanStop(
                "bad_args",
                "AssertionError: --speculative-eagle-topk and --speculative-num-draft-tokens "
                "must be unset when --speculative-num-steps is unset (they are auto-chosen together)",
            )
        steps, topk, draft = model.spec_defaults
    topk = 1 if topk is None else int(topk)
    if steps < 1 or topk < 1:
        raise PlanStop("bad_args", "ValueError: --speculative-num-steps and --speculative-eagle-topk must be >= 1")
    if draft is None and topk > 1:
        draft = steps + 1
    if topk == 1 and draft != steps + 1:
        if draft is not None:
            warnings.append(
                f"speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 = {steps + 1} "
                f"when speculative_eagle_topk == 1"
            )
        draft = steps + 1
    draft_model = bool(f.get("speculative_draft_model_path"))
    if name in EAGLE_FAMILY and not draft_model and model.mtp_layers == 0:
        raise PlanStop(
            "bad_args",
            f"ValueError: --speculative-algorithm {name} needs --speculative-draft-model-path: "
            f"{model.name} has no MTP layers",
        )
    return Spec(
        on=True,
        algorithm="EAGLE" if name in ("NEXTN", "MTP") else name,
        steps=int(steps),
        topk=topk,
        draft_tokens=int(draft if draft is not None else steps + 1),
        draft_model=True,
        warnings=tuple(warnings),
    )


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """The radix cache and attention as SGLang resolves them (``resolve_strategy``): the Mamba strategy, overlap,
    backend, page size, Mamba slots per running request (``ratio``) and the radix tree's Mamba-state levers."""

    strategy: str
    overlap: bool
    attention_backend: str
    page_size: int
    ratio: int
    radix_off: bool
    skip_decode_lock: bool
    tracking_slots: int  # extra_buffer's tracking copies per request (in ``ratio``)
    tree: MambaTree


def resolve_strategy(
    model: ModelProfile, gpu: GpuProfile, f: Mapping[str, Any], spec: Spec, *, env: Mapping[str, str] | None = None
) -> Strategy:
    """Mamba radix-cache strategy, overlap, attention backend and page size (``srt/arg_groups/overrides.py``, called
    from ``model_hook.py``); ``env`` is the server's environment (the decode-lock switch moves the ratio)."""
    radix_off = bool(f.get("disable_radix_cache"))
    overlap = not f.get("disable_overlap_schedule")
    asked = f.get("mamba_radix_cache_strategy") or "auto"
    page = f.get("page_size")
    backend = f.get("attention_backend")
    supports_extra = model.extra_buffer_arch and (f.get("linear_attn_backend") or "triton") == "triton"
    if asked.startswith("extra_buffer") and not model.has_mamba:
        raise PlanStop(
            "bad_args",
            f"ValueError: --mamba-radix-cache-strategy {asked} needs mamba state; "
            f"{model.architecture or model.name} has no linear-attention layers",
        )
    if asked.startswith("extra_buffer") and not supports_extra:
        raise PlanStop(
            "bad_args",
            f"ValueError: --mamba-radix-cache-strategy {asked} needs an extra-buffer "
            f"architecture and --linear-attn-backend triton",
        )
    strategy = "none"
    if model.has_mamba and not radix_off:
        strategy = asked
        if asked == "auto":
            strategy = "extra_buffer" if (overlap or (page or 1) > 1) and supports_extra else "no_buffer"
    # SM100 override for the Qwen3.5/Next hybrids: trtllm_mha + page 64, except (radix on, no extra_buffer, no spec).
    if backend is None and model.qwen_sm100_override and gpu.arch == "sm100":
        if not radix_off and not strategy.startswith("extra_buffer") and not spec.on:
            backend, page = "triton", page or 1
        else:
            backend, page = "trtllm_mha", page or 64
            if asked == "auto" and strategy == "no_buffer" and supports_extra:
                strategy = "extra_buffer"  # auto picks extra_buffer once page_size > 1
    backend = backend or gpu.default_attention_backend
    page = int(page or 1)
    if strategy == "no_buffer":
        overlap = False  # SGLang forces --disable-overlap-schedule for no_buffer
        if page > 1 or backend == "trtllm_mha":
            raise PlanStop(
                "bad_args",
                f"ValueError: --mamba-radix-cache-strategy no_buffer needs page_size 1 and a "
                f"non-trtllm_mha attention backend (got page_size={page}, {backend})",
            )
    if strategy == "extra_buffer_lazy" and not overlap:
        raise PlanStop(
            "bad_args",
            "ValueError: --mamba-radix-cache-strategy extra_buffer_lazy requires the overlap "
            "schedule (remove --disable-overlap-schedule)",
        )
    refusal = mamba_tree_refusal(f, strategy=strategy, draft_tokens=spec.draft_tokens, spec=spec.on, page=page)
    if refusal:
        raise PlanStop("bad_args", refusal)
    tree = resolve_mamba_tree(f, strategy=strategy, page=page, has_mamba=model.has_mamba)
    if spec.on and spec.topk > 1:
        if backend == "trtllm_mha":
            raise PlanStop("bad_args", "ValueError: trtllm_mha attention backend requires --speculative-eagle-topk 1")
        if page > 1 and backend not in ("fa3", "flashinfer", "triton"):
            raise PlanStop(
                "bad_args",
                f"ValueError: --speculative-eagle-topk > 1 with page_size > 1 needs the fa3, "
                f"flashinfer or triton attention backend (got {backend})",
            )
    skip = env_bool(env, SKIP_DECODE_LOCK)
    ratio = mamba_slots_per_request(strategy, overlap=overlap, radix_off=radix_off, skip_decode_lock=skip)
    return Strategy(
        strategy=strategy,
        overlap=overlap,
        attention_backend=backend,
        page_size=page,
        ratio=ratio,
        radix_off=radix_off,
        skip_decode_lock=skip,
        tracking_slots=0 if radix_off else mamba_tracking_slots(strategy, overlap=overlap),
        tree=tree,
    )


def graph_settings(f: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether decode and prefill CUDA graphs are captured: any of SGLang's four ways to turn one off wins."""
    raw = f.get("cuda_graph_config")
    cfg: dict[str, Any] = raw if isinstance(raw, dict) else {}
    all_off = bool(f.get("disable_cuda_graph"))
    decode_on = not (
        all_off
        or f.get("disable_decode_cuda_graph")
        or f.get("cuda_graph_backend_decode") == "disabled"
        or (cfg.get("decode") or {}).get("backend") == "disabled"
    )
    prefill_on = not (
        all_off
        or f.get("disable_prefill_cuda_graph")
        or f.get("cuda_graph_backend_prefill") == "disabled"
        or (cfg.get("prefill") or {}).get("backend") == "disabled"
    )
    return decode_on, prefill_on
