"""One SSE stream's chunks into a ``RequestRecord``: tokens by the server's own counts, finish reason, errors."""

from __future__ import annotations

import json
import re
from typing import TypedDict

from autotune.harness.workload.records import RequestRecord
from autotune.harness.workload.settle import SliceTally


# One streamed chunk as SGLang 0.5.23 sends it, only the keys the replay reads (all optional: a chunk carries some).
# The OpenAI routes' are ``srt/entrypoints/openai/protocol.py``'s stream responses; the native ``/generate`` chunk's
# ``meta_info`` is filled in ``srt/managers/tokenizer_manager.py``.
class ErrorBody(TypedDict, total=False):
    message: str


class FinishReason(TypedDict, total=False):
    type: str  # "stop", "length", "abort"
    message: str


class MetaInfo(TypedDict, total=False):
    completion_tokens: int
    prompt_tokens: int
    finish_reason: FinishReason | str | None
    spec_accept_length: float


class Usage(TypedDict, total=False):
    completion_tokens: int | None
    prompt_tokens: int


class Delta(TypedDict, total=False):
    content: str | None


class Choice(TypedDict, total=False):
    text: str  # /v1/completions
    delta: Delta  # /v1/chat/completions
    finish_reason: str | None


class SpecTokensDetails(TypedDict, total=False):
    spec_accept_length: float


class SglExt(TypedDict, total=False):
    spec_tokens_details: SpecTokensDetails | None  # a list only for n > 1, which the replay never asks for


class Chunk(TypedDict, total=False):
    """A native chunk (``meta_info``) or an OpenAI one (``choices``, ``usage``, SGLang's ``sglext``); ``error``
    when the request failed."""

    error: ErrorBody | str
    meta_info: MetaInfo | None
    usage: Usage | None
    choices: list[Choice] | None
    sglext: SglExt | None


_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_UNFINISHED = re.compile(rb'"finish_reason":\s*null')


class SseStream:
    """Turns one SSE stream's chunks into (tokens, finish, error) using the server's token counts.

    Fast path: a chunk that is not finished only needs its ``completion_tokens``, found by a regex instead of
    a JSON parse. That matters because SGLang's native chunks carry the *cumulative* text and ids, so a long
    output's late chunks are tens of KB each; only the last chunk (and errors) are parsed in full.
    ``tally``: the replay's per-slice token counts, fed with each chunk as it arrives.
    """

    def __init__(self, endpoint: str, tally: SliceTally | None = None):
        self.native = endpoint == "generate"
        self.counted = 0
        self.tally = tally

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
            if self.tally is not None:
                self.tally.add(now, total - self.counted)
            self.counted = total

    def feed(self, data: Chunk, rec: RequestRecord, now: float) -> None:
        if "error" in data:
            err = data["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        total = self._native(data, rec) if self.native else self._openai(data, rec)
        if total is not None:
            self._count(int(total), rec, now)

    def _native(self, data: Chunk, rec: RequestRecord) -> int | None:
        meta: MetaInfo = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if finish:
            rec.finish_reason = finish.get("type") if isinstance(finish, dict) else str(finish)
            if rec.finish_reason == "abort":
                rec.error = f"aborted by server: {finish.get('message') if isinstance(finish, dict) else ''}"
            if meta.get("spec_accept_length") is not None:
                rec.accept_length = float(meta["spec_accept_length"])
        if meta.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(meta["prompt_tokens"])
        return meta.get("completion_tokens")

    def _openai(self, data: Chunk, rec: RequestRecord) -> int | None:
        usage: Usage = data.get("usage") or {}
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
        ext: SglExt = data.get("sglext") or {}
        details: SpecTokensDetails = ext.get("spec_tokens_details") or {}
        if details.get("spec_accept_length") is not None:
            rec.accept_length = float(details["spec_accept_length"])
        return total
