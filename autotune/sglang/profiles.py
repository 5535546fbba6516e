"""Model and GPU profiles: the numbers SGLang's memory arithmetic and the speed model need.

A model profile is built from a HuggingFace ``config.json`` (bundled ones are real configs plus the weight
sizes SGLang logged for them). Supported: ``qwen3_5`` (Qwen3.5/3.6 hybrids, incl. a nested ``text_config``),
``qwen3_next``, and plain dense llama/qwen2/qwen3/mistral transformers (no Mamba pool).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.errors import ProfileError

GIB = 2**30
MIB = 2**20

# Bytes per element; block-scaled formats include their scales (mxfp8: 1 B + 1/32; nvfp4: 0.5 B + 1/16).
_DTYPE_BYTES: dict[str, float] = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                                  "half": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1.03125, "nvfp4": 0.5625,
                                  "fp4_mx_block16": 0.5625}
DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
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
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
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
    def family(self) -> str:
        return "qwen3_5" if self.model_type.startswith("qwen3_5") else self.model_type

    @property
    def conv_dim(self) -> int:
        return self.linear_v_heads * self.linear_v_dim + 2 * self.linear_k_heads * self.linear_k_dim

    def mamba_conv_bytes(self, tp: int = 1, conv_dtype: str = "bfloat16") -> int:
        """Conv state of one slot, all linear layers, per rank."""
        if not self.has_mamba:
            return 0
        return int(self.linear_layers * (self.conv_dim // tp) * (self.conv_kernel - 1) * dtype_bytes(conv_dtype))

    def mamba_ssm_bytes(self, tp: int = 1, ssm_dtype: str | None = None) -> int:
        """Temporal (ssm) state of one slot, all linear layers, per rank."""
        if not self.has_mamba:
            return 0
        heads = max(1, self.linear_v_heads // tp)
        return int(self.linear_layers * heads * self.linear_v_dim * self.linear_k_dim * dtype_bytes(ssm_dtype or self.ssm_dtype))

    def mamba_slot_bytes(self, tp: int = 1, ssm_dtype: str | None = None) -> int:
        """P: one Mamba slot (conv + ssm over all linear layers) per rank (``srt/configs/mamba_utils.py``, ``srt/configs/qwen3_next.py``)."""
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


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    """One GPU model: what nvidia-smi reports and the roofline figures."""

    name: str
    memory_mib: int  # nvidia-smi memory.total (what SGLang's mem-fraction heuristic reads)
    bandwidth: float  # HBM bytes/s
    peak_flops: float  # dense bf16 FLOP/s
    arch: str  # sm100 | sm90
    cuda_context_gib: float = 0.5

    @property
    def memory_gib(self) -> float:
        return self.memory_mib * MIB / GIB

    def tier(self, tp: int = 1) -> tuple[int, int]:
        """SGLang's defaults by nvidia-smi size: (chunked_prefill_size, decode cuda-graph max bs) (``srt/arg_groups/memory_hook.py``; docs/sglang-memory.md §2)."""
        gib = self.memory_mib / 1024
        if gib < 20:
            return 2048, 8
        if gib < 35:
            return 4096, 48 if tp < 4 else 160
        if gib < 60:
            return 4096, 32 if tp < 4 else 160
        if gib < 160:
            return 8192, 256 if tp < 4 else 512
        return 16384, 512


# Bundled models: the public config.json fields that matter, plus what SGLang logged for them
# (``Load weight end … mem usage``: target and MTP draft weights; ``srt/model_executor/model_runner.py``).
_QWEN36_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
        "vocab_size": 248320, "tie_word_embeddings": False, "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16",
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304},
}
_QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
    "torch_dtype": "bfloat16",
}
BUNDLED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen3.6-27b": (_QWEN36_27B, {"target_weights_gib": 51.05, "draft_weights_gib": 5.53,
                                  "streamed_weight_bytes": 51.25e9, "streamed_draft_bytes": 3.39e9,
                                  "flops_per_token": 52e9}),
    "qwen3-next-80b-a3b": (_QWEN3_NEXT_80B, {}),
}

GPUS: dict[str, GpuProfile] = {
    "b200": GpuProfile(name="b200", memory_mib=183_359, bandwidth=8.0e12, peak_flops=2.25e15, arch="sm100"),
    "h200": GpuProfile(name="h200", memory_mib=143_771, bandwidth=4.8e12, peak_flops=0.99e15, arch="sm90"),
    "h100": GpuProfile(name="h100", memory_mib=81_559, bandwidth=3.35e12, peak_flops=0.99e15, arch="sm90"),
}


