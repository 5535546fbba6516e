"""The fix for a drifted server: the planner's config for today's traffic, and a study file whose
``[workload]`` replays that traffic so ``autotune sweep`` can re-tune for it.

Today's traffic comes from SGLang's own token-length histograms over the watch window: lengths are drawn
bucket by bucket, then scaled so their mean matches SGLang's exact ``_sum``/``_count``. Prompt text is filler of
about four characters per token (exact on the simulator; on a real tokenizer the lengths are approximate).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from autotune.inspect.suggest import Suggestion
from autotune.inspect.sweep_file import WorkloadTable, _study_name, sweep_toml
from autotune.sglang.flags import FlagTable
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model
from autotune.watch.metrics import Histogram
from autotune.watch.window import Window

CHARS_PER_TOKEN = 4
MARGIN_GIB = 2.0  # headroom a suggestion must keep, as inspect asks of its own
_WORDS = (
    "the",
    "report",
    "measured",
    "latency",
    "across",
    "every",
    "region",
    "while",
    "operators",
    "kept",
    "notes",
    "about",
    "cache",
    "sizes",
    "and",
    "restarts",
    "during",
    "long",
    "night",
    "shifts",
)


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Today's request shape over the window."""

    requests: float
    prompt: Histogram | None
    output: Histogram | None
    prompt_mean: float | None
    output_mean: float | None

    @property
    def tokens_per_request(self) -> int | None:
        """KV one request holds by its end: its prompt plus its whole output."""
        if self.prompt_mean is None:
            return None
        return max(1, round(self.prompt_mean + (self.output_mean or 0.0)))


class PromptRow(TypedDict):
    """One row of the drifted prompts' JSONL, in autotune's own prompt format (``prompts.formats``)."""

    prompt: str
    max_tokens: int  # the drawn output length (the study sets ignore_eos, so each request produces it)


def traffic(window: Window) -> Traffic:
    """The window's request shape from the histograms, else from the token counters."""
    prompt, output = window.histogram("prompt_tokens_histogram"), window.histogram("generation_tokens_histogram")
    requests = window.counter_delta("num_requests_total") or 0.0

    def mean(h: Histogram | None, counter: str) -> float | None:
        if h is not None and h.count > 0:
            return h.mean
        total = window.counter_delta(counter)
        return total / requests if total and requests else None

    return Traffic(
        requests=max(requests, prompt.count if prompt else 0.0),
        prompt=prompt,
        output=output,
        prompt_mean=mean(prompt, "prompt_tokens_total"),
        output_mean=mean(output, "generation_tokens_total"),
    )


def draw_lengths(h: Histogram, n: int, rng: random.Random) -> list[int]:
    """``n`` lengths following the histogram's buckets, scaled so their mean is the histogram's exact mean."""
    buckets = [(lo, up if math.isfinite(up) else max(lo * 1.25, lo + 1), c) for lo, up, c in h.buckets() if c > 0]
    if not buckets:
        raise ValueError("the histogram has no observations")
    picks = rng.choices(buckets, weights=[c for *_, c in buckets], k=n)
    drawn = [rng.uniform(max(lo, 1.0), up) for lo, up, _ in picks]
    scale = (h.mean or 0.0) / (sum(drawn) / n) if h.mean else 1.0
    return [max(1, round(x * scale)) for x in drawn]


def filler(tokens: int, index: int) -> str:
    """A prompt of about ``tokens`` tokens (four characters each), distinct per row so no prefix is cached."""
    words, size, i = [f"Request {index}:"], len(f"Request {index}:"), index
    while size < tokens * CHARS_PER_TOKEN - 5:
        word = _WORDS[i % len(_WORDS)]
        words.append(word)
        size += len(word) + 1
        i = i * 7 + 3
    return " ".join(words)[: max(1, tokens * CHARS_PER_TOKEN - 1)]


