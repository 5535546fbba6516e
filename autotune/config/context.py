"""The context length a study's prompts must fit, known before any launch.

A prompt whose tokens plus its ``max_tokens`` exceed the server's context length is refused on every send: a
trial of such a sample measures nothing (a 50 MB line once cost two launches recorded as crashes). The limit is
the config's ``--context-length`` when it sets one, else the model's: a bundled profile's (what the simulator
serves), or an upper bound of what SGLang derives from a local model directory's ``config.json`` (its length keys
times a RoPE factor), so only prompts that surely cannot fit are refused; a HuggingFace id that is not on disk has
no known limit here, and ``PromptSample.check_fit`` then uses the longest any model has.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError, WorkloadError
from autotune.prompts import PromptSample
from autotune.prompts.tokens import TokenCounter
from autotune.sglang.profiles import load_model

# The keys SGLang reads a context length from (``get_context_length``: the first it finds, scaled by a RoPE factor).
CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def _config_context(config: Any) -> int | None:
    """An upper bound of the context SGLang derives from a ``config.json`` (or its ``text_config``): the largest
    length key times any RoPE scaling factor. An upper bound, so the check refuses only what surely cannot fit."""
    best = None
    for part in (config, config.get("text_config")) if isinstance(config, dict) else ():
        if not isinstance(part, dict):
            continue
        lengths = [v for v in (part.get(k) for k in CONTEXT_KEYS) if isinstance(v, int) and v > 0]
        rope = part.get("rope_scaling")
        factor = rope.get("factor") if isinstance(rope, dict) else None
        scale = float(factor) if isinstance(factor, (int, float)) and factor > 1 else 1.0
        if lengths:
            best = max(best or 0, int(max(lengths) * scale))
    return best


def model_context_len(model: str | None) -> int | None:
    """The context of a local model directory / ``config.json`` (``_config_context``), else a bundled profile's
    (what the simulator serves); None when neither is there (an id SGLang would download) or nothing says."""
    if not model:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return _config_context(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return None  # the profile check reports an unreadable config.json; this one only sizes a limit
    try:
        return load_model(model).context_len
    except ConfigError:
        return None


def context_limit(model: str | None, config: Mapping[str, Any]) -> tuple[int | None, str, bool]:
    """(tokens, what the limit is, whether the config set it): the config's ``context_length`` wins, as in SGLang."""
    flag = config.get("context_length")
    if isinstance(flag, int) and not isinstance(flag, bool) and flag > 0:
        return flag, "--context-length", True
    path = Path(str(model))
    name = path.parent.name if path.name == "config.json" else path.name or str(model)
    return model_context_len(model), f"{name}'s context length", False


def misfit_reason(model: str | None, config: Mapping[str, Any], sample: PromptSample, max_tokens: int) -> str | None:
    """Why no launch of ``config`` could serve ``sample``: a prompt over the config's own ``--context-length`` is
    that config's outcome (the reason, for a ``bad_args`` trial); one over the model's context is bad input, raised
    as ``PromptSample.check_fit``'s ``WorkloadError``. None when every sampled prompt fits."""
    limit, source, from_config = context_limit(model, config)
    try:  # counted by the model's own tokenizer where its directory has one (``prompts.tokens``)
        sample.check_fit(limit, max_tokens, source=source, counter=TokenCounter.for_model(model))
    except WorkloadError as exc:
        if not from_config:
            raise
        return str(exc)
    return None