def dtype_bytes(name: str | None) -> float:
    key = (name or "bfloat16").lower().replace("torch.", "")
    if key == "auto":
        return 2
    if key not in _DTYPE_BYTES:
        raise ProfileError(f"unknown dtype {name!r}", fix=f"use one of {', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[key]


def load_gpu(name: str, *, memory_mib: int | None = None) -> GpuProfile:
    """A bundled GPU (``b200``, ``h200``, ``h100``), optionally with another total memory (MiB)."""
    key = str(name).strip().lower().removeprefix("nvidia-").removeprefix("nvidia ")
    if key not in GPUS:
        raise ProfileError(f"unknown GPU {name!r}", key="gpu", fix=f"use one of {', '.join(GPUS)}")
    gpu = GPUS[key]
    if memory_mib is not None:
        if int(memory_mib) <= 0:
            raise ProfileError(f"GPU memory must be positive, got {memory_mib}", key="memory_mib")
        gpu = replace(gpu, memory_mib=int(memory_mib))
    return gpu


def load_model(name_or_path: str | Path) -> ModelProfile:
    """A bundled model (``qwen3.6-27b``, ``qwen3-next-80b-a3b``, or their HuggingFace ids such as
    ``Qwen/Qwen3.6-27B``) or a HF ``config.json`` / a model directory holding one (a local path wins)."""
    key = str(name_or_path).strip()
    path = Path(key).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return _load_config_file(path)
    bundled = _bundled_name(key)
    if bundled:
        config, measured = BUNDLED[bundled]
        return replace(from_hf_config(config, name=bundled, source=f"bundled profile {bundled}"), **measured)
    raise ProfileError(
        f"unknown model {key!r}: not a bundled profile and no config.json there",
        key="model", fix=f"use one of {', '.join(BUNDLED)} or a path to a HuggingFace config.json",
    )


def _bundled_name(key: str) -> str | None:
    """``Qwen/Qwen3.6-27B`` and ``qwen3-next-80b-a3b-instruct`` name bundled profiles too (a sim launch passes
    SGLang's ``--model-path``, which is usually a HuggingFace id)."""
    name = key.lower().rstrip("/").rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-thinking", "-fp8"):
        name = name.removesuffix(suffix)
    return name if name in BUNDLED else None


def _load_config_file(path: Path) -> ModelProfile:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read it as JSON: {exc}", file=str(path)) from exc
    if not isinstance(config, dict):
        raise ProfileError("expected a JSON object", file=str(path))
    return from_hf_config(config, name=path.parent.name if path.name == "config.json" else path.stem,
                          source=str(path))


def _need(cfg: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ProfileError(f"missing required field {key!r}", file=source, key=key)
    value = cfg[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ProfileError(f"{key} must be a positive integer, got {value!r}", file=source, key=key)
    return value


def _model_type(config: dict[str, Any], cfg: dict[str, Any], source: str) -> tuple[str, str]:
    """(model_type, architecture), rejecting what the planner does not model."""
    model_type = str(config.get("model_type") or cfg.get("model_type") or "")
    archs = config.get("architectures") or cfg.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    if model_type not in HYBRID_TYPES + DENSE_TYPES:
        raise ProfileError(
            f"unsupported model_type {model_type or None!r} (architecture {arch or '?'})", file=source,
            key="model_type", fix=f"supported: {', '.join(('qwen3_5', 'qwen3_next') + DENSE_TYPES)}",
        )
    if "quantization_config" in cfg:
        raise ProfileError("quantized checkpoints are not modelled", file=source, key="quantization_config",
                           fix="point at the bf16 checkpoint's config.json")
    return model_type, arch


def _linear_attention(cfg: dict[str, Any], layers: int, source: str) -> tuple[int, int, int, int, int, int]:
    """(key heads, value heads, key dim, value dim, conv kernel, full-attention layers) of a hybrid model."""
    kh, vh = _need(cfg, "linear_num_key_heads", source), _need(cfg, "linear_num_value_heads", source)
    kd, vd = _need(cfg, "linear_key_head_dim", source), _need(cfg, "linear_value_head_dim", source)
    kernel = _need(cfg, "linear_conv_kernel_dim", source)
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == layers:
        full = sum(1 for t in layer_types if t == "full_attention")
    else:
        interval = _need(cfg, "full_attention_interval", source)
        full = sum(1 for i in range(layers) if (i + 1) % interval == 0)
    return kh, vh, kd, vd, kernel, full


def _mlp(cfg: dict[str, Any], hidden: int, source: str) -> tuple[int, int, int]:
    """(active FFN width per token, MLP params per layer in total, MLP params per layer active per token)."""
    experts = int(cfg.get("num_experts") or 0)
    if not experts:
        active_ffn = _need(cfg, "intermediate_size", source)
        return active_ffn, 3 * hidden * active_ffn, 3 * hidden * active_ffn
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    expert_ffn = _need(cfg, "moe_intermediate_size", source)
    shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0)
    active_ffn = top_k * expert_ffn + shared_ffn
    return active_ffn, 3 * hidden * (experts * expert_ffn + shared_ffn) + hidden * experts, 3 * hidden * active_ffn


def _vit_params(vision: dict[str, Any] | None) -> int:
    if not vision:
        return 0
    v_hidden = int(vision.get("hidden_size") or 0)
    v_ffn = int(vision.get("intermediate_size") or 4 * v_hidden)
    v_depth = int(vision.get("depth") or vision.get("num_hidden_layers") or 24)
    return v_depth * (4 * v_hidden * v_hidden + 2 * v_hidden * v_ffn)


def from_hf_config(config: dict[str, Any], *, name: str, source: str = "config.json") -> ModelProfile:
    """Build a profile from a HuggingFace config dict; weights are estimated from the parameter count."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    cfg = {**config, **text} if text else dict(config)
    model_type, arch = _model_type(config, cfg, source)
    hidden = _need(cfg, "hidden_size", source)
    layers = _need(cfg, "num_hidden_layers", source)
    heads = _need(cfg, "num_attention_heads", source)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = _need(cfg, "vocab_size", source)
    hybrid = model_type in HYBRID_TYPES
    kh, vh, kd, vd, kernel, full = _linear_attention(cfg, layers, source) if hybrid else (0, 0, 0, 0, 0, layers)
    linear = layers - full
    active_ffn, mlp_total, mlp_active = _mlp(cfg, hidden, source)
    gate = 2 if hybrid else 1  # Qwen3.5/Next full attention has an output gate: q_proj is twice as wide
    attn = hidden * heads * head_dim * gate + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    conv_dim = vh * vd + 2 * kh * kd
    gdn = hidden * (2 * kh * kd + 2 * vh * vd + 2 * vh) + conv_dim * kernel + vh * vd * hidden
    embed = vocab * hidden
    tied = bool(cfg.get("tie_word_embeddings", False))
    body_total = full * (attn + mlp_total) + linear * (gdn + mlp_total)
    body_active = full * (attn + mlp_active) + linear * (gdn + mlp_active)
    lm_head = 0 if tied else embed
    mtp = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else None
    vit_params = _vit_params(vision)
    nbytes = int(dtype_bytes(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")))
    nbytes = 2 if nbytes == 4 else nbytes  # SGLang's dtype=auto serves fp32 checkpoints in bf16
    # One MTP layer = a full-attention decoder layer + the 2h→h fusion; SGLang loads its own embed/lm_head copy.
    draft_params = mtp * (attn + mlp_total + 2 * hidden * hidden) + (2 * embed if mtp else 0)
    streamed = (body_active + embed) * nbytes  # lm_head (or the tied table) is read once per step; lookups are not
    draft_streamed = mtp * (attn + mlp_active + 2 * hidden * hidden) * nbytes + embed * nbytes
    mixer_width = max(heads * head_dim * gate + 2 * kv_heads * head_dim, 2 * kh * kd + 2 * vh * vd + 2 * vh)
    # Live temporaries per prefill token: MLP gate/up + activation, six hidden-size buffers (residual, norms,
    # mixer and MLP outputs), the mixer's projections, and the GDN chunked scan's fp32 q/k/v + output.
    act = nbytes * (3 * active_ffn + 6 * hidden + mixer_width) + (4 * 2 * (conv_dim + vh * vd) if hybrid else 0)
    per_tok_attn = 4 * full * heads * head_dim * 1024  # attention over a ~1K context, both matmuls
    return ModelProfile(
        name=name, model_type=model_type, architecture=arch, num_layers=layers, full_layers=full,
        linear_layers=linear, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
        linear_k_heads=kh, linear_v_heads=vh, linear_k_dim=kd, linear_v_dim=vd, conv_kernel=kernel,
        ssm_dtype=str(cfg.get("mamba_ssm_dtype") or "float32"), hidden=hidden, ffn=active_ffn, vocab=vocab,
        mtp_layers=mtp,
        target_weights_gib=(body_total + embed + lm_head + vit_params) * nbytes / GIB,
        draft_weights_gib=draft_params * nbytes / GIB,
        streamed_weight_bytes=float(streamed), streamed_draft_bytes=float(draft_streamed if mtp else 0),
        flops_per_token=float(2 * (body_active + lm_head + (0 if lm_head else embed)) + per_tok_attn),
        draft_flops_per_token=float(2 * (mtp * (attn + mlp_active + 2 * hidden * hidden) + embed) if mtp else 0),
        context_len=int(cfg.get("max_position_embeddings") or 4096),
        multimodal=vision is not None, vit_hidden=int(vision.get("hidden_size") or 0) if vision else 0,
        vit_layers=int(vision.get("num_hidden_layers") or 24) if vision else 24,
        dtype_bytes=nbytes, extra_buffer_arch=hybrid,
        spec_defaults=(5, 4, 8) if model_type in ("llama", "mistral") else (3, 1, 4),
        act_bytes_per_token=float(act),
    )


def vit_factor(model: ModelProfile) -> float:
    """SGLang's VLM mem-fraction multiplier: 0.95 × clamp(1 − 0.1 × (complexity/ViT-L − 1), 0.8, 1.05)."""
    if not model.multimodal:
        return 1.0
    ratio = (model.vit_layers * model.vit_hidden**2) / (24 * 1024**2)
    return 0.95 * min(1.05, max(0.8, 1 - 0.1 * (ratio - 1)))
