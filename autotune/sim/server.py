"""The simulated server's HTTP side: SGLang's endpoints over a ``Scheduler`` paced on the wall clock.

One task drives the scheduler: it computes a step (pure, instant), sleeps until the step's modelled end, then
hands the emitted tokens to each request's stream. Each step's end is an absolute deadline chained from the
previous one, so lag never accumulates and no token is delivered before its modelled time. A stream that falls
behind sends everything it holds in one chunk (the chunks themselves are shaped in ``responses``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from autotune.sim import logs
from autotune.sim.auth import ApiKeyMiddleware
from autotune.sim.bodies import RequestBody
from autotune.sim.divergence import SimNumerics
from autotune.sim.requests import count_tokens, is_greedy, make_request, stable_hash
from autotune.sim.responses import CHAT, COMPLETION, NATIVE, SSEResponse, Stream, filler

__all__ = ["SSEResponse", "SimServer", "Stream", "filler", "install_sigterm"]

CATCH_UP_SLICE_S = 0.02  # when behind, how long the pacing loop may run steps before streams get to send
PACE_LOG_S = 10.0  # how often a busy server logs how far its wall clock trails the model (sim-only line)
# SGLang's tokenizer manager is its own process: a burst of requests reaches the scheduler within milliseconds. The
# sim's HTTP intake shares one event loop with the pacing, so on a busy host a burst would trickle in over tens of
# ms and be prefilled in dribs no GPU server forms. After idle, the first step waits while requests keep landing
# (each within INTAKE_GAP_S of the last), at most INTAKE_MAX_S of wall time; idle time is not lag, so no figure moves.
INTAKE_GAP_S = 0.01
INTAKE_MAX_S = 0.5
STALL_POLL_S = 0.05  # how often a stalled server's (--sim-stall) pacing loop wakes: it never steps


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status},
        status_code=status,
    )


class SimServer:
    """One simulated SGLang server: endpoints, request streams, and the pacing task."""

    def __init__(self, status: Any, *, log: logs.Log, on_fatal: Callable[[], None]):
        # ``status`` is the process's ``sim.status.ServerStatus``: facts, counters and report bodies.
        self.status = status
        self.sched = status.scheduler
        self.log = log
        self.on_fatal = on_fatal  # SGLang SIGKILLs its own process tree when a child fails
        self.streams: dict[str, Stream] = {}
        # Which output-changing flags differ from SGLang's reference: they decide each greedy request's tokens.
        self.numerics = SimNumerics.for_server(
            status.server_args,
            hybrid=status.model.has_mamba,
            ssm_dtype=status.model.ssm_dtype,
            unlisted=status.args.sim.numerics_flags,
        )
        self.ready = False
        self.draining = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_device_write = 0.0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-device")
        # How well the wall clock follows the model: how late each step's tokens went out (sim-only figures).
        # ``lag_s``: how far the wall clock trails the modelled clock, summed over busy stretches (idle time
        # resets the chain, so it is not lag); its growth over ``modelled_s`` is the lag fraction the harness
        # checks (``autotune.harness.trial``): tokens paced that much slower than the model, i.e. a CPU-bound figure.
        self.pace = {"steps": 0, "modelled_s": 0.0, "late_s_sum": 0.0, "late_s_max": 0.0, "lag_s": 0.0}
        self._lag_retired = 0.0
        self.speedup = status.args.sim.speedup  # --sim-speedup: modelled s per wall s
        self.stall = status.args.sim.stall  # --sim-stall: once ready, never serve a request
        self.app = Starlette(
            routes=self._routes(), middleware=[Middleware(ApiKeyMiddleware, api_key=status.server_args.get("api_key"))]
        )

    # -- pacing ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pace())
        self._task.add_done_callback(self._paced_out)

    def _paced_out(self, task: asyncio.Task[None]) -> None:
        """A crash in the scheduler kills the server the way SGLang's scheduler process does, never silently."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.log.lines(logs.scheduler_exception(f"{type(exc).__name__}: {exc}", phase="runtime"))
        self.log(logs.SIGQUIT)
        self.on_fatal()

    async def _pace(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.sched
        deadline = last_yield = loop.time()
        while True:
            if not sched.has_work():
                self._device(busy=False)
                self._wake.clear()
                await self._wake.wait()
                await self._intake(loop)
                deadline = last_yield = loop.time()  # idle time is not lag: the next step starts now
                self._lag_retired = self.pace["lag_s"]
                continue
            if self.stall and self.ready and not self.draining:  # --sim-stall: work is held, never stepped
                await asyncio.sleep(STALL_POLL_S)
                continue
            res = sched.step()
            for line in res.log_lines:
                self.log(line)
            if res.runtime_oom:
                self._runtime_oom(res.runtime_oom)
                return
            if res.duration_s > 0:
                paced = res.duration_s / self.speedup
                deadline += paced
                delay = deadline - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                    last_yield = loop.time()
                elif loop.time() - last_yield > CATCH_UP_SLICE_S:
                    # Behind: run steps back to back and let the streams send only every slice, so each sends
                    # one coalesced chunk instead of one per step (sends, not steps, are what a busy CPU lacks).
                    await asyncio.sleep(0)
                    last_yield = loop.time()
                late = loop.time() - deadline
                pace = self.pace
                pace["steps"] += 1
                pace["modelled_s"] += paced
                pace["late_s_sum"] += late
                pace["late_s_max"] = max(pace["late_s_max"], late)
                pace["lag_s"] = self._lag_retired + max(0.0, late)
                self._log_pace(loop.time())
            else:  # nothing could run (e.g. no waiting prompt fits): do not spin
                await asyncio.sleep(0.001)
                deadline = loop.time()
            if res.prefill_tokens:
                self.status.note_prefill(res.prefill_tokens)
            streams = self.streams
            for em in res.emissions:
                stream = streams.get(em.rid)
                if stream is not None:
                    stream.push(em)
            self._device(busy=True, prefill=res.kind == "prefill")

    async def _intake(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let a burst that woke an idle server land before its first step (see ``INTAKE_GAP_S``)."""
        sched, end = self.sched, loop.time() + INTAKE_MAX_S
        seen = len(sched.waiting)
        while loop.time() < end:
            await asyncio.sleep(INTAKE_GAP_S)
            if len(sched.waiting) == seen:
                return
            seen = len(sched.waiting)

    def _log_pace(self, now: float) -> None:
        """Every ``PACE_LOG_S`` while busy: one sim-only line with the lag since the previous one."""
        mark = getattr(self, "_pace_mark", None)
        if mark is None:
            self._pace_mark = (now, self.pace["modelled_s"], self.pace["lag_s"])
            return
        if now - mark[0] < PACE_LOG_S:
            return
        modelled, lag = self.pace["modelled_s"] - mark[1], self.pace["lag_s"] - mark[2]
        self._pace_mark = (now, self.pace["modelled_s"], self.pace["lag_s"])
        self.log(logs.pace_line(modelled, lag))

    def _runtime_oom(self, message: str) -> None:
        self.log.lines(logs.scheduler_exception(message, phase="runtime"))
        self.log("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        self.log(logs.kill_tree(os.getpid(), include_parent=True))
        self.on_fatal()

    def _device(self, *, busy: bool, prefill: bool = False) -> None:
        now = time.monotonic()
        if busy and now - self._last_device_write < 0.2:
            return  # the monitor samples every ~200 ms; writing more often only costs CPU
        self._last_device_write = now
        # A file write can take milliseconds on a busy disk: keep it off the pacing loop, in order.
        self._writer.submit(self.status.report_device, busy=busy, prefill=prefill)

    # -- requests -------------------------------------------------------------------------------------------
    def _submit(
        self, kind: str, text: str, prompt_tokens: int, max_new: int, ignore_eos: bool, body: RequestBody
    ) -> Stream:
        st = self.status
        rid = uuid.uuid4().hex
        req = make_request(
            rid,
            text,
            max_new,
            ignore_eos=ignore_eos,
            seed=st.seed,
            acceptance_mean=st.acceptance,
            output_mean=st.output_mean,
            output_dist=st.output_dist,
            prompt_tokens=prompt_tokens,
        )
        stream = Stream(
            rid,
            kind,
            req.prompt_tokens,
            model=str(body.get("model") or st.served_model_name),
            draft_tokens=st.draft_tokens,
        )
        stream.interval = max(1, int(st.server_args.get("stream_interval") or 1))
        stream.cache_report = bool(st.server_args.get("enable_cache_report"))
        stream.include_usage = bool((body.get("stream_options") or {}).get("include_usage")) or bool(
            st.server_args.get("stream_response_default_include_usage")
        )
        greedy = _greedy(kind, body)
        stream.return_logprob = kind == NATIVE and bool(body.get("return_logprob"))
        stream.logprob_text = bool(body.get("return_text_in_logprobs"))
        if greedy:  # the prompt decides the tokens
            stream.tokens = self.numerics.plan(text, st.seed, base=stable_hash("tokens", st.seed, text))
        self.streams[rid] = stream
        self.sched.add(req)
        st.on_request(req.prompt_tokens)
        self._wake.set()
        return stream

    def _close(self, stream: Stream) -> None:
        """Forget a stream; abort it in the scheduler if the client left before it finished (like SGLang)."""
        self.streams.pop(stream.rid, None)
        if not stream.finished:
            self.sched.abort(stream.rid)
            self._wake.set()
        self.status.on_done(
            stream.completion_tokens,
            finished=stream.finished,
            e2e_s=(stream.done_at or time.time()) - stream.created,
            ttft_s=(stream.first_at - stream.created) if stream.first_at else None,
            prompt_tokens=stream.prompt_tokens,
        )

    async def _serve(
        self, kind: str, text: str, prompt_tokens: int, max_new: Any, ignore_eos: bool, stream: bool, body: RequestBody
    ) -> Response:
        if self.draining or not self.ready:
            return _error(503, "The server is not ready or is shutting down.")
        try:
            _greedy(kind, body)
        except ValueError as exc:
            return _error(400, str(exc))
        ctx = self.status.context_len
        if max_new is None:
            max_new = max(1, ctx - prompt_tokens)
        if not isinstance(max_new, int) or max_new < 0:
            return _error(400, f"max_new_tokens must be a non-negative integer, got {max_new!r}")
        if prompt_tokens >= ctx:
            return _error(
                400, f"The input ({prompt_tokens} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        if prompt_tokens + max_new > ctx and not self.status.server_args.get("allow_auto_truncate"):
            return _error(
                400,
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {prompt_tokens + max_new} tokens: {prompt_tokens} tokens "
                f"from the input messages and {max_new} tokens for the completion.",
            )
        s = self._submit(kind, text, prompt_tokens, max(1, max_new), ignore_eos, body)
        if stream:
            return SSEResponse(s, self._close)
        try:
            await s.wait_finished()
        finally:
            self._close(s)
        return JSONResponse(s.body())

    async def generate(self, request: Request) -> Response:
        body = await _json(request)
        if body is None:
            return _error(400, "The request body must be a JSON object.")
        sp = body.get("sampling_params") or {}
        ids, text = body.get("input_ids"), body.get("text")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids):
            return _error(400, "input_ids must be a non-empty list of token ids (batches are not simulated).")
        if ids is None and not isinstance(text, str):
            return _error(400, "Either text (a string) or input_ids should be provided.")
        prompt = str(text) if ids is None else " ".join(map(str, ids))
        tokens = len(ids) if ids is not None else count_tokens(prompt)
        return await self._serve(
            NATIVE,
            prompt,
            tokens,
            sp.get("max_new_tokens", 128),
            bool(sp.get("ignore_eos")),
            bool(body.get("stream")),
            body,
        )

    async def completions(self, request: Request) -> Response:
        body = await _json(request) or RequestBody()  # no JSON object: no prompt, refused below
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            text, tokens = " ".join(map(str, prompt)), len(prompt)
        elif isinstance(prompt, str):
            text, tokens = prompt, count_tokens(prompt)
        else:
            return _error(400, "prompt must be a string or a list of token ids (batches are not simulated).")
        return await self._serve(
            COMPLETION,
            text,
            tokens,
            body.get("max_tokens", 16),
            bool(body.get("ignore_eos")),
            bool(body.get("stream")),
            body,
        )

    async def chat(self, request: Request) -> Response:
        body = await _json(request) or RequestBody()  # no JSON object: no messages, refused below
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _error(400, "messages must be a non-empty list of {role, content} objects.")
        text = (
            "".join(f"<|im_start|>{m.get('role', 'user')}\n{_content(m.get('content'))}<|im_end|>\n" for m in messages)
            + "<|im_start|>assistant\n"
        )
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        return await self._serve(
            CHAT, text, count_tokens(text), max_new, bool(body.get("ignore_eos")), bool(body.get("stream")), body
        )

    # -- status endpoints -----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.ready and not self.draining else 503)

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(self.status.model_info())

    async def server_info(self, request: Request) -> Response:
        # ``sim_pace`` is the simulator's own field (SGLang has no such key): what the harness's lag check reads.
        return JSONResponse({**self.status.server_info(ready=self.ready), "sim_pace": dict(self.pace)})

    async def models(self, request: Request) -> Response:
        st = self.status
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": st.served_model_name,
                        "object": "model",
                        "created": int(st.started_at),
                        "owned_by": "sglang",
                        "root": st.served_model_name,
                        "parent": None,
                        "max_model_len": st.context_len,
                    }
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        if not self.status.server_args.get("enable_metrics"):
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return PlainTextResponse(self.status.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def flush_cache(self, request: Request) -> Response:
        if self.streams or self.sched.has_work():
            return PlainTextResponse("Cache not flushed. Please check the server status.", status_code=400)
        self.status.flush()
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    async def sim_gpu(self, request: Request) -> Response:
        return JSONResponse(self.status.device_reading())

    async def sim_pace(self, request: Request) -> Response:
        return JSONResponse(self.pace)

    def _routes(self) -> list[Route]:
        return [
            Route("/health", self.health),
            Route("/health_generate", self.health),
            Route("/ready", self.health),
            Route("/model_info", self.model_info),
            Route("/get_model_info", self.model_info),
            Route("/server_info", self.server_info),
            Route("/get_server_info", self.server_info),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/metrics", self.metrics),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/sim/gpu", self.sim_gpu),
            Route("/sim/pace", self.sim_pace),
        ]

    # -- warm-up and shutdown -------------------------------------------------------------------------------
    async def warmup(self) -> None:
        """SGLang's warm-up request (8 tokens), run through the scheduler before the server reports ready."""
        s = self._submit(NATIVE, "The capital city of France is", 8, 8, False, {})
        try:
            await s.wait_finished()
        finally:
            self._close(s)

    async def drain(self, *, interval_s: float = 5.0) -> None:
        """SIGTERM: refuse new work, let in-flight requests finish, report what is left every ``interval_s``."""
        self.draining = True
        loop = asyncio.get_running_loop()
        next_report = loop.time() + interval_s
        while self.streams or self.sched.has_work():
            if loop.time() >= next_report:
                self.log(logs.graceful(list(self.streams)))
                next_report += interval_s
            await asyncio.sleep(0.05)
        self.log(logs.graceful([]))


async def _json(request: Request) -> RequestBody | None:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cast(RequestBody, body) if isinstance(body, dict) else None  # its keys read as sent (``RequestBody``)


def _greedy(kind: str, body: RequestBody) -> bool:
    """Whether the request decodes greedily (``requests.is_greedy``: ValueError for a bad temperature), by its
    temperature and top_k: in ``sampling_params`` for native, at the top level for OpenAI."""
    params = body.get("sampling_params") if kind == NATIVE else body
    if not isinstance(params, dict):
        params = {}
    return is_greedy(params.get("temperature"), params.get("top_k"))


def _content(content: Any) -> str:
    if isinstance(content, list):  # multimodal parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def install_sigterm(server: SimServer, exit_now: Callable[[], None]) -> None:
    """SIGTERM drains like SGLang, then exits; a second SIGTERM or SIGINT while draining exits at once."""
    loop = asyncio.get_running_loop()

    def handle() -> None:
        if server.draining:
            exit_now()
            return
        server.log(logs.sigterm())

        async def drain_then_exit() -> None:
            await server.drain()
            exit_now()

        loop.create_task(drain_then_exit())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle)
