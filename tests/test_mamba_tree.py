"""--mamba-track-interval and --mamba-max-states-per-path: the planner's rules (each citing the SGLang 0.5.23 line
it mirrors), what the simulator's radix cache and decode loop do with them, and a refused config stopped before
anything is launched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune.errors import ConfigError
from autotune.search.preflight import check_given
from autotune.search.space import Feasibility
from autotune.sglang.memory import plan
from autotune.sglang.numerics import changes_numerics, not_numerics_reason, numerics_flag
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim.evaluate import SimWorkload, evaluate
from autotune.sim.radix import CHARS, RadixCache, token_key
from autotune.sim.requests import make_request
from autotune.sim.scheduler import Scheduler

QWEN, B200, H200 = load_model("qwen3.6-27b"), load_gpu("b200"), load_gpu("h200")
MTP = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}


# -- the planner ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [0, -2])
def test_max_states_per_path_zero_or_below_minus_one_is_refused_with_sglangs_message(cap):
    """``handle_mamba_backend``, srt/arg_groups/mamba_hook.py L24-28 (run for every server, pipeline.py L251)."""
    p = plan(QWEN, B200, {**MTP, "mamba_max_states_per_path": cap})
    assert p.failure == "bad_args"
    assert p.message == (
        f"ValueError: --mamba-max-states-per-path must be -1 (unlimited) or a positive integer, got {cap}."
    )
    assert (
        plan(QWEN, B200, {**MTP, "disable_radix_cache": True, "mamba_max_states_per_path": cap}).failure == "bad_args"
    )  # refused whatever the cache strategy


def test_track_interval_below_the_draft_tokens_or_off_the_page_is_refused_for_extra_buffer_only():
    """``validate_mamba_extra_buffer``, mamba_hook.py L132-133 (>= speculative_num_draft_tokens) and L134-135
    (a multiple of page_size: 64 with trtllm_mha on a B200); no_buffer never reads the flag (L156-163)."""
    few = plan(QWEN, H200, {**MTP, "mamba_track_interval": 2})
    assert few.failure == "bad_args" and "mamba_hook.py L133" in few.message
    off_page = plan(QWEN, B200, {**MTP, "mamba_track_interval": 96})
    assert off_page.failure == "bad_args" and "mamba_hook.py L135" in off_page.message
    assert plan(QWEN, H200, {**MTP, "mamba_track_interval": 96}).fits  # page 1 on Hopper
    no_buffer = plan(
        QWEN,
        H200,
        {**MTP, "mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True, "mamba_track_interval": 2},
    )
    assert no_buffer.fits and "mamba_track_interval" in no_buffer.inert


def test_neither_lever_moves_a_pool_or_the_running_cap():
    """The tracking copies a request reserves come from the strategy alone (``get_mamba_tracking_slots``,
    srt/mem_cache/allocation_sizing.py L11-19): the plan is the same for any interval or cap."""
    base = plan(QWEN, B200, {**MTP, "max_mamba_cache_size": 96})
    for extra in ({"mamba_track_interval": 64}, {"mamba_track_interval": 4096}, {"mamba_max_states_per_path": 1}):
        other = plan(QWEN, B200, {**MTP, "max_mamba_cache_size": 96, **extra})
        assert (other.max_running_requests, other.kv_tokens, other.max_mamba_cache_size) == (
            base.max_running_requests,
            base.kv_tokens,
            base.max_mamba_cache_size,
        )
    fine = plan(QWEN, B200, {**MTP, "mamba_track_interval": 128, "mamba_max_states_per_path": 2}).extra
    # runtime_context.py L1966-1979: prefill states on lcm(max(64, page), page), decode ones also on the interval
    assert (fine["mamba_checkpoint_grid"], fine["mamba_track_grid"], fine["mamba_max_states_per_path"]) == (64, 128, 2)


def test_neither_lever_changes_outputs():
    """The numerics table: both only decide which prefix states are reused (docs/numerics.md)."""
    config = {**MTP, "mamba_track_interval": 64, "mamba_max_states_per_path": 2}
    assert changes_numerics(config) == []
    for dest in ("mamba_track_interval", "mamba_max_states_per_path"):
        assert numerics_flag(dest) is None and "prefix reuse only" in (not_numerics_reason(dest) or "")


# -- the simulator ----------------------------------------------------------------------------------------------
def _chain(cap: int | None) -> tuple[RadixCache, int]:
    """Three prompts, each extending the one before (a conversation's turns), then one that shares the first
    turn only: returns the cache and that last prompt's hit."""
    cache = RadixCache(hybrid=True, checkpoint_grid=64, page_size=64, max_states_per_path=cap)
    turn = "t" * 4 * 1000
    for text in (turn, turn + "u" * 4 * 500, turn + "u" * 4 * 500 + "v" * 4 * 500):
        key = token_key(text)
        node, hit, branch = cache.match(key, len(key) // CHARS - 1)
        cache.unlock(cache.insert(key, len(key) // CHARS, cached=hit, locked=node, branch=branch)[0])
    other = token_key(turn + "w" * 4 * 300)
    node, hit, _ = cache.match(other, len(other) // CHARS - 1)
    cache.unlock(node)
    return cache, hit


def test_max_states_per_path_frees_state_slots_and_costs_the_hits_it_dropped():
    """``_evict_excess_path_states`` (unified_cache/components/mamba.py L255-320): after each insert the shallowest
    states beyond the cap go (their KV stays), the deepest is kept."""
    unlimited, hit = _chain(None)
    capped, capped_hit = _chain(1)
    assert unlimited.states == 3 and capped.states == 1  # states at 960, 1472, 1984 tokens; the cap keeps 1984
    assert hit == 960 and capped_hit == 0  # the first turn's state is gone: its KV alone cannot resume a Mamba layer
    assert capped.tokens == unlimited.tokens


def test_a_finer_track_interval_slows_decoding_by_its_state_copies():
    """extra_buffer tracks each decoding request's state at every track-grid crossing (schedule_batch.py
    L3802-3830): one Mamba state copy each, so a finer interval costs decode time, in proportion."""
    clocks, tokens, copy_s = {}, {}, 0.0
    for interval in (64, 4096):
        p = plan(QWEN, B200, {**MTP, "mamba_track_interval": interval})
        sched = Scheduler.from_plan(p, QWEN, B200, seed=5, emit=False)
        copy_s = sched.perf.state_copy_s(1)
        for i in range(16):
            sched.add(make_request(str(i), f"request {i} " * 30, 600, seed=5))
        while sched.has_work():
            sched.step(64)
        clocks[interval], tokens[interval] = sched.clock, sched.stats.generation_tokens_total
    assert tokens[64] == tokens[4096]  # the same draws, the same tokens
    decoded = tokens[64] - 16  # each request's first token comes from its prefill
    expected = decoded * copy_s * (1 / 64 - 1 / 4096)
    assert clocks[64] - clocks[4096] == pytest.approx(expected, rel=1e-6)
    assert expected > 0


# -- refused before launch --------------------------------------------------------------------------------------
def test_a_refused_cap_stops_the_study_before_launch_and_is_bad_args_on_the_simulator():
    cfg = SimpleNamespace(
        path=None, given=lambda: [("baseline", "production", {**MTP, "mamba_max_states_per_path": 0})]
    )
    with pytest.raises(ConfigError) as info:
        check_given(cfg, feasibility=Feasibility(QWEN, B200))  # type: ignore[arg-type]
    assert "SGLang refuses this config: ValueError: --mamba-max-states-per-path must be -1" in str(info.value)
    assert "nothing was launched" in str(info.value)
    work = SimWorkload(prompts=["a prompt"], max_tokens=8, concurrency=1, warmup_s=1, measure_s=1)
    result = evaluate({**MTP, "mamba_max_states_per_path": 0}, work, model="qwen3.6-27b", gpu="b200")
    assert result.status == "bad_args" and "--mamba-max-states-per-path" in (result.reason or "")
