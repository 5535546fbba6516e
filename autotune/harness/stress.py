"""The stress phase: the winner's worst case (the running cap of the job's longest prompts at once, each decoding to
``max_tokens``), in the launch that measured its window, watched through the GPU peak, SGLang's retractions, the
pools' use and any OOM or crash. docs/search.md ("The worst case before the crown").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from autotune import tls
from autotune.harness.engines import logparse
from autotune.harness.gpu import GpuMonitor
from autotune.harness.steps import Launch, StepOutcome, after_ok
from autotune.harness.workload import ENDPOINTS, RequestBody, RequestRecord, SseStream, request_body
from autotune.launch import ServerHandle
from autotune.prompts import PromptRow
from autotune.prompts.rows import estimate_tokens
from autotune.results import Capacity, StressResult

DEFAULT_CAP_S = 180.0  # the phase's longest run: a real GPU reaches a full KV pool in minutes, the sim in seconds
REACHED = 0.95  # a pool counts as at its predicted peak at this share of it (page rounding, the last few tokens)
POLL_S = 0.25  # how often the log and the server are looked at
STRESS_PASS = 10_000  # pass markers from here on: no stress prompt shares a cached prefix with a window's
_RETRACT = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
_DECODE = re.compile(r"Decode batch, #running-req: (\d+), #(?:full )?token: (\d+)(?:.*?mamba num: (\d+))?")
_PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+),.*?#running-req: (\d+)")
QUEUE_CHUNKS = 2  # prompts queued behind the cap: this many prefill chunks' worth, so a full chunk forms at once
MAX_BURST = 4  # at most this many times the running cap sent


@dataclasses.dataclass(frozen=True, kw_only=True)
class StressTarget:
    """What the batch should reach: ``running`` requests at once (the running cap; ``requests`` are sent, the rest
    queued behind it), a prefill batch of ``prefill_tokens`` (a full chunk, or all the cap's prompts when they are
    fewer), the KV tokens the running ones hold at their longest (``kv_tokens``: at most the pool) and the Mamba
    slots (``mamba_slots``; None on a dense model)."""

    requests: int
    running: int
    prefill_tokens: int | None
    max_tokens: int
    prompt_tokens_max: int
    prompt_tokens_mean: float
    kv_tokens: int | None
    mamba_slots: int | None
    planned_peak_gib: float | None = None  # the planner's peak for this config (static + a full prefill chunk)
    overflows: bool = False  # the running batch needs more KV than the pool holds: SGLang must retract


def stress_line(data: Mapping[str, Any] | StressResult | None) -> str | None:
    """ "worst case: peak X of Y GiB, Z retractions, survived" (or the failure); None when never stressed."""
    res = data if isinstance(data, StressResult) else StressResult.from_dict(data)
    if res is None:
        return None
    peak = (
        f"peak {res.peak_used_gib:.1f} of {res.total_gib:.1f} GiB"
        if res.peak_used_gib is not None and res.total_gib is not None
        else "peak not read"
    )
    retractions = f"{res.retractions} retraction{'s' if res.retractions != 1 else ''}"
    if res.survived:
        verdict = (
            "survived"
            if res.reached_peak or res.ended == "all requests done"
            else (f"survived ({res.ended} before the predicted peak)")
        )
    elif res.interrupted:
        verdict = "interrupted"
    else:
        verdict = f"FAILED: {res.failure or 'server exited'}" + (f" ({_short(res.reason)})" if res.reason else "")
    return f"worst case: {peak}, {retractions}, {verdict}"


def _short(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def longest_rows(rows: Sequence[PromptRow], n: int) -> list[tuple[PromptRow, int]]:
    """``n`` requests of the sample's longest prompts (by token estimate), each with its pass number: the longest
    ``n`` once when the sample has them, else the whole sample again and again, each walk its own marker."""
    ranked = sorted(rows, key=estimate_tokens, reverse=True)
    if not ranked:
        return []
    return [(ranked[i % len(ranked)], STRESS_PASS + i // len(ranked)) for i in range(max(0, n))]


def burst_size(rows: Sequence[PromptRow], cap: int, chunk: int | None) -> int:
    """How many requests to send: the running cap, plus enough queued behind it that the waiting prompts hold
    ``QUEUE_CHUNKS`` prefill chunks (at most ``MAX_BURST`` × the cap). Requests reach a server spread over a few
    milliseconds, so a cap's worth alone may be prefilled in dribs; a queue this deep fills the next chunk whole."""
    cap = max(1, cap)
    if not chunk or chunk <= 0:
        return cap
    longest = longest_rows(rows, cap)
    mean = sum(estimate_tokens(row) for row, _ in longest) / max(1, len(longest))
    return max(cap, min(MAX_BURST * cap, -(-QUEUE_CHUNKS * chunk // max(1, int(mean)))))


def stress_target(
    capacity: Capacity | None,
    rows: Sequence[tuple[PromptRow, int]],
    *,
    max_tokens: int,
    plan: Mapping[str, Any] | None = None,
) -> StressTarget:
    """The peak the batch should reach: the first ``max_running_requests`` of ``rows`` running at once, every one
    at its prompt plus ``max_tokens``, bounded by the KV pool the server reported; one Mamba state per running
    request plus extra_buffer's tracking copies (the plan's slots→requests ratio less the 3 every radix-cached
    request reserves), bounded by the slots it reported; a prefill batch of a full chunk."""
    cap = capacity.max_running_requests if capacity is not None and capacity.max_running_requests else len(rows)
    running = rows[:cap]
    lengths = [estimate_tokens(row) for row, _ in running]
    per_request = [
        length + min(row.max_tokens or max_tokens, max_tokens)
        for (row, _), length in zip(running, lengths, strict=True)
    ]
    kv_pool = capacity.kv_tokens if capacity is not None else None
    kv = sum(per_request) if per_request else None
    overflows = bool(kv is not None and kv_pool and kv > kv_pool)
    if kv is not None and kv_pool:
        kv = min(kv, kv_pool)
    extra = (plan or {}).get("extra") or {}
    mamba = None
    if capacity is not None and capacity.mamba_slots:
        ratio = int(extra.get("ratio") or 1)
        mamba = min(capacity.mamba_slots, len(running) * (1 + max(0, ratio - 3)))
    chunk = (capacity.chunked_prefill_size if capacity is not None else None) or extra.get("chunked_prefill_size")
    prompts = sum(lengths)
    prefill = min(int(chunk), prompts) if chunk and int(chunk) > 0 else prompts
    peak = extra.get("peak_gib")
    return StressTarget(
        requests=len(rows),
        running=len(running),
        prefill_tokens=prefill or None,
        max_tokens=max_tokens,
        prompt_tokens_max=max(lengths, default=0),
        prompt_tokens_mean=round(sum(lengths) / len(lengths), 1) if lengths else 0.0,
        kv_tokens=kv,
        mamba_slots=mamba,
        planned_peak_gib=None if peak is None else float(peak),
        overflows=overflows,
    )


@dataclasses.dataclass
class _Pools:
    """What the scheduler's log lines say the batch held, since the phase began."""

    retractions: int = 0
    kv: int | None = None
    mamba: int | None = None
    running: int | None = None
    prefill: int | None = None

    def read(self, log: str) -> None:
        self.retractions = sum(int(m) for m in _RETRACT.findall(log))
        for running, kv, mamba in _DECODE.findall(log):
            self.running = max(self.running or 0, int(running))
            self.kv = max(self.kv or 0, int(kv))
            if mamba:
                self.mamba = max(self.mamba or 0, int(mamba))
        for new, tokens, running in _PREFILL.findall(log):
            self.running = max(self.running or 0, int(new) + int(running))
            self.prefill = max(self.prefill or 0, int(tokens))

    def reached(self, target: StressTarget) -> bool:
        """The batch is at the predicted peak: the KV pool at its share, or, for a batch that needs more than the
        pool, full (SGLang retracted: the count is part of the worst case); and so are the Mamba slots. The largest
        prefill batch is recorded beside its target, not waited for: SGLang's
        admission holds back room for the running requests' outputs, so a full chunk may never form at once."""
        full = self.retractions > 0
        kv = full or (
            not target.overflows and target.kv_tokens is not None and (self.kv or 0) >= REACHED * target.kv_tokens
        )
        mamba = full or target.mamba_slots is None or (self.mamba or 0) >= REACHED * target.mamba_slots
        return kv and mamba


@dataclasses.dataclass(frozen=True)
class StressStep:
    """The stress phase as a follow-up step (``run_trial(after=[StressStep()])``): after a trusted window.

    ``plan``: the planner's plan of the config (``MemoryPlan.to_dict()``; its peak and slots ratio), when known;
    ``cap_s``: the phase's longest run."""

    plan: Mapping[str, Any] | None = None
    cap_s: float = DEFAULT_CAP_S

    def runs_after(self, fields: Mapping[str, Any], server: ServerHandle) -> bool:
        return after_ok(fields, server)

    def __call__(self, server: ServerHandle, launch: Launch, fields: Mapping[str, Any]) -> StepOutcome:
        capacity = fields.get("capacity")
        capacity = capacity if isinstance(capacity, Capacity) else None
        cap = int((capacity.max_running_requests if capacity else None) or launch.workload.concurrency or 1)
        chunk = (capacity.chunked_prefill_size if capacity else None) or ((self.plan or {}).get("extra") or {}).get(
            "chunked_prefill_size"
        )
        rows = longest_rows(launch.sample.rows, burst_size(launch.sample.rows, cap, chunk))
        target = stress_target(capacity, rows, max_tokens=launch.workload.max_tokens, plan=self.plan)
        launch.phase(
            "stress",
            {
                "requests": target.requests,
                "running": target.running,
                "max_tokens": target.max_tokens,
                "prompt_tokens_max": target.prompt_tokens_max,
            },
        )
        t0 = time.monotonic()
        result = run_stress(server, launch, rows, target, cap_s=self.cap_s)
        launch.durations["stress"] = round(time.monotonic() - t0, 3)
        return StepOutcome(stress=result)


def run_stress(
    server: ServerHandle,
    launch: Launch,
    rows: Sequence[tuple[PromptRow, int]],
    target: StressTarget,
    *,
    cap_s: float = DEFAULT_CAP_S,
) -> StressResult:
    """Send the batch, watch it to its peak (or the end, or ``cap_s``), and read the verdict off the server."""
    log_start = len(server.log_text())
    monitor = GpuMonitor(launch.reader) if launch.reader is not None else None
    pools = _Pools()
    t0 = time.monotonic()
    with monitor if monitor is not None else contextlib.nullcontext():
        records, ended = asyncio.run(_drive(server, launch, rows, target, pools, log_start, cap_s))
    duration = time.monotonic() - t0
    log = server.log_text()[log_start:]
    pools.read(log)
    kind, line = None, None
    if not server.alive:
        code = server.poll()
        kind = logparse.classify(server.log_text(), code) or "crash"
        line = logparse.failure_line(server.log_text(), code) or f"server exited with code {code} under stress"
        ended = "server exited"
    elif logparse.classify(log, None) == "runtime_oom":  # a torch OOM it logged and survived is still one
        kind, line = "runtime_oom", logparse.failure_line(log, None)
    peaks = monitor.peaks() if monitor is not None else None
    return StressResult(
        survived=kind is None and ended != "interrupted",
        failure=kind,
        reason=line,
        ended=ended,
        duration_s=round(duration, 3),
        requests=len(rows),
        running_cap=target.running,
        completed=sum(1 for r in records if r.finish_reason not in (None, "cut") and r.error is None),
        errors=sum(1 for r in records if r.error is not None),
        max_tokens=target.max_tokens,
        prompt_tokens_max=target.prompt_tokens_max,
        prompt_tokens_mean=target.prompt_tokens_mean,
        peak_used_gib=peaks.peak_used_gib if peaks else None,
        total_gib=peaks.total_gib if peaks else None,
        planned_peak_gib=target.planned_peak_gib,
        retractions=pools.retractions,
        kv_peak_tokens=pools.kv,
        kv_target_tokens=target.kv_tokens,
        mamba_peak_slots=pools.mamba,
        mamba_target_slots=target.mamba_slots,
        running_peak=pools.running,
        prefill_peak_tokens=pools.prefill,
        prefill_target_tokens=target.prefill_tokens,
        reached_peak=pools.reached(target),
    )


async def _drive(
    server: ServerHandle,
    launch: Launch,
    rows: Sequence[tuple[PromptRow, int]],
    target: StressTarget,
    pools: _Pools,
    log_start: int,
    cap_s: float,
) -> tuple[list[RequestRecord], str]:
    """All requests at once; ends when the pools reach the target, all are done, the server dies, the study is
    stopped, or ``cap_s`` passes; the streams still open are closed (the server aborts them)."""
    wl = launch.workload
    records = [RequestRecord(row=row.line, sent=0.0, pass_no=pass_no) for row, pass_no in rows]
    timeout = httpx.Timeout(launch.timeouts.request_s, connect=30.0)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_one_connection_client(timeout)) for _ in rows]
        await _open_connections(clients, server.base_url)
        t0 = time.perf_counter()
        tasks = []
        for (row, pass_no), rec, client in zip(rows, records, clients, strict=True):
            endpoint = row.endpoint or wl.endpoint  # a Batch API line goes where its url says, as in the window
            body = request_body(endpoint, row, max_tokens=wl.max_tokens, ignore_eos=True, pass_no=pass_no)
            tasks.append(
                asyncio.create_task(_stream(client, server.base_url + ENDPOINTS[endpoint], body, rec, endpoint, t0))
            )
        ended, deadline = "cap reached", time.monotonic() + cap_s
        while time.monotonic() < deadline:
            if all(task.done() for task in tasks):
                ended = "all requests done"
                break
            if launch.stop_event is not None and launch.stop_event.is_set():
                ended = "interrupted"
                break
            if not server.alive:
                ended = "server exited"
                break
            pools.read(server.log_text()[log_start:])
            if pools.reached(target):
                ended = "peak reached"
                break
            await asyncio.sleep(POLL_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records, ended


def _one_connection_client(timeout: httpx.Timeout) -> httpx.AsyncClient:
    """A client of one keep-alive connection: one per request of the batch, not one pool for all of them.

    httpcore's pool re-examines every connection it holds each time a request starts or ends (an idle one costs a
    poll() and a scan of the whole pool), so one pool for a batch of N requests cost O(N²) a request, O(N³) for the
    batch (the tiny study's 192 requests: 4.0–4.9 → 2.3–2.4 CPU-s for the harness's trial, the phase
    22–26 → 14–15 s)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, **tls.secured())


async def _open_connections(clients: Sequence[httpx.AsyncClient], base_url: str) -> None:
    """One cheap GET per request first, at once, so the batch's POSTs go out on open connections together and the
    server's scheduler finds them waiting together (a burst of TCP handshakes would let it prefill them in dribs)."""

    async def one(client: httpx.AsyncClient) -> None:
        try:
            await client.get(f"{base_url}/model_info")
        except httpx.HTTPError:
            pass  # a server that does not answer shows in the phase itself

    await asyncio.gather(*(one(client) for client in clients))


async def _stream(
    client: httpx.AsyncClient, url: str, body: RequestBody, rec: RequestRecord, endpoint: str, t0: float
) -> None:
    """One streaming request into ``rec``; a closed stream at the phase's end is ``cut``, not an error."""
    stream = SseStream(endpoint)
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            buffer = b""
            async for piece in resp.aiter_raw():
                lines = (buffer + piece).split(b"\n")
                buffer = lines.pop()
                for line in lines:
                    payload = line[5:].strip() if line.startswith(b"data:") else b""
                    if payload == b"[DONE]":
                        return
                    if payload:
                        stream.feed_raw(payload, rec, time.perf_counter() - t0)
    except asyncio.CancelledError:
        rec.finish_reason = rec.finish_reason or "cut"
        raise
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
