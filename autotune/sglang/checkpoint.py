"""A checkpoint's bytes, read from its safetensors index or shard headers, and its quantization scheme.

The weights SGLang loads are the checkpoint's tensors, so the index's ``metadata.total_size`` (or the sum of
the shards' headers, which are a few KiB each) is exact for any precision; ``config.json`` arithmetic is the
fallback, named an estimate. MTP/NextN tensors are the draft's; vision tensors load with the target.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import ProfileError

INDEX_NAME = "model.safetensors.index.json"
_HEADER_LIMIT = 100 * 2**20  # safetensors caps its JSON header at 100 MB
# An ignore-list entry that leaves a whole mixer's input projection in 16 bits (a gate-only entry such as
# ``linear_attn.in_proj_ba`` or ``mixer.conv1d`` does not).
_MIXER_KEPT = re.compile(r"(linear_attn|mixer|mamba)(\.in_proj(_qkvz?)?)?$")
_DRAFT_MARKERS = ("mtp.", ".mtp.", "nextn", "model.mtp")
_VISION_MARKERS = ("visual.", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector")


@dataclass(frozen=True)
class Quantization:
    """Bytes per weight of the quantized linear layers, and what the checkpoint leaves in 16 bits."""

    method: str  # fp8, fp8-block, nvfp4, mxfp4, int4, int8, or none
    weight_bytes: float  # per element, scales included
    keeps_mixer: bool  # linear-attention / Mamba input projections left in 16 bits by the ignore list

    @property
    def quantized(self) -> bool:
        return self.method != "none"


NONE = Quantization(method="none", weight_bytes=2.0, keeps_mixer=False)


@dataclass(frozen=True)
class CheckpointBytes:
    """What the checkpoint's files say: total bytes, and the draft's and vision tower's share when known."""

    total: int
    draft: int | None  # MTP/NextN tensors; None when only the index (no sizes per tensor) was read
    vision: int | None
    has_draft_tensors: bool
    source: str  # "index" (metadata.total_size) or "headers" (summed shard headers)
    path: str


def quantization(cfg: dict[str, Any], source: str) -> Quantization:
    """The scheme in ``quantization_config`` (FP8 per-tensor or block, ModelOpt FP8/NVFP4, compressed-tensors,
    MXFP4, GPTQ/AWQ int4), as SGLang 0.5.23's loaders name them (``srt/layers/quantization/__init__.py``)."""
    q = cfg.get("quantization_config")
    if not q:
        return NONE
    if not isinstance(q, dict):
        raise ProfileError("quantization_config must be an object", file=source, key="quantization_config")
    method = str(q.get("quant_method") or "").lower()
    ignored = [
        str(x)
        for x in (
            q.get("ignore")
            or q.get("ignored_layers")
            or q.get("modules_to_not_convert")
            or q.get("exclude_modules")
            or []
        )
    ]
    keeps_mixer = any(_MIXER_KEPT.search(entry) for entry in ignored)
    if method == "fp8":
        block = q.get("weight_block_size")
        per = 4 / (block[0] * block[1]) if isinstance(block, list) and len(block) == 2 else 0.0
        return Quantization(method="fp8-block" if per else "fp8", weight_bytes=1 + per, keeps_mixer=keeps_mixer)
    if method in ("modelopt", "modelopt_fp4", "modelopt_fp8"):
        algo = str(q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo") or method).upper()
        if "FP4" in algo:
            return Quantization(method="nvfp4", weight_bytes=0.5 + 1 / 16, keeps_mixer=keeps_mixer)
        return Quantization(method="fp8", weight_bytes=1.0, keeps_mixer=keeps_mixer)
    if method == "mxfp4":
        return Quantization(method="mxfp4", weight_bytes=0.5 + 1 / 32, keeps_mixer=keeps_mixer)
    if method == "compressed-tensors":
        return _compressed_tensors(q, keeps_mixer)
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "auto-round"):
        bits, group = int(q.get("bits") or 4), int(q.get("group_size") or 128)
        per = (2 + bits / 8) / group if group > 0 else 0.0  # a 16-bit scale and a zero point per group
        return Quantization(method=f"int{bits}", weight_bytes=bits / 8 + per, keeps_mixer=keeps_mixer)
    raise ProfileError(
        f"quantization method {method or None!r} is not modelled",
        file=source,
        key="quantization_config.quant_method",
        fix="fp8, modelopt (FP8/NVFP4), compressed-tensors, mxfp4, gptq and awq are; or give the "
        "checkpoint's model.safetensors.index.json beside config.json",
    )


