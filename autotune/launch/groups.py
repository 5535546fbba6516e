"""GPU pools and the groups servers get from them: ``--gpus`` text, aligned groups, and how labels name a group.

A pool ``0-7`` holds aligned groups: servers spanning 2 GPUs get ``0,1 / 2,3 / 4,5 / 6,7``, never ``1,2``, so the
groups of one size tile the pool and a server never straddles two workers' halves (on real nodes the aligned pairs
are also the ones NVLink pairs). A study whose every config spans ``s`` GPUs runs ``len(pool) // s`` workers, each
pinned to one group; one whose size varies runs ``len(pool) // smallest`` workers sharing the pool through the
per-device locks (``gpulocks``).
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.errors import ConfigError


def parse_gpus(text: str) -> list[int]:
    """``"0,1,2,3"``, ``"0-3"``, ``"0-3,6,7"`` → GPU indices; repeats, reversed ranges or words are a ConfigError."""
    gpus: list[int] = []
    parts = [p.strip() for p in str(text).split(",")]
    for part in parts:
        lo, dash, hi = part.partition("-")
        if not lo.strip().isdigit() or (dash and not hi.strip().isdigit()):
            raise ConfigError(
                f"cannot read GPU list {text!r}",
                key="--gpus",
                fix="write GPU indices like 0,1,2,3 or ranges like 0-3,6,7",
            )
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ConfigError(f"GPU range {part!r} runs backwards", key="--gpus", fix=f"write {last}-{first}")
        gpus.extend(range(first, last + 1))
    if len(set(gpus)) != len(gpus):
        raise ConfigError(
            f"GPU list {text!r} repeats a GPU",
            key="--gpus",
            fix="name each GPU once: two workers on one GPU would skew both",
        )
    return gpus


def aligned_groups(pool: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """The pool's groups of ``size`` GPUs, tiling it from its start (a remainder too small for one is left out)."""
    pool = tuple(pool)
    return [pool[i : i + size] for i in range(0, len(pool) - size + 1, size)] if size >= 1 else []


def group_label(gpus: Sequence[int]) -> str:
    """How tags, progress prefixes and reports name a group: ``3`` or ``0,1``."""
    return ",".join(str(g) for g in gpus)


def worker_groups(pool: Sequence[int], spans: Sequence[int]) -> tuple[list[tuple[int, ...]], bool]:
    """(each worker's GPUs, shared): one size → a worker pinned to each aligned group; sizes that vary → one worker
    per smallest group, every one of them given the whole pool (shared through the locks)."""
    sizes = sorted(set(spans)) or [1]
    fitting = [s for s in sizes if s <= len(pool)] or sizes[:1]
    if len(fitting) == 1:
        return aligned_groups(pool, fitting[0]), False
    return [tuple(pool)] * (len(pool) // fitting[0]), True
