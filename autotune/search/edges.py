"""The memory-edge starting points, placed one at a time with what the study knows by then: the prompt tokens the
server counted, the output lengths the trials measured and the planner as corrected so far. docs/search.md ("Placing
the memory-edge starts").
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal, TypedDict

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.prompts import PromptSample
from autotune.results import TrialResult
from autotune.search.runner import prompt_texts
from autotune.search.space import Feasibility, Space
from autotune.search.starts import CHARS_PER_TOKEN, edge_configs, shared_prefix_tokens

MULTIPLIERS = (1.0, 1.2, 0.85, 1.45, 0.7, 1.7)
DEFAULT_OUTPUT_SHARE = 0.6  # of max_tokens, until a trial has measured output lengths
STARVED_SHARE = 0.5  # an edge start measuring under this share of the best given config's tok/s was past the wall


def observed_output(trials: list[FrozenTrial], max_tokens: int) -> float | None:
    """Mean output tokens per request: tokens in the window ÷ requests completed in it, from the finished ok trial
    whose window saw the most turnover (completions per request in flight). A window shorter than a request's life
    counts the tokens of requests still running but not their completion, which inflates the ratio; the trial
    closest to steady state inflates it least."""
    best: tuple[float, float] | None = None  # (turnover, tokens per completion)
    for t in trials:
        result = _ok_result(t)
        m = result.metrics if result is not None else None
        if m is not None and m.completed and m.output_tokens:
            turnover = m.completed / max(1, m.concurrency or 1)
            if best is None or turnover > best[0]:
                best = (turnover, m.output_tokens / m.completed)
    return None if best is None else min(float(max_tokens), best[1])


def _ok_result(t: FrozenTrial) -> TrialResult | None:
    """The result of a finished trial that measured ok; None otherwise."""
    result = TrialResult.of(t)
    return result if t.state == TrialState.COMPLETE and result is not None and result.ok else None


def starved_starts(trials: list[FrozenTrial]) -> int:
    """How many finished edge starts measured under ``STARVED_SHARE`` of the best baseline/enqueued tok/s."""

    def tok_s(t: FrozenTrial) -> float | None:
        result = _ok_result(t)
        return result.output_tok_s if result is not None else None

    given = [v for t in trials if t.user_attrs.get("role") in ("baseline", "enqueued") and (v := tok_s(t))]
    if not given:
        return 0
    floor = STARVED_SHARE * max(given)
    return sum(1 for t in trials if t.user_attrs.get("role") == "prior" and (v := tok_s(t)) is not None and v < floor)


def reported_prompt_tokens(trials: list[FrozenTrial]) -> dict[int, int]:
    """Prompt tokens per prompt-file line, as the server reported them for the finished baseline's requests
    (``records.jsonl`` rows' ``prompt_tokens``: SGLang's ``meta_info`` / ``usage``); a line sent again carries a
    pass marker, so its smallest count is its own. Empty when no baseline recorded any."""
    for t in trials:
        result = TrialResult.of(t)
        where = result.trial_dir if result is not None else None
        if t.user_attrs.get("role") == "baseline" and t.state == TrialState.COMPLETE and where:
            found = _records_prompt_tokens(str(Path(where) / "records.jsonl"))
            if found:
                return dict(found)
    return {}


@functools.lru_cache(maxsize=16)
def _records_prompt_tokens(path: str) -> tuple[tuple[int, int], ...]:
    out: dict[int, int] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return ()
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        tokens = row.get("prompt_tokens") if isinstance(row, dict) else None
        if isinstance(tokens, int) and tokens > 0 and isinstance(row.get("row"), int):
            out[row["row"]] = min(tokens, out.get(row["row"], tokens))
    return tuple(sorted(out.items()))


@functools.lru_cache(maxsize=8)
def _line_chars(path: Path, n: int, seed: int) -> tuple[tuple[int, int], ...]:
    """(prompt-file line, characters) of the study's sample: the replay's records name rows by line."""
    return tuple((int(row.line), len(row.as_text())) for row in PromptSample.load(path, n, seed).rows)


def prompt_tokens(line_chars: tuple[tuple[int, int], ...], reported: dict[int, int]) -> tuple[float, float]:
    """(mean prompt tokens of the sample, tokens per character): from the server's counts where it reported
    them, lines it did not send at the reported lines' tokens per character; ``1 / CHARS_PER_TOKEN`` without."""
    known = [(chars, reported[line]) for line, chars in line_chars if line in reported]
    ratio = 1.0 / CHARS_PER_TOKEN
    if known and sum(c for c, _ in known) > 0:
        ratio = sum(t for _, t in known) / sum(c for c, _ in known)
    tokens = [reported.get(line, chars * ratio) for line, chars in line_chars]
    return sum(tokens) / max(1, len(tokens)), ratio


