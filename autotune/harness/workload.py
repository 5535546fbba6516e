"""The workload: a fixed prompt sample, a streaming replay client, and metrics from its per-request records.

Every trial replays the same seeded sample, keeps ``concurrency`` requests in flight through a warm-up and
a measured window, and counts tokens by *arrival time* using the server's own ``completion_tokens`` (not a
retokenization: under speculative decoding one chunk carries several tokens). Throughput is what arrived
inside the window, so ramp-up and the drain tail never inflate or dilute it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from autotune.errors import WorkloadError
from autotune.prompts import PromptRow, PromptSample, check_repeats, walk_position
from autotune.results import Metrics, Percentiles, halves_drift

ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
CUT = "cut"  # finish reason of a stream the client closed at window end (not an error)


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """What each trial replays. ``concurrency=None`` means 2 × the server's effective max running requests."""

    prompts: Path
    sample_size: int = 200
    seed: int = 0
    max_tokens: int = 4096
    concurrency: int | None = None
    warmup_s: float = 10.0
    measure_s: float = 30.0
    endpoint: str = "generate"
    ignore_eos: bool = False
    repeats: str = "fresh"  # a prompt sent again in the window: "fresh" (pass-marked) or "verbatim"

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise WorkloadError(f"unknown endpoint {self.endpoint!r}", key="endpoint", fix=f"use one of {sorted(ENDPOINTS)}")
        check_repeats(self.repeats)
        for name in ("sample_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be at least 1", key=name)
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError("concurrency must be at least 1", key="concurrency")
        if self.warmup_s < 0 or self.measure_s <= 0:
            raise WorkloadError("warmup_s must be >= 0 and measure_s > 0", key="measure_s")


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the replay started."""

    row: int
    sent: float
    pass_no: int = 0  # the walk through the sample that sent it; a ``fresh`` replay marks the prompt with it
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)
    finish_reason: str | None = None
    error: str | None = None
    ended: float | None = None
    accept_length: float | None = None
    prompt_tokens: int | None = None  # as the server counted them (its final chunk's meta_info / usage)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class ReplayRecords:
    requests: list[RequestRecord]
    window: tuple[float, float]
    concurrency: int
    endpoint: str
    stopped_early: str | None = None  # why the replay ended before the window did
    # Share of one core the replay's process was running or waiting for a CPU during the window (≈ 1.0: the
    # client could not keep up, so the figure is the client's, not the server's); None before the window ended.
    client_busy: float | None = None
    probes: list[Any] = field(default_factory=list)  # ``window_probe`` results at the window's start and end

    def write_jsonl(self, path: Path) -> None:
        """One line per request; times rounded to 0.1 ms (a long window has ~1k chunks per request)."""
        with open(path, "w", encoding="utf-8") as fh:
            for rec in self.requests:
                row = asdict(rec)
                row["chunks"] = [[round(t, 4), n] for t, n in rec.chunks]
                for key in ("sent", "ended"):
                    row[key] = None if row[key] is None else round(row[key], 4)
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")

    @staticmethod
    def read_jsonl(path: Path) -> list[RequestRecord]:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return [RequestRecord(**{**r, "chunks": [tuple(c) for c in r["chunks"]]}) for r in rows]


def _request(endpoint: str, row: PromptRow, *, max_tokens: int, ignore_eos: bool, pass_no: int = 0) -> dict[str, Any]:
    n = min(row.max_tokens or max_tokens, max_tokens)
    if endpoint == "generate":
        params = {"max_new_tokens": n, "ignore_eos": ignore_eos, "temperature": 0}
        return {"text": row.as_text(pass_no), "sampling_params": params, "stream": True}
    body: dict[str, Any] = {
        "model": "default", "max_tokens": n, "ignore_eos": ignore_eos, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if endpoint == "chat":
        body["messages"] = row.as_messages(pass_no)
    else:
        body["prompt"] = row.as_text(pass_no)
    return body


_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_UNFINISHED = re.compile(rb'"finish_reason":\s*null')


class _Stream:
    """Turns one SSE stream's chunks into (tokens, finish, error) using the server's token counts.

    Fast path: a chunk that is not finished only needs its ``completion_tokens``, found by a regex instead of
    a JSON parse. That matters because SGLang's native chunks carry the *cumulative* text and ids, so a long
    output's late chunks are tens of KB each; only the last chunk (and errors) are parsed in full.
    """

    def __init__(self, endpoint: str):
        self.native = endpoint == "generate"
        self.counted = 0

    def feed_raw(self, payload: bytes, rec: RequestRecord, now: float) -> None:
        if _UNFINISHED.search(payload) and not payload.startswith(b'{"error"'):
            hits = _TOKENS.findall(payload)
            if hits:
                self._count(int(hits[-1]), rec, now)  # the last one: meta_info/usage follows the text
                return
            if not self.native:
                self._count(self.counted + 1, rec, now)  # no usage stats: one token per chunk
                return
        try:
            data = json.loads(payload)
        except ValueError:
            rec.error = f"bad SSE chunk: {payload[:100]!r}"
            return
        self.feed(data, rec, now)

    def _count(self, total: int, rec: RequestRecord, now: float) -> None:
        if total != self.counted:
            rec.chunks.append((now, total - self.counted))
            self.counted = total

    def feed(self, data: dict[str, Any], rec: RequestRecord, now: float) -> None:
        if "error" in data:
            err = data["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if self.native:
            meta = data.get("meta_info") or {}
            total = meta.get("completion_tokens")
            finish = meta.get("finish_reason")
            if finish:
                rec.finish_reason = finish.get("type") if isinstance(finish, dict) else str(finish)
                if rec.finish_reason == "abort":
                    rec.error = f"aborted by server: {finish.get('message') if isinstance(finish, dict) else ''}"
                if meta.get("spec_accept_length") is not None:
                    rec.accept_length = float(meta["spec_accept_length"])
            if meta.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(meta["prompt_tokens"])
        else:
            usage = data.get("usage") or {}
            total = usage.get("completion_tokens")
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
            choices = data.get("choices") or []
            if total is None and choices:
                piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                total = self.counted + (1 if piece else 0)  # no usage stats: one token per non-empty chunk
            for choice in choices:
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                    if rec.finish_reason == "abort":
                        rec.error = "aborted by server"
            details = (data.get("sglext") or {}).get("spec_tokens_details") or {}
            if details.get("spec_accept_length") is not None:
                rec.accept_length = float(details["spec_accept_length"])
        if total is not None:
            self._count(int(total), rec, now)


async def _one(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, endpoint: str, t0: float) -> None:
    clock = time.perf_counter
    stream = _Stream(endpoint)
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


def repeated_prompt_share(records: ReplayRecords) -> float:
    """Share of the window's requests whose exact prompt this replay had already sent. The replay walks a fixed
    sample round-robin, so a small sample under high concurrency comes round again; with ``repeats = "verbatim"``
    the same text goes out again and a radix cache serves it whole, hits a one-pass job of distinct prompts never
    gets. A ``fresh`` replay marks each pass, so its share is 0."""
    lo, hi = records.window
    seen: set[tuple[int, int]] = set()
    repeats = sent = 0
    for rec in records.requests:  # in the order they were sent
        key = (rec.row, rec.pass_no)
        if lo <= rec.sent < hi:
            sent += 1
            repeats += key in seen
        seen.add(key)
    return round(repeats / sent, 4) if sent else 0.0


def window_drift(records: ReplayRecords) -> float:
    """``halves_drift`` of the window's output tokens. A closed loop starts with every stream sending at once: a
    workload of long prompts and short answers then runs in waves (all prefill, then all decode, then all prefill
    again) that a short window catches at one phase, so its tok/s is that phase's, not the job's steady rate (on the
    simulator, one config read 80 tok/s in a 10 s + 20 s trial and 864 over 300 s + 300 s). Decode-heavy
    workloads read near 0 even before any request finishes, because their batch stays full."""
    lo, hi = records.window
    mid = (lo + hi) / 2
    first = second = 0
    for rec in records.requests:
        for t, n in rec.chunks:
            if lo <= t < mid:
                first += n
            elif mid <= t < hi:
                second += n
    return halves_drift(first, second)


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
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    should_stop: Callable[[], str | None] | None = None,
    request_timeout_s: float = 600.0,
    progress_interval_s: float = 0.5,
    window_probe: Callable[[], Awaitable[Any]] | None = None,
) -> ReplayRecords:
    """Keep ``concurrency`` streams in flight for ``warmup_s + measure_s``, then close them all.

    Closing the streams (not letting them finish) is deliberate: SGLang aborts a request whose client went
    away, so the server is idle when the harness stops it. ``should_stop`` returning a reason ends it early.
    ``repeats``: how a prompt goes out again once the walk through the sample comes round (``prompts.pass_marker``).
    At the window's start and end the client notes how busy its event-loop thread was (``client_busy``) and awaits
    ``window_probe`` (e.g. the simulated server's pacing counters) into ``probes``.
    """
    if endpoint not in ENDPOINTS:
        raise WorkloadError(f"unknown endpoint {endpoint!r}", key="endpoint", fix=f"use one of {sorted(ENDPOINTS)}")
    check_repeats(repeats)
    session = _Session(
        url=base_url.rstrip("/") + ENDPOINTS[endpoint], sample=sample, endpoint=endpoint, max_tokens=max_tokens,
        ignore_eos=ignore_eos, repeats=repeats, window_probe=window_probe, t0=time.perf_counter(),
        records=ReplayRecords([], (warmup_s, warmup_s + measure_s), concurrency, endpoint),
    )
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        tasks = [asyncio.create_task(session.worker(client)) for _ in range(concurrency)]
        try:
            await session.pace(should_stop, on_progress, progress_interval_s)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return session.records


@dataclass(kw_only=True)
class _Session:
    """One replay's shared state: its workers take rows from one counter and append to one record list."""

    url: str
    sample: PromptSample
    endpoint: str
    max_tokens: int
    ignore_eos: bool
    repeats: str
    window_probe: Callable[[], Awaitable[Any]] | None
    t0: float
    records: ReplayRecords
    next_row: int = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    async def worker(self, client: httpx.AsyncClient) -> None:
        """One in-flight stream after another, round-robin over the sample, until the window ends."""
        while self.elapsed() < self.records.window[1]:
            index, pass_no = walk_position(self.next_row, len(self.sample.rows), self.repeats)
            row = self.sample.rows[index]
            self.next_row += 1
            rec = RequestRecord(row=row.line, sent=self.elapsed(), pass_no=pass_no)
            self.records.requests.append(rec)
            body = _request(self.endpoint, row, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, pass_no=pass_no)
            await _one(client, self.url, body, rec, self.endpoint, self.t0)
            if rec.error is not None:
                await asyncio.sleep(0.05)  # a refusing server must not turn this loop into a busy spin

    async def mark(self, *, end: bool = False) -> tuple[float, float]:
        """(clock, busy seconds) at a window edge, and the probe's reading into ``probes``."""
        # The client's own figures exclude the probes' round trips (idle waits that are not the client's load).
        now = (time.perf_counter(), thread_busy_s()) if end else None
        if self.window_probe is not None:
            self.records.probes.append(await self.window_probe())
        return now or (time.perf_counter(), thread_busy_s())

    async def pace(self, should_stop: Callable[[], str | None] | None,
                   on_progress: Callable[[dict[str, Any]], None] | None, interval_s: float) -> None:
        """The control loop while the workers run: stop checks, progress, the window's edges, ``client_busy``."""
        records, window = self.records, self.records.window
        start: tuple[float, float] | None = None
        while (elapsed := self.elapsed()) < window[1]:
            reason = should_stop() if should_stop else None
            if reason:
                records.stopped_early = reason
                break
            if start is None and elapsed >= window[0]:
                start = await self.mark()
            if on_progress is not None:
                on_progress(_progress(records, elapsed, window))
            boundary = window[0] if start is None and elapsed < window[0] else window[1]
            await asyncio.sleep(min(interval_s, max(0.0, boundary - self.elapsed())))  # progress may have taken time
        if records.stopped_early is None:
            start = start or await self.mark()
            end = await self.mark(end=True)
            records.client_busy = round((end[1] - start[1]) / max(end[0] - start[0], 1e-9), 4)


def _progress(records: ReplayRecords, elapsed: float, window: tuple[float, float]) -> dict[str, Any]:
    """Live figures: tokens that arrived over the last second, requests done, errors so far."""
    recent = sum(n for r in records.requests[-4 * records.concurrency :] for t, n in r.chunks if t >= elapsed - 1.0)
    return {
        "phase": "warmup" if elapsed < window[0] else "measuring",
        "elapsed_s": round(elapsed, 2),
        "tok_s": float(recent),
        "completed": sum(1 for r in records.requests if r.finish_reason not in (None, CUT) and r.error is None),
        "errors": sum(1 for r in records.requests if r.error is not None),
    }


def _pct(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles()
    arr = np.asarray(values, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return Percentiles(p50=round(float(p50), 3), p90=round(float(p90), 3), p99=round(float(p99), 3), mean=round(float(arr.mean()), 3))


def metrics_from_records(records: ReplayRecords, *, window: tuple[float, float] | None = None) -> Metrics:
    """Steady-state figures for the window: tokens by arrival time, latencies of what the window observed."""
    start, end = window or records.window
    span = max(end - start, 1e-9)
    tokens, ttft, itl, e2e, completed, errors = 0, [], [], [], 0, 0
    accept_num = accept_den = 0.0
    for rec in records.requests:
        if rec.error is not None:
            errors += 1
        prev = None
        first = next((t for t, n in rec.chunks if n > 0), None)
        if first is not None and start <= first < end:
            ttft.append(first - rec.sent)
        for t, n in rec.chunks:
            if start <= t < end:
                tokens += n
                if prev is not None and n > 0:
                    itl.extend([(t - prev) / n] * n)
            prev = t
        done = rec.error is None and rec.finish_reason not in (None, CUT) and rec.ended is not None
        if done and start <= rec.ended < end:
            completed += 1
            e2e.append(rec.ended - rec.sent)
            if rec.accept_length is not None:
                accept_num += rec.accept_length * rec.tokens
                accept_den += rec.tokens
    return Metrics(
        output_tok_s=round(tokens / span, 3),
        request_s=round(completed / span, 4),
        ttft_ms=_pct(ttft), itl_ms=_pct(itl), e2e_ms=_pct(e2e),
        accept_length=round(accept_num / accept_den, 4) if accept_den else None,
        output_tokens=tokens, completed=completed, errors=errors, window_s=round(span, 3),
        concurrency=records.concurrency,
    )
