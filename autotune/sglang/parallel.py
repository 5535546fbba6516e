"""How many GPUs one SGLang server spans, as SGLang 0.5.23 counts them.

A server runs ``tp_size × pp_size`` GPUs per data-parallel replica. ``--dp-size N`` starts N replicas (each its
own TP group, one router in front), so it multiplies the count, except with attention data parallelism
(``--attn-dp-size``, or the deprecated ``--enable-dp-attention`` with ``--dp-size``): those ranks split the
attention of one TP group and use no GPUs of their own. ``--nnodes`` spreads the count over nodes; this module
answers per node, since a launch on one host sees that node's GPUs only.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def group_line(gpus: tuple[int, ...]) -> str:
    """``GPU 3`` or ``GPUs 2,3``: how messages name a server's devices."""
    return f"GPU {gpus[0]}" if len(gpus) == 1 else "GPUs " + ",".join(str(g) for g in gpus)
