"""The context length a study's prompts must fit, known before any launch.

A prompt whose tokens plus its ``max_tokens`` exceed the server's context length is refused on every send: a
trial of such a sample measures nothing (a 50 MB line once cost two launches recorded as crashes). The limit is
the config's ``--context-length`` when it sets one, else the model's ``max_position_embeddings`` (a bundled
profile, or the ``config.json`` of a local model directory, as SGLang reads it); a HuggingFace id that is not on
disk has no known limit here, and ``PromptSample.check_fit`` then uses the longest any model has.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError, WorkloadError
from autotune.prompts import PromptSample
from autotune.sglang.profiles import load_model


def model_context_len(model: str | None) -> int | None:
    """``max_position_embeddings`` of a local ``config.json`` (or its ``text_config``), else of a bundled profile;
    None when neither is there (an id SGLang would download) or the file does not say."""
    if not model:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # the profile check reports an unreadable config.json; this one only sizes a limit
        for part in (config, config.get("text_config")) if isinstance(config, dict) else ():
            value = part.get("max_position_embeddings") if isinstance(part, dict) else None
            if isinstance(value, int) and value > 0:
                return value
        return None
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
    try:
        sample.check_fit(limit, max_tokens, source=source)
    except WorkloadError as exc:
        if not from_config:
            raise
        return str(exc)
    return None
