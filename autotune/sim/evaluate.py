"""The simulated server without the server: the same ``Scheduler`` on a virtual clock, driven by a closed-loop
client that replays a prompt sample the way the harness does.

A trial that takes minutes of wall time on the HTTP simulator takes a fraction of a second here, so search
strategies can be compared over thousands of trials. Metrics use the harness's definitions over the window
[warmup, warmup + measure): tokens by the time they are emitted, TTFT of first tokens inside it, ITL per token
(a chunk's gap over its tokens), E2E and accept length of the requests that finish inside it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autotune.errors import ConfigError, WorkloadError
from autotune.prompts import check_repeats, on_pass, walk_position
from autotune.results import Capacity, Metrics, Percentiles, halves_drift
from autotune.settle import AGREE_TOLERANCE, TARGET_HALF_WIDTH, Settler, SettleRule, Settling, ramp_of, settle_rule
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
    warmup_s: float = 60.0  # floors of the settle rule (``autotune.settle``), as the harness's workload
    measure_s: float = 300.0
    warmup_max_s: float | None = None  # None: 4 × warmup_s
    measure_max_s: float | None = None  # None: 4 × measure_s
    target_half_width: float = TARGET_HALF_WIDTH
    settle_tolerance: float = AGREE_TOLERANCE
    ramp_s: float | None = None  # None: half the warm-up floor; stream k of c starts at k / c × ramp_s
    ignore_eos: bool = False
    repeats: str = "fresh"  # the harness's ``workload.repeats``: each walk through the sample pass-marked, or not

    @property
    def rule(self) -> SettleRule:
        return settle_rule(self)

    @property
    def ramp(self) -> float:
        return ramp_of(self)

    def __post_init__(self) -> None:
        check_repeats(self.repeats)
        if not self.prompts:
            raise WorkloadError("the prompt sample is empty", key="prompts", fix="give at least one prompt")
        if self.max_tokens < 1:
            raise WorkloadError(f"max_tokens must be at least 1, got {self.max_tokens}", key="max_tokens")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be at least 1, got {self.concurrency}", key="concurrency")
        if self.warmup_s < 0 or self.measure_s <= 0:
            raise WorkloadError(
                f"need warmup_s ≥ 0 and measure_s > 0, got {self.warmup_s} and {self.measure_s}", key="measure_s"
            )
        if self.ramp_s is not None and self.ramp_s < 0:
            raise WorkloadError(f"ramp_s must be >= 0, got {self.ramp_s}", key="ramp_s")


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
    settling: Settling | None = None  # the settle rule's verdict and every slice's tok/s (as the harness records)
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
    return Percentiles(p50=float(p50), p90=float(p90), p99=float(p99), mean=float((values * weights).sum() / cum[-1]))


def _capacity(mp: Any) -> Capacity:
    gib = mp.gib
    return Capacity(
        max_running_requests=mp.max_running_requests,
        kv_tokens=mp.kv_tokens,
        mamba_slots=mp.max_mamba_cache_size,
        mem_fraction_static=mp.mem_fraction_static,
        context_len=mp.extra.get("context_len"),
        chunked_prefill_size=mp.extra.get("chunked_prefill_size"),
        weights_gib=gib.weights,
        kv_gib=gib.kv,
        mamba_gib=gib.mamba_total,
        graphs_gib=gib.graphs,
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
    # What the plan gave: the outcome of a config that does not start, and the plan's part of any other.
    planned = SimEvaluation(
        status=mp.failure or "startup_oom",
        reason=mp.message,
        plan=mp.to_dict(),
        capacity=_capacity(mp),
        startup_s=mp.extra.get("startup_s"),
        max_running_requests=mp.max_running_requests,
        kv_tokens=mp.kv_tokens,
        mamba_slots=mp.max_mamba_cache_size,
    )
    if not mp.fits:
        return replace(planned, cpu_s=time.process_time() - cpu0)
    sched = Scheduler.from_plan(
        mp,
        model_p,
        gpu_p,
        noise=noise,
        seed=seed,
        emit=False,
        efficiency=deviation.efficiency(mp.extra) if deviation is not None else 1.0,
    )
    loop = _ClosedLoop(
        sched,
        workload,
        seed=seed,
        acceptance=acceptance,
        output_mean=output_mean,
        output_dist=output_dist,
        concurrency=workload.concurrency or 2 * sched.limits.max_running_requests,
    )
    status, reason = loop.run()
    metrics = loop.metrics() if status == "ok" else None
    hits, computed = sched.stats.cached_tokens_total, sched.stats.input_tokens_total
    return replace(
        planned,
        status=status,
        reason=reason,
        metrics=metrics,
        retractions=sched.stats.retractions,
        prefix_hit_share=round(hits / (hits + computed), 4) if hits + computed else 0.0,
        window_drift=loop.drift(),
        settling=loop.settling,
        sim_s=loop.t,
        cpu_s=time.process_time() - cpu0,
    )


class _ClosedLoop:
    """Keeps ``concurrency`` requests in flight, cycling through the prompts in order (each walk pass-marked when
    ``repeats`` is "fresh", as the harness's replay does), ramps the streams in and stops where the harness's
    settle rule (``autotune.settle``) stops, on the same per-slice token counts."""

    def __init__(
        self,
        sched: Scheduler,
        workload: SimWorkload,
        *,
        seed: int,
        acceptance: float,
        output_mean: float,
        output_dist: str,
        concurrency: int,
    ):
        self.sched, self.w, self.concurrency = sched, workload, concurrency
        self.make_request = functools.partial(
            make_request,
            ignore_eos=workload.ignore_eos,
            seed=seed,
            acceptance_mean=acceptance,
            output_mean=output_mean,
            output_dist=output_dist,
        )
        self.t = 0.0
        self.settler = Settler(workload.rule)
        self.settling: Settling | None = None
        self.slices: list[float] = []  # tokens per slice of ``settler.slice_s`` since the start, by emission time
        self.fed = 0  # slices handed to the settler
        self.keep_from = workload.rule.warmup_slices[0] * self.settler.slice_s  # the window never starts earlier
        self.window = (workload.warmup_s, workload.warmup_s + workload.measure_s)  # the settler's, once it stops
        self.sent = self.errors = 0
        self.drawn: dict[tuple[int, int], SimRequest] = {}  # by (prompt, pass marker)
        self.arrival: dict[str, float] = {}
        self.ttft: list[tuple[float, float]] = []  # (time, value) from the warm-up floor on: cut to the window later
        self.done: list[tuple[float, float, int, float]] = []  # (time, e2e, completion tokens, accept length or 0)
        self.cycles: list[tuple[Any, Any, np.ndarray]] = []  # (end time(s), gap(s), new tokens) per cycle or block

    def _send(self) -> None:
        index, pass_no = walk_position(self.sent, len(self.w.prompts), self.w.repeats)
        key = (index, pass_no)
        rid = str(self.sent)
        template = self.drawn.get(key)
        if template is None:  # a prompt's draws depend only on its text and the seed: derive them once
            text = on_pass(self.w.prompts[index], pass_no)
            template = self.drawn[key] = self.make_request(rid, text, self.w.max_tokens)
        self.sched.add(replace(template, rid=rid))
        self.arrival[rid] = self.t
        self.sent += 1

    def run(self) -> tuple[str, str | None]:
        """Step until the settle rule stops (or the run fails); stream k's first request at k / c × ramp."""
        sched, step, ramp = self.sched, self.sched.step, self.w.ramp
        started, stalled = 0, 0
        while self.settling is None:
            while started < self.concurrency and started / self.concurrency * ramp <= sched.clock:
                self.t = sched.clock
                self._send()
                started += 1
            if started < self.concurrency and not sched.has_work():
                sched.clock = started / self.concurrency * ramp  # idle until the next stream starts
                continue
            # single cycles while streams are still ramping in, so each starts on its time
            r: StepResult = step(BLOCK_CYCLES if started == self.concurrency else 1)
            if r.runtime_oom:
                return "runtime_oom", r.runtime_oom
            stalled = 0 if r.duration_s else stalled + 1
            if stalled > STALL_STEPS:
                self.t = sched.clock
                return "ok", "no request could be scheduled: every prompt is too long for the KV pool"
            t = self.t = sched.clock
            self._count(r, t)
            for rid in r.started:
                if t >= self.keep_from:
                    self.ttft.append((t, t - self.arrival[rid]))
            for em in r.finished:
                self._done(em, t)
                self._send()
            self._feed(t)
        return "ok", None

    def _count(self, r: StepResult, t: float) -> None:
        """A step's tokens into their slices (a block's cycles each by its own end), its cycles kept for ITL."""
        s = self.settler.slice_s
        if r.ends_s is not None:
            index = (r.ends_s / s).astype(np.int64)
            per = np.bincount(index - index[0], weights=r.cycle_tokens)
            self._grow(int(index[-1]))
            for offset, n in enumerate(per):
                self.slices[int(index[0]) + offset] += float(n)
            keep = r.ends_s >= self.keep_from
            assert isinstance(r.gaps_s, np.ndarray) and r.new is not None  # a block: per-cycle arrays
            if keep.any():
                self.cycles.append((r.ends_s[keep], r.gaps_s[keep], r.new[keep]))
            return
        if r.tokens:
            self._grow(int(t / s))
            self.slices[int(t / s)] += r.tokens
        if r.new is not None and t >= self.keep_from:
            self.cycles.append((t, r.gaps_s, r.new))

    def _grow(self, index: int) -> None:
        if index >= len(self.slices):
            self.slices.extend([0.0] * (index + 1 - len(self.slices)))

    def _feed(self, t: float) -> None:
        """Every slice that has ended into the settler; the window once it stops."""
        s = self.settler.slice_s
        while self.settling is None and (self.fed + 1) * s <= t:
            self.settling = self.settler.add(self.slices[self.fed] if self.fed < len(self.slices) else 0.0)
            self.fed += 1
        if self.settling is not None:
            self.window = self.settling.window

    def _done(self, em: Emission, t: float) -> None:
        arrival = self.arrival.pop(em.rid)
        if em.finish_reason == "abort":  # rejected (never fits): an error wherever it happens, as the harness counts
            self.errors += 1
            return
        if t >= self.keep_from:  # SGLang's per-request spec_accept_length: completion tokens per verify pass
            accept = em.completion_tokens / em.verify_ct if em.verify_ct else 0.0
            self.done.append((t, t - arrival, em.completion_tokens, accept))

    @property
    def tokens(self) -> int:
        """Tokens emitted inside the window (whole slices: the window starts and ends on slice boundaries)."""
        lo, hi = self.window
        s = self.settler.slice_s
        return int(sum(self.slices[round(lo / s) : round(hi / s)]))

    def drift(self) -> float:
        """The harness's ``window_drift`` on the window's slices (a middle slice split between the halves)."""
        s = self.settler.slice_s
        lo, hi = self.window
        inside = (self.slices + [0.0] * round(hi / s))[round(lo / s) : round(hi / s)]
        half = len(inside) / 2
        first = sum(inside[: int(half)]) + (inside[int(half)] / 2 if len(inside) % 2 else 0.0)
        return halves_drift(first, sum(inside) - first)

    def _window_cycles(self) -> tuple[list[Any], list[np.ndarray]]:
        """Gaps and new tokens of the cycles that ended inside the window."""
        lo, hi = self.window
        gaps, news = [], []
        for ends, gap, new in self.cycles:
            if isinstance(ends, np.ndarray):
                mask = (ends >= lo) & (ends < hi)
                if mask.any():
                    gaps.append(gap[mask])
                    news.append(new[mask])
            elif lo <= ends < hi:
                gaps.append(gap)
                news.append(new)
        return gaps, news

    def _itl_ms(self) -> Percentiles:
        """Per-token ITL percentiles over the window's decode cycles.

        A request's tokens from one cycle arrive as one chunk: each token's ITL is the chunk's gap over its size,
        weighted by that size. A cycle whose gap all its requests share (most) collapses to ≤ D weighted values.
        Entries are one cycle (``new`` 1-D; gap a float, or per request after an admission) or a block of cycles
        (``new`` k × n; one gap per cycle)."""
        row_gaps, row_new, loose_vals, loose_wts = [], [], [], []
        for gap, new in zip(*self._window_cycles(), strict=True):
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
        lo, hi = self.window
        window = hi - lo
        done = [d for d in self.done if lo <= d[0] < hi]
        accept_den = sum(d[2] for d in done if d[3])
        accept_num = sum(d[3] * d[2] for d in done if d[3])
        return Metrics(
            output_tok_s=self.tokens / window,
            request_s=len(done) / window,
            ttft_ms=_percentiles(np.asarray([v for t, v in self.ttft if lo <= t < hi]) * 1e3),
            itl_ms=self._itl_ms(),
            e2e_ms=_percentiles(np.asarray([d[1] for d in done]) * 1e3),
            accept_length=accept_num / accept_den if accept_den else None,
            output_tokens=self.tokens,
            completed=len(done),
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
    mtp = {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
    }
    configs = {
        "baseline": {**mtp, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4},
        "hand-tuned": {
            **mtp,
            "max_mamba_cache_size": 200,
            "mamba_full_memory_ratio": 0.6,
            "mem_fraction_static": 0.93,
            "max_running_requests": 64,
        },
    }
    for label, cfg in configs.items():
        ev = evaluate(cfg, work)
        m = ev.metrics
        tok = f"{m.output_tok_s:,.0f} tok/s, accept {m.accept_length:.2f}" if m else "-"
        print(
            f"{label:>10}: {ev.status}, R={ev.max_running_requests}, {tok}, {ev.sim_s:,.0f} simulated s in "
            f"{ev.cpu_s:.2f} CPU s = {ev.sim_s / max(ev.cpu_s, 1e-9):,.0f} simulated s per CPU s"
        )
