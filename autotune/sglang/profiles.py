"""Model profiles: the numbers SGLang's memory arithmetic and the speed model need.

A profile is built from a HuggingFace ``config.json`` of any family in ``sglang.families`` (bundled ones are
real configs plus the weight sizes SGLang logged for them); its weights come from the checkpoint's safetensors
index or shard headers beside it when they are there (``sglang.checkpoint``), else from arithmetic, named an
estimate. GPU profiles live in ``sglang.gpus``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.errors import ProfileError
from autotune.sglang.checkpoint import CheckpointBytes, Quantization, quantization, read_checkpoint
from autotune.sglang.families import (
    EXTRA_BUFFER_ARCHS,
    NOT_IN_SGLANG,
    Family,
    LinearState,
    family_of,
    supported_types,
)
from autotune.sglang.gpus import GIB, GPUS, MIB, GpuProfile, load_gpu
from autotune.sglang.hub import find_model

__all__ = [
    "GIB",
    "GPUS",
    "MIB",
    "BUNDLED",
    "GpuProfile",
    "ModelProfile",
    "dtype_bytes",
    "from_hf_config",
    "load_gpu",
    "load_model",
    "vit_factor",
]

# Bytes per element; block-scaled formats include their scales (mxfp8: 1 B + 1/32; nvfp4: 0.5 B + 1/16).
_DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "mxfp8": 1.03125,
    "nvfp4": 0.5625,
    "fp4_mx_block16": 0.5625,
}
# Activation temporaries of one forward, per token, are kept by torch's caching allocator in blocks that do not
# fit the next differently sized tensor; the observed peak is this much above the live sum (see
# docs/sglang-memory.md; chosen so the seed's 0.93 run fits and ≥ 0.95 does not, docs/sglang-memory.md §4).
ALLOCATOR_OVERHEAD = 1.7


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """One model as SGLang sees it at TP1 (methods take ``tp`` for per-rank figures)."""

    name: str
    model_type: str
    architecture: str
    num_layers: int
    full_layers: int  # full-attention layers (all layers for dense models)
    linear_layers: int  # Gated-DeltaNet (Mamba-pool) layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    linear: LinearState | None = None  # one linear-attention layer's state shape (None: no Mamba pool)
    family_name: str = "dense"
    qwen_sm100_override: bool = False  # the Qwen3.5/Next SM100 backend override applies
    quant_method: str = "none"  # the checkpoint's weight quantization (fp8, fp8-block, nvfp4, int4, …)
    weights_source: str = "arithmetic"  # index | headers | arithmetic | SGLang log (bundled)
    ssm_dtype: str = "float32"  # config ``mamba_ssm_dtype`` (SGLang's default when the flag is unset)
    hidden: int
    ffn: int  # dense MLP width; for MoE the per-token active expert width (top-k × expert + shared)
    vocab: int
    mtp_layers: int = 0
    target_weights_gib: float
    draft_weights_gib: float = 0.0  # MTP layers + their own embedding/lm_head copy, as SGLang loads them
    streamed_weight_bytes: float  # bytes read per target forward (decode step)
    streamed_draft_bytes: float = 0.0  # per draft (MTP) pass
    flops_per_token: float
    draft_flops_per_token: float = 0.0
    context_len: int
    multimodal: bool = False
    vit_hidden: int = 0
    vit_layers: int = 24  # what SGLang reads (vision ``num_hidden_layers``, default 24)
    dtype_bytes: int = 2
    extra_buffer_arch: bool = False  # in SGLang's _MAMBA_EXTRA_BUFFER_ARCHS
    spec_defaults: tuple[int, int, int] = (3, 1, 4)  # (steps, topk, draft tokens) when only the algorithm is set
    act_bytes_per_token: float  # live activation bytes of one prefill token at TP1 (before allocator overhead)

    @property
    def has_mamba(self) -> bool:
        return self.linear_layers > 0

    @property
    def conv_dim(self) -> int:
        return self.linear.conv_dim() if self.linear else 0

    @property
    def conv_kernel(self) -> int:
        return self.linear.conv_kernel if self.linear else 0

    def mamba_conv_bytes(self, tp: int = 1, conv_dtype: str = "bfloat16") -> int:
        """Conv state of one slot, all linear layers, per rank."""
        if not self.linear or not self.has_mamba:
            return 0
        return int(self.linear_layers * self.linear.conv_elems(tp) * dtype_bytes(conv_dtype))

    def mamba_ssm_bytes(self, tp: int = 1, ssm_dtype: str | None = None) -> int:
        """Temporal (ssm) state of one slot, all linear layers, per rank."""
        if not self.linear or not self.has_mamba:
            return 0
        return int(self.linear_layers * self.linear.ssm_elems(tp) * dtype_bytes(ssm_dtype or self.ssm_dtype))

    def mamba_slot_bytes(self, tp: int = 1, ssm_dtype: str | None = None) -> int:
        """P: one Mamba slot (conv + ssm over all linear layers) per rank (``mamba_cache_per_req``,
        ``srt/configs/mamba_utils.py`` L112-124)."""
        return self.mamba_conv_bytes(tp) + self.mamba_ssm_bytes(tp, ssm_dtype)

    def kv_cell_bytes(self, tp: int = 1, kv_dtype: str = "bfloat16", with_draft: bool = False) -> int:
        """KV bytes per token per rank; ``with_draft`` adds the MTP layers' cell (they share token ids).

        ``kv_dtype`` is a ``--kv-cache-dtype`` value; ``auto`` means the model's dtype."""
        kv_heads = max(1, self.num_kv_heads // tp)
        layers = self.full_layers + (self.mtp_layers if with_draft else 0)
        elem = self.dtype_bytes if kv_dtype == "auto" else dtype_bytes(kv_dtype)
        return int(kv_heads * (self.head_dim + self.v_head_dim) * layers * elem)

    @property
    def draft_kv_cell_bytes(self) -> int:
        return self.kv_cell_bytes(with_draft=True) - self.kv_cell_bytes()

    def weights_gib(self, *, with_draft: bool, tp: int = 1) -> float:
        return (self.target_weights_gib + (self.draft_weights_gib if with_draft else 0.0)) / tp

    def activation_bytes(self, tokens: int, tp: int = 1) -> float:
        """Peak activation memory of one forward over ``tokens`` prefill tokens, per rank."""
        return ALLOCATOR_OVERHEAD * self.workspace_bytes(tokens, tp)

    def workspace_bytes(self, tokens: int, tp: int = 1) -> float:
        """Live temporaries of one forward over ``tokens`` (sharded widths divide by tp; hidden-size ones do not)."""
        hidden_part = 6 * self.hidden * self.dtype_bytes
        sharded = self.act_bytes_per_token - hidden_part
        return tokens * (hidden_part + sharded / tp)


# Bundled models: the public config.json fields that matter, plus what SGLang logged for them
# (``Load weight end … mem usage``: target and MTP draft weights; ``srt/model_executor/model_runner.py``).
_QWEN36_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "vocab_size": 248320,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1,
        "torch_dtype": "bfloat16",
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304},
}
_QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "intermediate_size": 5120,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "torch_dtype": "bfloat16",
}
BUNDLED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen3.6-27b": (
        _QWEN36_27B,
        {
            "target_weights_gib": 51.05,
            "draft_weights_gib": 5.53,
            "streamed_weight_bytes": 51.25e9,
            "streamed_draft_bytes": 3.39e9,
            "flops_per_token": 52e9,
        },
    ),
    "qwen3-next-80b-a3b": (_QWEN3_NEXT_80B, {}),
}


