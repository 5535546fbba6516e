""" "Asked for N, got M": where the running cap SGLang granted is below the config's ``max_running_requests``, the
trial line, ``trials`` and ``inspect`` say so and name the pool that bound it. The pool is read from SGLang
0.5.23's own warnings (``sglang/srt/mem_cache/kv_cache_configurator.py`` L3141 "max_running_requests is capped to
%d by the mamba state cache", L3167 "max_running_requests was reduced from the requested %d to %d"), which the
planner and the simulator print word for word."""

from __future__ import annotations

import dataclasses

from test_diagnosis import probe_recorded

from autotune.harness.engines.logparse import capacity
from autotune.inspect.diagnose import explain_capacity
from autotune.inspect.state import ServerState
from autotune.progress import _fmt_result
from autotune.results import Capacity, Metrics, Percentiles, TrialResult, granted, granted_line
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model

MODEL, GPU = load_model("qwen3.6-27b"), load_gpu("b200")


def _log(p) -> str:
    return "\n".join(str(w) for w in p.extra["warnings"])


def test_the_planners_warning_names_the_pool_and_the_line_says_asked_and_got():
    config = {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 96, "max_running_requests": 32}
    p = plan(MODEL, GPU, config)
    assert p.extra["binding"] == "mamba" and p.max_running_requests < 32
    cap = capacity(_log(p))
    assert cap.bound_by == "mamba"
    cap = dataclasses.replace(cap, max_running_requests=p.max_running_requests)
    assert granted(config, cap) == (32, p.max_running_requests, "mamba")
    assert (
        granted_line(config, cap)
        == f"asked for 32 running, got {p.max_running_requests}: the Mamba state pool bound it"
    )
    # KV binds: L3167's warning, as SGLang words it
    kv = "max_running_requests was reduced from the requested 4096 to 1200 (per dp worker) due to the available KV"
    assert capacity(kv).bound_by == "kv" and capacity("nothing said").bound_by is None


def test_nothing_is_said_when_the_cap_is_what_was_asked_or_nothing_was_asked():
    cap = Capacity(max_running_requests=16, bound_by="mamba")
    assert granted({"max_running_requests": 16}, cap) is None
    assert granted({}, cap) is None  # SGLang's own default: nothing was asked
    assert granted({"max_running_requests": 64, "dp_size": 4}, cap) is None  # 64 over 4 DP workers: 16 each
    assert (
        granted_line({"max_running_requests": 20}, Capacity(max_running_requests=16)) == "asked for 20 running, got 16"
    )


def test_trial_line_says_asked_for_and_got():
    result = TrialResult(
        status="ok",
        config={"max_running_requests": 32},
        capacity=Capacity(max_running_requests=19, bound_by="mamba"),
        metrics=Metrics(
            output_tok_s=1000.0, request_s=1.0, ttft_ms=Percentiles(), itl_ms=Percentiles(), e2e_ms=Percentiles()
        ),
    )
    line = _fmt_result(result)
    assert "19 running (asked for 32 running, got 19: the Mamba state pool bound it)" in line


def test_inspect_says_asked_for_and_names_the_decode_lock_switch():
    state = ServerState.from_probe(probe_recorded())
    extra = dataclasses.replace(
        state,
        launch_command="python -m sglang.launch_server --max-running-requests 32",
        args={
            **state.args,
            "max_running_requests": 32,
            "mamba_radix_cache_strategy": "extra_buffer",
            "disable_overlap_schedule": False,
            "dp_size": 1,
        },
        mamba_slots=96,
        effective_mrr=24,
    )
    cap = explain_capacity(extra)
    # 96 // 5 = 19 is not what the server runs; 96 // 4 = 24 is (SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK, L3066-3069)
    assert cap.binding == "mamba" and "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1" in cap.sentence
    assert cap.sentence.startswith("asked for 32 running, got 24: ")
