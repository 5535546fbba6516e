"""What each trial replays (``WorkloadSpec``, the study's ``WorkloadSection``) and the request body one prompt becomes
on each endpoint."""

from __future__ import annotations

from typing import Required, TypedDict

from autotune.config.sections import WorkloadSection
from autotune.prompts import ChatMessage, PromptRow

ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


# What each trial replays: the study file's ``[workload]`` record itself, all the way to the replay client
# (``autotune measure`` builds one from its options and ``named_by`` its option names).
WorkloadSpec = WorkloadSection


class SamplingParams(TypedDict):
    max_new_tokens: int
    ignore_eos: bool
    temperature: float


class NativeBody(TypedDict):
    """SGLang's native ``/generate`` request (``GenerateReqInput``), streamed."""

    text: str
    sampling_params: SamplingParams
    stream: bool


class StreamOptions(TypedDict):
    include_usage: bool
    continuous_usage_stats: bool  # SGLang's extension: usage on every chunk, the arrival time of each token


class OpenAIBody(TypedDict, total=False):
    """An OpenAI ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) request, streamed."""

    model: Required[str]
    max_tokens: Required[int]
    ignore_eos: Required[bool]  # SGLang's extension of the OpenAI request
    temperature: Required[float]
    stream: Required[bool]
    stream_options: Required[StreamOptions]
    messages: list[ChatMessage]
    prompt: str


RequestBody = NativeBody | OpenAIBody


def request_body(endpoint: str, row: PromptRow, *, max_tokens: int, ignore_eos: bool, pass_no: int = 0) -> RequestBody:
    """The streaming request for ``row`` on ``endpoint`` (SGLang's native /generate or the OpenAI routes): greedy,
    unless the row carries the job's own temperature (a Batch API body's: it moves speculative acceptance)."""
    n = min(row.max_tokens or max_tokens, max_tokens)
    temperature = row.temperature if row.temperature is not None else 0
    if endpoint == "generate":
        params = SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos, temperature=temperature)
        return NativeBody(text=row.as_text(pass_no), sampling_params=params, stream=True)
    body = OpenAIBody(
        model="default",
        max_tokens=n,
        ignore_eos=ignore_eos,
        temperature=temperature,
        stream=True,
        stream_options=StreamOptions(include_usage=True, continuous_usage_stats=True),
    )
    if endpoint == "chat":
        body["messages"] = row.as_messages(pass_no)
    else:
        body["prompt"] = row.as_text(pass_no)
    return body
