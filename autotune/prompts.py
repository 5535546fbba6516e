"""The prompt file: one JSON object per line (``{"prompt": ...}`` or ``{"messages": [...]}``, optional
``max_tokens``), and the fixed, seeded sample every trial of a study replays.

Read by the config check (a bad file is one error before any launch), the harness's replay client and the
simulator engine's prediction; it depends on nothing but ``errors``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import WorkloadError

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


@dataclass(frozen=True)
class PromptRow:
    line: int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int | None = None

    def as_text(self, pass_no: int = 0) -> str:
        """The prompt for a text endpoint; chat rows rendered with Qwen's ChatML template. ``pass_no``: see
        ``pass_marker``."""
        if self.prompt is not None:
            return on_pass(self.prompt, pass_no)
        turns = "".join(f"<|im_start|>{m.get('role', 'user')}\n{m.get('content', '')}<|im_end|>\n" for m in self.messages or ())
        return on_pass(turns + "<|im_start|>assistant\n", pass_no)

    def as_messages(self, pass_no: int = 0) -> list[dict[str, Any]]:
        """The prompt for a chat endpoint; the ``pass_marker`` leads the first message's content (the server's
        chat template puts only a role header before it)."""
        messages: list[dict[str, Any]] = [dict(m) for m in self.messages] if self.messages is not None else [
            {"role": "user", "content": self.prompt or ""}]
        if pass_no:
            content = messages[0].get("content", "")
            messages[0]["content"] = ([{"type": "text", "text": pass_marker(pass_no)}, *content]
                                      if isinstance(content, list) else on_pass(str(content), pass_no))
        return messages


CHARS_PER_TOKEN = 4
# The estimate a prompt's length is checked with, before any launch: 4 characters per token is the simulator's own
# count (``sim.requests.count_tokens``, so the check refuses exactly what the sim would) and about what Qwen's and
# Llama's BPE tokenizers average on English prose. Code, digits and non-Latin text tokenize denser (more tokens than
# this says), so a prompt refused here is too long for them too; only prose of unusually long words could fit a
# little above the estimate. A prompt the estimate lets through but the server refuses is counted as a rejected
# request of the trial (``harness.outcome``), never hidden.
UNKNOWN_CONTEXT_TOKENS = 10 * 2**20  # no known context length (an HF id, not a local dir): the longest any model has
_MARKER_CHARS = len(pass_marker(9999))  # a ``fresh`` replay's later walks lead each prompt with a pass marker


def estimate_tokens(row: PromptRow) -> int:
    """A row's prompt tokens at ``CHARS_PER_TOKEN``, counting the longest pass marker a replay may put in front."""
    return -(-(len(row.as_text()) + _MARKER_CHARS) // CHARS_PER_TOKEN)


def _where(path: Path, line_no: int) -> dict[str, str]:
    """``file:line``, as compilers and editors name a line (a terminal can open it there)."""
    return {"file": f"{path}:{line_no}"}


def _decode(path: Path, line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(
            f"line is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})", **_where(path, line_no),
            fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove the line") from None


def _parse_row(path: Path, line_no: int, text: str) -> PromptRow:
    where = _where(path, line_no)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"line is not valid JSON ({exc.msg})", **where, fix="each line must be one JSON object") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"line is a JSON {type(data).__name__}, not an object", **where,
                            fix='use {"prompt": "..."} or {"messages": [...]}')
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise WorkloadError(f"max_tokens must be a positive integer, got {max_tokens!r}", **where,
                            fix="remove it or give a whole number of tokens")
    prompt, messages = data.get("prompt"), data.get("messages")
    if prompt is not None and not isinstance(prompt, str):
        raise WorkloadError(f'"prompt" must be a string, got a JSON {type(prompt).__name__}', **where,
                            fix='write {"prompt": "..."}')
    if isinstance(prompt, str):
        return PromptRow(line_no, prompt=prompt, max_tokens=max_tokens)
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and "content" in m for m in messages):
        return PromptRow(line_no, messages=tuple(messages), max_tokens=max_tokens)
    raise WorkloadError(
        'row has neither a "prompt" string nor a chat "messages" list of {"role", "content"} objects', **where,
        fix='use {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}',
    )


def read_rows(path: Path) -> list[PromptRow]:
    """Every row of the file, split on ``\\n`` bytes (a JSON string may hold U+2028, which ``str.splitlines``
    would cut) and decoded line by line, so invalid UTF-8 is one error naming its line; a leading BOM is skipped."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WorkloadError(f"cannot read prompts file {path} ({exc.strerror})",
                            fix="point it at a readable JSONL file") from None
    rows = []
    for line_no, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        if raw.strip():
            rows.append(_parse_row(path, line_no, _decode(path, line_no, raw)))
    return rows


@dataclass(frozen=True)
class PromptSample:
    """A fixed, seeded sample of prompt rows: identical for every trial of a study. ``short_of``: how many rows
    fewer than the ``sample_size`` asked for the file had (the sample is then the whole file; see ``note``)."""

    path: Path
    rows: tuple[PromptRow, ...]
    seed: int = 0
    short_of: int = 0

    @classmethod
    def load(cls, path: Path | str, n: int, seed: int = 0) -> PromptSample:
        path = Path(path)
        if not path.is_file():
            raise WorkloadError("prompts file not found", file=str(path), fix="pass --prompts with a JSONL file of prompts")
        rows = read_rows(path)
        if not rows:
            raise WorkloadError("prompts file has no rows", file=str(path), fix="add one JSON object per line")
        rng = random.Random(seed)
        chosen = rng.sample(rows, min(n, len(rows)))
        return cls(path=path, rows=tuple(chosen), seed=seed, short_of=max(0, n - len(rows)))

    @property
    def note(self) -> str | None:
        """The warning a short sample deserves (None when the file had ``sample_size`` rows or more)."""
        if not self.short_of:
            return None
        have = len(self.rows)
        return (f"{self.path} has {have} prompt{'s' * (have != 1)}, {self.short_of} fewer than sample_size "
                f"{have + self.short_of}: every trial replays only {'these' if have != 1 else 'this one'} (add rows, or "
                f"lower sample_size)")

    def check_fit(self, context_len: int | None, max_tokens: int, *, source: str = "the context length") -> None:
        """A ``WorkloadError`` naming the first sampled row (by line) whose estimated prompt tokens plus its
        ``max_tokens`` exceed ``context_len`` (the server would refuse every send of it); ``context_len`` None:
        ``UNKNOWN_CONTEXT_TOKENS``. ``source`` says where the limit came from, for the message."""
        limit = context_len or UNKNOWN_CONTEXT_TOKENS
        over = [(row, estimate_tokens(row), min(row.max_tokens or max_tokens, max_tokens)) for row in self.rows]
        over = sorted((o for o in over if o[1] + o[2] > limit), key=lambda o: o[0].line)
        if not over:
            return
        row, tokens, new = over[0]
        more = f"; {len(over) - 1} more sampled prompt{'s' * (len(over) > 2)} too" if len(over) > 1 else ""
        known = (f"{source} ({limit:,} tokens)" if context_len else
                 f"{limit:,} tokens, the longest context any model has (this one's is not known before launch)")
        raise WorkloadError(
            f"prompt is ~{tokens:,} tokens ({len(row.as_text()):,} chars at {CHARS_PER_TOKEN} per token) + {new:,} "
            f"max_tokens, over {known}{more}", **_where(self.path, row.line),
            fix="shorten or remove the line, lower max_tokens, or raise --context-length")

    def __len__(self) -> int:
        return len(self.rows)