def _compressed_tensors(q: dict[str, Any], keeps_mixer: bool) -> Quantization:
    groups = q.get("config_groups") or {}
    weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")), None) or {}
    bits = int(weights.get("num_bits") or 8)
    group = int(weights.get("group_size") or 0)
    fmt = str(q.get("format") or "")
    if bits == 4 and ("nvfp4" in fmt or weights.get("type") == "float"):
        return Quantization(method="nvfp4", weight_bytes=0.5 + 1 / 16, keeps_mixer=keeps_mixer)
    per = 2 / group if group > 0 else 0.0
    name = "fp8" if bits == 8 and weights.get("type") == "float" else f"int{bits}"
    return Quantization(method=name, weight_bytes=bits / 8 + per, keeps_mixer=keeps_mixer)


def read_checkpoint(folder: Path) -> CheckpointBytes | None:
    """The checkpoint's bytes from ``folder``: shard headers when the shards are there (exact per tensor), else
    the index's ``total_size``; None when neither exists (a bare ``config.json``)."""
    index_path = folder / INDEX_NAME
    index: dict[str, Any] | None = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"cannot read it as JSON: {exc}", file=str(index_path)) from exc
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ProfileError("expected an object with a weight_map", file=str(index_path), key="weight_map")
    shards = (
        sorted({folder / str(f) for f in (index or {}).get("weight_map", {}).values()})
        if index
        else sorted(folder.glob("*.safetensors"))
    )
    if shards and all(s.is_file() for s in shards):
        return _from_headers(shards, folder)
    if index is None:
        return None
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, (int, float)) or isinstance(total, bool) or total <= 0:
        raise ProfileError(
            "metadata.total_size is missing or not a positive number",
            file=str(index_path),
            key="metadata.total_size",
            fix="regenerate the index, or put the shards beside it",
        )
    names = list(index["weight_map"])
    return CheckpointBytes(
        total=int(total),
        draft=None,
        vision=None,
        has_draft_tensors=any(_is_draft(n) for n in names),
        source="index",
        path=str(index_path),
    )


def _from_headers(shards: list[Path], folder: Path) -> CheckpointBytes:
    total = draft = vision = 0
    for shard in shards:
        for name, nbytes in _header_sizes(shard).items():
            total += nbytes
            if _is_draft(name):
                draft += nbytes
            elif any(m in name for m in _VISION_MARKERS):
                vision += nbytes
    return CheckpointBytes(
        total=total, draft=draft, vision=vision, has_draft_tensors=draft > 0, source="headers", path=str(folder)
    )


def _header_sizes(shard: Path) -> dict[str, int]:
    """Bytes per tensor from one shard's header (8-byte little-endian length, then JSON); the data is not read."""
    try:
        with shard.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > _HEADER_LIMIT:
                raise ProfileError(f"header of {length} bytes is larger than safetensors allows", file=str(shard))
            header = json.loads(fh.read(length))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"not a safetensors file: {exc}", file=str(shard)) from exc
    sizes: dict[str, int] = {}
    for name, meta in header.items():
        if name == "__metadata__" or not isinstance(meta, dict):
            continue
        begin, end = meta.get("data_offsets") or (0, 0)
        sizes[name] = int(end) - int(begin)
    return sizes


def _is_draft(name: str) -> bool:
    return name.startswith("mtp.") or any(m in name for m in _DRAFT_MARKERS)
