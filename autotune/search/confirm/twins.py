"""Twins: search launches of one server at two memory fractions, confirmed as one contender.

Two launches are twins when their configs differ only in the memory fraction, their servers logged the same running
cap, and each KV pool holds the running requests at their mean steady context; the confirmation keeps the better
search figure of each pair. Why the fraction then decides nothing SGLang's scheduler does: docs/search.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.results import TrialResult
from autotune.search.edges import mean_prompt_tokens
from autotune.search.seeding import launch_key
from autotune.search.space import key_of

MEMORY_ONLY = frozenset({"mem_fraction_static"})  # flags that size the pools and nothing the scheduler reads else


def held_tokens(mean_prompt_tokens: float, max_tokens: int) -> float:
    """KV tokens a running request holds on average at steady state, at most (see the module docstring)."""
    return mean_prompt_tokens + max_tokens / 2.0


def study_held_tokens(cfg: StudyConfig, trials: list[FrozenTrial]) -> float:
    """``held_tokens`` for a study: its prompt sample's mean as the servers counted it (``edges.mean_prompt_tokens``)
    and its ``max_tokens``; the one bound the confirmation ranks by and the summary reports with."""
    return held_tokens(mean_prompt_tokens(cfg, trials), cfg.workload.max_tokens)


def twin_key(trial: FrozenTrial, held: float | None) -> str:
    """The identity the confirmation ranks ``trial`` under: its config without the memory fraction and its logged
    running cap, when its KV pool holds that cap at ``held`` tokens a request; else its own launch key (``held``
    None: never a twin)."""
    result = TrialResult.of(trial) if held is not None else None
    cap = result.capacity if result is not None else None
    if (
        result is None
        or held is None
        or cap is None
        or not cap.max_running_requests
        or not cap.kv_tokens
        or cap.kv_tokens < cap.max_running_requests * held
    ):
        return launch_key(trial)
    rest = {k: v for k, v in result.config.items() if k not in MEMORY_ONLY}
    return f"{key_of(rest)} running={cap.max_running_requests}"


def twins_of(trials: Iterable[FrozenTrial], numbers: Iterable[int], held: float | None) -> dict[int, tuple[int, ...]]:
    """For each trial of ``numbers`` (the confirmation's contenders), the other finished launches of ``trials`` (the
    ones it could take: ``ranking.ranked``; an infeasible or pruned launch was left out on its own) it stood for as
    one server: the same ``twin_key``, another config (a launch of the same config is a repeat, not a twin), not
    itself confirmed (a hand-written config is, in reach); only the contenders that had any. Empty without the
    bound."""
    numbers = list(numbers)
    if held is None:
        return {}
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"]
    keys = {t.number: (twin_key(t, held), launch_key(t)) for t in ok}
    out: dict[int, tuple[int, ...]] = {}
    for n in numbers:
        if n not in keys:
            continue
        twin, own = keys[n]
        others = tuple(m for m, (k, launch) in sorted(keys.items()) if m not in numbers and k == twin and launch != own)
        if others:
            out[n] = others
    return out
