"""How many GPUs one SGLang server spans, as SGLang 0.5.23 counts them (``tp × pp`` per replica, × ``dp`` except
with attention DP, per node), and which device ordinal each scheduler opens. docs/sglang-memory.md §9,
docs/study-file.md ("Servers over several GPUs").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    try:
        return max(1, int(value)) if value not in (None, "") else 1
    except (TypeError, ValueError):
        return 1


def attention_dp(config: Mapping[str, Any]) -> bool:
    """True when ``dp_size`` means attention data parallelism (inside the TP group), not replicas."""
    return bool(config.get("enable_dp_attention")) or _int(config, "attn_dp_size") > 1


def server_gpus(config: Mapping[str, Any]) -> int:
    """The GPUs one server with ``config`` (dest-keyed SGLang flags) needs on each of its nodes."""
    size = _int(config, "tp_size") * _int(config, "pp_size")
    if not attention_dp(config):
        size *= _int(config, "dp_size")
    nodes = _int(config, "nnodes")
    return max(1, size // nodes) if size % nodes == 0 else size


def requests_per_dp(requested: int, config: Mapping[str, Any]) -> int:
    """The running-request cap each DP worker gets from ``--max-running-requests`` (SGLang divides it over the
    attention DP ranks: ``srt/model_executor/pool_configurator.py`` L956, ``max_running_requests // attn_dp_size``);
    the one rule the diagnosis and a trial's granted cap both use."""
    dp = int(config.get("attn_dp_size") or config.get("dp_size") or 1)
    return int(requested) // max(1, dp)


@dataclass(frozen=True)
class Rank:
    """One scheduler process of a server on this node: its parallel ranks and the device ordinal it opens."""

    tp: int
    pp: int
    dp: int | None  # None without data parallelism
    gpu_id: int

    def label(self, config: Mapping[str, Any]) -> str:
        """SGLang's log prefix for this scheduler (``DP1 TP0``, ``PP1 TP1``; empty for a single rank)."""
        parts = [f"DP{self.dp}"] if self.dp is not None else []
        if _int(config, "pp_size") > 1:
            parts.append(f"PP{self.pp}")
        if _int(config, "tp_size") > 1:
            parts.append(f"TP{self.tp}")
        return " ".join(parts)


def ranks(config: Mapping[str, Any]) -> list[Rank]:
    """Every scheduler node 0 starts for ``config``, in SGLang's launch order (replica, pp rank, tp rank)."""
    tp, pp, dp, nodes = (_int(config, k) for k in ("tp_size", "pp_size", "dp_size", "nnodes"))
    step, base = _int(config, "gpu_id_step"), int(config.get("base_gpu_id") or 0)
    nodes_per_group = max(nodes // pp, 1)
    tp_node, pp_node = max(tp // nodes_per_group, 1), max(pp // nodes, 1)
    attn_dp = attention_dp(config)
    attn_size = _int(config, "attn_dp_size") if _int(config, "attn_dp_size") > 1 else dp
    replicas = 1 if attn_dp else dp
    out = []
    for replica in range(replicas):
        offset = replica * tp * pp * step
        for pp_rank in range(pp_node):
            for tp_rank in range(tp_node):
                if attn_dp:  # compute_dp_attention_world_info: consecutive tp ranks share one attention-DP rank
                    dp_rank: int | None = tp_rank // max(1, tp // attn_size)
                else:
                    dp_rank = replica if dp > 1 else None
                gpu = base + offset + (pp_rank % pp_node) * tp_node + (tp_rank % tp_node) * step
                out.append(Rank(tp=tp_rank, pp=pp_rank, dp=dp_rank, gpu_id=gpu))
    return out


def pp_stage(layers: int, full: int, pp: int) -> tuple[int, int]:
    """(layers, full-attention layers) of the fullest pipeline stage of a model with ``layers`` layers, ``full``
    of them full attention: the rank a memory plan is for.

    ``get_pp_indices`` (``srt/distributed/utils.py``) gives every stage ``layers // pp`` layers and the last
    ``layers % pp`` stages one more; Qwen hybrids put full attention on every k-th layer (k = layers / full), and
    a stage holds those whose ids fall in its range (``pool_configurator.py``: ``start_layer <= i < end_layer``)."""
    if pp <= 1 or layers <= 0:
        return layers, full
    base, extra = divmod(layers, pp)
    stages, start = [], 0
    for index in range(pp):
        size = base + (1 if index >= pp - extra else 0)
        if full and layers % full == 0:
            held = sum(1 for i in range(start, start + size) if (i + 1) % (layers // full) == 0)
        else:
            held = -(-full * size // layers)
        stages.append((size, held))
        start += size
    return max(stages)


def group_line(gpus: tuple[int, ...]) -> str:
    """``GPU 3`` or ``GPUs 2,3``: how messages name a server's devices."""
    return f"GPU {gpus[0]}" if len(gpus) == 1 else "GPUs " + ",".join(str(g) for g in gpus)