def dtype_bytes(name: str | None) -> float:
    key = (name or "bfloat16").lower().replace("torch.", "")
    if key == "auto":
        return 2
    if key not in _DTYPE_BYTES:
        raise ProfileError(f"unknown dtype {name!r}", fix=f"use one of {', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[key]


def load_model(name_or_path: str | Path) -> ModelProfile:
    """A bundled model (``qwen3.6-27b``, ``qwen3-next-80b-a3b``, or their HuggingFace ids such as
    ``Qwen/Qwen3.6-27B``), a HF ``config.json`` or a folder holding one (with the safetensors index or shards
    beside it for exact weights; a local path wins), or a HuggingFace model id (``sglang.hub``)."""
    key = str(name_or_path).strip()
    path = Path(key).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return _load_config_file(path)
    bundled = _bundled_name(key)
    if bundled:
        config, measured = BUNDLED[bundled]
        return replace(
            from_hf_config(config, name=bundled, source=f"bundled profile {bundled}"),
            **measured,
            weights_source="SGLang log (bundled)" if measured else "arithmetic",
        )
    folder = find_model(key)  # a model id: the local HuggingFace cache, or its two small files from the Hub
    if folder is not None:
        return _load_config_file(folder / "config.json", name=key.rstrip("/").rsplit("/", 1)[-1])
    raise ProfileError(
        f"unknown model {key!r}: not a bundled profile, no config.json there, not in the HuggingFace cache",
        key="model",
        fix=f"use one of {', '.join(BUNDLED)}, a folder with config.json (and "
        "model.safetensors.index.json), or an org/name HuggingFace id with network access",
    )


def _bundled_name(key: str) -> str | None:
    """``Qwen/Qwen3.6-27B`` and ``qwen3-next-80b-a3b-instruct`` name bundled profiles too (a sim launch passes
    SGLang's ``--model-path``, which is usually a HuggingFace id). A quantized id (``-FP8``) does not."""
    name = key.lower().rstrip("/").rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-thinking"):
        name = name.removesuffix(suffix)
    return name if name in BUNDLED else None


def _load_config_file(path: Path, *, name: str | None = None) -> ModelProfile:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read it as JSON: {exc}", file=str(path)) from exc
    if not isinstance(config, dict):
        raise ProfileError("expected a JSON object", file=str(path))
    checkpoint = read_checkpoint(path.parent) if path.name == "config.json" else None
    return from_hf_config(
        config,
        name=name or (path.parent.name if path.name == "config.json" else path.stem),
        source=str(path),
        checkpoint=checkpoint,
    )


def _need(cfg: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ProfileError(f"missing required field {key!r}", file=source, key=key)
    value = cfg[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ProfileError(f"{key} must be a positive integer, got {value!r}", file=source, key=key)
    return value


def _family(config: dict[str, Any], cfg: dict[str, Any], source: str) -> tuple[Family, str, str]:
    """(family, model_type, architecture), rejecting what SGLang 0.5.23 does not serve."""
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    archs = config.get("architectures") or cfg.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    family = family_of(model_type) or family_of(str(config.get("model_type") or ""))
    if family is None:
        why = NOT_IN_SGLANG.get(model_type.split("_")[0], "")
        raise ProfileError(
            f"unsupported model_type {model_type or None!r} (architecture {arch or '?'}){': ' + why if why else ''}",
            file=source,
            key="model_type",
            fix=f"supported: {', '.join(supported_types())}",
        )
    return family, model_type, arch


@dataclass(frozen=True)
class _Arith:
    """Parameter counts from ``config.json`` (an estimate of the checkpoint), split the way the planner needs."""

    embed: int  # the input embedding table
    lm_head: int  # 0 when tied
    quantizable: int  # attention, MLP/expert and (unless kept) mixer projections of the target's layers
    kept: int  # target parameters a quantized checkpoint keeps in 16 bits (mixers as the recipe says)
    active_quantizable: int  # what one token reads of ``quantizable`` (routed experts: top-k of them)
    mtp_layer: int  # one MTP layer (a full-attention decoder layer + the 2h→h fusion)
    mtp_active: int
    vit: int
    active_ffn: int  # FFN width one token goes through (MoE: top-k experts + shared)
    attn: int  # one full-attention layer's projections


def _mlp_params(fam: Family, cfg: dict[str, Any], hidden: int, kind: str | None) -> tuple[int, int, int]:
    """(params, params one token reads, FFN width one token goes through) of one MLP block."""
    mm = fam.mlp_matrices
    if kind is None:
        return 0, 0, 0
    if kind == "dense":
        ffn = int(cfg.get("intermediate_size") or cfg.get("ffn_hidden_size") or 0)
        return mm * hidden * ffn, mm * hidden * ffn, ffn
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 1)
    expert_ffn = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    shared = int(
        cfg.get("shared_expert_intermediate_size")
        or cfg.get("moe_shared_expert_intermediate_size")
        or cfg.get("shared_intermediate_size")
        or 0
    )
    shared += int(cfg.get("num_shared_experts") or 0) * expert_ffn
    total = mm * hidden * (experts * expert_ffn + shared) + hidden * experts
    return total, mm * hidden * (top_k * expert_ffn + shared), top_k * expert_ffn + shared


def _arith(
    fam: Family,
    cfg: dict[str, Any],
    blocks: list[tuple[Any, Any]],
    state: LinearState | None,
    q: Quantization,
    dims: tuple[int, int, int, int, int],
    vision: dict[str, Any] | None,
) -> _Arith:
    hidden, heads, kv_heads, head_dim, vocab = dims
    gate = 2 if fam.gated_attention else 1
    attn = hidden * heads * head_dim * gate + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mixer = state.mixer_params(hidden) if state else 0
    quant = kept = active = 0
    ffn_active = 0
    for mix, mlp in blocks:
        a = attn if mix in ("attention", "both") else 0
        m = mixer if mix in ("linear", "both") else 0
        total, act, ffn = _mlp_params(fam, cfg, hidden, mlp)
        ffn_active = max(ffn_active, ffn)
        mixer_q = 0 if q.keeps_mixer else m
        quant += a + total + mixer_q
        kept += m - mixer_q
        active += a + act + mixer_q
    last_mlp = next((mlp for _, mlp in reversed(blocks) if mlp), "dense")
    mtp_total, mtp_act, _ = _mlp_params(fam, cfg, hidden, last_mlp)
    embed = vocab * hidden
    tied = bool(cfg.get("tie_word_embeddings", False))
    return _Arith(
        embed=embed,
        lm_head=0 if tied else embed,
        quantizable=quant,
        kept=kept,
        active_quantizable=active,
        mtp_layer=attn + mtp_total + 2 * hidden * hidden,
        mtp_active=attn + mtp_act + 2 * hidden * hidden,
        vit=_vit_params(vision),
        active_ffn=ffn_active,
        attn=attn,
    )


def _vit_params(vision: dict[str, Any] | None) -> int:
    if not vision:
        return 0
    v_hidden = int(vision.get("hidden_size") or 0)
    v_ffn = int(vision.get("intermediate_size") or 4 * v_hidden)
    v_depth = int(vision.get("depth") or vision.get("num_hidden_layers") or 24)
    return v_depth * (4 * v_hidden * v_hidden + 2 * v_hidden * v_ffn)


def _weights(
    a: _Arith,
    q: Quantization,
    nbytes: int,
    mtp: int,
    ck: CheckpointBytes | None,
) -> tuple[float, float, float, float, str]:
    """(target bytes, draft bytes, streamed bytes per target step, per draft pass, source): from the checkpoint's
    files when given (the arithmetic only splits them), else the arithmetic."""
    wq, w16 = q.weight_bytes, nbytes
    target = a.quantizable * wq + (a.kept + a.embed + a.lm_head + a.vit) * w16
    mtp_file = mtp * a.mtp_layer * wq
    streamed = a.active_quantizable * wq + (a.kept + a.embed) * w16  # lm_head (or the tied table) once a step
    draft_streamed = mtp * a.mtp_active * wq + a.embed * w16
    source = "arithmetic"
    if ck is not None:
        if ck.draft is not None:
            mtp_file = float(ck.draft) if ck.has_draft_tensors else 0.0
        elif not ck.has_draft_tensors:
            mtp_file = 0.0
        else:
            mtp_file *= ck.total / max(1.0, target + mtp_file)
        scale = (ck.total - mtp_file) / max(1.0, target)
        target, streamed, source = ck.total - mtp_file, streamed * scale, ck.source
    # SGLang's MTP draft loads its layers plus its own embedding and lm_head copy.
    draft = mtp_file + 2 * a.embed * w16 if mtp else 0.0
    return target, draft, streamed, draft_streamed if mtp else 0.0, source


def _kv_geometry(cfg: dict[str, Any], hidden: int, heads: int) -> tuple[int, int, int]:
    """(KV heads, K head dim, V head dim) of the KV cache; MLA (Kimi-Linear's full attention) caches one latent
    "head" of kv_lora_rank + rope dims that is not split over TP."""
    if cfg.get("kv_lora_rank"):
        return 1, int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0), 0
    head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads)
    return int(cfg.get("num_key_value_heads") or heads), head_dim, head_dim


