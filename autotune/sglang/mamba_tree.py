"""How much Mamba state SGLang 0.5.23's radix cache keeps on a shared prefix: ``--mamba-track-interval`` and
``--mamba-max-states-per-path``, their refusals, and the grids the simulator's radix cache saves states on.

Neither flag sizes a pool: the tracking copies a request reserves come from the strategy alone
(``allocation_sizing.py`` L11-19), so the memory plan and the running cap do not move with them. They change
which states the tree holds, so which prompt tokens a later request need not prefill, and how many state copies
decoding makes (docs/sglang-memory.md §1, "Mamba states on shared prefixes").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FLA_CHUNK_SIZE", "TRACK_INTERVAL_DEFAULT", "MambaTree", "mamba_tree_refusal", "resolve_mamba_tree"]

TRACK_INTERVAL_DEFAULT = 256  # ``mamba_track_interval``'s default, ``srt/arg_groups/fields/exec_.py`` L530-533
# The GDN scan's chunk: the model's mamba_chunk_size, else FLA's 64 (``overrides.py`` L1897-1927, L1914-1917).
FLA_CHUNK_SIZE = 64


def _cap(f: Mapping[str, Any]) -> int:
    raw = f.get("mamba_max_states_per_path")
    return -1 if raw is None else int(raw)


def mamba_tree_refusal(f: Mapping[str, Any], *, strategy: str, draft_tokens: int, spec: bool, page: int) -> str | None:
    """SGLang's own message where 0.5.23 refuses the two flags (the caller stops with ``bad_args``), else None:
    ``--mamba-max-states-per-path`` 0 or below -1 for every model (``handle_mamba_backend``,
    ``srt/arg_groups/mamba_hook.py`` L24-28, run for every server by ``pipeline.py`` L251); for the extra-buffer
    strategies, a track interval below the draft tokens or not a multiple of the page
    (``validate_mamba_extra_buffer``, ``mamba_hook.py`` L132-135, bare asserts)."""
    cap = _cap(f)
    if cap == 0 or cap < -1:
        return f"ValueError: --mamba-max-states-per-path must be -1 (unlimited) or a positive integer, got {cap}."
    extra_buffer = strategy.startswith("extra_buffer")
    interval = int(f.get("mamba_track_interval") or TRACK_INTERVAL_DEFAULT)
    if extra_buffer and spec and interval < draft_tokens:
        return (
            "AssertionError (sglang/srt/arg_groups/mamba_hook.py L133: assert view.mamba_track_interval >= "
            f"view.speculative_num_draft_tokens): --mamba-track-interval {interval} < "
            f"speculative_num_draft_tokens {draft_tokens}"
        )
    if extra_buffer and interval % page:
        return (
            "AssertionError (sglang/srt/arg_groups/mamba_hook.py L135: assert view.mamba_track_interval % "
            f"view.page_size == 0): --mamba-track-interval {interval} is not a multiple of page_size {page}"
        )
    return None


@dataclass(frozen=True, kw_only=True)
class MambaTree:
    """The radix cache's Mamba-state levers as resolved: whether states are cached in the tree at all, the grids a
    prefill and decoding save them on (None unless extra_buffer tracks them), and the per-path cap."""

    mamba_tree: bool
    mamba_checkpoint_grid: int | None
    mamba_track_interval: int | None
    mamba_track_grid: int | None
    mamba_max_states_per_path: int | None

    def to_dict(self) -> dict[str, int | bool | None]:
        """As ``MemoryPlan.extra`` holds them (the keys are the fields')."""
        return dataclasses.asdict(self)


def resolve_mamba_tree(f: Mapping[str, Any], *, strategy: str, page: int, has_mamba: bool) -> MambaTree:
    """What the simulator's radix cache needs of the two flags (validated first: ``mamba_tree_refusal``)."""
    cap = _cap(f)
    extra_buffer = strategy.startswith("extra_buffer")
    interval = int(f.get("mamba_track_interval") or TRACK_INTERVAL_DEFAULT)
    tree = has_mamba and strategy not in ("none", "")
    tracked = tree and extra_buffer  # no_buffer saves each prompt's end and never reads the interval
    # A prefill saves its state on the checkpoint grid (``runtime_context.py`` L1966-1971: lcm of the cache chunk,
    # max(FLA chunk, page), and the page); decoding on the track grid, which also lands on the interval (L1974-1979).
    grid = math.lcm(max(FLA_CHUNK_SIZE, page), page)
    return MambaTree(
        mamba_tree=tree,
        mamba_checkpoint_grid=grid if tracked else None,
        mamba_track_interval=interval if tracked else None,
        mamba_track_grid=math.lcm(grid, interval) if tracked else None,
        mamba_max_states_per_path=cap if tree and cap > 0 else None,
    )
