"""Starting points on the memory wall, chosen by the planner before the first launch.

An offline job's throughput rises with the number of requests decoding together until the KV pool can no longer
hold them, and the planner knows both limits of any config without a GPU: the running cap SGLang will derive and
the KV tokens it will allocate. So the search does not have to find the wall by walking into it: sample the
space, keep the configs the planner is sure start, and enqueue the few that admit the most concurrency (in
distinct categorical settings). The sampler then refines around measured points instead of random ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from autotune.search.space import Feasibility, Space, key_of

CHARS_PER_TOKEN = 4.0  # a rough tokenizer ratio: the prior only ranks configs, it predicts no throughput
# KV a running request holds on average, as a share of max_tokens beside its prompt: unknown before the first
# measurement (it depends on the output lengths), so the starting points bracket it, one share each.
OUTPUT_SHARES = (0.5, 0.6, 0.7, 0.8)
# Flags that decide where memory goes (the levers of SGLang 0.5.23's ``srt/mem_cache/kv_cache_configurator.py``, see
# docs/sglang-memory.md §3); the others are held at the production config's values.
MEMORY_LEVERS = frozenset(
    {
        "mem_fraction_static",
        "max_running_requests",
        "max_mamba_cache_size",
        "mamba_full_memory_ratio",
        "mamba_ssm_dtype",
        "disable_radix_cache",
        "mamba_radix_cache_strategy",
        "chunked_prefill_size",
        "max_total_tokens",
        "kv_cache_dtype",
    }
)


def tokens_per_request(prompt_chars: list[int], max_tokens: int, share: float) -> int:
    """KV tokens one running request holds on average: its prompt plus ``share`` of its output budget."""
    mean_prompt = sum(prompt_chars) / max(1, len(prompt_chars)) / CHARS_PER_TOKEN
    return max(1, int(mean_prompt + share * max_tokens))


def shared_prefix_tokens(texts: list[str]) -> float:
    """Mean prompt tokens a request shares with another prompt of the sample (its longest common prefix with any
    other; in sorted order that is one of its two neighbours). With the radix cache on, SGLang holds a shared prefix
    once in the KV pool, however many running requests use it."""
    ordered = sorted(texts)
    if len(ordered) < 2:
        return 0.0

    def common(a: str, b: str) -> int:  # binary search on C-speed slice compares: prompts run to 30k characters
        lo, hi = 0, min(len(a), len(b))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
        return lo

    lcp = [common(a, b) for a, b in zip(ordered, ordered[1:], strict=False)]
    best = [max(lcp[i - 1] if i > 0 else 0, lcp[i] if i < len(lcp) else 0) for i in range(len(ordered))]
    return sum(best) / len(best) / CHARS_PER_TOKEN


def random_values(space: Space, rng: np.random.Generator) -> dict[str, Any]:
    """One uniform random draw of the space's active parameters (what Optuna's RandomSampler draws, without a
    study: placing an edge start samples hundreds of configs)."""
    values: dict[str, Any] = dict(space.fixed)
    for param in space.params:
        if not param.active(values):
            continue
        dist = param.distribution
        if isinstance(dist, CategoricalDistribution):
            values[param.name] = dist.choices[int(rng.integers(len(dist.choices)))]
        elif isinstance(dist, IntDistribution):
            if dist.log:
                values[param.name] = int(round(math.exp(rng.uniform(math.log(dist.low), math.log(dist.high)))))
            else:
                step = dist.step or 1
                values[param.name] = dist.low + step * int(rng.integers((dist.high - dist.low) // step + 1))
        else:
            assert isinstance(dist, FloatDistribution)
            if dist.step:
                n = int(round((dist.high - dist.low) / dist.step))
                values[param.name] = round(dist.low + dist.step * int(rng.integers(n + 1)), 6)
            elif dist.log:
                values[param.name] = round(math.exp(rng.uniform(math.log(dist.low), math.log(dist.high))), 6)
            else:
                values[param.name] = round(float(rng.uniform(dist.low, dist.high)), 6)
    return values


@dataclass(frozen=True, kw_only=True)
class _Start:
    """A sampled config the planner is sure starts, with what it planned: the running cap, the KV pool's tokens and
    the headroom at peak (GiB)."""

    config: Mapping[str, Any]
    running: int
    kv_tokens: int
    headroom_gib: float


def edge_configs(
    space: Space,
    feasibility: Feasibility,
    *,
    prompt_chars: list[int],
    max_tokens: int,
    n: int,
    seed: int,
    samples: int = 300,
    exclude: Sequence[Mapping[str, Any]] = (),
    hold: Mapping[str, Any] | None = None,
    per_request: list[int] | None = None,
    shared_prefix: float = 0.0,
) -> list[dict[str, Any]]:
    """Up to ``n`` distinct configs of ``space``, each the one (among ``samples`` random ones the planner is sure
    start) with the highest running cap its KV pool holds when a request holds a given share of its output
    budget — one share per config, so the starting points bracket the wall. Flags in ``hold`` that are not
    memory levers keep their values there (the production config's), so a starting point differs from
    production only where memory is decided; configs in ``exclude`` are not proposed again. ``per_request``
    (KV tokens one running request holds, one entry per config; ``edges.EdgeStarts`` derives them from the prompt
    sample and the output lengths trials observed) replaces the fixed output shares. A config that keeps the radix
    cache holds ``shared_prefix`` tokens of each request once (``shared_prefix_tokens``), not per request."""
    rng = np.random.default_rng(seed)
    held = {k: v for k, v in (hold or {}).items() if k in space.names and k not in MEMORY_LEVERS}
    seen = {key_of(c) for c in exclude}
    candidates: list[_Start] = []
    for _ in range(samples):
        config = space.complete({**random_values(space, rng), **held})
        if key_of(config) in seen:
            continue
        seen.add(key_of(config))
        memory_plan = feasibility.predict(config, inert=False)
        if feasibility.clear(memory_plan):
            candidates.append(
                _Start(
                    config=config,
                    running=memory_plan.max_running_requests,
                    kv_tokens=memory_plan.kv_tokens,
                    headroom_gib=memory_plan.gib.headroom,
                )
            )
    candidates.sort(key=lambda c: (c.running, c.headroom_gib), reverse=True)
    if per_request is None:
        shares = [OUTPUT_SHARES[round(i * (len(OUTPUT_SHARES) - 1) / max(1, n - 1))] for i in range(n)]
        per_request = [tokens_per_request(prompt_chars, max_tokens, share) for share in shares]
    chosen: list[dict[str, Any]] = []
    for tokens in per_request[:n]:
        # more requests than the pool holds would be retracted by SGLang, not served
        pick = next(
            (
                c
                for c in candidates
                if c.running * _held_per_request(c.config, tokens, shared_prefix) <= c.kv_tokens
                and c.config not in chosen
            ),
            None,
        )
        if pick is not None:
            chosen.append(dict(pick.config))
    return chosen


def _held_per_request(config: Mapping[str, Any], tokens: int, shared_prefix: float) -> float:
    """KV tokens one running request holds in ``config``: its own, less the shared prefix the radix cache keeps once."""
    return tokens if config.get("disable_radix_cache") else max(1.0, tokens - shared_prefix)
