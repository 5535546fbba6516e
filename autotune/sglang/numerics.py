"""Which SGLang 0.5.23 flags change a model's outputs (``NUMERICS_FLAGS``, each with its reference value and why),
which do not though one might suspect them (``NOT_NUMERICS``), and which flags of a config differ from a reference.
The table says where to expect a difference; it measures none. docs/numerics.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import ConfigError
from autotune.sglang.flags import FlagTable

__all__ = [
    "NOT_NUMERICS",
    "NUMERICS_FLAGS",
    "NumericsChange",
    "NumericsFlag",
    "changes_numerics",
    "not_numerics_reason",
    "numerics_flag",
    "reference_config",
]


@dataclass(frozen=True, kw_only=True)
class NumericsFlag:
    """One output-changing flag: its reference value, the values that differ from it, and why."""

    dest: str
    reference: Any  # what SGLang 0.5.23 does when the flag is unset (the numerically reference value)
    values: tuple[Any, ...] | None  # values that change outputs; None: any value other than the reference
    why: str
    only_with: str | None = None  # the setting without which the flag is inert (no effect on any output)
    aliases: Mapping[Any, Any] = field(default_factory=dict)  # spellings SGLang treats as the same value

    def canonical(self, value: Any) -> Any:
        """``value`` with ``None`` (unset) read as the reference and synonyms folded (``half`` → ``float16``)."""
        if value is None:
            return self.reference
        return self.aliases.get(value, value)


NUMERICS_FLAGS: tuple[NumericsFlag, ...] = (
    NumericsFlag(
        dest="mamba_ssm_dtype",
        reference="float32",
        values=("bfloat16", "float16"),
        why="dtype of the Gated-DeltaNet/Mamba recurrent state. The state is rewritten at every decoded token, "
        "so its rounding error accumulates along the sequence. Unset means the model config's "
        "mamba_ssm_dtype, float32 for Qwen3-Next and Qwen3.5/3.6 (SGLang's own fallback is float32)",
        only_with="a hybrid Mamba/GDN model",
    ),
    NumericsFlag(
        dest="kv_cache_dtype",
        reference="auto",
        values=("fp8_e5m2", "fp8_e4m3", "mxfp8", "nvfp4", "fp4_mx_block16", "bf16"),
        why="precision of the stored keys and values every later token attends to. auto stores them in the "
        "model dtype; bf16 equals auto only on a bfloat16 checkpoint, so it is listed (conservatively)",
        aliases={"bfloat16": "bf16"},
    ),
    NumericsFlag(
        dest="quantization",
        reference=None,
        values=None,
        why="quantised weights (and for w8a8/fp8 methods, activations): every matmul changes. Unset means the "
        "checkpoint's own precision",
    ),
    NumericsFlag(
        dest="dtype",
        reference="auto",
        values=("float16", "bfloat16", "float32"),
        why="dtype of weights and activations. auto is the checkpoint's torch_dtype (bfloat16 for the bundled "
        "models), so bfloat16 equals auto there; higher precision (float32) changes outputs too",
        aliases={"half": "float16", "float": "float32"},
    ),
    NumericsFlag(
        dest="quantization_param_path",
        reference=None,
        values=None,
        why="per-layer scaling factors for an fp8 KV cache: they change how keys and values are rounded",
        only_with="an fp8 KV cache (--kv-cache-dtype fp8_*)",
    ),
    NumericsFlag(
        dest="modelopt_quant",
        reference=None,
        values=None,
        why="NVIDIA ModelOpt quantises the weights at load time",
    ),
    NumericsFlag(
        dest="enable_fp32_lm_head",
        reference=False,
        values=(True,),
        why="logits computed in float32 instead of the model dtype: nearly tied top tokens can swap. Higher "
        "precision than the reference is still a different output",
    ),
    NumericsFlag(
        dest="enable_tf32_matmul",
        reference=False,
        values=(True,),
        why="float32 matmuls run in TF32 (10-bit mantissa). Unset leaves PyTorch's default, TF32 off",
    ),
    NumericsFlag(
        dest="triton_attention_reduce_in_fp32",
        reference=False,
        values=(True,),
        why="the triton attention kernel reduces in float32 instead of the model dtype",
        only_with="the triton attention backend",
    ),
    NumericsFlag(
        dest="enable_mamba_cache_stochastic_rounding",
        reference=False,
        values=(True,),
        why="stochastic rounding of the float16 SSM state: outputs change, and vary from run to run",
        only_with="--mamba-ssm-dtype float16 on SM100",
    ),
    NumericsFlag(
        dest="enable_int8_mamba_checkpoint",
        reference=False,
        values=(True,),
        why="radix-cache Mamba checkpoints stored in int8: a request that reuses a cached prefix resumes from a "
        "quantised state",
        only_with="a hybrid Mamba/GDN model with the radix cache on",
    ),
    NumericsFlag(
        dest="enable_quant_communications",
        reference=False,
        values=(True,),
        why="tensor-parallel collectives carry quantised activations",
        only_with="tp_size > 1",
    ),
    NumericsFlag(
        dest="prefill_kv_cache_dequant_dtype",
        reference="auto",
        values=("nvfp4", "fp8_e4m3"),
        why="precision the KV cache is dequantised to for prefill attention",
    ),
    NumericsFlag(
        dest="flashinfer_mxfp4_moe_precision",
        reference="default",
        values=("bf16", "fp8"),
        why="activation precision of flashinfer's mxfp4 MoE kernels",
        only_with="an mxfp4 MoE checkpoint",
    ),
    NumericsFlag(
        dest="deepep_dispatcher_output_dtype",
        reference="auto",
        values=("bf16", "fp8", "int8", "nvfp4"),
        why="dtype tokens are sent to experts in: fp8/int8/nvfp4 quantise the expert inputs",
        only_with="DeepEP expert parallelism",
    ),
    NumericsFlag(
        dest="flashinfer_a2a_dispatch_type",
        reference=None,
        values=("bf16", "nvfp4", "mxfp8"),
        why="dtype of flashinfer's all-to-all expert dispatch: nvfp4/mxfp8 quantise the expert inputs",
        only_with="flashinfer all-to-all expert parallelism",
        aliases={"auto": None},
    ),
    NumericsFlag(
        dest="qsa_indexer_dtype",
        reference="auto",
        values=("bfloat16", "fp8_e4m3"),
        why="precision of the sparse-attention indexer, which decides which tokens are attended",
        only_with="a QSA sparse-attention model",
    ),
)

# Flags one might expect in the table, and why they are not there. A key ending in ``*`` is a prefix.
NOT_NUMERICS: dict[str, str] = {
    "speculative_*": "speculative decoding is lossless for greedy requests: the target model verifies every "
    "draft token and keeps only its own argmax, so the draft's dtype, quantisation and depth change "
    "the acceptance rate, never the tokens (the accept thresholds relax verification of sampled "
    "requests only)",
    "max_running_requests": "scheduling only: how many requests share a batch",
    "chunked_prefill_size": "scheduling only: how a long prompt is split across forward passes",
    "schedule_policy": "scheduling only: the order waiting requests are admitted in",
    "disable_radix_cache": "prefix reuse only: a cache hit skips recomputing the same prefix at the same precision",
    "mamba_radix_cache_strategy": "prefix reuse only: where Mamba states are checkpointed, not their precision",
    "speculative_adaptive": "speculation depth only: steps chosen per batch size move the acceptance and the speed; "
    "the target still verifies every draft token, so greedy tokens are the same (see "
    "speculative_*)",
    "enable_unified_memory": "memory layout only: the same KV cache and Mamba state, in the same dtypes, stored in one "
    "arena and read through a virtual-to-physical table (FP4 KV, the one precision change it "
    "could meet, is refused with it)",
    "mamba_track_interval": "prefix reuse only: how often decoding snapshots a Mamba state for the radix cache "
    "(a copy in the pool's own dtype), not its precision",
    "mamba_max_states_per_path": "prefix reuse only: how many cached Mamba states a path keeps; a dropped one is "
    "recomputed at the same precision",
    "max_mamba_cache_size": "memory only: how many Mamba state slots exist",
    "mamba_full_memory_ratio": "memory only: the split between Mamba state and KV cache",
    "mem_fraction_static": "memory only: how much of the GPU the pools take",
    "max_total_tokens": "memory only: the KV pool's size",
    "cuda_graph_*": "replays the same kernels at the same precision",
    "disable_overlap_schedule": "scheduling only: CPU work overlapped with the GPU or not",
    "attention_backend": "kernel choice at the same precision: only the order of floating-point sums changes, the "
    "same order of effect as a different batch size (noise a probe must tolerate)",
    "moe_runner_backend": "kernel choice at the same precision (see attention_backend)",
    "fp8_gemm_runner_backend": "kernel choice for fp8 GEMMs: the precision is set by --quantization or the "
    "checkpoint; the backend changes only the order of sums (see attention_backend)",
    "fp4_gemm_runner_backend": "kernel choice for fp4 GEMMs (see fp8_gemm_runner_backend)",
    "tp_size": "same precision split across GPUs: only the all-reduce order changes (see attention_backend)",
    "enable_deterministic_inference": "batch-invariant kernels at the same precision: it removes batch-dependent "
    "summation noise rather than adding error",
    "sampling_backend": "sampled requests only: a greedy token is the argmax whatever the sampler",
    "random_seed": "sampled requests only",
    "torchao_config": "not a flag of SGLang 0.5.23 (its parser has no --torchao-config)",
}

_BY_DEST = {flag.dest: flag for flag in NUMERICS_FLAGS}


@dataclass(frozen=True, kw_only=True)
class NumericsChange:
    """One flag of a config whose value changes outputs against the reference config."""

    flag: str  # SGLang dest name
    value: Any  # the config's effective value (unset read as SGLang's reference)
    reference: Any  # the reference config's effective value
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, "reference": self.reference, "why": self.why}


def numerics_flag(dest: str) -> NumericsFlag | None:
    """The table's entry for ``dest``, or None when the flag does not change outputs."""
    return _BY_DEST.get(dest)


