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


@dataclass(frozen=True)
class PromptRow:
    line: int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int | None = None

    def as_text(self) -> str:
        """The prompt for a text endpoint; chat rows rendered with Qwen's ChatML template."""
        if self.prompt is not None:
            return self.prompt
        turns = "".join(f"<|im_start|>{m.get('role', 'user')}\n{m.get('content', '')}<|im_end|>\n" for m in self.messages or ())
        return turns + "<|im_start|>assistant\n"

    def as_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]


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