def drifted_rows(t: Traffic, *, n: int, seed: int, fallback_output: int) -> list[PromptRow]:
    """JSONL rows that replay today's traffic: a prompt of the drawn length and ``max_tokens`` of the drawn
    output (the study sets ``ignore_eos`` so each request produces exactly that)."""
    rng = random.Random(seed)
    if t.prompt is not None and t.prompt.count > 0:
        prompts = draw_lengths(t.prompt, n, rng)
    elif t.prompt_mean:
        prompts = [round(t.prompt_mean)] * n
    else:
        raise ValueError("no prompt lengths observed in the window")
    if t.output is not None and t.output.count > 0:
        outputs = draw_lengths(t.output, n, rng)
    else:
        outputs = [round(t.output_mean or fallback_output)] * n
    return [PromptRow(prompt=filler(p, i), max_tokens=o) for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]


def rebalance(advice: Any, tokens_per_request: int) -> Any | None:
    """The planner's Mamba-slot count that runs the most requests of today's size at once: fewer slots give
    their memory back to KV until KV ÷ tokens-per-request meets the running cap. None when the model has no
    Mamba pool to trade, the planner has no profiles, or nothing serves more than the current config."""
    if advice is None or advice.model is None or advice.gpu is None or not advice.ratio:
        return None
    model, gpu = load_model(advice.model), load_gpu(advice.gpu)
    config, ratio = dict(advice.config), int(advice.ratio)
    current = plan(model, gpu, config)

    def served(p: Any) -> int:
        return min(p.max_running_requests, p.kv_tokens // tokens_per_request) if p.fits else 0

    now = served(current)
    top = max(1, (current.max_mamba_cache_size or ratio) // ratio)
    best: tuple[int, int, int, Any] | None = None  # (served, kv, slots, plan)
    for t in range(1, top + 1):
        changes = {"max_mamba_cache_size": ratio * t}
        p = plan(model, gpu, {**config, **changes})
        if not p.fits or p.gib.headroom < MARGIN_GIB:
            continue
        key = (served(p), p.kv_tokens, ratio * t, p)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None or best[0] <= now:
        return None
    n, _, slots, p = best
    changes = {"max_mamba_cache_size": slots}  # an explicit count makes --mamba-full-memory-ratio inert
    return Suggestion(
        changes=changes,
        argv=FlagTable.bundled().to_argv(changes),
        max_running_requests=p.max_running_requests,
        binding=p.extra.get("binding"),
        kv_tokens=p.kv_tokens,
        mamba_slots=p.max_mamba_cache_size,
        mem_fraction_static=p.mem_fraction_static,
        headroom_gib=round(p.gib.headroom, 2),
        confidence=advice.confidence or "low",
        note=f"holds {n} requests of ~{tokens_per_request:,} tokens at once (the running config: {now})",
    )


def suggestion_line(s: Any) -> str:
    note = f"; {s.note}" if s.note else ""
    return (
        f"{' '.join(s.argv)} → {s.max_running_requests} running, {s.kv_tokens:,} KV tokens, "
        f"{s.headroom_gib:.1f} GiB headroom (planner, confidence {s.confidence}{note})"
    )


def write_study(diagnosis: Any, suggestion: Any | None, rows: list[PromptRow], out_dir: Path) -> Path:
    """``<out_dir>/watch-<host>-<port>.toml`` and its prompts JSONL; the study enqueues ``suggestion`` first."""
    d = diagnosis
    if suggestion is not None:
        kept = [s for s in d.advice.suggestions if s.changes != suggestion.changes]
        d = dataclasses.replace(d, advice=dataclasses.replace(d.advice, suggestions=[suggestion, *kept]))
    name = _study_name(d.url, "watch")
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = out_dir / f"{name}-prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    workload = WorkloadTable(
        prompts=prompts.name, sample_size=len(rows), max_tokens=max(r["max_tokens"] for r in rows), ignore_eos=True
    )
    path = out_dir / f"{name}.toml"
    path.write_text(sweep_toml(d, workload=workload, origin="watch"), encoding="utf-8")
    return path
