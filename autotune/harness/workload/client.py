"""The replay client: keeps ``concurrency`` streams in flight over HTTP until the settle rule says the window is done,
counting the server's own ``completion_tokens`` by arrival time; one loop can measure several windows in a row.
docs/search.md ("A trial's number is steady state by construction").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from autotune import tls
from autotune.errors import WorkloadError
from autotune.harness.workload.records import CUT, ReplayRecords, RequestRecord
from autotune.harness.workload.settle import NextWindow, Settler, SettleRule, Settling, SliceTally
from autotune.harness.workload.spec import ENDPOINTS, RequestBody, request_body
from autotune.harness.workload.sse import SseStream
from autotune.prompts import PromptSample, check_repeats, walk_position


@dataclass(frozen=True)
class ReplayProgress:
    """One live tick of the replay (``on_progress``): tokens that arrived over the last second, requests done and
    errors so far, in which phase and window of the loop."""

    phase: str
    elapsed_s: float
    tok_s: float
    completed: int
    errors: int
    window: int = 1


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: RequestBody,
    rec: RequestRecord,
    endpoint: str,
    t0: float,
    tally: SliceTally | None = None,
) -> None:
    """One streaming request into ``rec`` (and its tokens into ``tally``); never raises but for cancellation."""
    clock = time.perf_counter
    stream = SseStream(endpoint, tally)
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec.error = f"HTTP {resp.status_code}: {text}"
                return
            buffer, done = b"", False
            # SGLang never compresses SSE; skipping httpx's decoder chain saves ~20% CPU per chunk.
            pieces = resp.aiter_bytes() if resp.headers.get("content-encoding") else resp.aiter_raw()
            async for piece in pieces:
                now = clock() - t0  # one arrival time per network read
                lines = (buffer + piece).split(b"\n")
                buffer = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    stream.feed_raw(payload, rec, now)
                    if rec.error is not None:
                        done = True
                        break
                if done:
                    break
            if rec.finish_reason is None and rec.error is None:
                rec.error = "stream ended without a finish reason"
    except asyncio.CancelledError:
        rec.finish_reason = rec.finish_reason or CUT
        raise
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        rec.ended = clock() - t0


def thread_busy_s() -> float:
    """Seconds the calling thread has been running *or runnable* (waiting in the run queue for a CPU): Linux's
    ``/proc/thread-self/schedstat``. The replay is one event loop on one thread; when that thread is never idle, the
    client, not the server, sets the pace. Waiting for a CPU counts, so a client starved by other processes is
    saturated too. Other threads are not summed in: each adds its own run-queue wait, and on a loaded host the sum
    read 6× a core while the loop itself still had idle time. Waiting for the GIL held by another thread is neither
    running nor runnable, so it is not counted: the harness keeps its other threads light for that reason (the
    /dev/shm sampler reads /proc only when a file awaits attribution). Elsewhere: the thread's CPU time."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as fh:
            run_ns, wait_ns = fh.read().split()[:2]
        return (int(run_ns) + int(wait_ns)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


async def replay(
    base_url: str,
    sample: PromptSample,
    *,
    concurrency: int,
    max_tokens: int,
    warmup_s: float,
    measure_s: float,
    endpoint: str = "generate",
    ignore_eos: bool = False,
    repeats: str = "fresh",
    on_progress: Callable[[ReplayProgress], None] | None = None,
    should_stop: Callable[[], str | None] | None = None,
    request_timeout_s: float = 600.0,
    progress_interval_s: float = 0.5,
    window_probe: Callable[[], Awaitable[Any]] | None = None,
    rule: SettleRule | None = None,
    ramp_s: float = 0.0,
    windows: int = 1,
    go_on: Callable[[ReplayRecords], bool] | None = None,
) -> ReplayRecords:
    """Keep ``concurrency`` streams in flight through a warm-up and ``windows`` windows, then close them all.

    ``rule`` decides where the warm-up and the window end (``autotune.settle``; ``warmup_s`` / ``measure_s`` are
    its floors); without one both last exactly ``warmup_s`` and ``measure_s``. ``ramp_s``: stream k's first request
    waits k / concurrency × ``ramp_s``. Closing the streams (not letting them finish) is deliberate: SGLang aborts a
    request whose client went away, so the server is idle when the harness stops it. ``should_stop`` returning a
    reason ends it early. ``repeats``: how a prompt goes out again once the walk through the sample comes round
    (``prompts.pass_marker``). At the window's start and end the client notes how busy its event-loop thread was
    (``client_busy``) and awaits ``window_probe`` (e.g. the simulated server's pacing counters) into ``probes``.
    ``windows``: windows 2.. each follow the one before in the same loop under the settle rule without a warm-up
    (``NextWindow``), as long as ``go_on`` says yes of each window before; their records are the returned first
    window's ``later``. A window's records hold every request it saw (sent before its end, not ended before its
    start); the first's hold its warm-up's too. An early stop ends the loop in whichever window it came.
    """
    if endpoint not in ENDPOINTS:
        raise WorkloadError(f"unknown endpoint {endpoint!r}", key="endpoint", fix=f"use one of {sorted(ENDPOINTS)}")
    check_repeats(repeats)
    rule = rule or SettleRule.fixed(warmup_s, measure_s)
    session = _Session(
        url=base_url.rstrip("/"),
        sample=sample,
        endpoint=endpoint,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        repeats=repeats,
        window_probe=window_probe,
        t0=time.perf_counter(),
        records=ReplayRecords([], (rule.warmup_s, rule.warmup_s + rule.measure_s), concurrency, endpoint),
        settler=Settler(rule),
        tally=SliceTally(rule.slice_s),
        ramp_s=ramp_s,
        windows=windows,
        go_on=go_on,
    )
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, **tls.secured()) as client:
        tasks = [asyncio.create_task(session.worker(client, k)) for k in range(concurrency)]
        try:
            await session.pace(should_stop, on_progress, progress_interval_s)
        finally:
            session.done = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        session.close_window(last=True)
    first, *later = session.measured
    first.later = later
    return first


