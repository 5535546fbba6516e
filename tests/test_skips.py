"""A planner skip says which pool took the memory, beside SGLang's own line."""

from __future__ import annotations

from autotune.search.skips import pool_cause, skip_reason
from autotune.sglang.memory import MemoryGiB, MemoryPlan, plan
from autotune.sglang.profiles import load_gpu, load_model


def test_eight_hundred_mamba_slots_are_named_as_the_cause_not_the_fraction():
    p = plan(
        load_model("qwen3.6-27b"),
        load_gpu("b200"),
        {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 800, "mem_fraction_static": 0.94},
    )
    assert not p.fits
    reason = skip_reason(p)
    assert reason.startswith(p.message)  # SGLang's line first: the correction reads its figures
    assert "the Mamba state of 800 slots" in reason and "--max-mamba-cache-size" in reason
    budget = p.extra["pre_gib"] * p.mem_fraction_static
    assert f"{budget:.1f} GiB --mem-fraction-static 0.94 reserves" in reason


def test_a_plan_that_fits_or_has_no_sizes_gets_no_account():
    fits = plan(load_model("qwen3.6-27b"), load_gpu("b200"), {})
    assert fits.fits and pool_cause(fits) is None
    unsized = MemoryPlan(
        fits=False,
        failure="bad_args",
        message="AssertionError: heads",
        mem_fraction_static=0.9,
        max_mamba_cache_size=None,
        max_running_requests=0,
        kv_tokens=0,
        inert=[],
        gib=MemoryGiB(),
    )
    assert skip_reason(unsized) == "AssertionError: heads"
