"""A prompt row and how a replay sends it: the text or chat messages of one request, its own output budget and
sampling, and the pass markers that keep a replay's later walks through the sample from being served from cache.

Depends on nothing but ``errors`` (layer 0: the config check, the harness and the simulator all read prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.errors import WorkloadError
from autotune.prompts.messages import ChatMessage

if TYPE_CHECKING:
    from autotune.prompts.template import ChatTemplate

REPEATS = ("fresh", "verbatim")  # how a replay re-sends a prompt it already sent (``workload.repeats``)


def pass_marker(pass_no: int) -> str:
    """What a ``fresh`` replay puts in front of a prompt on its ``pass_no``-th walk through the sample (none on the
    first). An offline job sends each prompt once; a replay that walks a 200-prompt sample several times in one
    window would otherwise let the radix cache serve whole prompts it cached on the previous walk, hits the job
    never gets. The marker leads the prompt, so nothing cached on another pass matches beyond it, while prompts of
    the same pass still share their common prefix (a system prompt) exactly as the job's do."""
    return f"[pass {pass_no}]\n" if pass_no else ""


def check_repeats(repeats: str) -> None:
    """A ``repeats`` value the replay knows, or a ``WorkloadError`` naming the choices."""
    if repeats not in REPEATS:
        raise WorkloadError(f"unknown repeats {repeats!r}", key="repeats", fix=f"use one of {list(REPEATS)}")


def walk_position(sent: int, size: int, repeats: str) -> tuple[int, int]:
    """(row index, pass marker) of the ``sent``-th request of a replay walking ``size`` prompts round-robin: each
    later walk is marked when ``repeats`` is "fresh", never when "verbatim"."""
    walk, index = divmod(sent, size)
    return index, walk if repeats == "fresh" else 0


def on_pass(text: str, pass_no: int) -> str:
    """``text`` as a ``fresh`` replay sends it on walk ``pass_no`` (the simulator's evaluator and the replay agree)."""
    return pass_marker(pass_no) + text


ENDPOINTS = ("chat", "completions")  # what a Batch API line's ``url`` names: the replay sends the row there


@dataclass(frozen=True)
class PromptRow:
    """One request of the sample. ``line``: where it is in its file (a record's index in a JSON array file);
    ``endpoint``: the endpoint the job sends it to (a Batch API line's ``url``), None for the study's own;
    ``template``: the served model's chat template, set when the sample is bound to a model."""

    line: int
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    endpoint: str | None = None
    template: ChatTemplate | None = field(default=None, compare=False, repr=False)

    def as_text(self, pass_no: int = 0) -> str:
        """The prompt for a text endpoint. Chat rows are rendered with the model's own chat template when the
        sample is bound to a model that has one, else with Qwen's ChatML (the simulator's default, right for Qwen
        and no other family). ``pass_no``: see ``pass_marker``."""
        if self.prompt is not None:
            return on_pass(self.prompt, pass_no)
        if self.template is not None:
            return self.template.render(self.as_messages(pass_no))
        turns = "".join(
            f"<|im_start|>{m.get('role', 'user')}\n{m.get('content', '')}<|im_end|>\n" for m in self.messages or ()
        )
        return on_pass(turns + "<|im_start|>assistant\n", pass_no)

    def as_messages(self, pass_no: int = 0) -> list[ChatMessage]:
        """The prompt for a chat endpoint; the ``pass_marker`` leads the first message's content (the server's
        chat template puts only a role header before it)."""
        messages: list[ChatMessage] = (
            [m.copy() for m in self.messages]
            if self.messages is not None
            else [{"role": "user", "content": self.prompt or ""}]
        )
        if pass_no:
            content = messages[0].get("content", "")
            messages[0]["content"] = (
                [{"type": "text", "text": pass_marker(pass_no)}, *content]
                if isinstance(content, list)
                else on_pass(str(content), pass_no)
            )
        return messages


CHARS_PER_TOKEN = 4
# The estimate a prompt's length is checked with, before any launch: 4 characters per token is the simulator's own
# count (``sim.requests.count_tokens``, so the check refuses exactly what the sim would) and about what Qwen's and
# Llama's BPE tokenizers average on English prose. Code, digits and non-Latin text tokenize denser (more tokens than
# this says), so a prompt refused here is too long for them too; only prose of unusually long words could fit a
# little above the estimate. A prompt the estimate lets through but the server refuses is counted as a rejected
# request of the trial (``harness.outcome``), never hidden.
UNKNOWN_CONTEXT_TOKENS = 10 * 2**20  # no known context length (an HF id, not a local dir): the longest any model has
LONGEST_PASS = 9999  # a ``fresh`` replay's later walks lead each prompt with a pass marker; this one is the longest
_MARKER_CHARS = len(pass_marker(LONGEST_PASS))


def estimate_tokens(row: PromptRow) -> int:
    """A row's prompt tokens at ``CHARS_PER_TOKEN``, counting the longest pass marker a replay may put in front."""
    return -(-(len(row.as_text()) + _MARKER_CHARS) // CHARS_PER_TOKEN)
