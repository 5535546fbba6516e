"""How many GPUs a study's servers can span, and whether its GPU pool holds them, known before any launch.

A server spans ``tp × pp × dp`` GPUs (``sglang.parallel.server_gpus``). A study whose fixed flags, baseline or
enqueued configs span more GPUs than the pool it is given (``[engine] gpus``, or ``sweep --gpus``), or whose space
can only propose configs larger than it, would spend its whole budget on servers that cannot start: that is one
line on load. A space that *varies* the size keeps its larger configs; the sweep skips those the pool cannot hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from autotune.errors import ConfigError
from autotune.sglang.parallel import server_gpus

# The flags that decide a server's GPU count (dest names, as the space and fixed flags hold them).
SIZE_FLAGS = ("tp_size", "pp_size", "dp_size", "attn_dp_size", "enable_dp_attention", "nnodes")
_MAX_COMBOS = 4096  # a space's size flags are a handful of small choices; past this, sample the corners


def _values(spec: Any) -> list[Any]:
    """The values a space parameter can take (int ranges by their step; floats are not sizes)."""
    if spec.choices is not None:
        return list(spec.choice_values)
    if spec.kind == "int":
        step = int(spec.step or 1)
        values = list(range(int(spec.low), int(spec.high) + 1, step))
        return values if len(values) <= 64 else [values[0], values[-1]]
    return [spec.low, spec.high]


def space_spans(fixed: Mapping[str, Any], space: Mapping[str, Any]) -> list[int]:
    """Every GPU count a config of this space (over ``fixed``) can span, ascending."""
    names = [n for n in SIZE_FLAGS if n in space]
    grids = [_values(space[n]) for n in names]
    combos: Iterable[tuple[Any, ...]] = itertools.product(*grids)
    sizes = set()
    for k, combo in enumerate(combos):
        if k >= _MAX_COMBOS:
            break
        config = {**fixed, **{n: v for n, v in zip(names, combo, strict=True) if v is not None}}
        sizes.add(server_gpus(config))
    return sorted(sizes) or [server_gpus(fixed)]


def study_spans(cfg: Any) -> list[int]:
    """GPU counts a study's servers span: its space's, and its baseline's and enqueued configs'."""
    given = {server_gpus(c) for c in cfg.given_configs()}
    return sorted(set(space_spans(cfg.engine.fixed, cfg.space)) | given)


def sweep_gpus(cfg: Any) -> tuple[int, ...]:
    """The GPUs a sweep may use: its pool (``[engine] gpus``), else as many as its largest server spans, counted up
    from ``[engine] gpu``."""
    eng = cfg.engine
    return eng.pool or tuple(range(eng.first_gpu, eng.first_gpu + max(study_spans(cfg))))


def check_pool(cfg: Any, pool: tuple[int, ...] | None, *, file: str | None, key: str = "engine.gpus") -> None:
    """ConfigError when ``pool`` cannot hold the study: a given config (fixed flags, baseline, enqueued) spans
    more GPUs than it has, or the space proposes nothing small enough. None: no pool, nothing to check."""
    if pool is None:
        return
    n = len(pool)
    for role, label, config in cfg.given():
        need = server_gpus(config)
        if need > n:
            what = (
                "the fixed flags"
                if role == "baseline" and need == server_gpus(cfg.engine.fixed)
                else f"the {role} config {label!r}"
            )
            raise ConfigError(
                f"{what} span {need} GPUs (tp_size × pp_size × dp_size) but the pool has {n} "
                f"({','.join(map(str, pool))})",
                file=file,
                key=key,
                fix=f"give at least {need} GPUs, or lower tp_size/pp_size/dp_size",
            )
    spans = space_spans(cfg.engine.fixed, cfg.space)
    if min(spans) > n:
        raise ConfigError(
            f"every config of [space] spans at least {min(spans)} GPUs but the pool has {n}",
            file=file,
            key=key,
            fix=f"give at least {min(spans)} GPUs, or let [space] propose smaller tp_size/pp_size/dp_size",
        )