def not_numerics_reason(dest: str) -> str | None:
    """Why ``dest`` is not in the table, when it is one of the flags considered and left out."""
    if dest in NOT_NUMERICS:
        return NOT_NUMERICS[dest]
    for key, reason in NOT_NUMERICS.items():
        if key.endswith("*") and dest.startswith(key[:-1]):
            return reason
    return None


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name} must be a mapping of SGLang flag names (dest) to values, got {type(value).__name__}",
            key=name,
            fix="pass a dict such as {'kv_cache_dtype': 'fp8_e4m3'}",
        )
    return value


def _references(defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each flag's reference value, with ``defaults`` (e.g. a model's own ``mamba_ssm_dtype``) replacing it."""
    given = _mapping(defaults, "defaults")
    unknown = sorted(set(given) - set(_BY_DEST))
    if unknown:
        raise ConfigError(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not in the numerics table",
            key="defaults",
            fix=f"use flags among {', '.join(_BY_DEST)}",
        )
    table = FlagTable.bundled()
    out = {}
    for flag in NUMERICS_FLAGS:
        value = table.coerce(flag.dest, given[flag.dest]) if given.get(flag.dest) is not None else None
        out[flag.dest] = flag.reference if value is None else flag.canonical(value)
    return out


def reference_config(defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every table flag at its reference value: the config against which outputs are "unchanged"."""
    return _references(defaults)


