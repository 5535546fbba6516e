"""The fixed, seeded sample every trial of a study replays, drawn from the job's input file (``formats``)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import WorkloadError
from autotune.prompts.formats import read_file
from autotune.prompts.rows import UNKNOWN_CONTEXT_TOKENS, PromptRow
from autotune.prompts.template import ChatTemplate
from autotune.prompts.tokens import TokenCounter


@dataclass(frozen=True)
class PromptSample:
    """A fixed, seeded sample of prompt rows: identical for every trial of a study. ``short_of``: how many rows
    fewer than the ``sample_size`` asked for the file had (the sample is then the whole file; see ``note``)."""

    path: Path
    rows: tuple[PromptRow, ...]
    seed: int = 0
    short_of: int = 0
    format: str = "jsonl"  # ``formats.ReadRows.format``: jsonl, batch (OpenAI Batch API), sharegpt
    skipped: int = 0  # ShareGPT records with no human turn before a reply
    template: ChatTemplate | None = field(default=None, compare=False, repr=False)

    @classmethod
    def load(cls, path: Path | str, n: int, seed: int = 0) -> PromptSample:
        path = Path(path)
        if not path.is_file():
            raise WorkloadError(
                "prompts file not found",
                file=str(path),
                fix="pass --prompts with a JSONL, OpenAI Batch API or ShareGPT file of prompts",
            )
        read = read_file(path)
        if not read.rows:
            raise WorkloadError("prompts file has no rows", file=str(path), fix="add one JSON object per line")
        rng = random.Random(seed)
        chosen = rng.sample(read.rows, min(n, len(read.rows)))
        return cls(
            path=path,
            rows=tuple(chosen),
            seed=seed,
            short_of=max(0, n - len(read.rows)),
            format=read.format,
            skipped=read.skipped,
        )

    def for_model(self, model_path: str | Path | None) -> PromptSample:
        """The sample with chat rows rendered by the model's own chat template (``ChatTemplate.find``), for the
        native endpoint; unchanged when the model has none (a bundled profile, a hub id: ChatML stays)."""
        template = ChatTemplate.find(model_path)
        if template is None or template == self.template:
            return self
        rows = tuple(dataclasses.replace(r, template=template) if r.messages is not None else r for r in self.rows)
        return dataclasses.replace(self, rows=rows, template=template)

    def where(self, row: PromptRow) -> str:
        """Where ``row`` is in its file: ``file:line``, or ``file: record N`` in a JSON array."""
        return f"{self.path}: record {row.line}" if self.format == "sharegpt" else f"{self.path}:{row.line}"

    @property
    def note(self) -> str | None:
        """The warning a short sample deserves (None when the file had ``sample_size`` rows or more), and the
        ShareGPT records it skipped."""
        notes = []
        if self.skipped:
            notes.append(
                f"{self.path}: skipped {self.skipped} record{'s' * (self.skipped != 1)} with no human turn "
                "before a reply"
            )
        if self.short_of:
            have = len(self.rows)
            notes.append(
                f"{self.path} has {have} prompt{'s' * (have != 1)}, {self.short_of} fewer than sample_size "
                f"{have + self.short_of}: every trial replays only {'these' if have != 1 else 'this one'} "
                "(add rows, or lower sample_size)"
            )
        return "; ".join(notes) or None

    def check_fit(
        self,
        context_len: int | None,
        max_tokens: int,
        *,
        source: str = "the context length",
        counter: TokenCounter | None = None,
    ) -> None:
        """A ``WorkloadError`` naming the first sampled row (by line) whose prompt tokens plus its ``max_tokens``
        exceed ``context_len`` (the server would refuse every send of it); ``context_len`` None:
        ``UNKNOWN_CONTEXT_TOKENS``. ``source`` says where the limit came from; ``counter`` counts the tokens (the
        model's tokenizer, ``TokenCounter.for_model``; default the character estimate, named as one)."""
        limit = context_len or UNKNOWN_CONTEXT_TOKENS
        counter = counter or TokenCounter()
        over = [(row, counter.count(row), min(row.max_tokens or max_tokens, max_tokens)) for row in self.rows]
        over = sorted((o for o in over if o[1] + o[2] > limit), key=lambda o: o[0].line)
        if not over:
            return
        row, tokens, new = over[0]
        more = f"; {len(over) - 1} more sampled prompt{'s' * (len(over) > 2)} too" if len(over) > 1 else ""
        known = (
            f"{source} ({limit:,} tokens)"
            if context_len
            else f"{limit:,} tokens, the longest context any model has (this one's is not known before launch)"
        )
        raise WorkloadError(
            f"prompt is {'' if counter.exact else '~'}{tokens:,} tokens ({counter.how(row)}) + {new:,} "
            f"max_tokens, over {known}{more}",
            file=self.where(row),
            fix="shorten or remove the line, lower max_tokens, or raise --context-length",
        )

    def __len__(self) -> int:
        return len(self.rows)
