"""The simulated server without the server: the same ``Scheduler`` on a virtual clock, driven by a closed-loop
client that replays a prompt sample the way the harness does.

A trial that takes minutes of wall time on the HTTP simulator takes a fraction of a second here, so search
strategies can be compared over thousands of trials. Metrics use the harness's definitions over the window
[warmup, warmup + measure): tokens by the time they are emitted, TTFT of first tokens inside it, ITL per token
(a chunk's gap over its tokens), E2E and accept length of the requests that finish inside it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autotune.errors import ConfigError, WorkloadError
from autotune.prompts import check_repeats, on_pass, walk_position
from autotune.results import Capacity, Metrics, Percentiles, halves_drift
from autotune.sim.requests import SimRequest, check_request_params, make_request
from autotune.sim.scheduler import Emission, Scheduler, StepResult

STALL_STEPS = 100  # zero-time steps in a row: nothing can run (every prompt is too long for the KV pool)
BLOCK_CYCLES = 64  # quiet decode cycles the scheduler may run as one block (it stops at every event)


@dataclass(frozen=True, kw_only=True)
class SimWorkload:
    """A prompt sample and how to replay it (what the harness's replay client does over HTTP)."""

    prompts: Sequence[str]
    max_tokens: int = 4096
    concurrency: int | None = None  # None → 2 × the effective max_running_requests, like the harness
    warmup_s: float = 60.0
    measure_s: float = 300.0
    ignore_eos: bool = False
    repeats: str = "fresh"  # the harness's ``workload.repeats``: each walk through the sample pass-marked, or not

    def __post_init__(self) -> None:
        check_repeats(self.repeats)
        if not self.prompts:
            raise WorkloadError("the prompt sample is empty", key="prompts", fix="give at least one prompt")
        if self.max_tokens < 1:
            raise WorkloadError(f"max_tokens must be at least 1, got {self.max_tokens}", key="max_tokens")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be at least 1, got {self.concurrency}", key="concurrency")
        if self.warmup_s < 0 or self.measure_s <= 0:
            raise WorkloadError(f"need warmup_s ≥ 0 and measure_s > 0, got {self.warmup_s} and {self.measure_s}",
                                key="measure_s")


@dataclass(frozen=True, kw_only=True)
class SimEvaluation:
    """One simulated trial: a status like ``TrialResult.status``, the window's metrics, and what the plan gave."""

    status: str  # "ok" | a plan failure ("startup_oom", "bad_args", ...) | "runtime_oom"
    reason: str | None = None
    metrics: Metrics | None = None
    plan: dict[str, Any] | None = None
    capacity: Capacity | None = None
    startup_s: float | None = None  # modelled load + graph capture time
    max_running_requests: int | None = None
    kv_tokens: int | None = None
    mamba_slots: int | None = None
    retractions: int = 0
    prefix_hit_share: float = 0.0  # prompt tokens the radix cache served, of all prompt tokens admitted (whole run)
    window_drift: float = 0.0  # the harness's ``workload.window_drift``: the window's halves' tokens, apart
    sim_s: float = 0.0  # simulated seconds
    cpu_s: float = 0.0  # CPU seconds this evaluation took

    @property
    def output_tok_s(self) -> float:
        return self.metrics.output_tok_s if self.metrics else 0.0


def _percentiles(values: np.ndarray, weights: np.ndarray | None = None) -> Percentiles:
    """p50/p90/p99 and mean; with ``weights``, as if each value were repeated that many times."""
    if values.size == 0:
        return Percentiles()
    if weights is None:
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return Percentiles(p50=float(p50), p90=float(p90), p99=float(p99), mean=float(values.mean()))
    order = np.argsort(values)
    ranked, cum = values[order], np.cumsum(weights[order])
    at = np.searchsorted(cum, np.array([0.5, 0.9, 0.99]) * cum[-1])
    p50, p90, p99 = ranked[np.minimum(at, ranked.size - 1)]
    return Percentiles(p50=float(p50), p90=float(p90), p99=float(p99),
                       mean=float((values * weights).sum() / cum[-1]))


def _capacity(mp: Any) -> Capacity:
    gib = mp.gib
    return Capacity(
        max_running_requests=mp.max_running_requests, kv_tokens=mp.kv_tokens, mamba_slots=mp.max_mamba_cache_size,
        mem_fraction_static=mp.mem_fraction_static, context_len=mp.extra.get("context_len"),
        chunked_prefill_size=mp.extra.get("chunked_prefill_size"), weights_gib=gib.weights, kv_gib=gib.kv,
        mamba_gib=gib.mamba_total, graphs_gib=gib.graphs,
    )


def evaluate(
    flags: Mapping[str, Any],
    workload: SimWorkload,
    *,
    model: Any = "qwen3.6-27b",
    gpu: Any = "b200",
    seed: int = 0,
    noise: float = 0.0,
    acceptance: float = 0.825,
    output_mean: float = 2500,
    output_dist: str = "lognormal",
    deviation: Any = None,
) -> SimEvaluation:
    """Simulate one trial of ``flags`` (SGLang dest names) on ``workload``; ``model``/``gpu`` are names or profiles.
    ``deviation`` (``sim.truth.Deviation``) makes the simulated machine differ from the planner's model."""
    from autotune.sglang.flags import FlagTable
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model

    cpu0 = time.process_time()
    check_request_params(acceptance_mean=acceptance, output_mean=output_mean, output_dist=output_dist)
    model_p = load_model(model) if isinstance(model, str) else model
    gpu_p = load_gpu(gpu) if isinstance(gpu, str) else gpu
    try:  # what SGLang's parser rejects, the simulated server rejects too: a trial outcome, not an exception
        config = FlagTable.bundled().check(flags)
    except ConfigError as exc:
        return SimEvaluation(status="bad_args", reason=str(exc), cpu_s=time.process_time() - cpu0)
    mp = plan(model_p, gpu_p, config)
    if deviation is not None:
        from autotune.sim.truth import deviate

        mp = deviate(mp, model_p, deviation)
    common: dict[str, Any] = dict(
        plan=mp.to_dict(), capacity=_capacity(mp), startup_s=mp.extra.get("startup_s"),
        max_running_requests=mp.max_running_requests, kv_tokens=mp.kv_tokens, mamba_slots=mp.max_mamba_cache_size,
    )
    if not mp.fits:
        return SimEvaluation(status=mp.failure or "startup_oom", reason=mp.message, **common,
                             cpu_s=time.process_time() - cpu0)
    sched = Scheduler.from_plan(mp, model_p, gpu_p, noise=noise, seed=seed, emit=False,
                                track_interval=config.get("mamba_track_interval"),
                                efficiency=deviation.decode_efficiency if deviation is not None else 1.0)
    loop = _ClosedLoop(sched, workload, seed=seed, acceptance=acceptance, output_mean=output_mean,
                       output_dist=output_dist, concurrency=workload.concurrency or 2 * sched.limits.max_running_requests)
    status, reason = loop.run()
    metrics = loop.metrics() if status == "ok" else None
    hits, computed = sched.stats.cached_tokens_total, sched.stats.input_tokens_total
    return SimEvaluation(status=status, reason=reason, metrics=metrics, retractions=sched.stats.retractions,
                         prefix_hit_share=round(hits / (hits + computed), 4) if hits + computed else 0.0,
                         window_drift=halves_drift(loop.first_half, loop.tokens - loop.first_half), sim_s=loop.t,
                         cpu_s=time.process_time() - cpu0, **common)


class _ClosedLoop:
    """Keeps ``concurrency`` requests in flight, cycling through the prompts in order (each walk pass-marked when
    ``repeats`` is "fresh", as the harness's replay does), and records the window."""

    def __init__(self, sched: Scheduler, workload: SimWorkload, *, seed: int, acceptance: float, output_mean: float,
                 output_dist: str, concurrency: int):
        self.sched, self.w, self.concurrency = sched, workload, concurrency
        self.req_args = dict(ignore_eos=workload.ignore_eos, seed=seed, acceptance_mean=acceptance,
                             output_mean=output_mean, output_dist=output_dist)
        self.t = 0.0
        self.lo, self.hi = workload.warmup_s, workload.warmup_s + workload.measure_s
        self.sent = 0
        self.drawn: dict[tuple[int, int], SimRequest] = {}  # by (prompt, pass marker)
        self.arrival: dict[str, float] = {}
        self.tokens = self.first_half = self.completed = self.errors = 0  # first_half: window tokens before its middle
        self.accept_num = self.accept_den = 0.0  # Σ per-request accept length × tokens, Σ tokens
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.gaps: list[float | np.ndarray] = []  # per decode cycle (or block) in the window: gaps before tokens
        self.news: list[np.ndarray] = []  # ... and the tokens each request got

    def _send(self) -> None:
        index, pass_no = walk_position(self.sent, len(self.w.prompts), self.w.repeats)
        key = (index, pass_no)
        rid = str(self.sent)
        template = self.drawn.get(key)
        if template is None:  # a prompt's draws depend only on its text and the seed: derive them once
            text = on_pass(self.w.prompts[index], pass_no)
            template = self.drawn[key] = make_request(rid, text, self.w.max_tokens, **self.req_args)
        self.sched.add(replace(template, rid=rid))
        self.arrival[rid] = self.t
        self.sent += 1

    def run(self) -> tuple[str, str | None]:
        for _ in range(self.concurrency):
            self._send()
        sched, lo, hi = self.sched, self.lo, self.hi
        step = sched.step
        add_gap, add_new = self.gaps.append, self.news.append
        t, tokens, first_half, stalled = 0.0, 0, 0, 0
        mid = (lo + hi) / 2
        status: tuple[str, str | None] = ("ok", None)
        while t < hi:
            r: StepResult = step(BLOCK_CYCLES)
            if r.runtime_oom:
                status = ("runtime_oom", r.runtime_oom)
                break
            if r.duration_s:
                stalled = 0
            else:
                stalled += 1
                if stalled > STALL_STEPS:
                    status = ("ok", "no request could be scheduled: every prompt is too long for the KV pool")
                    break
            t = sched.clock
            inside = lo <= t < hi
            if r.ends_s is not None:  # a block of cycles: count each cycle by its own end
                mask = (r.ends_s >= lo) & (r.ends_s < hi)
                if mask.any():
                    tokens += int(r.cycle_tokens[mask].sum())
                    first_half += int(r.cycle_tokens[mask & (r.ends_s < mid)].sum())
                    add_gap(r.gaps_s[mask])
                    add_new(r.new[mask])
            elif inside:
                tokens += r.tokens
                first_half += r.tokens if t < mid else 0
                if r.new is not None:
                    add_gap(r.gaps_s)
                    add_new(r.new)
            if r.started or r.finished:
                self.t = t
                for rid in r.started:
                    if inside:
                        self.ttft.append(t - self.arrival[rid])
                for em in r.finished:
                    self._done(em, inside)
                    self._send()
        self.t, self.tokens, self.first_half = t, tokens, first_half
        return status

    def _done(self, em: Emission, inside: bool) -> None:
        arrival = self.arrival.pop(em.rid)
        if em.finish_reason == "abort":  # rejected (never fits): an error wherever it happens, as the harness counts
            self.errors += 1
            return
        if not inside:
            return
        self.completed += 1
        self.e2e.append(self.t - arrival)
        if em.verify_ct:  # SGLang's per-request spec_accept_length: completion tokens per verify pass
            self.accept_num += em.completion_tokens / em.verify_ct * em.completion_tokens
            self.accept_den += em.completion_tokens

    def _itl_ms(self) -> Percentiles:
        """Per-token ITL percentiles over the window's decode cycles.

        A request's tokens from one cycle arrive as one chunk: each token's ITL is the chunk's gap over its size,
        weighted by that size. A cycle whose gap all its requests share (most) collapses to ≤ D weighted values.
        Entries are one cycle (``new`` 1-D; gap a float, or per request after an admission) or a block of cycles
        (``new`` k × n; one gap per cycle)."""
        row_gaps, row_new, loose_vals, loose_wts = [], [], [], []
        for gap, new in zip(self.gaps, self.news, strict=True):
            if new.ndim == 2:
                row_gaps.append(gap)
                row_new.append(new)
            elif isinstance(gap, float):
                row_gaps.append(np.array([gap]))
                row_new.append(new[None, :])
            else:
                loose_vals.append(gap * 1e3 / new)
                loose_wts.append(new)
        if row_gaps:
            gaps = np.concatenate(row_gaps)
            sizes = np.concatenate([np.full(len(b), b.shape[1]) for b in row_new])
            flat = np.concatenate([b.ravel() for b in row_new])
            per = flat.astype(np.int64)
            top = int(per.max())
            rows = np.repeat(np.arange(len(gaps)), sizes)
            weight = np.bincount(rows * top + per - 1, weights=flat, minlength=len(gaps) * top).reshape(-1, top)
            values = gaps[:, None] * 1e3 / np.arange(1, top + 1)[None, :]
            keep = weight > 0
            loose_vals.append(values[keep])
            loose_wts.append(weight[keep])
        if not loose_vals:
            return Percentiles()
        return _percentiles(np.concatenate(loose_vals), np.concatenate(loose_wts))

    def metrics(self) -> Metrics:
        window = self.w.measure_s
        itl = self._itl_ms()
        return Metrics(
            output_tok_s=self.tokens / window,
            request_s=self.completed / window,
            ttft_ms=_percentiles(np.asarray(self.ttft) * 1e3),
            itl_ms=itl,
            e2e_ms=_percentiles(np.asarray(self.e2e) * 1e3),
            accept_length=self.accept_num / self.accept_den if self.accept_den else None,
            output_tokens=self.tokens,
            completed=self.completed,
            errors=self.errors,
            window_s=window,
            concurrency=self.concurrency,
        )


def _seed_prompts(n: int = 512, mean_tokens: int = 270, seed: int = 0) -> list[str]:
    """Synthetic prompts with the seed job's shape (~270 tokens on average), each distinct."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean_tokens) - 0.18, 0.6, n), 16, 4 * mean_tokens).astype(int)
    return [f"prompt {i}: " + "lorem ipsum dolor sit amet " * (int(k) * 4 // 27 + 1) for i, k in enumerate(lengths)]


if __name__ == "__main__":  # figures for the seed configs; the benchmark script calls evaluate() directly
    prompts = _seed_prompts()
    work = SimWorkload(prompts=prompts, max_tokens=4096, warmup_s=60, measure_s=600)
    mtp = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
           "speculative_num_draft_tokens": 4}
    configs = {
        "baseline": {**mtp, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4},
        "hand-tuned": {**mtp, "max_mamba_cache_size": 200, "mamba_full_memory_ratio": 0.6,
                       "mem_fraction_static": 0.93, "max_running_requests": 64},
    }
    for label, cfg in configs.items():
        ev = evaluate(cfg, work)
        m = ev.metrics
        tok = f"{m.output_tok_s:,.0f} tok/s, accept {m.accept_length:.2f}" if m else "-"
        print(f"{label:>10}: {ev.status}, R={ev.max_running_requests}, {tok}, {ev.sim_s:,.0f} simulated s in "
              f"{ev.cpu_s:.2f} CPU s = {ev.sim_s / max(ev.cpu_s, 1e-9):,.0f} simulated s per CPU s")