def _effective(config: Mapping[str, Any], references: dict[str, Any], table: FlagTable) -> dict[str, Any]:
    out = {}
    for flag in NUMERICS_FLAGS:
        raw = config.get(flag.dest)
        value = None if raw is None or raw is False else table.coerce(flag.dest, raw)
        out[flag.dest] = references[flag.dest] if value is None else flag.canonical(value)
    return out


def changes_numerics(
    config: Mapping[str, Any], reference: Mapping[str, Any] | None = None, *, defaults: Mapping[str, Any] | None = None
) -> list[NumericsChange]:
    """The flags of ``config`` whose effective value differs from ``reference``'s, in table order.

    Both are dest-keyed configs (``{"kv_cache_dtype": "fp8_e4m3"}``); a flag absent, ``None`` or ``False`` means
    SGLang's reference value, and ``reference=None`` means SGLang's defaults. ``defaults`` replaces a reference
    value where the model decides it (``{"mamba_ssm_dtype": profile.ssm_dtype}``). Values are checked against
    SGLang 0.5.23's choices: a bad one raises ``ConfigError`` naming the flag and the allowed values.
    """
    config = _mapping(config, "config")
    references = _references(defaults)
    table = FlagTable.bundled()
    mine = _effective(config, references, table)
    theirs = _effective(_mapping(reference, "reference"), references, table)
    return [
        NumericsChange(flag=flag.dest, value=mine[flag.dest], reference=theirs[flag.dest], why=flag.why)
        for flag in NUMERICS_FLAGS
        if mine[flag.dest] != theirs[flag.dest]
    ]
