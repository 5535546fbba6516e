"""The simulator's radix (prefix) cache: the tree itself, the scheduler's use of it, and what the server reports."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from autotune.sim.evaluate import SimWorkload, evaluate
from autotune.sim.radix import CHARS, RadixCache, token_key

SHARED = "You label incident reports. " * 150  # ≈ 1,050 tokens every prompt shares
MTP = {"speculative_algorithm": "NEXTN"}


def shared_prompts(n: int = 24) -> list[str]:
    return [
        f"{SHARED}Report {i}: " + "the disk filled up overnight and the job stopped " * (3 + i % 5) for i in range(n)
    ]


def key(text: str) -> str:
    return token_key(text)


# -- the tree ---------------------------------------------------------------------------------------------------
def test_a_prompt_hits_what_an_earlier_one_inserted_and_splits_at_the_divergence():
    cache = RadixCache()
    a, b = key("A" * 400 + "tail one"), key("A" * 400 + "tail two, longer")
    node, hit, _ = cache.match(a, len(a) // CHARS - 1)
    assert hit == 0
    node, _ = cache.insert(a, len(a) // CHARS, cached=0, locked=node)
    cache.unlock(node)
    node, hit, _ = cache.match(b, len(b) // CHARS - 1)
    assert hit == 101  # "tail" shares one more whole token after the 100 of "A"s
    assert cache.locked_tokens == hit  # only the hit is held while the request prefills
    cache.unlock(node)
    assert cache.evictable_tokens == cache.tokens == len(a) // CHARS


def test_lru_eviction_spares_locked_prefixes_and_the_most_recent():
    cache = RadixCache()
    nodes = []
    for text in ("x" * 80, "y" * 80, "z" * 80):
        node, *_ = cache.match(key(text), 19)
        node, _ = cache.insert(key(text), 20, cached=0, locked=node)
        nodes.append(node)
    cache.unlock(nodes[0])
    cache.unlock(nodes[1])  # z stays locked (a running request)
    freed = cache.evict(tokens=1)
    assert freed == 20
    for text, hit in (("x" * 80, 0), ("y" * 80, 19)):  # the least recently used went first
        node, got, _ = cache.match(key(text), 19)
        cache.unlock(node)
        assert got == hit
    assert cache.evict(tokens=1000) == 20  # y goes; z is locked by its running request
    assert cache.tokens == cache.locked_tokens == 20
    assert cache.match(key("z" * 80), 19)[1] == 19


def test_page_size_cuts_a_hit_to_whole_pages():
    cache = RadixCache(page_size=16)
    text = key("p" * 4 * 100)
    node, *_ = cache.match(text, 99)
    cache.unlock(cache.insert(text, 100, cached=0, locked=node)[0])
    assert cache.match(text, 99)[1] == 96


def test_hybrid_hits_resume_only_from_saved_states():
    """no_buffer saves a state at the end of each prompt, so a prompt that only shares a prefix never resumes.
    extra_buffer (0.5.23's ``_mamba_radix_cache_v2_req_prepare_for_extend``, ``schedule_batch.py`` L3176-3232)
    saves one state per prefill on the 64-token checkpoint grid: the first prompt's at its last grid point, the
    second's at the branch point the match reported (the shared KV's last grid point), where the third resumes."""
    prefix = "s" * 4 * 600
    first, second, third = (key(prefix + ending) for ending in ("first ending", "a different ending", "third one"))
    cache = RadixCache(hybrid=True)  # no_buffer
    node, *_ = cache.match(first, len(first) // CHARS - 1)
    node, copies = cache.insert(first, len(first) // CHARS, cached=0, locked=node)
    cache.unlock(node)
    assert copies == 1 and cache.match(second, len(second) // CHARS - 1)[1] == 0
    cache = RadixCache(hybrid=True, checkpoint_grid=64, page_size=64)  # extra_buffer on a B200 (page 64)
    node, hit, branch = cache.match(first, len(first) // CHARS - 1)
    assert (hit, branch) == (0, None)
    node, copies = cache.insert(first, len(first) // CHARS, cached=0, locked=node, branch=branch)
    cache.unlock(node)
    assert copies == 1 and cache.states == 1  # at 576, the last grid point of the 603 tokens computed
    node, hit, branch = cache.match(second, len(second) // CHARS - 1)
    assert (hit, branch) == (576, None)  # the first prompt's state lies inside the shared 600 tokens
    cache.unlock(node)
    cache = RadixCache(hybrid=True, checkpoint_grid=64, page_size=64)
    longer = key(prefix + "x" * 4 * 200)  # its state lands at 768, past the shared prefix
    node, *_ = cache.match(longer, len(longer) // CHARS - 1)
    cache.unlock(cache.insert(longer, len(longer) // CHARS, cached=0, locked=node)[0])
    node, hit, branch = cache.match(second, len(second) // CHARS - 1)
    assert (hit, branch) == (0, 576)  # KV matches 600 tokens, no state there: computes all, saves at 576
    cache.unlock(cache.insert(second, len(second) // CHARS, cached=hit, locked=node, branch=branch)[0])
    assert cache.match(third, len(third) // CHARS - 1)[1] == 576


# -- the scheduler and evaluate() -------------------------------------------------------------------------------
def _evaluate(flags: dict, prompts: list[str], **kw):
    work = SimWorkload(prompts=prompts, max_tokens=300, concurrency=kw.pop("concurrency", 24), warmup_s=5, measure_s=20)
    return evaluate(flags, work, seed=3, output_mean=250, **kw)


def test_shared_prefixes_skip_prefill_and_raise_throughput_only_with_the_radix_cache():
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model
    from autotune.sim.scheduler import Scheduler

    prompts = shared_prompts()
    on = _evaluate(MTP, prompts)
    off = _evaluate({**MTP, "disable_radix_cache": True}, prompts)
    assert on.status == off.status == "ok"
    assert on.output_tok_s > 1.05 * off.output_tok_s, (on.output_tok_s, off.output_tok_s)
    # The same run, step by step: the cache served tokens, so fewer prompt tokens were computed.
    model, gpu = load_model("qwen3.6-27b"), load_gpu("b200")
    stats = {}
    for label, flags in (("on", MTP), ("off", {**MTP, "disable_radix_cache": True})):
        sched = Scheduler.from_plan(plan(model, gpu, flags), model, gpu, seed=3, emit=False)
        from autotune.sim.requests import make_request

        for i, text in enumerate(shared_prompts(72)):  # waves: the second saves the shared state, later ones hit
            sched.add(make_request(str(i), text, 50, seed=3))
        while sched.has_work():
            sched.step(64)
        stats[label] = sched.stats
    assert stats["on"].cached_tokens_total > 0 and stats["off"].cached_tokens_total == 0
    # (the first prefill batch admits many prompts at once, before any is cached, and the next one computes the
    # shared prefix again to save its Mamba state at the branch point: SGLang fcfs does the same)
    assert stats["on"].input_tokens_total < 0.75 * stats["off"].input_tokens_total
    assert stats["on"].prompt_tokens_total == stats["off"].prompt_tokens_total


def test_prompts_without_a_shared_prefix_never_hit():
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model
    from autotune.sim.requests import make_request
    from autotune.sim.scheduler import Scheduler

    model, gpu = load_model("qwen3.6-27b"), load_gpu("b200")
    sched = Scheduler.from_plan(plan(model, gpu, MTP), model, gpu, seed=3, emit=False)
    for i in range(12):
        sched.add(make_request(str(i), chr(65 + i) + " a request body of its own" * 40, 20, seed=3))
    while sched.has_work():
        sched.step(64)
    assert sched.cache is not None and sched.stats.cached_tokens_total == 0
    assert sched.stats.input_tokens_total == sched.stats.prompt_tokens_total


# -- the paced server ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_paced_server_reports_hits_and_agrees_with_evaluate(sim):
    from test_sim_server import _replay, paced_within

    prompts = shared_prompts()
    concurrency, max_tokens, warmup, window = 12, 300, 1.0, 4.0
    predicted = evaluate(
        MTP,
        SimWorkload(prompts=prompts, max_tokens=max_tokens, concurrency=concurrency, warmup_s=warmup, measure_s=window),
        seed=7,
        output_mean=250,
    )
    p = sim(
        "--speculative-algorithm",
        "NEXTN",
        "--enable-metrics",
        "--sim-seed",
        "7",
        "--sim-warmup-s",
        "0",
        "--sim-output-mean",
        "250",
    )
    p.wait_ready()
    measured, low, high = paced_within(
        p.url,
        predicted.output_tok_s,
        warmup,
        window,
        lambda: asyncio.run(_replay(p.url, prompts, concurrency, max_tokens, warmup, window)),
    )
    assert low <= measured <= high, (measured, predicted.output_tok_s, low, high)
    body = httpx.post(
        f"{p.url}/generate", json={"text": prompts[0], "sampling_params": {"max_new_tokens": 4}}, timeout=30
    ).json()
    assert body["meta_info"]["cached_tokens"] >= 1000
    metrics = httpx.get(f"{p.url}/metrics", timeout=10).text
    hit_rate = float(re.search(r"^sglang:cache_hit_rate\{[^}]*\} (\S+)", metrics, re.M)[1])
    device_hit = float(
        re.search(r'^sglang:prefill_effective_tokens_total\{[^}]*mode="device_hit"[^}]*\} (\S+)', metrics, re.M)[1]
    )
    # Cumulative since start: the first two waves of 12 compute the shared prefix (the second saves its state at
    # the branch point: 0.5.23's rule), later ones hit ~0.9 of their prompt (a 4 s window takes it past half).
    assert hit_rate > 0.5 and device_hit > 0
    assert re.search(r"#cached-token: [1-9]", p.log)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_radix_cache_off_reports_no_hits(sim):
    p = sim("--disable-radix-cache", "--enable-metrics")
    p.wait_ready()
    for _ in range(2):
        body = httpx.post(
            f"{p.url}/generate",
            json={"text": SHARED + "same prompt", "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        ).json()
        assert body["meta_info"]["cached_tokens"] == 0
    metrics = httpx.get(f"{p.url}/metrics", timeout=10).text
    assert re.search(r"^sglang:cache_hit_rate\{[^}]*\} 0\.0$", metrics, re.M)
    assert json.dumps(body)  # a well-formed body


@pytest.fixture
def sim(tmp_path):
    from test_sim_server import sim as make

    yield from make.__wrapped__(tmp_path)
