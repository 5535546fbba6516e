"""evaluate(): the scheduler on a virtual clock with the real planner — the calibration targets of the simulator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autotune.errors import WorkloadError
from autotune.sim.evaluate import SimEvaluation, SimWorkload, _seed_prompts, evaluate

pytestmark = pytest.mark.timeout(120)

MTP = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}
BASELINE = {**MTP, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4}
HAND_TUNED = {
    **MTP,
    "max_mamba_cache_size": 200,
    "mamba_full_memory_ratio": 0.6,
    "mem_fraction_static": 0.93,
    "max_running_requests": 64,
}


@pytest.fixture(scope="module")
def work() -> SimWorkload:
    """The seed job's shape: ~270-token prompts, answers of ~2.5K tokens capped at 4,096."""
    return SimWorkload(prompts=_seed_prompts(256), max_tokens=4096, warmup_s=60, measure_s=180)


@pytest.fixture(scope="module")
def baseline(work: SimWorkload) -> SimEvaluation:
    return evaluate(BASELINE, work)


@pytest.fixture(scope="module")
def tuned(work: SimWorkload) -> SimEvaluation:
    return evaluate(HAND_TUNED, work)


def test_c9_seed_baseline_throughput(baseline: SimEvaluation) -> None:
    assert baseline.status == "ok" and baseline.max_running_requests == 16
    m = baseline.metrics
    assert m is not None
    assert 2000 * 0.9 <= m.output_tok_s <= 2180 * 1.1
    assert m.accept_length == pytest.approx(3.07, abs=0.15)
    assert m.concurrency == 32  # 2 × R, like the harness


def test_c11_never_above_the_roofline(baseline: SimEvaluation, tuned: SimEvaluation) -> None:
    assert tuned.max_running_requests == 40
    assert baseline.output_tok_s <= 4800
    assert tuned.output_tok_s <= 8800


def test_hand_tuned_beats_baseline_like_the_seed(baseline: SimEvaluation, tuned: SimEvaluation) -> None:
    assert tuned.output_tok_s >= 1.8 * baseline.output_tok_s


def test_metrics_are_consistent(tuned: SimEvaluation) -> None:
    m = tuned.metrics
    assert m is not None and m.window_s == 180 and m.errors == 0
    assert m.completed > 50 and m.request_s == pytest.approx(m.completed / 180)
    assert m.output_tokens == pytest.approx(m.output_tok_s * 180)
    assert 0 < m.itl_ms.p50 <= m.itl_ms.p90 <= m.itl_ms.p99
    assert 0 < m.ttft_ms.p50 < m.e2e_ms.p50
    assert tuned.sim_s == pytest.approx(240, abs=1) and 0 < tuned.cpu_s
    assert tuned.startup_s and tuned.startup_s > 60  # modelled load + capture, not the instant sim start
    assert tuned.capacity is not None and tuned.capacity.kv_tokens == tuned.kv_tokens
    assert tuned.plan is not None and tuned.plan["fits"]


@pytest.mark.parametrize(("alpha", "batch", "spec_wins"), [(0.8, 64, True), (0.35, 64, False), (0.35, 128, False)])
def test_c12_c13_speculation_sign(work: SimWorkload, alpha: float, batch: int, spec_wins: bool) -> None:
    sized = {
        "max_mamba_cache_size": 5 * batch + 5,
        "max_running_requests": batch,
        "mem_fraction_static": 0.93,
        "mamba_ssm_dtype": "bfloat16",
    }
    short = SimWorkload(prompts=work.prompts, max_tokens=4096, warmup_s=40, measure_s=80)
    spec = evaluate({**MTP, **sized}, short, acceptance=alpha)
    plain = evaluate(sized, short, acceptance=alpha)
    assert spec.max_running_requests == plain.max_running_requests == batch
    assert (spec.output_tok_s > plain.output_tok_s) is spec_wins


