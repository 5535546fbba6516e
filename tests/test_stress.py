"""The stress phase on the simulated SGLang server: the sample's longest prompts, ``max_tokens`` with ignore_eos and
the full running cap at once, in the launch that measured the window. One config survives with retractions and a
peak below the planner's; one passes its window and dies under the stress phase (the prefill activations of a
full chunk beyond what its memory fraction leaves, on a machine whose activations are 4 × the planner's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.config import Timeouts
from autotune.harness.engines import make_engine
from autotune.harness.setup import TrialSetup
from autotune.harness.stress import StressStep, burst_size, longest_rows, stress_line
from autotune.harness.trial import run_trial
from autotune.harness.workload import PromptSample, WorkloadSpec
from autotune.prompts.rows import estimate_tokens
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
GPU = 6  # a simulated device index only these tests use
SPEC = {
    "speculative_algorithm": "EAGLE",
    "speculative_eagle_topk": 1,
    "speculative_num_steps": 3,
    "speculative_num_draft_tokens": 4,
    "context_length": 8192,
}


@pytest.fixture
def devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    return tmp_path


def _setup(
    tmp_path: Path, *, max_tokens: int, concurrency: int | None = None, sim: dict | None = None, prompts: Path = PROMPTS
) -> TrialSetup:
    engine = make_engine(
        "sim",
        model_path="qwen3.6-27b",
        sim_gpu="b200",
        sim_options={"startup_s": 0.2, "release_s": 0.2, "warmup_s": 0.1, **(sim or {})},
    )
    work = WorkloadSpec(
        prompts=prompts, sample_size=50, warmup_s=1.0, measure_s=1.0, max_tokens=max_tokens, concurrency=concurrency
    )
    return TrialSetup(
        engine=engine,
        workload=work,
        gpu_index=GPU,
        run_dir=tmp_path / "runs",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )


def test_the_batch_is_the_longest_prompts_with_fresh_markers_and_a_queue_for_a_full_chunk():
    rows = PromptSample.load(PROMPTS, 100, 0).rows  # the shipped sample: ≈100–600-token prompts
    lengths = sorted((estimate_tokens(r) for r in rows), reverse=True)
    batch = longest_rows(rows, 130)
    assert [estimate_tokens(r) for r, _ in batch[:100]] == lengths  # longest first, the whole sample once
    assert {p for _, p in batch[:100]} == {10_000} and {p for _, p in batch[100:]} == {10_001}  # then a fresh walk
    mean = sum(lengths[:40]) / 40
    assert burst_size(rows, 40, 16384) == max(40, -(-2 * 16384 // int(mean)))  # two chunks of prompts queued
    assert burst_size(rows, 40, 16384) <= 4 * 40 and burst_size(rows, 40, None) == 40


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_config_survives_its_worst_case_with_retractions_and_a_peak_within_the_plan(devices):
    # 28 running requests of ≈490-token prompts at 1,024 tokens each need ≈42K KV tokens: a 30K pool retracts.
    config = {**SPEC, "max_running_requests": 32, "max_total_tokens": 30000}
    planned = plan(load_model("qwen3.6-27b"), load_gpu("b200"), config).to_dict()
    result = run_trial(
        _setup(devices, max_tokens=1024), config, trial_dir=devices / "t", after=[StressStep(plan=planned, cap_s=60)]
    )
    assert result.status == "ok", result.reason
    stress = result.stress
    assert stress is not None and stress.survived and stress.failure is None
    assert stress.retractions >= 1 and stress.reached_peak and stress.ended == "peak reached"
    assert stress.running_cap == result.capacity.max_running_requests and stress.max_tokens == 1024
    assert stress.kv_target_tokens == result.capacity.kv_tokens  # the batch needs more than the pool holds
    assert stress.planned_peak_gib == planned["extra"]["peak_gib"]
    assert 0 < stress.peak_used_gib <= stress.planned_peak_gib + 0.05 and stress.total_gib > stress.peak_used_gib
    line = stress_line(result.stress)
    assert line.startswith(f"worst case: peak {stress.peak_used_gib:.1f} of {stress.total_gib:.1f} GiB, ")
    assert line.endswith("retractions, survived") or line.endswith("1 retraction, survived")
    assert result.durations_s["stress"] < 60


@pytest.mark.timeout(120)
def test_a_config_that_passes_its_window_dies_under_the_stress_phase(devices):
    # At 0.95 a 4,096-token prefill chunk's activations fit the plan; on a machine with 4 × the planner's
    # activation memory one dies above ≈3,800 tokens. A job of one stream at a time (short prompts and a few of
    # ≈3,000 tokens) never prefills more than one prompt at once; its worst case, 64 of the long ones at once,
    # fills a chunk.
    prompts = devices / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"Report {i}: " + ("word " * (2400 if i % 5 == 0 else 80))}) + "\n" for i in range(50)
        )
    )
    config = {
        **SPEC,
        "disable_radix_cache": True,
        "max_running_requests": 64,
        "mem_fraction_static": 0.95,
        "chunked_prefill_size": 4096,
        "cuda_graph_max_bs_prefill": 1024,
    }
    assert plan(load_model("qwen3.6-27b"), load_gpu("b200"), config).fits  # the planner sees nothing wrong
    setup = _setup(devices, max_tokens=256, concurrency=1, sim={"activation_scale": 4.0}, prompts=prompts)
    result = run_trial(setup, config, trial_dir=devices / "t", after=[StressStep(cap_s=60)])
    assert result.status == "ok" and result.output_tok_s, result.reason  # the window measured
    stress = result.stress
    assert stress is not None and not stress.survived and stress.failure == "runtime_oom"
    assert stress.ended == "server exited" and "CUDA out of memory" in stress.reason
    assert stress_line(result.stress).startswith("worst case: peak ") and "FAILED: runtime_oom" in stress_line(
        result.stress
    )
