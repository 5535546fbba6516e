"""The memory-edge starting points, placed one at a time with what the study knows by then.

``starts.edge_configs`` finds the config with the highest running cap whose KV pool holds that many requests. How
much KV a request holds is the unknown: its prompt (known from the sample) plus its output (known only once a
server has answered). So the edge starts are not queued up front: after the baseline and the enqueued configs have
run, each edge start is placed when the sweep needs its next trial, from

- the prompt sample's mean length and the mean output length the finished trials measured (tokens in the window
  over requests completed in it, pooled; ``DEFAULT_OUTPUT_SHARE`` of ``max_tokens`` before any measurement), and
- the planner as corrected so far (``correction.CorrectedFeasibility``): an edge start that ran out of memory
  moves the wall, and the next one is placed below it.

The i-th start takes ``MULTIPLIERS[i]`` × the measured output length: the first on the estimate, the others
bracketing it. A start that started but starved (under ``STARVED_SHARE`` of the best given config's tok/s: the KV
pool could not hold what the cap let in, so SGLang retracted and re-prefilled instead of decoding) was past the
wall too, where the planner's memory correction cannot see it: each one doubles the KV a request is taken to hold
for the starts after it.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
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
    data = t.user_attrs.get("result")
    if t.state != TrialState.COMPLETE or not data or data.get("status") != "ok":
        return None
    return TrialResult.from_dict(data)


def starved_starts(trials: list[FrozenTrial]) -> int:
    """How many finished edge starts measured under ``STARVED_SHARE`` of the best baseline/enqueued tok/s."""
    def tok_s(t: FrozenTrial) -> float | None:
        result = _ok_result(t)
        return result.output_tok_s if result is not None else None

    given = [v for t in trials if t.user_attrs.get("role") in ("baseline", "enqueued") and (v := tok_s(t))]
    if not given:
        return 0
    floor = STARVED_SHARE * max(given)
    return sum(1 for t in trials if t.user_attrs.get("role") == "prior" and (v := tok_s(t)) is not None
               and v < floor)


class EdgeStarts:
    """Places the study's ``edge_starts`` one at a time (role ``prior``, labels ``memory edge i``)."""

    def __init__(self, cfg: StudyConfig, space: Space, feasibility: Feasibility | None):
        self.cfg, self.space, self.feasibility = cfg, space, feasibility
        self.n = cfg.study.edge_starts if feasibility is not None else 0
        wl = cfg.workload
        self.max_tokens = wl.max_tokens
        texts = prompt_texts(wl.prompts, wl.sample_size, wl.seed)
        self.prompt_chars = [len(text) for text in texts]
        self.shared_prefix = shared_prefix_tokens(list(texts)) if self.n else 0.0  # start-up work only if used
        self.prompt_tokens = sum(self.prompt_chars) / max(1, len(self.prompt_chars)) / CHARS_PER_TOKEN
        self.given = cfg.given_configs()

    def per_request(self, trials: list[FrozenTrial], i: int) -> tuple[int, float | None]:
        seen = observed_output(trials, self.max_tokens)
        output = seen if seen is not None else DEFAULT_OUTPUT_SHARE * self.max_tokens
        mult = MULTIPLIERS[min(i, len(MULTIPLIERS) - 1)]
        backoff = 2 ** starved_starts(trials)
        return max(1, int(backoff * (self.prompt_tokens + mult * output))), seen

    def place(self, study: optuna.Study, trials: list[FrozenTrial]) -> dict[str, Any] | None:
        """Queue the next edge start when nothing else is queued; returns its config (None: nothing placed)."""
        if not self.n or any(t.state == TrialState.WAITING for t in trials):
            return None
        placed = [t for t in trials if t.user_attrs.get("role") == "prior"]
        if len(placed) >= self.n:
            return None
        if any(t.state == TrialState.RUNNING and t.user_attrs.get("role") in ("baseline", "enqueued", "prior")
               for t in trials):
            return None  # its outcome is what this placement should learn from: the sampler goes meanwhile
        i = len(placed)
        tokens, seen = self.per_request(trials, i)
        tried = [dict(t.user_attrs["config"]) for t in trials if "config" in t.user_attrs]
        configs = edge_configs(self.space, self.feasibility, prompt_chars=self.prompt_chars,
                               max_tokens=self.max_tokens, n=1, seed=self.cfg.study.seed + 7 * i,
                               exclude=[*self.given, *tried], hold=self.given[0], per_request=[tokens],
                               shared_prefix=self.shared_prefix)
        if not configs:
            self.n = i  # nothing the planner is sure starts holds that many requests: no more edge starts
            return None
        config = configs[0]
        params = {k: v for k, v in config.items() if k in self.space.names}
        study.enqueue_trial(params, user_attrs={
            "role": "prior", "label": f"memory edge {i + 1}", "config": config, "edge_kv_per_request": tokens,
            "edge_output_tokens": None if seen is None else round(seen, 1)})
        return config
