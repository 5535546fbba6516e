"""The scheduler's running batch and the memory it holds: one numpy slot per running request, the request
whose prompt is split across prefill steps, KV tokens page by page, Mamba slots, and the radix cache's locks,
inserts and LRU evictions.

Apart from ``sim.scheduler`` so what is held reads on its own, beside the rules that decide who runs.
``Scheduler`` extends ``RunningBatch``: one object, so the decode hot loop reads plain attributes.
"""

from __future__ import annotations

import math

import numpy as np

from autotune.sim.limits import SchedulerLimits
from autotune.sim.radix import CHARS, RadixCache
from autotune.sim.step import ReqState


class RunningBatch:
    """Running requests in slots ``[0, n)`` of parallel arrays, the chunked request, and the radix cache."""

    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        # D the KV reservation uses: SGLang reserves for max_speculative_num_draft_tokens (under adaptive the largest
        # candidate + 1); ``_cycle_d`` is what one verify actually runs.
        self._d = (limits.adaptive.max_draft_tokens if limits.adaptive else limits.draft_tokens) if limits.spec else 1
        self._adaptive_d: dict[tuple[int, float], int] = {}
        self._page = max(1, limits.page_size)
        self.chunked: ReqState | None = None  # the request whose prompt is split across prefill steps
        self._cycles = 0  # decode cycles so far; a running request's verify count is cycles since it entered
        # Running requests, one slot each, contiguous in [0, n). ctx_sum = Σ (prompt + generated) over them.
        cap = max(1, limits.max_running_requests)
        self._n = 0
        self._ctx_sum = 0.0
        self._reqs: list[ReqState] = []
        # left = tokens still to generate; slack = max_new_tokens − target (so max_new − generated = slack + left).
        self._prompt, self._target, self._left, self._slack = (np.zeros(cap) for _ in range(4))
        self._inv_nla = np.zeros(cap)  # 1/(−ln α): floor(Exp(1) · this) has P(≥ k) = α^k accepted drafts
        self._last = np.zeros(cap)  # when each request entered (its prefill token); older ones: _prev_end
        self._prev_end = 0.0  # when the previous decode cycle ended
        self._fresh = False  # a request entered since the previous decode cycle
        # SGLang's prefix cache: hits skip prefill, the tree lives in the KV pool (and Mamba slots), LRU-evicted.
        self.cache = (
            RadixCache(
                hybrid=limits.hybrid,
                checkpoint_grid=limits.mamba_checkpoint_grid,
                page_size=limits.page_size,
                max_states_per_path=limits.mamba_max_states_per_path,
            )
            if limits.radix_cache
            else None
        )

    # -- what is held -------------------------------------------------------------------------------------
    def kv_used_tokens(self) -> int:
        """KV tokens held (not evictable), page-aligned per request as SGLang's allocator counts them; a prefix
        running requests share through the radix cache is held once."""
        n, page = self._n, self._page
        if page > 1:
            ctx = self._prompt[:n] + self._target[:n] - self._left[:n]
            used = int(np.ceil(ctx / page).sum()) * page
        else:
            used = int(self._ctx_sum)
        if self.chunked is not None:
            used += -(-(self.chunked.done_prefill + self.chunked.cached) // page) * page
        return used - self._shared()

    def _kv_cap(self) -> int:
        """KV tokens the requests may hold: the KV pool; under --enable-unified-memory the shared arena less the
        Mamba states held in it (busy requests' slots and the cached states they lock), which float against it.
        Evictable cached tokens and states count as room, as the KV pool's evictable prefixes do."""
        lim = self.limits
        if lim.arena_tokens is None:
            return lim.kv_tokens
        busy = self._n + (self.chunked is not None)
        locked = self.cache.locked_states if self.cache is not None else 0
        return lim.arena_tokens - (busy * lim.mamba_slots_per_req + locked) * lim.state_tokens

    def _cycle_d(self) -> int:
        """Tokens per request of the next verify: D; under --speculative-adaptive the steps + 1 the running batch's
        slot settles on at the batch's mean acceptance (``sglang.adaptive.AdaptiveSpec.steps_for``)."""
        ad, n = self.limits.adaptive, self._n
        if ad is None or not n:
            return self._d
        alpha = round(float(np.exp(-1.0 / self._inv_nla[:n]).mean()), 3)
        d = self._adaptive_d.get((n, alpha))
        if d is None:
            d = self._adaptive_d[(n, alpha)] = ad.steps_for(n, self.limits.graph_bs, alpha) + 1
        return d

    def _shared(self) -> int:
        return self.cache.shared_tokens if self.cache is not None else 0

    def _mamba_num(self) -> int:
        """Slots in use: each busy request's state and tracking copies, plus one the radix cache keeps."""
        lim = self.limits
        if not lim.hybrid:
            return 0
        busy = self._n + (self.chunked is not None)
        cached = self.cache.states if self.cache is not None else (1 if busy else 0)
        return min(lim.mamba_slots or 0, busy * lim.mamba_slots_per_req + cached)

    def _mamba_usage(self) -> float:
        return self._mamba_num() / self.limits.mamba_slots if self.limits.mamba_slots else 0.0

    # -- slots --------------------------------------------------------------------------------------------
    def _enter(self, r: ReqState) -> None:
        i = self._n
        self._n += 1
        self._reqs.append(r)
        req = r.req
        self._prompt[i], self._target[i], self._left[i] = req.prompt_tokens, req.target_len, req.target_len - r.gen
        self._slack[i], self._last[i] = req.max_new_tokens - req.target_len, r.last_t
        self._fresh = True
        self._inv_nla[i] = -1.0 / math.log(req.alpha)
        self._ctx_sum += req.prompt_tokens + r.gen
        r.entry = (self._cycles, r.gen)

    def _sync(self, i: int) -> ReqState:
        """Write slot ``i``'s array state back to its request (verify passes = cycles since it entered)."""
        r = self._reqs[i]
        cycles0, gen0 = r.entry
        gen = int(self._target[i] - self._left[i])
        if self._d > 1:
            cycles = self._cycles - cycles0
            r.verify += cycles
            r.accepted += gen - gen0 - cycles
        r.gen, r.last_t = gen, max(float(self._last[i]), self._prev_end)
        r.entry = (self._cycles, gen)
        return r

    def _leave(self, i: int) -> ReqState:
        """Remove slot ``i`` (swap with the last slot)."""
        r = self._sync(i)
        self._ctx_sum -= r.req.prompt_tokens + r.gen
        last = self._n - 1
        if i != last:
            for arr in (self._prompt, self._target, self._left, self._slack, self._inv_nla, self._last):
                arr[i] = arr[last]
            self._reqs[i] = self._reqs[last]
        self._reqs.pop()
        self._n = last
        if self.cache is not None:
            self._release(r)
        return r

    # -- the radix cache ----------------------------------------------------------------------------------
    @property
    def _radix(self) -> RadixCache:
        """The radix cache, for the paths that run only with one (``cache`` is None with the cache off)."""
        assert self.cache is not None
        return self.cache

    def _admit(self, r: ReqState) -> None:
        """Match the request's prompt in the radix cache and lock the hit (at least one token is computed)."""
        key = r.req.key
        limit = min(r.req.prompt_tokens, len(key) // CHARS) - 1
        r.node, r.cached, r.branch = self._radix.match(key, max(0, limit))

    def _release(self, r: ReqState) -> None:
        """Unlock its prefix (finished, aborted, retracted or not admitted after all); ``cached`` stays for its
        report and is matched afresh at its next admission."""
        if r.node is not None:
            self._radix.unlock(r.node)
            r.node = None

    def _insert_done(self, batch: list[tuple[ReqState, int]]) -> int:
        """Insert the prompts whose prefill this step completes (SGLang's cache_unfinished_req), so requests
        admitted later can hit them; returns the Mamba states saved on the way (each one a state copy)."""
        copies = 0
        for r, take in batch:
            if r.done_prefill + take >= r.extend_len:
                key = r.req.key
                tokens = min(r.req.prompt_tokens, len(key) // CHARS)
                assert r.node is not None  # admitted: it holds its match
                r.node, saved = self._radix.insert(key, tokens, cached=r.cached, locked=r.node, branch=r.branch)
                copies += saved
        return copies

    def _make_room(self) -> None:
        """Evict cached prefixes (LRU) that no longer fit beside what running requests hold: KV tokens, and for
        hybrid models the Mamba slots the running requests leave free."""
        cache, lim = self._radix, self.limits
        if not cache.evictable_tokens and not cache.evictable_states:
            return
        over = self.kv_used_tokens() + cache.evictable_tokens - self._kv_cap()
        if lim.arena_tokens is not None:  # one arena: an evictable state's bytes are KV tokens too; LRU leaf by leaf
            over += cache.evictable_states * lim.state_tokens
            while over > 0 and (cache.evictable_tokens or cache.evictable_states):
                tokens, states = cache.evictable_tokens, cache.evictable_states
                cache.evict(tokens=1, states=1)
                freed = tokens - cache.evictable_tokens + (states - cache.evictable_states) * lim.state_tokens
                if not freed:
                    break
                over -= freed
            return
        states_over = 0
        if lim.hybrid:
            busy = self._n + (self.chunked is not None)
            states_over = cache.states - max(0, (lim.mamba_slots or 0) - busy * lim.mamba_slots_per_req)
        if over > 0 or states_over > 0:
            cache.evict(tokens=over, states=states_over)