def test_same_seed_same_result_and_noise_is_seeded(work: SimWorkload) -> None:
    short = SimWorkload(prompts=work.prompts, warmup_s=20, measure_s=60)
    a, b = evaluate(BASELINE, short, seed=3, noise=0.05), evaluate(BASELINE, short, seed=3, noise=0.05)
    assert a.metrics == b.metrics
    c = evaluate(BASELINE, short, seed=4, noise=0.05)
    assert c.metrics != a.metrics
    assert c.output_tok_s == pytest.approx(a.output_tok_s, rel=0.25)


def test_same_result_in_another_process(work: SimWorkload) -> None:
    code = (
        "from autotune.sim.evaluate import SimWorkload, _seed_prompts, evaluate; "
        "w = SimWorkload(prompts=_seed_prompts(256), warmup_s=10, measure_s=30); "
        "m = evaluate({'speculative_algorithm': 'EAGLE', 'max_mamba_cache_size': 80}, w, seed=9, noise=0.05).metrics; "
        "print(repr((m.output_tokens, m.completed, m.itl_ms.p99)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).parents[1],
        env={"PYTHONHASHSEED": "123"},
    )
    here = evaluate(
        {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 80},
        SimWorkload(prompts=_seed_prompts(256), warmup_s=10, measure_s=30),
        seed=9,
        noise=0.05,
    ).metrics
    assert here is not None
    assert out.stdout.strip() == repr((here.output_tokens, here.completed, here.itl_ms.p99))


def test_kv_pressure_retracts_and_keeps_serving(work: SimWorkload) -> None:
    ev = evaluate(
        {**BASELINE, "max_total_tokens": 20_000}, SimWorkload(prompts=work.prompts, warmup_s=30, measure_s=90)
    )
    assert ev.status == "ok" and ev.kv_tokens <= 20_000
    assert ev.retractions > 0
    assert ev.metrics is not None and ev.output_tok_s > 100


def test_plan_failures_are_returned_without_simulating(work: SimWorkload) -> None:
    oom = evaluate({**MTP, "mem_fraction_static": 0.97, "disable_prefill_cuda_graph": True}, work)
    assert oom.status == "runtime_oom" and "CUDA out of memory" in (oom.reason or "")
    assert oom.sim_s == 0 and oom.metrics is None and oom.output_tok_s == 0.0
    low = evaluate({**MTP, "mem_fraction_static": 0.3}, work)
    assert low.status == "startup_oom" and low.sim_s == 0
    assert "Not enough GPU memory" in (low.reason or "") or "Loaded weights leave no GPU memory" in (low.reason or "")


def test_unknown_or_renamed_flags_are_bad_args(work: SimWorkload) -> None:
    ev = evaluate({**MTP, "mamba_scheduler_strategy": "extra_buffer"}, work)
    assert ev.status == "bad_args" and "--mamba-radix-cache-strategy" in (ev.reason or "")
    assert ev.metrics is None and ev.sim_s == 0
    typed = evaluate(
        {**BASELINE, "max_mamba_cache_size": "80"}, SimWorkload(prompts=work.prompts, warmup_s=5, measure_s=10)
    )
    assert typed.status == "ok" and typed.mamba_slots == 80


def test_prompts_too_long_for_the_pool_are_errors_not_a_hang(work: SimWorkload) -> None:
    huge = SimWorkload(prompts=["word " * 40_000], warmup_s=5, measure_s=10)
    ev = evaluate({**BASELINE, "max_total_tokens": 20_000}, huge)
    assert ev.status == "ok" and "too long" in (ev.reason or "")
    assert ev.metrics is not None and ev.metrics.errors > 0 and ev.metrics.output_tokens == 0


def test_bad_workloads_are_workload_errors() -> None:
    with pytest.raises(WorkloadError, match="empty"):
        SimWorkload(prompts=[])
    with pytest.raises(WorkloadError, match="concurrency"):
        SimWorkload(prompts=["a"], concurrency=0)
    with pytest.raises(WorkloadError, match="measure_s"):
        SimWorkload(prompts=["a"], measure_s=0)


