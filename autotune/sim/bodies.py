"""The response bodies the simulator sends, as TypedDicts naming SGLang 0.5.23's keys: native ``/generate``
(``text``, ``output_ids``, ``meta_info``) and the OpenAI completion and chat bodies, whole or as stream chunks;
and, last, the request bodies it reads. They stay plain JSON (the keys are SGLang's and OpenAI's); mypy checks
every key ``responses.py`` writes and ``server.py`` reads."""

from __future__ import annotations

from typing import Any, Literal, Required, TypedDict

# ``[logprob, token_id, text or None]``, as SGLang's ``output_token_logprobs`` lists each token
LogprobTriple = list[float | int | str | None]


class FinishReason(TypedDict, total=False):
    """``meta_info.finish_reason``: ``stop`` (with the matched token), ``length`` (with it) or ``abort``."""

    type: Required[Literal["stop", "length", "abort"]]
    matched: int
    length: int
    message: str


class Logprobs(TypedDict):
    input_token_logprobs: list[LogprobTriple]
    output_token_logprobs: list[LogprobTriple]


class MetaInfo(TypedDict, total=False):
    """Native ``meta_info``: always the request's counts; logprobs when asked for; latency and speculative
    figures once finished."""

    id: Required[str]
    finish_reason: Required[FinishReason | None]
    prompt_tokens: Required[int]
    weight_version: Required[str]
    num_retractions: Required[int]
    reasoning_tokens: Required[int]
    completion_tokens: Required[int]
    cached_tokens: Required[int]
    cached_tokens_details: Required[None]
    dp_rank: Required[int | None]
    input_token_logprobs: list[LogprobTriple]
    output_token_logprobs: list[LogprobTriple]
    e2e_latency: float
    spec_verify_ct: int
    spec_accept_length: float
    spec_accept_rate: float
    spec_num_correct_drafts: int
    spec_num_proposed_drafts: int


class NativeBody(TypedDict):
    """A whole native ``/generate`` response."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class Usage(TypedDict):
    """The OpenAI usage block (``prompt_tokens_details`` only under ``--enable-cache-report``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None
    reasoning_tokens: int


class TextChoice(TypedDict):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    matched_stop: int | None


class ChatMessage(TypedDict):
    role: str | None
    content: str
    reasoning_content: None
    tool_calls: None


class ChatDeltaChoice(TypedDict):
    index: int
    delta: ChatMessage
    logprobs: None
    finish_reason: str | None
    matched_stop: int | None


class ChatChoice(TypedDict):
    index: int
    message: ChatMessage
    logprobs: None
    finish_reason: str | None
    matched_stop: int | None


class Completion(TypedDict):
    """An OpenAI completion or chat body, whole (``choices`` of messages) or one stream chunk (of deltas)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice | ChatChoice | ChatDeltaChoice]
    usage: Usage | None


# The request bodies the simulator reads. The keys are SGLang's (``/generate``'s ``GenerateReqInput``) and OpenAI's
# (``/v1/completions``, ``/v1/chat/completions``); the values are as the client sent them, unchecked (``Any``): the
# handlers test each before use and answer 400 where one is wrong, as SGLang does.
class SamplingParams(TypedDict, total=False):
    """``/generate``'s ``sampling_params``: the ones the simulator reads."""

    max_new_tokens: Any
    ignore_eos: Any
    temperature: Any
    top_k: Any


class RequestBody(TypedDict, total=False):
    """A generation request as sent, by the keys the simulator reads (one endpoint's keys, or another's)."""

    model: Any  # OpenAI: echoed back in the response
    stream: Any
    stream_options: Any  # OpenAI: ``{"include_usage": true}``
    ignore_eos: Any  # OpenAI (SGLang's extension); native: in ``sampling_params``
    temperature: Any  # OpenAI; native: in ``sampling_params``
    top_k: Any
    text: Any  # native
    input_ids: Any
    sampling_params: SamplingParams
    return_logprob: Any
    return_text_in_logprobs: Any
    prompt: Any  # completions
    max_tokens: Any  # completions and chat
    messages: Any  # chat
    max_completion_tokens: Any
