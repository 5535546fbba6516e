"""The scheduler's records: a request's state between steps, and what one step returns (its duration, the tokens
each request got, SGLang's log lines)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autotune.sim.requests import SimRequest

if TYPE_CHECKING:
    from autotune.sim.radix import _Node

__all__ = ["Emission", "ReqState", "StepResult"]


@dataclass(slots=True)
class Emission:
    """Tokens one request produced in one step (``completion_tokens`` is its running total)."""

    rid: str
    new_tokens: int
    completion_tokens: int
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" (could never fit) when finished
    verify_ct: int = 0  # speculative verify passes so far
    accepted_drafts: int = 0  # draft tokens accepted so far (bonus tokens excluded)
    prompt_tokens: int = 0
    retractions: int = 0
    cached_tokens: int = 0  # prompt tokens the radix cache served (SGLang's meta_info.cached_tokens)


@dataclass(slots=True)
class StepResult:
    """One iteration: how long it takes on the modelled GPU and what it produced."""

    duration_s: float
    kind: str  # "prefill" | "decode" | "idle"
    # Sequences default to a shared empty tuple: building lists nobody fills costs more than the step itself.
    emissions: Sequence[Emission] = ()  # every request's tokens (empty when the scheduler does not emit)
    log_lines: Sequence[str] = ()  # SGLang's messages, without timestamps
    runtime_oom: str | None = None  # fatal: the server dies with this message
    tokens: int = 0  # output tokens produced this step
    prefill_tokens: int = 0  # prefill: the batch's new (uncached) tokens, whose activations the step holds
    verify: int = 0  # verify passes this step (speculative decode cycles: one per running request)
    started: Sequence[str] = ()  # rids whose first token came out this step
    finished: Sequence[Emission] = ()  # always filled, even when emissions are not
    # decode: seconds since each request's previous token (one float when that is the same for all)
    gaps_s: float | np.ndarray | None = None
    new: np.ndarray | None = None  # decode: per request, tokens this cycle (aligned with gaps_s)
    # A block of k decode cycles (``step(max_cycles)``): each cycle's end on the clock and its tokens; then
    # ``gaps_s`` holds one gap per cycle and ``new`` is k × running.
    ends_s: np.ndarray | None = None
    cycle_tokens: np.ndarray | None = None


class ReqState:
    """A request's mutable state in the scheduler while it waits, prefills, or is retracted."""

    __slots__ = (
        "req",
        "gen",
        "done_prefill",
        "seq",
        "verify",
        "accepted",
        "retractions",
        "started",
        "last_t",
        "entry",
        "cached",
        "node",
        "branch",
    )

    def __init__(self, req: SimRequest, seq: int):
        self.req, self.seq = req, seq
        self.gen = 0  # completion tokens so far (kept across retraction, re-prefilled with the prompt)
        self.done_prefill = 0  # tokens of the current (re-)prefill already in KV
        self.verify = self.accepted = self.retractions = 0
        self.started = False
        self.last_t = 0.0
        self.entry = (0, 0)  # (decode cycle, gen) when it last entered the running batch
        self.cached = 0  # prompt tokens the radix cache served at its last admission
        self.node: _Node | None = None  # the radix-cache node it holds locked while admitted (None: holds none)
        self.branch: int | None = None  # where its prefill saves the Mamba state (``sim.radix.Match.branch``)

    @property
    def extend_len(self) -> int:
        """Tokens its (re-)prefill computes: prompt and output so far, less what the radix cache served."""
        return self.req.prompt_tokens + self.gen - self.cached
