"""One request's response as SGLang shapes it: native ``/generate`` and OpenAI completion/chat bodies, streamed
(SSE) or whole, with ``meta_info.output_token_logprobs`` when a native request asks for ``return_logprob``.

Native streaming events are formatted by hand from a pre-built filler text (``tokens``): that keeps the pacing
loop's hot path to a string join and one ``send`` per request per step (``Stream._native_chunk`` says why);
everything else is ``json.dumps``. Which tokens a request emits is its ``TokenPlan``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from autotune.sim.bodies import (
    ChatChoice,
    ChatDeltaChoice,
    ChatMessage,
    Completion,
    FinishReason,
    Logprobs,
    MetaInfo,
    NativeBody,
    TextChoice,
    Usage,
)
from autotune.sim.tokens import STREAM, TokenPlan, filler

__all__ = ["CHAT", "COMPLETION", "EOS_ID", "NATIVE", "SSEResponse", "Stream", "filler"]

NATIVE, COMPLETION, CHAT = "generate", "text_completion", "chat.completion"
EOS_ID = 248046  # what a "stop" finish reports as the matched token


class Stream:
    """One request's tokens as they are delivered, and what its response needs to say about them."""

    __slots__ = (
        "rid",
        "kind",
        "prompt_tokens",
        "completion_tokens",
        "sent",
        "finished",
        "reason",
        "verify_ct",
        "accepted",
        "retractions",
        "event",
        "created",
        "first_at",
        "done_at",
        "tokens",
        "model",
        "include_usage",
        "draft_tokens",
        "gone",
        "interval",
        "return_logprob",
        "logprob_text",
        "cached",
        "cache_report",
    )

    def __init__(self, rid: str, kind: str, prompt_tokens: int, *, model: str, draft_tokens: int):
        self.rid, self.kind, self.prompt_tokens = rid, kind, prompt_tokens
        self.completion_tokens = self.sent = self.verify_ct = self.accepted = self.retractions = 0
        self.finished, self.gone, self.include_usage = False, False, False
        self.reason: str | None = None
        self.event = asyncio.Event()
        self.created = time.time()
        self.first_at = self.done_at = 0.0
        # Which tokens it emits: by default a stretch of the filler picked by its id (a sampled request);
        # the server sets a prompt-determined plan for greedy requests (``sim.divergence``).
        self.tokens = TokenPlan.reference(int(rid[:4], 16) % STREAM)
        self.return_logprob = False  # native ``return_logprob``: add output_token_logprobs to meta_info
        self.logprob_text = False  # ``return_text_in_logprobs``: each triple carries the token's text
        self.model, self.draft_tokens = model, draft_tokens
        self.interval = 1  # SGLang's --stream-interval: send every N tokens (and always the last)
        self.cached = 0  # prompt tokens the radix cache served (meta_info.cached_tokens)
        self.cache_report = False  # --enable-cache-report: OpenAI usage carries prompt_tokens_details

    def push(self, em: Any) -> None:
        if not self.first_at and em.completion_tokens:
            self.first_at = time.time()
        self.completion_tokens = em.completion_tokens
        self.verify_ct, self.accepted, self.retractions = em.verify_ct, em.accepted_drafts, em.retractions
        self.cached = em.cached_tokens
        if em.finished:
            self.finished, self.reason, self.done_at = True, em.finish_reason or "length", time.time()
        # Wake the sender only when it will send: with a large --stream-interval, idle wake-ups would cost the
        # pacing loop as much CPU as the chunks it saves.
        if self.finished or self.completion_tokens - self.sent >= self.interval:
            self.event.set()

    async def wait_finished(self) -> None:
        while not self.finished and not self.gone:
            await self.event.wait()
            self.event.clear()

    # -- response bodies ------------------------------------------------------------------------------------
    def _finish_native(self) -> FinishReason | None:
        if not self.finished:
            return None
        if self.reason == "stop":
            return {"type": "stop", "matched": EOS_ID}
        if self.reason == "abort":
            return {"type": "abort", "message": "Aborted: the request cannot fit in the KV cache."}
        return {"type": "length", "length": self.completion_tokens}

    def meta(self) -> MetaInfo:
        n = self.completion_tokens
        meta = MetaInfo(
            id=self.rid,
            finish_reason=self._finish_native(),
            prompt_tokens=self.prompt_tokens,
            weight_version="default",
            num_retractions=self.retractions,
            reasoning_tokens=0,
            completion_tokens=n,
            cached_tokens=self.cached,
            cached_tokens_details=None,
            dp_rank=None,
        )
        if self.return_logprob:
            self._add_logprobs(meta, n)
        if self.finished:
            meta["e2e_latency"] = self.done_at - self.created
            if self.draft_tokens > 1:
                proposed = self.verify_ct * (self.draft_tokens - 1)
                meta["spec_verify_ct"] = self.verify_ct
                meta["spec_accept_length"] = n / self.verify_ct if self.verify_ct else 0.0
                meta["spec_accept_rate"] = self.accepted / proposed if proposed else 0.0
                meta["spec_num_correct_drafts"] = self.accepted
                meta["spec_num_proposed_drafts"] = proposed
        return meta

    def _add_logprobs(self, meta: MetaInfo, end: int) -> None:
        logprobs = self.logprobs(end)
        meta["input_token_logprobs"] = logprobs["input_token_logprobs"]
        meta["output_token_logprobs"] = logprobs["output_token_logprobs"]

    def logprobs(self, end: int) -> Logprobs:
        """SGLang's logprob fields for output tokens [0, end): ``[logprob, token_id, text or null]`` triples.

        ``logprob_start_len`` defaults to -1 in SGLang (no prompt logprobs); the simulator never returns any.
        """
        ids, values = self.tokens.ids(0, end), self.tokens.logprobs(0, end)
        return {
            "input_token_logprobs": [],
            "output_token_logprobs": [
                [lp, tid, f" w{tid}" if self.logprob_text else None] for lp, tid in zip(values, ids, strict=True)
            ],
        }

    def usage(self) -> Usage:
        p, n = self.prompt_tokens, self.completion_tokens
        details = {"cached_tokens": self.cached} if self.cache_report else None
        return {
            "prompt_tokens": p,
            "completion_tokens": n,
            "total_tokens": p + n,
            "prompt_tokens_details": details,
            "reasoning_tokens": 0,
        }

    def chunk(self, start: int, end: int) -> str:
        """One SSE event with tokens [start, end) (cumulative text for native, a delta for OpenAI)."""
        if self.kind == NATIVE:
            return self._native_chunk(end)
        text, _ = self.tokens.span(start, end)
        reason = self.reason if self.finished else None
        matched = EOS_ID if self.finished and self.reason == "stop" else None
        choice: ChatDeltaChoice | TextChoice
        if self.kind == CHAT:
            delta = ChatMessage(
                role="assistant" if start == 0 else None, content=text, reasoning_content=None, tool_calls=None
            )
            choice = ChatDeltaChoice(index=0, delta=delta, logprobs=None, finish_reason=reason, matched_stop=matched)
            obj = "chat.completion.chunk"
        else:
            choice = TextChoice(index=0, text=text, logprobs=None, finish_reason=reason, matched_stop=matched)
            obj = "text_completion"
        out = _event(
            Completion(
                id=self.rid, object=obj, created=int(self.created), model=self.model, choices=[choice], usage=None
            )
        )
        if self.finished and self.include_usage:
            out += _event(
                Completion(
                    id=self.rid, object=obj, created=int(self.created), model=self.model, choices=[], usage=self.usage()
                )
            )
        return out

    def _native_chunk(self, end: int) -> str:
        """A native ``/generate`` event carries the *cumulative* text and ids, so ``json.dumps`` of it grows with
        the output: ~160 µs at 200 tokens against ~4 µs for this f-string, per request per sent step, on the one
        core that paces every request. ``benchmarks/sim_capacity.py`` (streaming ``/generate``) is bounded by
        exactly this loop, so the common event (not finished, no logprobs) stays hand-built; the filler text and
        ids need no escaping. The rarer final/logprob event and the OpenAI deltas go through ``json.dumps``."""
        text, ids = self.tokens.span(0, end)
        if self.finished or self.return_logprob:
            meta = self.meta()
            if end != self.completion_tokens:
                meta["completion_tokens"] = end
                if self.return_logprob:
                    self._add_logprobs(meta, end)
            info = json.dumps(meta, separators=(",", ":"))
            return f'data: {{"text":"{text}","output_ids":[{ids}],"meta_info":{info}}}\n\n'
        return (
            f'data: {{"text":"{text}","output_ids":[{ids}],"meta_info":{{"id":"{self.rid}",'
            f'"finish_reason":null,"prompt_tokens":{self.prompt_tokens},"weight_version":"default",'
            f'"num_retractions":{self.retractions},"reasoning_tokens":0,"completion_tokens":{end},'
            f'"cached_tokens":{self.cached},"cached_tokens_details":null,"dp_rank":null}}}}\n\n'
        )

    def body(self) -> NativeBody | Completion:
        """The non-streaming response."""
        text, ids = self.tokens.span(0, self.completion_tokens)
        if self.kind == NATIVE:
            return NativeBody(text=text, output_ids=json.loads(f"[{ids}]"), meta_info=self.meta())
        reason = self.reason or "abort"
        matched = EOS_ID if reason == "stop" else None
        choice: ChatChoice | TextChoice
        if self.kind == CHAT:
            message = ChatMessage(role="assistant", content=text, reasoning_content=None, tool_calls=None)
            choice = ChatChoice(index=0, message=message, logprobs=None, finish_reason=reason, matched_stop=matched)
            obj = "chat.completion"
        else:
            choice = TextChoice(index=0, text=text, logprobs=None, finish_reason=reason, matched_stop=matched)
            obj = "text_completion"
        return Completion(
            id=self.rid, object=obj, created=int(self.created), model=self.model, choices=[choice], usage=self.usage()
        )


def _event(data: Completion) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class SSEResponse(Response):
    """A server-sent-event stream fed by a ``Stream``; a client disconnect aborts the request."""

    def __init__(self, stream: Stream, on_close: Callable[[Stream], None]):
        self.stream, self.on_close = stream, on_close
        self.status_code = 200
        self.background = None

    async def _watch(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stream.gone = True
                self.stream.event.set()
                return

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        s = self.stream
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        try:
            while not s.gone:
                await s.event.wait()
                s.event.clear()
                if s.gone:
                    break
                end = s.completion_tokens
                if end - s.sent >= s.interval or s.finished:
                    text = s.chunk(s.sent, end)
                    s.sent = end
                    if s.finished:
                        await send(
                            {
                                "type": "http.response.body",
                                "body": (text + "data: [DONE]\n\n").encode(),
                                "more_body": False,
                            }
                        )
                        return
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        except OSError:
            s.gone = True
        finally:
            watcher.cancel()
            self.on_close(s)
