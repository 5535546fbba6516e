"""GPU profiles: what the device reports (total memory, compute capability) and its roofline figures.

Memory is ``nvidia-smi --query-gpu=memory.total`` in MiB, as SGLang's mem-fraction tiers read it; bandwidth and
dense bf16 FLOP/s are the vendors' datasheet figures. Sources per row: docs/sglang-memory.md §10.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from autotune.errors import ProfileError

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    """One GPU model: what nvidia-smi reports and the roofline figures."""

    name: str
    memory_mib: int  # nvidia-smi memory.total (what SGLang's mem-fraction heuristic reads)
    bandwidth: float  # HBM bytes/s
    peak_flops: float  # dense bf16 FLOP/s
    arch: str  # SGLang's platform class: sm100 (capability 10.x), sm90, sm89, sm80, sm120, or rocm
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability (gfx major for ROCm: (9, 4) is gfx942)
    cuda_context_gib: float = 0.5
    device_names: tuple[str, ...] = ()  # substrings of the NVML/rocm-smi name this profile stands for

    @property
    def memory_gib(self) -> float:
        return self.memory_mib * MIB / GIB

    def tier(self, tp: int = 1) -> tuple[int, int]:
        """SGLang's defaults by nvidia-smi size: (chunked_prefill_size, decode cuda-graph max bs)
        (``srt/arg_groups/memory_hook.py``; docs/sglang-memory.md §2)."""
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

    @property
    def default_attention_backend(self) -> str:
        """``get_default_attn_backend`` for an MHA model (``srt/arg_groups/model_override_base.py`` L277-334):
        fa3 on Hopper, aiter on ROCm, else flashinfer (SM100's trtllm_mha comes from the model overrides)."""
        return {"sm90": "fa3", "rocm": "aiter"}.get(self.arch, "flashinfer")


def _gpu(name: str, mib: int, bw: float, flops: float, arch: str, cap: tuple[int, int], *names: str) -> GpuProfile:
    return GpuProfile(
        name=name, memory_mib=mib, bandwidth=bw, peak_flops=flops, arch=arch, capability=cap, device_names=names
    )


GPUS: dict[str, GpuProfile] = {
    "b200": _gpu("b200", 183_359, 8.0e12, 2.25e15, "sm100", (10, 0), "B200"),
    "b300": _gpu("b300", 275_040, 8.0e12, 2.25e15, "sm100", (10, 3), "B300"),
    "gb200": _gpu("gb200", 189_471, 8.0e12, 2.5e15, "sm100", (10, 0), "GB200"),
    "h200": _gpu("h200", 143_771, 4.8e12, 0.99e15, "sm90", (9, 0), "H200"),
    "h100": _gpu("h100", 81_559, 3.35e12, 0.99e15, "sm90", (9, 0), "H100"),
    "h20": _gpu("h20", 97_871, 4.0e12, 0.148e15, "sm90", (9, 0), "H20"),
    "a100-80g": _gpu("a100-80g", 81_920, 2.039e12, 0.312e15, "sm80", (8, 0), "A100-SXM4-80GB", "A100 80GB", "A100"),
    "l40s": _gpu("l40s", 46_068, 0.864e12, 0.362e15, "sm89", (8, 9), "L40S"),
    "rtx-pro-6000": _gpu("rtx-pro-6000", 97_887, 1.792e12, 0.5e15, "sm120", (12, 0), "RTX PRO 6000"),
    "mi300x": _gpu("mi300x", 196_288, 5.3e12, 1.307e15, "rocm", (9, 4), "MI300X"),
}
_ALIASES = {"a100": "a100-80g", "rtx-pro-6000-blackwell": "rtx-pro-6000", "rtxpro6000": "rtx-pro-6000"}


def load_gpu(name: str, *, memory_mib: int | None = None) -> GpuProfile:
    """A bundled GPU profile by name, optionally with another total memory (MiB)."""
    key = str(name).strip().lower().removeprefix("nvidia-").removeprefix("nvidia ").replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise ProfileError(f"unknown GPU {name!r}", key="gpu", fix=f"use one of {', '.join(GPUS)}")
    gpu = GPUS[key]
    if memory_mib is not None:
        if int(memory_mib) <= 0:
            raise ProfileError(f"GPU memory must be positive, got {memory_mib}", key="memory_mib")
        gpu = replace(gpu, memory_mib=int(memory_mib))
    return gpu


def profile_for_device(device_name: str, total_mib: int, capability: tuple[int, int] | None = None) -> GpuProfile:
    """The profile of the GPU a real server runs on, from what NVML reports: the bundled profile whose name the
    device's matches (longest match wins: a GB200 is not a B200), with the device's own total memory; an unknown
    device gets the nearest architecture's roofline figures, named after the device."""
    text = re.sub(r"\s+", " ", device_name.upper())
    hits = [
        (len(alias), gpu)
        for gpu in GPUS.values()
        for alias in gpu.device_names
        if re.search(rf"(?<![A-Z0-9]){re.escape(alias.upper())}(?![0-9])", text)
    ]
    best = max(hits, key=lambda h: h[0])[1] if hits else None
    cap = (int(capability[0]), int(capability[1])) if capability else None
    if best is None:
        arch = _arch_of(cap) if cap else "sm90"
        similar = next((g for g in GPUS.values() if g.arch == arch), GPUS["h100"])
        slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
        best = replace(similar, name=slug, device_names=(device_name,))
    if cap and best.capability != cap:
        best = replace(best, capability=cap, arch=_arch_of(cap))
    return replace(best, memory_mib=int(total_mib))


def _arch_of(cap: tuple[int, int]) -> str:
    """SGLang's platform class of a CUDA compute capability (``srt/utils/common.py`` L292-330: ``is_sm100`` is
    major 10, ``is_hopper`` major 9)."""
    major, minor = cap
    if major == 10:
        return "sm100"
    if major == 9:
        return "sm90"
    if major == 12:
        return "sm120"
    if major == 8 and minor == 9:
        return "sm89"
    return "sm80"