def mean_prompt_tokens(cfg: StudyConfig, trials: list[FrozenTrial]) -> float:
    """The study's prompt sample's mean length in tokens, as the server counted them where it reported them
    (``prompt_tokens``)."""
    wl = cfg.workload
    return prompt_tokens(_line_chars(wl.prompts, wl.sample_size, wl.seed), reported_prompt_tokens(trials))[0]


class EdgeAttrs(TypedDict):
    """A queued memory-edge start's user attributes (stored as these keys): its config and what the planner
    assumed of a request when it placed it (KV tokens, output and prompt tokens, and where the prompt's came from)."""

    role: Literal["prior"]
    label: str
    config: dict[str, Any]
    edge_kv_per_request: int
    edge_output_tokens: float | None
    edge_prompt_tokens: float
    edge_prompt_tokens_from: str


class EdgeStarts:
    """Places the study's ``edge_starts`` one at a time (role ``prior``, labels ``memory edge i``)."""

    def __init__(self, cfg: StudyConfig, space: Space, feasibility: Feasibility | None):
        self.cfg, self.space, self.feasibility = cfg, space, feasibility
        self.n = cfg.study.edge_starts if feasibility is not None else 0
        wl = cfg.workload
        self.max_tokens = wl.max_tokens
        texts = prompt_texts(wl.prompts, wl.sample_size, wl.seed)
        self.prompt_chars = [len(text) for text in texts]
        self.line_chars = _line_chars(wl.prompts, wl.sample_size, wl.seed)
        self.shared_prefix = shared_prefix_tokens(list(texts)) if self.n else 0.0  # start-up work only if used
        self.given = cfg.given_configs()

    def prompt_tokens(self, trials: list[FrozenTrial]) -> tuple[float, float, bool]:
        """(mean prompt tokens, tokens per character, whether the server reported them) with what is known now."""
        reported = reported_prompt_tokens(trials)
        mean, ratio = prompt_tokens(self.line_chars, reported)
        return mean, ratio, bool(reported)

    def per_request(self, trials: list[FrozenTrial], i: int) -> tuple[int, float | None]:
        seen = observed_output(trials, self.max_tokens)
        output = seen if seen is not None else DEFAULT_OUTPUT_SHARE * self.max_tokens
        mult = MULTIPLIERS[min(i, len(MULTIPLIERS) - 1)]
        backoff = 2 ** starved_starts(trials)
        prompt, _, _ = self.prompt_tokens(trials)
        return max(1, int(backoff * (prompt + mult * output))), seen

    def place(self, study: optuna.Study, trials: list[FrozenTrial]) -> EdgeAttrs | None:
        """Queue the next edge start when nothing else is queued; returns what it queued (None: nothing placed)."""
        if not self.n or any(t.state == TrialState.WAITING for t in trials):
            return None
        placed = [t for t in trials if t.user_attrs.get("role") == "prior"]
        if len(placed) >= self.n:
            return None
        if any(
            t.state == TrialState.RUNNING and t.user_attrs.get("role") in ("baseline", "enqueued", "prior")
            for t in trials
        ):
            return None  # its outcome is what this placement should learn from: the sampler goes meanwhile
        i = len(placed)
        tokens, seen = self.per_request(trials, i)
        tried = [dict(t.user_attrs["config"]) for t in trials if "config" in t.user_attrs]
        assert self.feasibility is not None  # edge starts are only placed with a planner (``self.n`` is 0 without)
        prompt, ratio, reported = self.prompt_tokens(trials)
        shared = self.shared_prefix * CHARS_PER_TOKEN * ratio  # shared_prefix_tokens counts 4 characters a token
        configs = edge_configs(
            self.space,
            self.feasibility,
            prompt_chars=self.prompt_chars,
            max_tokens=self.max_tokens,
            n=1,
            seed=self.cfg.study.seed + 7 * i,
            exclude=[*self.given, *tried],
            hold=self.given[0],
            per_request=[tokens],
            shared_prefix=shared,
        )
        if not configs:
            self.n = i  # nothing the planner is sure starts holds that many requests: no more edge starts
            return None
        config = configs[0]
        params = {k: v for k, v in config.items() if k in self.space.names}
        attrs = EdgeAttrs(
            role="prior",
            label=f"memory edge {i + 1}",
            config=config,
            edge_kv_per_request=tokens,
            edge_output_tokens=None if seen is None else round(seen, 1),
            edge_prompt_tokens=round(prompt, 1),
            edge_prompt_tokens_from="server" if reported else f"{CHARS_PER_TOKEN:g} characters per token",
        )
        study.enqueue_trial(params, user_attrs=dict(attrs))
        return attrs