def test_package_exports_evaluate_lazily() -> None:
    code = (
        "import sys, autotune.sim as s; assert 'numpy' not in sys.modules; "
        "from autotune.sim import evaluate, SimWorkload; print(evaluate.__name__, SimWorkload.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert out.stdout.split() == ["evaluate", "SimWorkload"]


def test_fresh_repeats_keep_only_the_prefix_a_pass_shares() -> None:
    """A small sample walked many times: ``verbatim`` lets the radix cache serve whole prompts from the previous
    walk; ``fresh`` (the default) serves only the prefix prompts of one walk share, as a one-pass job would see."""
    shared = "system prompt " * 300  # ≈ 1,050 tokens every prompt starts with
    prompts = [shared + f"question {i}: " + f"{i} details " * 300 for i in range(12)]
    runs = {
        mode: evaluate(
            BASELINE, SimWorkload(prompts=prompts, max_tokens=32, concurrency=8, warmup_s=5, measure_s=20, repeats=mode)
        )
        for mode in ("fresh", "verbatim")
    }
    fresh, verbatim = runs["fresh"], runs["verbatim"]
    assert fresh.status == verbatim.status == "ok" and fresh.metrics.completed > 5 * len(prompts)  # many walks
    assert verbatim.prefix_hit_share > 0.9  # whole prompts from the previous walk
    assert 0.35 < fresh.prefix_hit_share < 0.56  # the shared system prompt only: ≈ 1,050 of ≈ 1,900 tokens
    assert verbatim.output_tok_s > 1.3 * fresh.output_tok_s  # what the repeated walks were worth
    alone = evaluate(
        BASELINE,
        SimWorkload(
            prompts=[p[len(shared) :] for p in prompts], max_tokens=32, concurrency=8, warmup_s=5, measure_s=20
        ),
    )
    assert alone.prefix_hit_share < 0.01  # no shared prefix, no walk repeated: nothing to serve
    with pytest.raises(WorkloadError, match="repeats"):
        SimWorkload(prompts=["a"], repeats="twice")


def test_window_drift_flags_a_window_that_caught_the_start() -> None:
    """Long prompts, short answers, no warm-up and a window held to 14 s: the window's first half is the first
    prefills (few tokens), its second the first decodes, and the settle rule flags it. The same floors under the
    default rule run on until the estimate holds, and read the steady rate; the seed workload's batch is full from
    the start."""
    prompts = [f"document {i}: " + f"line {i} of the record. " * 1000 for i in range(200)]  # ≈ 5,500 tokens each
    flags = {
        **MTP,
        "disable_radix_cache": True,
        "max_running_requests": 128,
        "max_mamba_cache_size": 128,
        "mem_fraction_static": 0.93,
    }
    start = evaluate(
        flags, SimWorkload(prompts=prompts, max_tokens=300, warmup_s=0, measure_s=14, measure_max_s=14), output_mean=300
    )
    steady = evaluate(flags, SimWorkload(prompts=prompts, max_tokens=300, warmup_s=120, measure_s=120), output_mean=300)
    ruled = evaluate(flags, SimWorkload(prompts=prompts, max_tokens=300, warmup_s=10, measure_s=30), output_mean=300)
    assert start.status == steady.status == ruled.status == "ok"
    assert start.window_drift > 1.0 and steady.window_drift < 0.1
    assert start.output_tok_s < 0.8 * steady.output_tok_s  # what the unsettled window got wrong
    assert start.settling is not None and not start.settling.settled  # ... and the rule says so
    assert abs(ruled.output_tok_s / steady.output_tok_s - 1) < 0.10
    assert ruled.settling is not None and ruled.settling.window[1] > 40  # it ran past its floors to get there
    seed = evaluate(BASELINE, SimWorkload(prompts=_seed_prompts(256), max_tokens=4096, warmup_s=10, measure_s=20))
    assert seed.window_drift < 0.1
