"""SGLang's continuous-batching scheduler, reduced to what decides throughput, on an injected clock:
``Scheduler.step()`` runs one iteration and returns its modelled duration, never sleeping. docs/engines-and-
launchers.md ("The simulated engine").
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import numpy as np

from autotune.sim.batch import RunningBatch
from autotune.sim.limits import (
    ACTIVATION_BYTES_PER_TOKEN,
    CLIP_MAX_NEW_TOKENS,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    RETRACT_DECODE_STEPS,
    SchedulerLimits,
    SchedulerStats,
)
from autotune.sim.logs import decode_line, prefill_line, retract_line, runtime_oom
from autotune.sim.perf import PerfModel, PerfParams
from autotune.sim.requests import SimRequest
from autotune.sim.step import Emission, ReqState, StepResult

__all__ = ["Emission", "Scheduler", "SchedulerLimits", "SchedulerStats", "StepResult"]


class Scheduler(RunningBatch):
    """Continuous batching for one server: ``add`` and ``abort`` requests, ``step`` one iteration at a time.

    What the running requests hold (their slots, KV tokens, Mamba slots, radix-cache locks) is ``RunningBatch``'s
    (``sim.batch``); this class decides who runs: admission, prefill, decode cycles, retraction and aborts."""

    def __init__(self, limits: SchedulerLimits, perf: PerfModel, *, seed: int = 0, emit: bool = True):
        super().__init__(limits)
        self.perf = perf
        # False (evaluate): nobody reads per-request Emissions or batch log lines, so none are built; the events
        # (started, finished), counters and arrays are the same either way.
        self.emit = emit
        self._stats = SchedulerStats(kv_total=limits.kv_tokens, mamba_total=limits.mamba_slots or 0)
        self._rng = np.random.default_rng([seed, 0xACCE])
        self._expo = np.empty(0)  # a block of Exp(1) draws consumed n at a time by decode cycles
        self._expo_pos = 0
        self._budget = limits.chunked_prefill_size if limits.chunked_prefill_size > 0 else 1 << 62
        # extra_buffer tracks each decoding request's state every track-grid tokens (one state copy each:
        # ``schedule_batch.py`` L3802-3830), an expected copy per that many tokens generated.
        grid = limits.mamba_track_grid
        self._track_s_per_token = perf.state_copy_s(1) / grid if grid and limits.radix_cache else 0.0
        self.waiting: deque[ReqState] = deque()
        self._aborts: set[str] = set()
        self._unfit: list[Emission] = []  # requests that can never fit, finished with "abort" at the next return
        self._seq = 0
        self.clock = 0.0  # Σ step durations: the scheduler's own time (for gaps and throughput), never a clock read
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._dead: str | None = None
        self._log_tokens = self._log_verify = 0
        self._log_t = self._prefill_log_t = 0.0

    @classmethod
    def from_plan(
        cls,
        plan: Any,
        model: Any,
        gpu: Any,
        *,
        noise: float = 0.0,
        seed: int = 0,
        emit: bool = True,
        decode_log_interval: int = 40,
        efficiency: float = 1.0,
    ) -> Scheduler:
        """The scheduler and speed model for a fitting plan: one constructor for the paced and the virtual clock.
        ``efficiency`` scales the achieved bandwidth and compute shares (a machine faster or slower than the model:
        ``sim.truth.Deviation.decode_efficiency``)."""
        limits = SchedulerLimits.from_plan(plan, decode_log_interval=decode_log_interval)
        x = plan.extra
        params = PerfParams.from_profiles(
            model,
            gpu,
            kv_cell_bytes=x.get("kv_cell_bytes"),
            mamba_slot_bytes=x.get("mamba_slot_bytes"),
            with_draft=limits.spec,
            tp=int(x.get("tp_size") or 1),
        )
        if efficiency != 1.0:
            params = dataclasses.replace(
                params, eta_bw=params.eta_bw * efficiency, eta_compute=params.eta_compute * efficiency
            )
        perf = PerfModel(params, spec=limits.spec, draft_tokens=limits.draft_tokens, noise=noise, seed=seed)
        return cls(limits, perf, seed=seed, emit=emit)

    # -- the contract the HTTP server uses ----------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        self._seq += 1
        self.waiting.append(ReqState(req, self._seq))

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def has_work(self) -> bool:
        return self._dead is None and bool(self._n or self.waiting or self.chunked or self._aborts)

    def step(self, max_cycles: int = 1) -> StepResult:
        """One iteration. Without emissions, ``max_cycles`` > 1 lets a quiet stretch of decode cycles (no request
        finishing, nothing to admit, no log line) run as one block: the same cycles, draws and times as one by one."""
        if self._dead is not None:
            return StepResult(0.0, "idle", runtime_oom=self._dead)
        if self._aborts:
            self._apply_aborts()
        result = self._prefill() or (self._decode(max_cycles) if self._n else StepResult(0.0, "idle"))
        if self._unfit:
            result.finished = [*result.finished, *self._unfit]
            if self.emit:
                result.emissions = [*result.emissions, *self._unfit]
            self._unfit = []
        # A decode step ends exactly where its last cycle ended (``duration_s`` is that minus the start, rounded).
        self.clock = self._prev_end if result.kind == "decode" else self.clock + result.duration_s
        if self.cache is not None:
            self._make_room()
        return result

    @property
    def stats(self) -> SchedulerStats:
        """The counters, with the gauges refreshed now (refreshing them every step would cost the hot loop)."""
        s = self._stats
        s.num_running, s.num_queue = self._n, len(self.waiting) + (self.chunked is not None)
        s.kv_used = self.kv_used_tokens()
        s.mamba_used = self._mamba_num()
        s.new_token_ratio = self.new_token_ratio
        s.clock_s = self.clock
        return s

    # -- prefill ------------------------------------------------------------------------------------------
    def _prefill(self) -> StepResult | None:
        lim = self.limits
        if self.chunked is None and (not self.waiting or self._n >= lim.max_running_requests):
            return None
        budget = self._budget
        n = self._n
        # SGLang holds back new_token_ratio × what running requests may still generate (optimistic on purpose:
        # when it is wrong, decode retracts and the ratio goes up).
        left = np.minimum(self._slack[:n] + self._left[:n], CLIP_MAX_NEW_TOKENS).sum() if n else 0.0
        free = self._kv_cap() - self.kv_used_tokens() - float(left) * self.new_token_ratio
        batch: list[tuple[ReqState, int]] = []
        if self.chunked is not None:
            r = self.chunked
            take = min(r.extend_len - r.done_prefill, budget)
            batch.append((r, take))
            budget -= take
            free -= take
        cache = self.cache
        while self.waiting and budget > 0 and n + len(batch) < lim.max_running_requests:
            r = self.waiting[0]
            if r.req.prompt_tokens + r.gen + self._d + self._page > lim.kv_tokens:
                self.waiting.popleft()  # can never fit, even alone: SGLang rejects it
                self._finish_unfit(r)
                continue
            if cache is not None:
                held = cache.locked_tokens
                self._admit(r)
                free -= cache.locked_tokens - held  # a hit on an unlocked prefix now holds it
            need = r.extend_len
            future = min(r.req.max_new_tokens - r.gen, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
            if need + future > free and (n or batch):
                if cache is not None:
                    self._release(r)
                break  # wait for running requests to finish and free KV
            self.waiting.popleft()
            if need > budget:  # split: this chunk now, the rest in the next prefill steps
                take = budget // self._page * self._page or budget
                batch.append((r, take))
                break
            batch.append((r, need))
            budget -= need
            free -= need + future
        return self._run_prefill(batch) if batch else None

    def _run_prefill(self, batch: list[tuple[ReqState, int]]) -> StepResult:
        lim = self.limits
        new_tokens = sum(take for _, take in batch)
        if lim.runtime_oom_tokens is not None and new_tokens > lim.runtime_oom_tokens:
            self._dead = runtime_oom(new_tokens, new_tokens * ACTIVATION_BYTES_PER_TOKEN / 2**30)
            return StepResult(0.0, "prefill", runtime_oom=self._dead)
        running_before = self._n
        duration = self.perf.prefill_s(new_tokens, len(batch))
        cached = 0
        if self.cache is not None:
            cached = sum(r.cached for r, take in batch if r.done_prefill == 0)
            duration += self.perf.state_copy_s(self._insert_done(batch))
        st = self._stats
        st.input_tokens_total += new_tokens
        st.cached_tokens_total += cached
        now = self.clock + duration
        started: list[str] = []
        finished: list[Emission] = []
        emissions: list[Emission] = []
        self.chunked = None
        for r, take in batch:
            r.done_prefill += take
            if r.done_prefill < r.extend_len:
                self.chunked = r
                continue
            if r.gen == 0:
                self._stats.prompt_tokens_total += r.req.prompt_tokens
            r.gen += 1  # the last chunk samples the next token
            r.done_prefill = 0
            r.last_t = now
            if not r.started:
                r.started = True
                started.append(r.req.rid)
            if r.gen >= r.req.target_len:
                em = self._emission(r, 1, finished=True, reason=r.req.finish_reason)
                finished.append(em)
                if self.cache is not None:
                    self._release(r)
            else:
                self._enter(r)
                em = self._emission(r, 1, finished=False, reason=None)
            if self.emit:
                emissions.append(em)
        tokens = sum(1 for r, _ in batch if r is not self.chunked)
        self._stats.generation_tokens_total += tokens
        self._stats.requests_total += len(finished)
        lines: list[str] = []
        if self.emit:
            elapsed = max(now - self._prefill_log_t, 1e-9)
            self._prefill_log_t = now
            lines.append(
                prefill_line(
                    new_seq=len(batch),
                    new_token=new_tokens,
                    kv_usage=self.kv_used_tokens() / lim.kv_tokens,
                    mamba_usage=self._mamba_usage(),
                    hybrid=lim.hybrid,
                    running=running_before,
                    queue=len(self.waiting),
                    pending=sum(r.extend_len for r in self.waiting),
                    graph=new_tokens <= lim.prefill_graph_tokens,
                    throughput=new_tokens / elapsed,
                    cached_token=cached,
                )
            )
        return StepResult(
            duration,
            "prefill",
            emissions=emissions,
            log_lines=lines,
            tokens=tokens,
            started=started,
            finished=finished,
            prefill_tokens=new_tokens,
        )

    # -- decode -------------------------------------------------------------------------------------------
    def _decode(self, max_cycles: int = 1) -> StepResult:
        """One decode cycle over every running request; or, when nobody listens (``emit`` off) and nothing can
        happen in between, up to ``max_cycles`` of them as one block, ending at the first cycle where a request
        finishes. Both take the same draws in the same order, so they give the same run bit for bit."""
        lines: list[str] = []
        self._ensure_decode_room(lines)
        n = self._n
        if n == 0:
            return StepResult(0.0, "idle", log_lines=lines)
        lim, d, dc = self.limits, self._d, self._cycle_d()
        if d > 1 and self._expo_pos + n > len(self._expo):
            self._expo = self._rng.standard_exponential(1 << 16)
            self._expo_pos = 0
        quiet = max_cycles > 1 and not self.emit and not self._fresh and not lines
        k = self._quiet_cycles(max_cycles) if quiet else 1
        left = self._left[:n]
        if d > 1:  # accepted drafts = floor(E·c), P(≥ j) = α^j; tokens = min(accepted + 1, D)
            new = self._expo[self._expo_pos : self._expo_pos + k * n].reshape(k, n) * self._inv_nla[:n]
            new += 1.0
            np.minimum(new, dc, out=new)
            np.floor(new, out=new)
        else:
            new = np.ones((k, n))
        cum = np.cumsum(new, axis=0) if k > 1 else new
        hit = bool((cum[-1] >= left).any())
        if hit:  # stop at the first cycle where a request finishes; it gets only what it had left
            k = int(np.argmax((cum >= left).any(axis=1))) + 1
            new, cum = new[:k], cum[:k]
            np.minimum(new[-1], left - (cum[-2] if k > 1 else 0.0), out=new[-1])
        if d > 1:
            self._expo_pos += k * n
        row_tokens = new.sum(axis=1)
        graph = n <= lim.decode_graph_bs
        ends = None
        if k > 1:  # each cycle's time from its own starting context, summed in order as stepping would
            starts = self._ctx_sum + np.concatenate(([0.0], np.cumsum(row_tokens[:-1])))
            cycle_s = self.perf.decode_s_many(n, starts, graph=graph, d=dc) + row_tokens * self._track_s_per_token
            ends = np.cumsum(np.concatenate(([self.clock], cycle_s)))[1:]
            now = float(ends[-1])
        else:
            now = (
                self.clock
                + self.perf.decode_s(n, self._ctx_sum, graph=graph, d=dc)
                + float(row_tokens[0]) * self._track_s_per_token
            )
        left -= new.sum(axis=0)
        # Every request in the previous cycle last got tokens when it ended; only entrants since differ.
        gaps: float | np.ndarray
        if ends is not None:
            gaps = np.diff(np.concatenate(([self._prev_end], ends)))
        elif self._fresh:
            gaps = now - np.maximum(self._last[:n], self._prev_end)
        else:
            gaps = now - self._prev_end
        self._fresh = False
        self._prev_end = now
        tokens = int(row_tokens.sum())
        self._ctx_sum += tokens
        self._cycles += k
        emissions = self._emit_all(new[0]) if self.emit else []
        finished: list[Emission] = []
        if hit:
            for i in np.flatnonzero(left <= 0)[::-1]:  # highest slot first: swap-removal keeps the rest valid
                r = self._leave(int(i))
                em = self._emission(r, int(new[-1, i]), finished=True, reason=r.req.finish_reason)
                finished.append(em)
                if self.emit:
                    emissions[int(i)] = em
        st = self._stats
        st.requests_total += len(finished)
        st.generation_tokens_total += tokens
        if d > 1:
            st.spec_verify_ct += n * k
            st.spec_accepted_tokens += tokens
        self._log_tokens += tokens
        self._log_verify += n * k
        for _ in range(k):  # one subtraction per cycle, so the float is the same however cycles are grouped
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if self._cycles % lim.decode_log_interval == 0:
            self._log_decode(lines, now, n)
        block = ends is not None
        return StepResult(
            now - self.clock,
            "decode",
            emissions=emissions,
            log_lines=lines,
            tokens=tokens,
            verify=n * k if d > 1 else 0,
            finished=finished,
            gaps_s=gaps,
            new=new if block else new[0],
            ends_s=ends,
            cycle_tokens=row_tokens if block else None,
        )

    def _quiet_cycles(self, max_cycles: int) -> int:
        """How many cycles may run as one block: up to the next decode-log line, while the KV fast path holds
        for every one of them, and within the current block of acceptance draws."""
        lim, n, d, page = self.limits, self._n, self._d, self._page
        k = min(max_cycles, lim.decode_log_interval - self._cycles % lim.decode_log_interval)
        room = self._kv_cap() - self._ctx_sum + self._shared() - n * (page - 1 + d)
        k = min(k, int(room // (n * d)) + 1)
        if d > 1:
            k = min(k, (len(self._expo) - self._expo_pos) // n)
        return max(k, 1)

    def _log_decode(self, lines: list[str], now: float, n: int) -> None:
        lim = self.limits
        gen_tps = self._log_tokens / max(now - self._log_t, 1e-9)
        accept = self._log_tokens / self._log_verify if self._log_verify else 1.0
        self._stats.last_gen_throughput = gen_tps
        self._log_tokens = self._log_verify = 0
        self._log_t = now
        if self.emit:
            used = self.kv_used_tokens()
            lines.append(
                decode_line(
                    running=self._n,
                    kv_used=used,
                    kv_usage=used / lim.kv_tokens,
                    mamba_num=self._mamba_num(),
                    mamba_usage=self._mamba_usage(),
                    hybrid=lim.hybrid,
                    spec=self._d > 1,
                    accept_len=accept,
                    accept_rate=(accept - 1) / max(1, self._d - 1),
                    graph=n <= lim.decode_graph_bs,
                    throughput=gen_tps,
                    queue=len(self.waiting),
                )
            )

    def _emit_all(self, new: np.ndarray) -> list[Emission]:
        gens = (self._target[: self._n] - self._left[: self._n]).tolist()
        spec, cycles_now = self._d > 1, self._cycles
        out = []
        for r, k, g in zip(self._reqs, new.tolist(), gens, strict=True):
            cycles = cycles_now - r.entry[0] if spec else 0
            out.append(
                Emission(
                    r.req.rid,
                    int(k),
                    int(g),
                    False,
                    None,
                    r.verify + cycles,
                    r.accepted + int(g) - r.entry[1] - cycles,
                    r.req.prompt_tokens,
                    r.retractions,
                    r.cached,
                )
            )
        return out

    def _emission(self, r: ReqState, new_tokens: int, *, finished: bool, reason: str | None) -> Emission:
        return Emission(
            r.req.rid,
            new_tokens,
            r.gen,
            finished,
            reason,
            r.verify,
            r.accepted,
            r.req.prompt_tokens,
            r.retractions,
            r.cached,
        )

    def _ensure_decode_room(self, lines: list[str]) -> None:
        """Retract the newest requests until the next cycle's D tokens per request fit (SGLang's retract_decode)."""
        lim, page, d = self.limits, self._page, self._d
        if self._ctx_sum - self._shared() + self._n * (page - 1 + d) <= self._kv_cap():
            return  # fast path: fits even if every request sits at a page boundary
        retracted, gained, before = 0, 0, self.kv_used_tokens()
        while self._n and self.kv_used_tokens() + self._n * (d + page - 1) > self._kv_cap():
            r = self._leave(max(range(self._n), key=lambda i: self._reqs[i].seq))
            if not self._n:  # even alone it cannot grow: SGLang aborts the last request
                self._finish_unfit(r)
                lines.append(f"retract_decode: aborted last request {r.req.rid} due to OOM")
                return
            r.retractions += 1
            r.done_prefill = 0
            self.waiting.appendleft(r)
            retracted += 1
        gained = before - self.kv_used_tokens()
        old, n = self.new_token_ratio, self._n
        target, left = float(self._target[:n].sum()), float(self._left[:n].sum())
        total_max = target + float(self._slack[:n].sum()) or 1.0
        self.new_token_ratio = min(1.0, (target - left + RETRACT_DECODE_STEPS * n) / total_max)
        self._stats.retractions += retracted
        mamba_gained = retracted * lim.mamba_slots_per_req if lim.hybrid else None
        lines.append(retract_line(retracted, gained, mamba_gained, old, self.new_token_ratio))

    def _finish_unfit(self, r: ReqState) -> None:
        self._unfit.append(self._emission(r, 0, finished=True, reason="abort"))
        self._stats.aborted_total += 1

    # -- aborts -------------------------------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        gone, self._aborts = self._aborts, set()
        kept = deque(r for r in self.waiting if r.req.rid not in gone)
        count = len(self.waiting) - len(kept)
        self.waiting = kept
        if self.chunked is not None and self.chunked.req.rid in gone:
            if self.cache is not None:
                self._release(self.chunked)
            self.chunked, count = None, count + 1
        for i in range(self._n - 1, -1, -1):
            if self._reqs[i].req.rid in gone:
                self._leave(i)
                count += 1
        self._stats.aborted_total += count
