"""The hybrid model families SGLang 0.5.23 serves, as data: which layers hold which state, and its shape.

Each family mirrors its SGLang config class (``srt/configs/<family>.py``: ``linear_layer_ids``,
``full_attention_layer_ids`` and ``mamba2_cache_params``); the state arithmetic mirrors
``srt/configs/mamba_utils.py`` (``Mamba2StateShape.create`` L195-245, ``KimiLinearStateShape.create``
L324-367). docs/sglang-memory.md §9 lists them with their lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from autotune.errors import ProfileError

Cfg = Mapping[str, Any]
Mixer = Literal["attention", "linear", "both"] | None
Mlp = Literal["dense", "moe"] | None


@dataclass(frozen=True)
class LinearState:
    """One linear-attention layer's cached state (conv + temporal), as SGLang shapes it per attention-TP rank."""

    kind: Literal["mamba2", "kda"]
    intermediate: int  # mamba2: the conv's value width; kda: num_heads × head_dim
    groups: int  # mamba2: n_groups (B/C groups, or GDN key heads); kda: key heads
    heads: int  # temporal-state heads
    head_dim: int
    state: int  # mamba2: ssm state size (GDN key dim); kda: key head dim
    conv_kernel: int
    dt_per_head: int = 1  # projections per head in in_proj (Mamba2 dt: 1; GDN a and b: 2), weights only

    def conv_dim(self, tp: int = 1) -> int:
        """Conv channels per rank (Mamba2: n_groups widened to a multiple of tp when it does not divide)."""
        if self.kind == "kda":
            return self.intermediate // tp + 2 * (self.groups * self.state // tp)
        groups = self.groups if self.groups % tp == 0 else self.groups + (tp - self.groups)
        return (self.intermediate + 2 * groups * self.state) // tp

    def conv_elems(self, tp: int = 1) -> int:
        return self.conv_dim(tp) * (self.conv_kernel - 1)

    def ssm_elems(self, tp: int = 1) -> int:
        heads = max(1, self.heads // tp)
        width = self.head_dim if self.kind == "kda" else self.state
        return heads * self.head_dim * width

    def mixer_params(self, hidden: int) -> int:
        """In/out projections and conv of one mixer (an estimate for checkpoints without an index)."""
        conv = self.conv_dim() * self.conv_kernel
        qk = 2 * self.groups * self.state
        return hidden * (qk + 2 * self.intermediate + self.dt_per_head * self.heads) + conv + self.intermediate * hidden


@dataclass(frozen=True)
class Family:
    """How one SGLang config class lays out its layers and sizes their state."""

    name: str
    model_types: tuple[str, ...]
    source: str  # the SGLang 0.5.23 config class and lines this entry mirrors
    layers: Callable[[Cfg, int], list[tuple[Mixer, Mlp]]]  # per layer: (mixer, MLP kind)
    state: Callable[[Cfg], LinearState] | None
    gated_attention: bool = False  # Qwen3.5/Next full attention has an output gate (q_proj twice as wide)
    mlp_matrices: int = 3  # SwiGLU gate/up/down; Nemotron-H's relu² MLP has 2
    qwen_sm100_override: bool = False  # ``model_overrides/qwen3_5.py`` L17-50 (trtllm_mha, page 64 on SM100)


def _int(cfg: Cfg, *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            return int(value)
    if default is None:
        raise ProfileError(f"missing required field {keys[0]!r}", key=keys[0])
    return default


def _moe(cfg: Cfg, i: int) -> Mlp:
    """MoE or dense MLP at layer ``i`` (first-k-dense, dense layer lists, decoder_sparse_step)."""
    experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    if not experts:
        return "dense"
    if i < _int(cfg, "first_k_dense_replace", "num_dense_layers", default=0):
        return "dense"
    if i in (cfg.get("mlp_only_layers") or ()):
        return "dense"
    return "moe"


def _qwen_layers(cfg: Cfg, n: int) -> list[tuple[Mixer, Mlp]]:
    """``qwen3_next.py`` L259-286: ``layer_types`` if given, else every ``full_attention_interval``-th layer."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        full = [t == "full_attention" for t in types]
    else:
        interval = _int(cfg, "full_attention_interval")
        full = [(i + 1) % interval == 0 for i in range(n)]
    return [("attention" if f else "linear", _moe(cfg, i)) for i, f in enumerate(full)]


_NEMOTRON_PATTERN = {"M": ("linear", None), "*": ("attention", None), "-": (None, "dense"), "E": (None, "moe")}
_NEMOTRON_TYPES = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_layers(cfg: Cfg, n: int) -> list[tuple[Mixer, Mlp]]:
    """``nemotron_h.py`` L195-209, L497-510: each block is one of Mamba, attention, MLP or MoE."""
    types = cfg.get("layers_block_type")
    pattern = (
        "".join(_NEMOTRON_TYPES.get(t, "?") for t in types)
        if isinstance(types, list)
        else str(cfg.get("hybrid_override_pattern") or "")
    )
    if not pattern or any(c not in _NEMOTRON_PATTERN for c in pattern):
        raise ProfileError(
            "hybrid_override_pattern must be made of 'M', '*', '-' and 'E'", key="hybrid_override_pattern"
        )
    return [_NEMOTRON_PATTERN[c] for c in pattern]  # type: ignore[misc]


def _typed_layers(linear: tuple[str, ...], full: tuple[str, ...]) -> Callable[[Cfg, int], list[tuple[Mixer, Mlp]]]:
    """Layers named by ``layer_types`` (LFM2: conv/full_attention; GraniteMoeHybrid: mamba/attention)."""

    def layers(cfg: Cfg, n: int) -> list[tuple[Mixer, Mlp]]:
        types = cfg.get("layer_types")
        if not isinstance(types, list) or len(types) != n:
            indices = set(cfg.get("attn_layer_indices") or cfg.get("full_attn_idxs") or ())
            types = [full[0] if i in indices else linear[0] for i in range(n)]
        out: list[tuple[Mixer, Mlp]] = []
        for i, t in enumerate(types):
            if t not in linear + full:
                raise ProfileError(
                    f"layer_types[{i}] is {t!r}", key="layer_types", fix=f"use {' or '.join(linear + full)}"
                )
            out.append(("linear" if t in linear else "attention", _moe(cfg, i)))
        return out

    return layers


def _kimi_layers(cfg: Cfg, n: int) -> list[tuple[Mixer, Mlp]]:
    """``kimi_linear.py`` L158-171: ``linear_attn_config.kda_layers`` (1-based) are KDA, the rest MLA."""
    kda = set((cfg.get("linear_attn_config") or {}).get("kda_layers") or ())
    return [("linear" if i + 1 in kda else "attention", _moe(cfg, i)) for i in range(n)]


def _gdn(cfg: Cfg) -> LinearState:
    """``qwen3_next.py`` L288-313 (Qwen3.5/3.6 text configs subclass it, ``qwen3_5.py`` L15, L119)."""
    vh, vd = _int(cfg, "linear_num_value_heads"), _int(cfg, "linear_value_head_dim")
    return LinearState(
        kind="mamba2",
        intermediate=vh * vd,
        groups=_int(cfg, "linear_num_key_heads"),
        heads=vh,
        head_dim=vd,
        state=_int(cfg, "linear_key_head_dim"),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim"),
        dt_per_head=2,
    )


def _nemotron_state(cfg: Cfg) -> LinearState:
    """``nemotron_h.py`` L425-439."""
    heads, dim = _int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim")
    return LinearState(
        kind="mamba2",
        intermediate=heads * dim,
        groups=_int(cfg, "n_groups", "mamba_n_groups"),
        heads=heads,
        head_dim=dim,
        state=_int(cfg, "ssm_state_size"),
        conv_kernel=_int(cfg, "conv_kernel", "mamba_d_conv", default=4),
    )


def _falcon_state(cfg: Cfg) -> LinearState:
    """``falcon_h1.py`` L211-229 (mamba_intermediate, mamba_d_head "auto"), L302-315."""
    hidden = _int(cfg, "hidden_size")
    inter = _int(cfg, "mamba_d_ssm", default=_int(cfg, "mamba_expand", default=2) * hidden)
    heads = _int(cfg, "mamba_n_heads")
    head = cfg.get("mamba_d_head")
    return LinearState(
        kind="mamba2",
        intermediate=inter,
        groups=_int(cfg, "mamba_n_groups", default=1),
        heads=heads,
        head_dim=inter // heads if head in (None, "auto") else int(head),
        state=_int(cfg, "mamba_d_state"),
        conv_kernel=_int(cfg, "mamba_d_conv", default=4),
    )


def _granite_state(cfg: Cfg) -> LinearState:
    """``granitemoehybrid.py`` L239 (mamba_intermediate_size = expand × hidden), L298-310."""
    return LinearState(
        kind="mamba2",
        intermediate=_int(cfg, "mamba_expand", default=2) * _int(cfg, "hidden_size"),
        groups=_int(cfg, "mamba_n_groups", default=1),
        heads=_int(cfg, "mamba_n_heads"),
        head_dim=_int(cfg, "mamba_d_head"),
        state=_int(cfg, "mamba_d_state"),
        conv_kernel=_int(cfg, "mamba_d_conv", default=4),
    )


def _short_conv_state(cfg: Cfg) -> LinearState:
    """``lfm2.py`` L59-97, ``lfm2_moe.py`` L49-85: conv state only (state_size 0), over the hidden width."""
    hidden = _int(cfg, "hidden_size")
    return LinearState(
        kind="mamba2",
        intermediate=hidden,
        groups=1,
        heads=1,
        head_dim=hidden,
        state=0,
        conv_kernel=_int(cfg, "conv_L_cache", default=3),
    )


def _kda_state(cfg: Cfg) -> LinearState:
    """``kimi_linear.py`` L173-182 → ``KimiLinearStateShape.create`` (key heads and dim default to the value's)."""
    la = cfg.get("linear_attn_config") or {}
    heads, dim = int(la.get("num_heads") or 0), int(la.get("head_dim") or 0)
    if heads <= 0 or dim <= 0:
        raise ProfileError("linear_attn_config needs num_heads and head_dim", key="linear_attn_config")
    return LinearState(
        kind="kda",
        intermediate=heads * dim,
        groups=heads,
        heads=heads,
        head_dim=dim,
        state=dim,
        conv_kernel=int(la.get("short_conv_kernel_size") or 4),
    )


FAMILIES: tuple[Family, ...] = (
    Family(
        name="qwen3_5",
        model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        source="srt/configs/qwen3_5.py L15-138 (subclasses Qwen3NextConfig)",
        layers=_qwen_layers,
        state=_gdn,
        gated_attention=True,
        qwen_sm100_override=True,
    ),
    Family(
        name="qwen3_next",
        model_types=("qwen3_next",),
        source="srt/configs/qwen3_next.py L259-313",
        layers=_qwen_layers,
        state=_gdn,
        gated_attention=True,
        qwen_sm100_override=True,
    ),
    Family(
        name="nemotron_h",
        model_types=("nemotron_h",),
        source="srt/configs/nemotron_h.py L195-209, L409-439",
        layers=_nemotron_layers,
        state=_nemotron_state,
        mlp_matrices=2,
    ),
    Family(
        name="falcon_h1",
        model_types=("falcon_h1",),
        source="srt/configs/falcon_h1.py L288-315",
        layers=lambda cfg, n: [("both", "dense")] * n,
        state=_falcon_state,
    ),
    Family(
        name="lfm2",
        model_types=("lfm2", "lfm2_moe"),
        source="srt/configs/lfm2.py L42-97, lfm2_moe.py L28-85",
        layers=_typed_layers(("conv", "short_conv"), ("full_attention",)),
        state=_short_conv_state,
    ),
    Family(
        name="granitemoehybrid",
        model_types=("granitemoehybrid",),
        source="srt/configs/granitemoehybrid.py L279-310",
        layers=_typed_layers(("mamba",), ("attention",)),
        state=_granite_state,
    ),
    Family(
        name="kimi_linear",
        model_types=("kimi_linear",),
        source="srt/configs/kimi_linear.py L158-182",
        layers=_kimi_layers,
        state=_kda_state,
    ),
    Family(
        name="dense",
        model_types=("llama", "qwen2", "qwen3", "mistral"),
        source="no linear-attention state",
        layers=lambda cfg, n: [("attention", _moe(cfg, i)) for i in range(n)],
        state=None,
    ),
)
# Hybrid families with a public config.json that SGLang 0.5.23 does not serve (no config class, no model file).
NOT_IN_SGLANG = {"jamba": "SGLang 0.5.23 has no Jamba model (no srt/models/jamba.py)"}
# ``srt/arg_groups/overrides.py`` L403-430: architectures whose Mamba radix cache may take extra_buffer.
EXTRA_BUFFER_ARCHS = frozenset(
    {
        "KimiLinearForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3NextForCausalLM",
        "FalconH1ForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "NemotronHForCausalLM",
    }
)


def family_of(model_type: str) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def supported_types() -> list[str]:
    return [t for f in FAMILIES for t in f.model_types]
