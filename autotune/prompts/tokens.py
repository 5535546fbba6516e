"""How many tokens a prompt is: the model's own tokenizer where one is at hand, else an estimate named as such.

A local model directory ships ``tokenizer.json`` (the Hugging Face fast tokenizer every SGLang model has); with the
``tokenizers`` package installed (``pip install 'autotune[tokenizer]'``) it counts prompts exactly as the server
will, so a prompt near the context length is judged on its real count. Without either, 4 characters a token is
the estimate, and every message that uses it says so: real text runs 3–5 characters a token, so a prompt near
the limit may be refused by the estimate alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.prompts.rows import CHARS_PER_TOKEN, LONGEST_PASS, PromptRow, estimate_tokens


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> Any:
    """A tokenizer file, loaded once per file version (every trial checks its sample's fit)."""
    from tokenizers import Tokenizer  # optional: the ``tokenizer`` extra

    return Tokenizer.from_file(path)


@dataclass(frozen=True)
class TokenCounter:
    """Counts a row's prompt tokens (the longest pass marker included): with ``tokenizer`` (a ``tokenizers``
    Tokenizer) exactly, else at ``CHARS_PER_TOKEN``. ``source``: where the tokenizer came from, for messages."""

    tokenizer: Any = field(default=None, compare=False, repr=False)
    source: str | None = None

    @classmethod
    def for_model(cls, model: str | Path | None) -> TokenCounter:
        """The tokenizer of a local model directory (its ``tokenizer.json``) when the ``tokenizers`` package is
        installed; else the character estimate (a bundled profile, a hub id not on disk, no package)."""
        path = Path(str(model)).expanduser() if model else None
        if path is not None and path.name == "config.json":
            path = path.parent
        file = path / "tokenizer.json" if path is not None and path.is_dir() else None
        if file is None or not file.is_file():
            return cls()
        try:
            return cls(tokenizer=_load(str(file), file.stat().st_mtime), source=str(file))
        except ImportError:
            return cls(source=f"{file} (install the tokenizers package to count with it)")
        except Exception:  # noqa: BLE001 - a tokenizer file this version cannot read: fall back to the estimate
            return cls(source=f"{file} (unreadable by the tokenizers package)")

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, row: PromptRow) -> int:
        """The row's prompt tokens with the longest pass marker in front (exact with a tokenizer)."""
        if self.tokenizer is None:
            return estimate_tokens(row)
        return len(self.tokenizer.encode(row.as_text(LONGEST_PASS)).ids)

    def how(self, row: PromptRow) -> str:
        """How ``count`` counted ``row``, for a message: the tokenizer, or the estimate named as one."""
        if self.tokenizer is not None:
            return f"by the model's tokenizer, {self.source}"
        why = f"the model's tokenizer {self.source} was not used" if self.source else "no tokenizer at hand"
        return f"{len(row.as_text()):,} chars at {CHARS_PER_TOKEN} per token, an estimate: {why}"