def _activation_per_token(nbytes: int, ffn: int, hidden: int, attn_width: int, state: LinearState | None) -> float:
    """Live temporaries per prefill token: MLP gate/up + activation, six hidden-size buffers (residual, norms,
    mixer and MLP outputs), the mixer's projections, and the linear-attention scan's fp32 q/k/v + output."""
    width, scan = attn_width, 0
    if state:
        width = max(width, 2 * state.groups * state.state + 2 * state.intermediate + 2 * state.heads)
        scan = 4 * 2 * (state.conv_dim() + state.intermediate)
    return float(nbytes * (3 * ffn + 6 * hidden + width) + scan)


def from_hf_config(
    config: dict[str, Any], *, name: str, source: str = "config.json", checkpoint: CheckpointBytes | None = None
) -> ModelProfile:
    """Build a profile from a HuggingFace config dict; weights from ``checkpoint`` (the safetensors index or
    shard headers) when given, else estimated from the parameter count and the quantization scheme."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    cfg = {**config, **text} if text else dict(config)
    fam, model_type, arch = _family(config, cfg, source)
    hidden = _need(cfg, "hidden_size", source)
    heads = _need(cfg, "num_attention_heads", source)
    layers = int(cfg.get("num_hidden_layers") or 0)
    try:
        blocks = fam.layers(cfg, layers)
        state = fam.state(cfg) if fam.state else None
    except ProfileError as exc:
        raise ProfileError(exc.message, file=source, key=exc.key, fix=exc.fix) from None
    if not blocks:
        raise ProfileError("missing required field 'num_hidden_layers'", file=source, key="num_hidden_layers")
    layers = len(blocks)
    kv_heads, head_dim, v_head_dim = _kv_geometry(cfg, hidden, heads)
    vocab = _need(cfg, "vocab_size", source)
    full = sum(1 for mix, _ in blocks if mix in ("attention", "both"))
    linear = sum(1 for mix, _ in blocks if mix in ("linear", "both")) if state else 0
    q = quantization(cfg, source)
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else None
    attn_heads_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads)
    a = _arith(
        fam,
        cfg,
        blocks,
        state,
        q,
        (hidden, heads, int(cfg.get("num_key_value_heads") or heads), attn_heads_dim, vocab),
        vision,
    )
    mtp = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    nbytes = int(dtype_bytes(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")))
    nbytes = 2 if nbytes == 4 else nbytes  # SGLang's dtype=auto serves fp32 checkpoints in bf16
    target, draft, streamed, draft_streamed, weights_source = _weights(a, q, nbytes, mtp, checkpoint)
    gate = 2 if fam.gated_attention else 1
    act = _activation_per_token(
        nbytes, a.active_ffn, hidden, heads * attn_heads_dim * gate + 2 * kv_heads * head_dim, state
    )
    per_tok_attn = 4 * full * heads * attn_heads_dim * 1024  # attention over a ~1K context, both matmuls
    body_active = a.active_quantizable + a.kept
    return ModelProfile(
        name=name,
        model_type=model_type,
        architecture=arch,
        num_layers=layers,
        full_layers=full,
        linear_layers=linear,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        linear=state,
        family_name=fam.name,
        qwen_sm100_override=fam.qwen_sm100_override,
        quant_method=q.method,
        weights_source=weights_source,
        ssm_dtype=str(cfg.get("mamba_ssm_dtype") or "float32"),
        hidden=hidden,
        ffn=a.active_ffn,
        vocab=vocab,
        mtp_layers=mtp,
        target_weights_gib=target / GIB,
        draft_weights_gib=draft / GIB,
        streamed_weight_bytes=float(streamed),
        streamed_draft_bytes=float(draft_streamed),
        flops_per_token=float(2 * (body_active + (a.lm_head or a.embed)) + per_tok_attn),
        draft_flops_per_token=float(2 * (mtp * a.mtp_active + a.embed) if mtp else 0),
        context_len=int(cfg.get("max_position_embeddings") or 4096),
        multimodal=vision is not None,
        vit_hidden=int(vision.get("hidden_size") or 0) if vision else 0,
        vit_layers=int(vision.get("num_hidden_layers") or 24) if vision else 24,
        dtype_bytes=nbytes,
        extra_buffer_arch=bool(state) and (arch in EXTRA_BUFFER_ARCHS or (not arch and fam.qwen_sm100_override)),
        spec_defaults=(5, 4, 8) if model_type in ("llama", "mistral") else (3, 1, 4),
        act_bytes_per_token=float(act),
    )


def vit_factor(model: ModelProfile) -> float:
    """SGLang's VLM mem-fraction multiplier: 0.95 × clamp(1 − 0.1 × (complexity/ViT-L − 1), 0.8, 1.05)."""
    if not model.multimodal:
        return 1.0
    ratio = (model.vit_layers * model.vit_hidden**2) / (24 * 1024**2)
    return 0.95 * min(1.05, max(0.8, 1 - 0.1 * (ratio - 1)))