@dataclass(kw_only=True)
class _Session:
    """One replay's shared state: its workers take rows from one counter and append to one record list; the control
    loop feeds each finished slice of the tally to the settler."""

    url: str  # the server's base URL: each request goes to its endpoint's path
    sample: PromptSample
    endpoint: str  # the study's endpoint; a row that names its own (an OpenAI Batch API line) goes there
    max_tokens: int
    ignore_eos: bool
    repeats: str
    window_probe: Callable[[], Awaitable[Any]] | None
    t0: float
    records: ReplayRecords
    settler: Settler
    tally: SliceTally
    ramp_s: float = 0.0
    windows: int = 1
    go_on: Callable[[ReplayRecords], bool] | None = None
    next_row: int = 0
    done: bool = False
    sent: list[RequestRecord] = field(default_factory=list)  # every request of the loop, in the order sent
    measured: list[ReplayRecords] = field(default_factory=list)  # the windows so far, ``records`` last
    opened: float = float("-inf")  # when ``records``' window began (the first's: its warm-up's requests count too)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    async def worker(self, client: httpx.AsyncClient, k: int) -> None:
        """Stream ``k``: waits its place in the ramp, then one in-flight request after another, round-robin over
        the sample, until the window ends."""
        delay = k / self.records.concurrency * self.ramp_s - self.elapsed()
        if delay > 0:
            await asyncio.sleep(delay)
        while not self.done:
            index, pass_no = walk_position(self.next_row, len(self.sample.rows), self.repeats)
            row = self.sample.rows[index]
            self.next_row += 1
            rec = RequestRecord(row=row.line, sent=self.elapsed(), pass_no=pass_no)
            self.sent.append(rec)
            endpoint = row.endpoint or self.endpoint
            body = request_body(endpoint, row, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, pass_no=pass_no)
            await _one(client, self.url + ENDPOINTS[endpoint], body, rec, endpoint, self.t0, self.tally)
            if rec.error is not None:
                await asyncio.sleep(0.05)  # a refusing server must not turn this loop into a busy spin

    async def mark(self, *, end: bool = False) -> tuple[float, float]:
        """(clock, busy seconds) at a window edge, and the probe's reading into ``probes``."""
        # The client's own figures exclude the probes' round trips (idle waits that are not the client's load).
        now = (time.perf_counter(), thread_busy_s()) if end else None
        if self.window_probe is not None:
            self.records.probes.append(await self.window_probe())
        return now or (time.perf_counter(), thread_busy_s())

    async def feed(
        self, fed: int, start: tuple[float, float] | None
    ) -> tuple[int, tuple[float, float] | None, Settling | None]:
        """Every slice that has ended into the settler: (slices fed, the window's start mark, the settling once
        the rule says stop)."""
        slice_s = self.tally.slice_s
        while (fed + 1) * slice_s <= self.elapsed():
            settling = self.settler.add(self.tally.slice(fed))
            fed += 1
            if start is None and self.settler.in_window:
                start = await self.mark()
            if settling is not None:
                return fed, start, settling
        return fed, start, None

    async def pace(
        self,
        should_stop: Callable[[], str | None] | None,
        on_progress: Callable[[ReplayProgress], None] | None,
        interval_s: float,
    ) -> None:
        """The control loop while the workers run: stop checks, progress, each window's edges, ``client_busy``."""
        self.measured.append(self.records)
        start = await self.mark() if self.settler.in_window else None
        fed = 0
        while True:
            reason = should_stop() if should_stop else None
            if reason:
                self.records.stopped_early = reason
                return
            fed, start, settling = await self.feed(fed, start)
            if settling is not None:
                assert start is not None
                start = await self.next_window(settling, start)
                if start is None:
                    return
                continue
            if on_progress is not None:
                on_progress(
                    _progress(
                        self.sent,
                        self.records.concurrency,
                        self.elapsed(),
                        "measuring" if self.settler.in_window else "warmup",
                        len(self.measured),
                    )
                )
            boundary = (fed + 1) * self.tally.slice_s
            await asyncio.sleep(min(interval_s, max(0.0, boundary - self.elapsed())))  # progress may have taken time

    async def next_window(self, settling: Settling, start: tuple[float, float]) -> tuple[float, float] | None:
        """Close the window that just settled and open the next one at the same edge (its start mark); None when
        it was the last (the workers stop). The edge's probe reading ends one window and starts the next."""
        records = self.records
        records.settling, records.window = settling, settling.window
        last = len(self.measured) >= self.windows
        self.done = last  # the last window's streams send nothing more while the edge is read
        end = await self.mark(end=True)
        records.client_busy = round((end[1] - start[1]) / max(end[0] - start[0], 1e-9), 4)
        closed = self.close_window()
        if last or (self.go_on is not None and not self.go_on(closed)):
            self.done = True
            return None
        self.opened = settling.window[1]
        self.records = ReplayRecords(
            [], records.window, records.concurrency, records.endpoint, probes=records.probes[-1:]
        )
        self.measured.append(self.records)
        self.settler = NextWindow(self.settler.rule, settling.tok_s)
        return time.perf_counter(), thread_busy_s()

    def close_window(self, *, last: bool = False) -> ReplayRecords:
        """The requests the current window saw: sent before its end (any, once the loop is over) and not ended
        before its start (a stream cut at the loop's end has ended)."""
        records = self.records
        end = float("inf") if last or records.settling is None else records.window[1]
        records.requests = [r for r in self.sent if r.sent < end and (r.ended is None or r.ended >= self.opened)]
        return records


def _progress(sent: list[RequestRecord], concurrency: int, elapsed: float, phase: str, window: int) -> ReplayProgress:
    """Live figures: tokens that arrived over the last second, requests done, errors so far."""
    recent = sum(n for r in sent[-4 * concurrency :] for t, n in r.chunks if t >= elapsed - 1.0)
    return ReplayProgress(
        phase=phase,
        elapsed_s=round(elapsed, 2),
        tok_s=float(recent),
        completed=sum(1 for r in sent if r.finish_reason not in (None, CUT) and r.error is None),
        errors=sum(1 for r in sent if r.error is not None),
        window=window,
    )
