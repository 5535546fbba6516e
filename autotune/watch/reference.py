"""What the tuning assumed, for ``autotune watch`` to compare production with: the replayed prompt sample's
length range, the winner's output lengths, its confirmed tok/s (with a bootstrap interval) and accept length.

Read from the ``provenance.json`` that ``autotune apply`` writes beside the fleet (or the directory holding
it), or from the study file itself (the study storage then also gives the winner's per-request records).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autotune.config import load_config
from autotune.deploy.apply import load_winner
from autotune.errors import AutotuneError, ConfigError
from autotune.harness.workload import ReplayRecords
from autotune.prompts import PromptSample

CHARS_PER_TOKEN = 4.0  # the same rough ratio the prior and the simulator use; real tokenizers differ a little
BOOTSTRAP = 2000


@dataclass(frozen=True)
class TunedWorkload:
    """The study's workload as far as watch reads it: the replayed prompt sample (file, size, seed) and the most
    output a request could ask for."""

    prompts: str | None = None
    sample_size: int = 200
    seed: int = 0
    max_tokens: int = 4096


@dataclass(frozen=True, kw_only=True)
class Tuned:
    source: str
    prompt_range: tuple[int, int] | None = None  # tokens (≈ characters ÷ 4), min and max of the replayed sample
    output_range: tuple[int, int] | None = None  # tokens the winner's requests produced (or 1 … max_tokens)
    tok_s: float | None = None  # the winner's confirmed output tok/s per server
    tok_s_ci: tuple[float, float] | None = None  # 95 % bootstrap interval of the median confirmation run
    accept_length: float | None = None
    workload: TunedWorkload = TunedWorkload()
    notes: list[str] = field(default_factory=list)


def median_interval(runs: list[float], *, seed: int = 0) -> tuple[float, float] | None:
    """Seeded bootstrap 95 % interval of the median, the way ``confirm`` states the winner's figure."""
    if len(runs) < 2:
        return None
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(runs, size=(BOOTSTRAP, len(runs)), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def _prompt_range(workload: TunedWorkload, notes: list[str]) -> tuple[tuple[int, int] | None, int | None]:
    """(min, max) prompt tokens of the replayed sample, and the largest output a row may ask for."""
    max_tokens = workload.max_tokens
    if not workload.prompts:
        notes.append("the study records no prompt file: the prompt-length rule is off")
        return None, max_tokens
    try:
        sample = PromptSample.load(workload.prompts, workload.sample_size, workload.seed)
    except AutotuneError as exc:
        notes.append(f"the study's prompt sample cannot be read ({exc}): the prompt-length rule is off")
        return None, max_tokens
    lengths = [max(1, round(len(row.as_text()) / CHARS_PER_TOKEN)) for row in sample.rows]
    largest = max(min(row.max_tokens or max_tokens, max_tokens) for row in sample.rows)
    return (min(lengths), max(lengths)), largest


def _from_provenance(path: Path) -> Tuned:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read it ({exc.strerror})", file=str(path), key="--study") from None
    except ValueError:
        raise ConfigError("not valid JSON", file=str(path), fix="rewrite it with autotune apply --out DIR") from None
    if not isinstance(meta, dict) or "workload" not in meta:
        raise ConfigError(
            "has no workload", file=str(path), key="workload", fix="pass the provenance.json that autotune apply wrote"
        )
    notes: list[str] = []
    stored = meta.get("workload") or {}
    workload = TunedWorkload(
        prompts=stored.get("prompts"),
        sample_size=int(stored.get("sample_size") or 200),
        seed=int(stored.get("seed") or 0),
        max_tokens=int(stored.get("max_tokens") or 4096),
    )
    prompt_range, largest = _prompt_range(workload, notes)
    runs = [float(r) for r in meta.get("output_tok_s_runs") or []]
    ci = median_interval(runs)
    if ci is None:
        notes.append("fewer than two confirmation runs recorded: the throughput rule is off")
    return Tuned(
        source=f"{path} (study {meta.get('study')}, trial {meta.get('trial')})",
        prompt_range=prompt_range,
        output_range=(1, largest) if largest else None,
        tok_s=meta.get("output_tok_s"),
        tok_s_ci=ci,
        workload=workload,
        notes=notes,
    )


def _output_range(result: Any, largest: int | None) -> tuple[int, int] | None:
    """The winner's own output lengths (finished requests of its records), else 1 … the largest max_tokens."""
    records = Path(result.trial_dir or "") / "records.jsonl" if result.trial_dir else None
    if records is not None and records.is_file():
        try:
            done = [r.tokens for r in ReplayRecords.read_jsonl(records) if r.finish_reason in ("stop", "length")]
        except (OSError, ValueError, TypeError, KeyError):
            done = []
        if done:
            return min(done), max(done)
    return (1, largest) if largest else None


def _from_study(path: Path) -> Tuned:
    cfg = load_config(path)
    winner = load_winner(cfg.storage_url, cfg.name)
    notes: list[str] = []
    stored = {**cfg.workload.model_dump(mode="json"), **winner.workload}  # the winner's own workload overrides
    workload = TunedWorkload(
        prompts=str(cfg.workload.prompts),
        sample_size=int(stored.get("sample_size") or 200),
        seed=int(stored.get("seed") or 0),
        max_tokens=int(stored.get("max_tokens") or 4096),
    )
    prompt_range, largest = _prompt_range(workload, notes)
    ci = median_interval(winner.tok_s_runs)
    if ci is None:
        notes.append("the winner has fewer than two confirmation runs: the throughput rule is off")
    metrics = winner.result.metrics
    return Tuned(
        source=f"study {winner.study} (trial {winner.trial}) in {path}",
        prompt_range=prompt_range,
        output_range=_output_range(winner.result, largest),
        tok_s=winner.tok_s,
        tok_s_ci=ci,
        accept_length=metrics.accept_length if metrics else None,
        workload=workload,
        notes=notes,
    )


def load_tuned(path: str | Path) -> Tuned:
    """The reference from a ``provenance.json``, the directory ``apply --out`` wrote, or a study TOML."""
    path = Path(path)
    if path.is_dir():
        path = path / "provenance.json"
    if path.suffix == ".toml":
        return _from_study(path)
    if not path.is_file():
        raise ConfigError(
            "not found",
            file=str(path),
            key="--study",
            fix="pass the provenance.json autotune apply wrote, its directory, or the study TOML",
        )
    return _from_provenance(path)
