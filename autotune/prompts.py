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
        messages = [dict(m) for m in self.messages] if self.messages is not None else [
            {"role": "user", "content": self.prompt or ""}]
        if pass_no:
            content = messages[0].get("content", "")
            messages[0]["content"] = ([{"type": "text", "text": pass_marker(pass_no)}, *content]
                                      if isinstance(content, list) else on_pass(str(content), pass_no))
        return messages


def _parse_row(path: Path, line_no: int, text: str) -> PromptRow:
    where = f"{path}:{line_no}"
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WorkloadError(f"line is not valid JSON ({exc.msg})", file=where, fix="each line must be one JSON object") from exc
    if not isinstance(data, dict):
        raise WorkloadError("line is not a JSON object", file=where, fix='use {"prompt": "..."} or {"messages": [...]}')
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise WorkloadError("max_tokens must be a positive integer", file=where, key="max_tokens")
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, str):
        return PromptRow(line_no, prompt=prompt, max_tokens=max_tokens)
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and "content" in m for m in messages):
        return PromptRow(line_no, messages=tuple(messages), max_tokens=max_tokens)
    raise WorkloadError(
        'row has neither a "prompt" string nor a chat "messages" list', file=where,
        fix='use {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}',
    )


@dataclass(frozen=True)
class PromptSample:
    """A fixed, seeded sample of prompt rows: identical for every trial of a study."""

    path: Path
    rows: tuple[PromptRow, ...]
    seed: int = 0

    @classmethod
    def load(cls, path: Path | str, n: int, seed: int = 0) -> PromptSample:
        path = Path(path)
        if not path.is_file():
            raise WorkloadError("prompts file not found", file=str(path), fix="pass --prompts with a JSONL file of prompts")
        rows = [
            _parse_row(path, i, line)
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
            if line.strip()
        ]
        if not rows:
            raise WorkloadError("prompts file has no rows", file=str(path), fix="add one JSON object per line")
        rng = random.Random(seed)
        chosen = rng.sample(rows, n) if n < len(rows) else rng.sample(rows, len(rows))
        return cls(path=path, rows=tuple(chosen), seed=seed)

    def __len__(self) -> int:
        return len(self.rows)
