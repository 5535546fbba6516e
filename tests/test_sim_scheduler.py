"""The scheduler with hand-built limits (the planner's numbers are tested through evaluate), and the requests
it schedules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.sglang.memory import MemoryGiB, MemoryPlan
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim.perf import PerfModel, PerfParams, expected_accept_length
from autotune.sim.requests import SimRequest, count_tokens, make_request
from autotune.sim.scheduler import Scheduler, SchedulerLimits, StepResult

pytestmark = pytest.mark.timeout(60)

PARAMS = PerfParams.from_profiles(load_model("qwen3.6-27b"), load_gpu("b200"))


def limits(**overrides) -> SchedulerLimits:
    base = dict(
        max_running_requests=4,
        kv_tokens=200_000,
        chunked_prefill_size=4096,
        page_size=1,
        spec=True,
        draft_tokens=4,
        mamba_slots=20,
        ratio=5,
        decode_graph_bs=512,
        decode_log_interval=40,
    )
    base.update(overrides)
    return SchedulerLimits(**base)


def scheduler(lim: SchedulerLimits | None = None, *, seed: int = 0) -> Scheduler:
    lim = lim or limits()
    return Scheduler(lim, PerfModel(PARAMS, spec=lim.spec, draft_tokens=lim.draft_tokens), seed=seed)


def req(rid: str, prompt: int = 100, target: int = 50, *, alpha: float = 0.8, eos: bool = True) -> SimRequest:
    """A request producing exactly ``target`` tokens (``eos``: it stops on its own, else max_new_tokens cuts it)."""
    if eos:
        return SimRequest(
            rid=rid, prompt_tokens=prompt, max_new_tokens=4 * target, ignore_eos=False, natural_len=target, alpha=alpha
        )
    return SimRequest(
        rid=rid, prompt_tokens=prompt, max_new_tokens=target, ignore_eos=True, natural_len=10 * target, alpha=alpha
    )


def drain(s: Scheduler, max_steps: int = 200_000) -> list[StepResult]:
    out = []
    for _ in range(max_steps):
        if not s.has_work():
            return out
        out.append(s.step())
        if out[-1].runtime_oom:
            return out
    raise AssertionError("the scheduler never drained")


# -- requests ---------------------------------------------------------------------------------------------
def test_count_tokens() -> None:
    assert count_tokens("") == 1
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2
    assert count_tokens("x" * 1080) == 270


def test_make_request_is_deterministic_and_spread() -> None:
    a = make_request("a", "hello world", 4096, seed=1)
    b = make_request("b", "hello world", 4096, seed=1)
    assert (a.alpha, a.natural_len) == (b.alpha, b.natural_len)
    many = [make_request(str(i), f"prompt {i}", 100_000, seed=0) for i in range(2000)]
    alphas = [r.alpha for r in many]
    lengths = [r.natural_len for r in many]
    assert sum(alphas) / len(alphas) == pytest.approx(0.825, abs=0.01)
    assert max(alphas) - min(alphas) > 0.1
    assert sum(lengths) / len(lengths) == pytest.approx(2500, rel=0.05)
    assert len({make_request("x", "hello world", 4096, seed=s).natural_len for s in range(20)}) > 10


def test_target_len_and_finish_reason() -> None:
    stop = make_request("a", "p", 100_000, output_dist="fixed", output_mean=300)
    assert (stop.target_len, stop.finish_reason) == (300, "stop")
    cut = make_request("a", "p", 200, output_dist="fixed", output_mean=300)
    assert (cut.target_len, cut.finish_reason) == (200, "length")
    forced = make_request("a", "p", 1000, ignore_eos=True, output_dist="fixed", output_mean=300)
    assert (forced.target_len, forced.finish_reason) == (1000, "length")
    uniform = [
        make_request(str(i), str(i), 10_000, output_dist="uniform", output_mean=100).natural_len for i in range(500)
    ]
    assert 1 <= min(uniform) and max(uniform) <= 199


def test_request_derivation_is_stable_across_processes() -> None:
    code = (
        "from autotune.sim.requests import make_request as m; "
        "r = m('q', 'The capital of France is', 4096, seed=7); print(repr((r.alpha, r.natural_len)))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
            cwd=Path(__file__).parents[1],
            env={"PYTHONHASHSEED": str(k)},
        ).stdout
        for k in (1, 2)
    }
    here = make_request("q", "The capital of France is", 4096, seed=7)
    assert outs == {repr((here.alpha, here.natural_len)) + "\n"}


def test_bad_request_params_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="output_dist"):
        make_request("a", "p", 10, output_dist="pareto")
    with pytest.raises(ConfigError, match="acceptance"):
        make_request("a", "p", 10, acceptance_mean=1.5)


# -- limits -----------------------------------------------------------------------------------------------
def test_limits_validate_and_read_a_plan() -> None:
    with pytest.raises(ConfigError, match="max_running_requests"):
        limits(max_running_requests=0)
    plan = MemoryPlan(
        fits=True,
        failure=None,
        message=None,
        mem_fraction_static=0.93,
        max_mamba_cache_size=200,
        max_running_requests=40,
        kv_tokens=798_000,
        inert=[],
        gib=MemoryGiB(),
        extra={
            "ratio": 5,
            "spec": True,
            "draft_tokens": 4,
            "chunked_prefill_size": 16384,
            "page_size": 64,
            "runtime_oom_tokens": 30000,
            "decode_graph_bs": 40,
        },
    )
    lim = SchedulerLimits.from_plan(plan)
    assert (lim.max_running_requests, lim.kv_tokens, lim.mamba_slots, lim.draft_tokens) == (40, 798_000, 200, 4)
    assert (lim.page_size, lim.chunked_prefill_size, lim.runtime_oom_tokens, lim.decode_graph_bs) == (
        64,
        16384,
        30000,
        40,
    )
    assert lim.hybrid and lim.mamba_slots_per_req == 3


# -- batching ---------------------------------------------------------------------------------------------
def test_batching_is_bounded_by_max_running_requests() -> None:
    s = scheduler()
    for i in range(10):
        s.add(req(str(i)))
    first = s.step()
    assert first.kind == "prefill"
    st = s.stats
    assert (st.num_running, st.num_queue, st.kv_used, st.mamba_used) == (4, 6, 404, 13)  # 4×(100+1); 4×3+1 slots
    assert st.prompt_tokens_total == 400 and st.generation_tokens_total == 4
    assert sorted(first.started) == ["0", "1", "2", "3"]
    assert re.fullmatch(
        r"Prefill batch, #new-seq: 4, #new-token: 400, #cached-token: 0, full token usage: \d\.\d\d, "
        r"mamba usage: \d\.\d\d, #running-req: 0, #queue-req: 6, #pending-token: 600, "
        r"cuda graph: False, input throughput \(token/s\): [\d.]+",
        first.log_lines[0],
    )
    second = s.step()
    assert second.kind == "decode" and len(second.emissions) == 4
    assert all(1 <= e.new_tokens <= 4 for e in second.emissions)


def test_every_request_gets_exactly_its_tokens() -> None:
    s = scheduler(limits(max_running_requests=3))
    targets = {"a": 1, "b": 37, "c": 120, "d": 5, "e": 64}
    for rid, n in targets.items():
        s.add(req(rid, target=n, eos=rid in "ace"))
    got: dict[str, int] = {}
    finals = {}
    for res in drain(s):
        for e in res.emissions:
            got[e.rid] = got.get(e.rid, 0) + e.new_tokens
            assert e.completion_tokens == got[e.rid]
            if e.finished:
                finals[e.rid] = e
    assert got == targets
    assert {rid: e.finish_reason for rid, e in finals.items()} == {
        "a": "stop",
        "b": "length",
        "c": "stop",
        "d": "length",
        "e": "stop",
    }
    assert s.stats.requests_total == 5 and s.stats.generation_tokens_total == sum(targets.values())
    c = finals["c"]
    assert c.verify_ct > 0 and c.completion_tokens == 1 + c.verify_ct + c.accepted_drafts


def test_long_prompt_is_chunked_and_first_token_comes_from_the_last_chunk() -> None:
    s = scheduler()
    s.add(req("long", prompt=10_000, target=3))
    kinds = []
    for _ in range(3):
        res = s.step()
        kinds.append((res.kind, res.tokens, res.started))
    assert kinds == [("prefill", 0, []), ("prefill", 0, []), ("prefill", 1, ["long"])]
    assert s.stats.prompt_tokens_total == 10_000


def test_accept_length_follows_alpha() -> None:
    s = scheduler(limits(max_running_requests=8))
    for i in range(8):
        s.add(req(str(i), target=3000, alpha=0.825, eos=False))
    drain(s)
    assert s.stats.avg_spec_accept_length == pytest.approx(expected_accept_length(0.825, 4), rel=0.03)
    s.stats.reset_spec()
    assert s.stats.avg_spec_accept_length is None


def test_decode_log_line_every_interval() -> None:
    s = scheduler(limits(decode_log_interval=40))
    s.add(req("a", target=400, eos=False))
    lines = [line for res in drain(s) for line in res.log_lines if line.startswith("Decode")]
    assert len(lines) == s._cycles // 40
    assert re.fullmatch(
        r"Decode batch, #running-req: 1, #full token: \d+, full token usage: 0\.\d\d, mamba num: 4, "
        r"mamba usage: 0\.20, accept len: \d\.\d\d, accept rate: 0\.\d\d, cuda graph: True, "
        r"gen throughput \(token/s\): [\d.]+, #queue-req: 0",
        lines[0],
    )


def test_no_spec_emits_one_token_per_cycle_and_plain_log_fields() -> None:
    s = scheduler(limits(spec=False, draft_tokens=1, mamba_slots=None, ratio=1))
    s.add(req("a", target=100))
    results = drain(s)
    decodes = [r for r in results if r.kind == "decode"]
    assert len(decodes) == 99 and all(r.tokens == 1 and r.verify == 0 for r in decodes)
    line = next(line for r in results for line in r.log_lines if line.startswith("Decode"))
    assert "#token: " in line and "mamba" not in line and "accept" not in line


def test_kv_pressure_retracts_without_crashing() -> None:
    s = scheduler(limits(max_running_requests=8, kv_tokens=3000))
    for i in range(8):
        s.add(req(str(i), prompt=200, target=400, eos=False))
    results = drain(s)
    retracts = [line for r in results for line in r.log_lines if line.startswith("KV cache pool is full")]
    assert retracts
    assert re.fullmatch(
        r"KV cache pool is full\. Retract requests\. #retracted_reqs: \d+, #new_tokens_gained: \d+, "
        r"#mamba_num_gained: \d+, #new_token_ratio: \d\.\d{4} -> \d\.\d{4}",
        retracts[0],
    )
    finished = {e.rid: e for r in results for e in r.finished}
    assert len(finished) == 8 and all(e.completion_tokens == 400 for e in finished.values())
    assert s.stats.retractions >= 1 and any(e.retractions for e in finished.values())
    assert not any(r.runtime_oom for r in results)


def test_prompt_larger_than_the_pool_is_aborted_not_stuck() -> None:
    s = scheduler(limits(kv_tokens=1000))
    s.add(req("huge", prompt=5000))
    s.add(req("ok", prompt=100, target=10))
    results = drain(s)
    finished = {e.rid: e.finish_reason for r in results for e in r.finished}
    assert finished == {"huge": "abort", "ok": "stop"}


def test_runtime_oom_on_a_large_prefill_batch() -> None:
    s = scheduler(limits(runtime_oom_tokens=1000, chunked_prefill_size=8192))
    s.add(req("small", prompt=500, target=5))
    assert s.step().runtime_oom is None
    for i in range(3):
        s.add(req(f"big{i}", prompt=900))
    drain(s)
    res = s.step()
    assert res.runtime_oom and "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in res.runtime_oom
    assert not s.has_work()


def test_abort_frees_the_slot() -> None:
    s = scheduler(limits(max_running_requests=1))
    s.add(req("a", target=1000))
    s.add(req("b", target=5))
    s.step()
    s.step()
    s.abort("a")
    rest = drain(s)
    assert all(e.rid == "b" for r in rest for e in r.emissions)
    assert {e.rid for r in rest for e in r.finished} == {"b"}
    assert s.stats.aborted_total == 1


def test_same_seed_same_run_and_seed_matters() -> None:
    def run(seed: int) -> list[tuple[str, int]]:
        s = scheduler(seed=seed)
        for i in range(6):
            s.add(req(str(i), target=200, alpha=0.7))
        return [(e.rid, e.new_tokens) for r in drain(s) for e in r.emissions]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_without_emissions_the_events_still_come() -> None:
    lim = limits()
    s = Scheduler(lim, PerfModel(PARAMS, spec=True, draft_tokens=4), emit=False)
    s.add(req("a", target=30))
    results = drain(s)
    assert all(not r.emissions for r in results)
    assert sum(r.tokens for r in results) == 30
    assert [e.rid for r in results for e in r.finished] == ["a"]


def run_both_ways(lim: SchedulerLimits, requests: list[SimRequest], *, noise: float, seed: int) -> list[list[tuple]]:
    """The same requests through an emitting scheduler stepped one cycle at a time, and through a silent one
    that may run quiet stretches as blocks (what evaluate does)."""
    runs = []
    for emit, cycles in ((True, 1), (False, 64)):
        s = Scheduler(
            lim,
            PerfModel(PARAMS, spec=lim.spec, draft_tokens=lim.draft_tokens, noise=noise, seed=seed),
            seed=seed,
            emit=emit,
        )
        for r in requests:
            s.add(r)
        events = []
        while s.has_work():
            res = s.step(cycles)
            retracts = [line for line in res.log_lines if line.startswith("KV cache")]
            if res.finished or res.started or retracts:
                events.append(
                    (
                        s.clock,
                        [(e.rid, e.completion_tokens, e.verify_ct, e.accepted_drafts) for e in res.finished],
                        list(res.started),
                        retracts,
                    )
                )
        st = s.stats
        events.append((st.generation_tokens_total, st.spec_verify_ct, st.retractions, st.new_token_ratio))
        runs.append(events)
    return runs


@pytest.mark.parametrize("spec", [True, False])
def test_emitting_and_virtual_runs_are_the_same_run(spec: bool) -> None:
    """The HTTP server (emissions, one cycle per step) and evaluate (counters only, quiet stretches in blocks)
    drive one scheduler: the same events at the same clock times, bit for bit."""
    lim = limits(
        max_running_requests=8,
        kv_tokens=3000,
        page_size=16,
        spec=spec,
        draft_tokens=4 if spec else 1,
        decode_log_interval=40,
    )
    requests = [
        req(str(i), prompt=200 + 10 * i, target=400 + 20 * i, alpha=0.6 + 0.03 * i, eos=False) for i in range(10)
    ]
    emitting, virtual = run_both_ways(lim, requests, noise=0.1, seed=5)
    assert emitting == virtual
    assert any(retracts for *_, retracts in emitting[:-1])
    many = [req(str(i), prompt=100 + i, target=300 + 37 * i, alpha=0.85) for i in range(40)]
    emitting, virtual = run_both_ways(limits(max_running_requests=16, kv_tokens=400_000), many, noise=0.0, seed=1)
    assert emitting == virtual and len(emitting) > 40


@pytest.mark.parametrize("spec", [True, False])
def test_from_plan_builds_the_same_model_for_both_clocks(spec: bool) -> None:
    from autotune.sglang.memory import plan

    model, gpu = load_model("qwen3.6-27b"), load_gpu("b200")
    flags = {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 80} if spec else {"max_mamba_cache_size": 80}
    s = Scheduler.from_plan(plan(model, gpu, flags), model, gpu, decode_log_interval=10, emit=False)
    assert s.limits.decode_log_interval == 10 and s.limits.spec is spec and not s.emit
    assert s.limits.draft_tokens == (4 if spec else 1) and s.limits.page_size == 64
    # The plan's KV cell includes the MTP draft's share only under speculation; the target cell stays 64 KiB.
    assert s.perf.params.kv_cell_bytes == 65_536
    assert s.perf.params.draft_cell_bytes == 4_096
