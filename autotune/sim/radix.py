"""SGLang's radix (prefix) cache, reduced to what decides throughput: which prompt tokens a request need not
prefill again, and how much KV (and Mamba state) the cached prefixes hold. Prefix matching is string matching on
the simulator's 4-character tokens (C-speed ``startswith``); what is modelled after SGLang 0.5.23's
``RadixCache`` / ``MambaRadixCache``, and what is not: docs/engines-and-launchers.md ("Prefix reuse").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CHARS", "Match", "RadixCache", "token_key"]

CHARS = 4  # characters per simulated token (requests.CHARS_PER_TOKEN)


def token_key(text: str) -> str:
    """The prompt as whole simulated tokens: padded with NULs to a multiple of four characters."""
    pad = -len(text) % CHARS
    return text + "\0" * pad if pad else text


class _Node:
    __slots__ = ("children", "parent", "key", "depth", "ref", "pins", "last", "marks")

    def __init__(self, parent: _Node | None, key: str, depth: int):
        self.children: dict[str, _Node] = {}
        self.parent, self.key, self.depth = parent, key, depth  # depth: tokens from the root to this node's end
        self.ref = 0  # running requests whose locked path ends at or below this node
        self.pins = 0  # running requests whose locked path ends exactly here (their Mamba state's node)
        self.last = 0  # logical time of the last match or insert through this node (LRU)
        self.marks: list[int] = []  # depths (within this node's span) where a Mamba state was saved

    @property
    def tokens(self) -> int:
        return len(self.key) // CHARS


class Match(NamedTuple):
    """A match: the node locked for the caller, the hit in tokens, and the branch point (extra_buffer: the grid
    depth of the cached KV beyond the hit, where this request's prefill saves its state; else None)."""

    node: _Node
    hit: int
    branch: int | None = None


@dataclass
class RadixStats:
    """Counters the server reports (``/metrics``) and the scheduler's admission reads."""

    hit_tokens: int = 0  # prompt tokens served from the cache
    input_tokens: int = 0  # prompt tokens computed (prefilled)
    evicted_tokens: int = 0
    state_copies: int = 0  # Mamba states saved into the tree


class RadixCache:
    """A token-level radix tree in the KV pool; ``hybrid`` adds Mamba-state checkpoints."""

    def __init__(
        self,
        *,
        hybrid: bool = False,
        checkpoint_grid: int | None = None,
        page_size: int = 1,
        max_states_per_path: int | None = None,
    ):
        self.hybrid = hybrid
        self.grid = checkpoint_grid if hybrid else None  # extra_buffer's checkpoint grid; None: no_buffer
        self.cap = max_states_per_path if hybrid else None  # None: unlimited
        self.page = max(1, page_size)
        self.root = _Node(None, "", 0)
        self.root.ref = 1  # never evicted
        self.tokens = 0  # tokens held by the tree
        self.locked_tokens = 0  # of those, in nodes some running request holds
        self.locked_sum = 0  # Σ over lockers of the tokens each holds (shared ones counted per locker)
        self.states = 0  # Mamba states saved in the tree
        self.locked_states = 0
        self.stats = RadixStats()
        self._clock = 0

    # -- what the scheduler's KV accounting needs ------------------------------------------------------------
    @property
    def shared_tokens(self) -> int:
        """Tokens running requests hold once in the pool but would each hold without sharing."""
        return self.locked_sum - self.locked_tokens

    @property
    def evictable_tokens(self) -> int:
        return self.tokens - self.locked_tokens

    @property
    def evictable_states(self) -> int:
        return self.states - self.locked_states

    # -- match / lock / insert -----------------------------------------------------------------------------
    def match(self, key: str, limit: int) -> Match:
        """The longest usable cached prefix of ``key`` (at most ``limit`` tokens), locked for the caller.

        Returns the node to unlock later, the hit length in tokens and the branch point. A hit that ends inside
        an edge splits it, so locks and evictions stay whole nodes.
        """
        self._clock += 1
        node, pos, best, full = self.root, 0, (self.root, 0), 0
        limit_chars = limit * CHARS
        while pos < limit_chars:
            child = node.children.get(key[pos : pos + CHARS])
            if child is None:
                break
            span = _common(child.key, key, pos, limit_chars)
            if span == 0:
                break
            child.last = self._clock
            end = child.depth - child.tokens + span // CHARS
            full = end
            usable = self._usable(child, end)
            if usable is not None:
                best = (child, usable)
            if span < len(child.key):
                break
            node, pos = child, pos + span
        node, hit = best
        if hit and hit < node.depth:
            node = self._split(node, hit)
        self._lock(node)
        branch = full // self.grid * self.grid if self.grid else 0
        return Match(node, hit, branch if branch > hit else None)

    def _usable(self, node: _Node, end: int) -> int | None:
        """The deepest resumable depth in ``node`` at or before token ``end`` (pages; saved states if hybrid)."""
        start = node.depth - node.tokens
        if self.hybrid:
            marks = [m for m in node.marks if m <= end]
            return marks[-1] if marks else None
        usable = end // self.page * self.page
        return usable if usable > start else None

    def insert(
        self, key: str, tokens: int, *, cached: int, locked: _Node, branch: int | None = None
    ) -> tuple[_Node, int]:
        """Insert the prefilled prompt (its first ``tokens`` tokens), move the caller's lock from ``locked`` to
        its end, and return (the new locked node, Mamba states saved: the caller pays their copies).
        ``branch`` is the match's branch point."""
        self._clock += 1
        node, pos, end = self.root, 0, tokens * CHARS
        while pos < end:
            node.last = self._clock
            child = node.children.get(key[pos : pos + CHARS])
            if child is None:
                leaf = _Node(node, key[pos:end], tokens)
                leaf.last = self._clock
                node.children[key[pos : pos + CHARS]] = leaf
                self.tokens += leaf.tokens
                node = leaf
                pos = end
                break
            span = _common(child.key, key, pos, end)
            if span < len(child.key):
                child = self._split(child, child.depth - child.tokens + span // CHARS)
            node, pos = child, pos + span
        node.last = self._clock
        copies = self._save_states(node, self._checkpoints(cached, tokens, branch)) if self.hybrid else 0
        self._lock(node)
        self._unlock(locked)
        if copies and self.cap is not None:
            self._cap_path(node)
        return node, copies

    def _checkpoints(self, cached: int, tokens: int, branch: int | None) -> set[int]:
        """Where a prefill from ``cached`` to ``tokens`` leaves its state: the prompt's end (no_buffer), else one
        on the grid, at the branch point if it lies in what was computed, or at the computed span's last grid
        point (none when under one grid step was computed: ``schedule_batch.py`` L3176-3183, L3216-3231)."""
        if self.grid is None:
            return {tokens // self.page * self.page} - {0}
        if tokens - cached < self.grid:
            return set()
        if branch is not None and cached < branch < tokens:
            return {branch}
        return {cached + (tokens - cached) // self.grid * self.grid}

    def _save_states(self, end_node: _Node, want: set[int]) -> int:
        """Mark the depths in ``want`` (on the path to ``end_node``) as saved states; returns how many are new."""
        copies = 0
        node: _Node | None = end_node
        while node is not None and node is not self.root and want:
            start = node.depth - node.tokens
            here = sorted(d for d in want if start < d <= node.depth and d not in node.marks)
            if here:
                node.marks = sorted([*node.marks, *here])
                copies += len(here)
                if node.ref:
                    self.locked_states += len(here)
            want = {d for d in want if d <= start}
            node = node.parent
        self.states += copies
        self.stats.state_copies += copies
        return copies

    def _cap_path(self, tail: _Node) -> None:
        """``--mamba-max-states-per-path``: drop the shallowest states on the path to ``tail`` beyond the cap, sparing
        the deepest, those at a fork or a leaf, and those a running request resumes from (a state inside a node's
        span has one continuation, as SGLang's node split there would)."""
        path: list[tuple[_Node, int]] = []
        node: _Node | None = tail
        while node is not None and node is not self.root:
            path.extend((node, m) for m in reversed(node.marks))
            node = node.parent
        excess = len(path) - (self.cap or 0)
        for node, mark in reversed(path[1:]):  # shallowest first; path[0] is the deepest (the tail)
            if excess <= 0:
                break
            if mark == node.depth and (len(node.children) != 1 or node.pins):
                continue
            node.marks.remove(mark)
            self.states -= 1
            if node.ref:
                self.locked_states -= 1
            excess -= 1

    def _split(self, node: _Node, depth: int) -> _Node:
        """Cut ``node`` at token ``depth``: a new parent holds the head; returns that parent."""
        start = node.depth - node.tokens
        cut = (depth - start) * CHARS
        head = _Node(node.parent, node.key[:cut], depth)
        head.ref, head.last = node.ref, node.last
        head.marks = [m for m in node.marks if m <= depth]
        node.marks = [m for m in node.marks if m > depth]
        assert node.parent is not None
        node.parent.children[node.key[:CHARS]] = head
        node.key = node.key[cut:]
        node.parent = head
        head.children[node.key[:CHARS]] = node
        return head

    def _lock(self, node: _Node) -> None:
        self.locked_sum += node.depth
        node.pins += 1
        while node is not self.root:
            if node.ref == 0:
                self.locked_tokens += node.tokens
                self.locked_states += len(node.marks)
            node.ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: _Node) -> None:
        """A request that held ``node`` finished, was aborted or retracted: its prefix becomes evictable."""
        self._unlock(node)

    def _unlock(self, node: _Node) -> None:
        self.locked_sum -= node.depth
        node.pins -= 1
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.locked_tokens -= node.tokens
                self.locked_states -= len(node.marks)
            node = node.parent  # type: ignore[assignment]

    # -- eviction ------------------------------------------------------------------------------------------
    def evict(self, *, tokens: int = 0, states: int = 0) -> int:
        """Evict least-recently-used unlocked leaves until ``tokens`` KV tokens and ``states`` Mamba states are
        freed (or nothing evictable is left). Returns the tokens freed."""
        if tokens <= 0 and states <= 0:
            return 0
        heap = [(n.last, id(n), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed = freed_states = 0
        while heap and (freed < tokens or freed_states < states):
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[:CHARS]]
            freed += leaf.tokens
            freed_states += len(leaf.marks)
            if parent is not self.root and parent.ref == 0 and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))
        self.tokens -= freed
        self.states -= freed_states
        self.stats.evicted_tokens += freed
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def reset(self) -> None:
        """``/flush_cache``: drop every cached prefix (only called when idle, so nothing is locked)."""
        self.root.children.clear()
        self.tokens = self.locked_tokens = self.locked_sum = self.states = self.locked_states = 0


def _common(edge: str, key: str, pos: int, end: int) -> int:
    """Characters ``edge`` shares with ``key[pos:end]``, in whole tokens (binary search on ``startswith``)."""
    n = min(len(edge), end - pos)
    if key.startswith(edge[:n], pos):
        return n // CHARS * CHARS
    lo, hi = 0, n // CHARS  # tokens known to match / upper bound
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key.startswith(edge[: mid * CHARS], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo * CHARS
