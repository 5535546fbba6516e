"""The fidelity probe: does a trial's server answer like the study's reference config?

After the throughput window (never during it), K fixed prompts, greedy, exactly N new tokens each with
``return_logprob`` through ``POST /generate``, all in flight together; compared with the baseline's recorded
``Reference``. A server that errors or returns no logprobs raises ``ProbeError`` (the trial is ``probe_error``,
never a silent pass). The figures and when a trial is probed: docs/numerics.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from autotune import tls
from autotune.results import FidelityFigures

__all__ = [
    "DEFAULT_PROMPTS",
    "DEFAULT_TOKENS",
    "FidelityProbe",
    "FlagChange",
    "ProbeError",
    "ProbeOutput",
    "Reference",
    "ReferenceInfo",
    "choose_prompts",
    "compare",
    "generate_outputs",
    "outputs_differ",
    "run_probe",
    "verdict",
]

DEFAULT_PROMPTS = 16  # K
DEFAULT_TOKENS = 256  # N
REFERENCE_VERSION = 1


class ProbeError(Exception):
    """The probe could not measure the server's outputs (server error, timeout, no logprobs)."""


@dataclass(frozen=True)
class ProbeOutput:
    """One prompt's greedy output: token ids and their log-probabilities (None where the server gave none)."""

    ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeOutput:
        return cls(tuple(int(i) for i in data["ids"]), tuple(None if v is None else float(v) for v in data["logprobs"]))


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Reference:
    """The reference config's probe outputs, stored with the study (``save`` / ``load``)."""

    prompts: tuple[str, ...]
    tokens: int
    outputs: tuple[ProbeOutput, ...]
    config: dict[str, Any] = field(default_factory=dict)
    lines: tuple[int, ...] = ()  # the prompts' line numbers in the prompts file, for a reader
    trial: int | None = None  # the study trial whose launch recorded it

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REFERENCE_VERSION,
            "trial": self.trial,
            "config": self.config,
            "tokens": self.tokens,
            "prompts": [
                {"line": line, "sha256": _text_hash(text), "text": text}
                for line, text in zip(self.lines or (None,) * len(self.prompts), self.prompts, strict=True)
            ],
            "outputs": [asdict(o) for o in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Reference:
        prompts = data["prompts"]
        return cls(
            prompts=tuple(str(p["text"]) for p in prompts),
            tokens=int(data["tokens"]),
            outputs=tuple(ProbeOutput.from_dict(o) for o in data["outputs"]),
            config=dict(data.get("config") or {}),
            lines=tuple(int(p["line"]) for p in prompts if p.get("line") is not None),
            trial=data.get("trial"),
        )

    def save(self, path: Path) -> str:
        """Write atomically; returns the file's sha256 (what the study records beside its path)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), separators=(",", ":")) + "\n"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def load(cls, path: Path, *, sha256: str | None = None) -> Reference | None:
        """The stored reference, or None when it is missing, unreadable or not the file ``sha256`` names."""
        try:
            raw = Path(path).read_bytes()
        except OSError:
            return None
        if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
            return None
        try:
            return cls.from_dict(json.loads(raw))
        except (ValueError, KeyError, TypeError):
            return None

    def matches(self, prompts: Sequence[str], tokens: int) -> bool:
        return tuple(prompts) == self.prompts and tokens == self.tokens


@dataclass(frozen=True, kw_only=True)
class FlagChange:
    """A flag a config sets differently from the reference: its value, the reference's (None: unset) and, for a
    flag the numerics table lists (``sglang.numerics.NumericsChange``), why it changes outputs."""

    flag: str
    value: Any = None
    reference: Any = None
    why: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """As the figures store it: ``{flag, value, reference}``, and ``why`` for a table flag."""
        data = {"flag": self.flag, "value": self.value, "reference": self.reference}
        return data if self.why is None else {**data, "why": self.why}


@dataclass(frozen=True, kw_only=True)
class ReferenceInfo:
    """Where the study keeps its reference outputs (``path``, the file's ``sha256`` when compared with it) and the
    trial whose launch recorded them; ``config``: the reference config, written into a reference being recorded."""

    path: str | None = None
    trial: int | None = None
    sha256: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def stored(self) -> dict[str, str | int | None]:
        """As a probe's figures store it (``FidelityFigures.reference``): path, sha256, trial."""
        return {"path": self.path, "sha256": self.sha256, "trial": self.trial}


@dataclass(frozen=True, kw_only=True)
class FidelityProbe:
    """What ``run_trial`` probes after the window: ``reference=None`` records this server's outputs as the
    reference (written to ``record_to``); otherwise they are compared with ``reference``."""

    prompts: tuple[str, ...]
    tokens: int = DEFAULT_TOKENS
    lines: tuple[int, ...] = ()
    reference: Reference | None = None
    record_to: Path | None = None
    changes: tuple[FlagChange, ...] = ()  # the output-changing flags (the numerics table's) that differ from it
    # Every flag the config sets differently from the reference, table or not: what an output change no table flag
    # explains is reported against.
    differs: tuple[FlagChange, ...] = ()
    reference_info: ReferenceInfo = field(default_factory=ReferenceInfo)  # copied into the figures
    timeout_s: float = 600.0
    # A launch that exists only to record the reference: probe whenever the server is up, whatever its (cut short)
    # throughput window measured.
    only: bool = False

    @property
    def records(self) -> bool:
        return self.reference is None


def choose_prompts(rows: Sequence[Any], k: int = DEFAULT_PROMPTS) -> list[Any]:
    """K rows of the study's (seeded, fixed) sample, evenly spaced through it: the same K for every trial."""
    n = len(rows)
    if n == 0:
        return []
    k = min(k, n)
    return [rows[i * n // k] for i in range(k)]


def _parse(body: Any, tokens: int) -> ProbeOutput:
    meta = body.get("meta_info") if isinstance(body, dict) else None
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(triples, list):
        raise ProbeError(
            "the server answered /generate with return_logprob=true but without "
            "meta_info.output_token_logprobs: it does not support return_logprob"
        )
    ids: list[int] = []
    logprobs: list[float | None] = []
    for triple in triples:
        if not isinstance(triple, list | tuple) or len(triple) < 2 or not isinstance(triple[1], int):
            raise ProbeError(
                f"unexpected output_token_logprobs entry {triple!r} (SGLang's shape is [logprob, token_id, text])"
            )
        ids.append(int(triple[1]))
        logprobs.append(None if triple[0] is None else float(triple[0]))
    if not ids and isinstance(body.get("output_ids"), list):
        raise ProbeError("the server returned output_ids but no output_token_logprobs")
    return ProbeOutput(tuple(ids[:tokens]), tuple(logprobs[:tokens]))


async def _generate_one(client: httpx.AsyncClient, base_url: str, text: str, tokens: int) -> ProbeOutput:
    body = {
        "text": text,
        "return_logprob": True,
        "stream": False,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True},
    }
    try:
        resp = await client.post(f"{base_url}/generate", json=body)
    except httpx.TimeoutException:
        raise ProbeError("a probe request to /generate timed out") from None
    except httpx.HTTPError as exc:
        raise ProbeError(f"a probe request to /generate failed: {type(exc).__name__}: {exc}".rstrip(": ")) from None
    if resp.status_code != 200:
        raise ProbeError(f"/generate answered HTTP {resp.status_code} to a probe request: {resp.text[:300]}")
    try:
        data = resp.json()
    except ValueError:
        raise ProbeError(f"/generate answered a probe request with non-JSON: {resp.text[:200]!r}") from None
    if isinstance(data, dict) and data.get("error"):
        raise ProbeError(f"/generate answered a probe request with an error: {str(data['error'])[:300]}")
    return _parse(data, tokens)


async def _generate_all(base_url: str, prompts: Sequence[str], tokens: int, timeout_s: float) -> list[ProbeOutput]:
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, **tls.secured()) as client:
        return list(await asyncio.gather(*(_generate_one(client, base_url, text, tokens) for text in prompts)))


def generate_outputs(
    base_url: str, prompts: Sequence[str], tokens: int, *, timeout_s: float = 600.0
) -> list[ProbeOutput]:
    """Greedy outputs of ``prompts`` from the server at ``base_url`` (all in flight together)."""
    return asyncio.run(_generate_all(base_url, prompts, tokens, timeout_s))


def _prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(reference: Sequence[ProbeOutput], outputs: Sequence[ProbeOutput], tokens: int) -> FidelityFigures:
    """The probe's comparison figures for ``outputs`` against ``reference`` (same prompts, same order)."""
    if len(reference) != len(outputs):
        raise ProbeError(f"{len(outputs)} probe outputs for {len(reference)} reference prompts")
    prefixes, exact, deltas = [], [], []
    for ref, out in zip(reference, outputs, strict=True):
        n = _prefix(ref.ids, out.ids)
        prefixes.append(n)
        exact.append(ref.ids == out.ids)
        for i in range(n):  # the same token after the same text: both sides scored the reference token
            a, b = (
                ref.logprobs[i] if i < len(ref.logprobs) else None,
                out.logprobs[i] if i < len(out.logprobs) else None,
            )
            if a is not None and b is not None:
                deltas.append(abs(a - b))
    k = len(prefixes)
    return FidelityFigures(
        prefix_match_mean=round(sum(prefixes) / k, 3) if k else None,
        prefix_match_min=min(prefixes) if k else None,
        exact_share=round(sum(exact) / k, 4) if k else None,
        mean_abs_logprob_delta=round(sum(deltas) / len(deltas), 6) if deltas else None,
        scored_tokens=len(deltas),
        first_difference=tuple(None if e else p for p, e in zip(prefixes, exact, strict=True)),
    )


def outputs_differ(figures: FidelityFigures) -> bool:
    """The probe's rule for "the outputs differ": some prompt's N greedy tokens are not all the reference's."""
    return figures.exact_share is None or figures.exact_share < 1.0


def verdict(figures: FidelityFigures, differs: Sequence[FlagChange]) -> FidelityFigures:
    """``figures`` with what the comparison means: whether the outputs differ and, when they do although no
    output-changing flag changed (``changes`` empty), ``unexpected``, with the flags the config differs from the
    reference in (``differs``)."""
    differ = outputs_differ(figures)
    return dataclasses.replace(
        figures,
        outputs_differ=differ,
        unexpected=differ and not figures.changes,
        differs=tuple(d.to_dict() for d in differs),
    )


def run_probe(base_url: str, probe: FidelityProbe, *, trial_dir: Path | None = None) -> FidelityFigures:
    """Probe the server at ``base_url``: record the reference, or compare with it. Returns the figures stored as
    ``TrialResult.fidelity`` and writes the outputs to ``trial_dir/fidelity.json``. Raises ``ProbeError``."""
    t0 = time.monotonic()
    outputs = generate_outputs(base_url, probe.prompts, probe.tokens, timeout_s=probe.timeout_s)
    duration = round(time.monotonic() - t0, 3)
    info = probe.reference_info
    if probe.records:
        figures = FidelityFigures(role="reference")
        if probe.record_to is not None:
            ref = Reference(
                prompts=probe.prompts,
                tokens=probe.tokens,
                outputs=tuple(outputs),
                lines=probe.lines,
                config=dict(info.config),
                trial=info.trial,
            )
            info = ReferenceInfo(path=str(probe.record_to), sha256=ref.save(probe.record_to), trial=info.trial)
            figures = dataclasses.replace(figures, reference=info.stored())
    else:
        assert probe.reference is not None
        figures = dataclasses.replace(
            compare(probe.reference.outputs, outputs, probe.tokens),
            role="probe",
            changes=tuple(c.to_dict() for c in probe.changes),
            reference=info.stored(),
        )
        figures = verdict(figures, probe.differs)
    figures = dataclasses.replace(figures, prompts=len(probe.prompts), tokens=probe.tokens, duration_s=duration)
    if trial_dir is not None:
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        (Path(trial_dir) / "fidelity.json").write_text(
            json.dumps({**figures.to_dict(), "outputs": [asdict(o) for o in outputs]}, separators=(",", ":")) + "\n"
        )
    return figures
