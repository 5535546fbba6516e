"""The hand-written configs checked before the first launch: a baseline or ``[[enqueue]]`` SGLang refuses (the
engine's argument check and SGLang's cross-flag rules) is an error in the study file, not a trial; a config the
planner only expects to run out of memory is not refused. docs/study-file.md ("Bad files").
"""

from __future__ import annotations

from typing import Any

from autotune.config import StudyConfig
from autotune.errors import ConfigError
from autotune.search.correction import CorrectedFeasibility
from autotune.search.runner import study_engine


def table_of(role: str, label: str) -> str:
    """Where a given config lives in the study file: ``[baseline]`` or ``[[enqueue]] "label"``."""
    return "[baseline]" if role == "baseline" else f'[[enqueue]] "{label}"'


def check_given(cfg: StudyConfig, *, engine: Any = None, feasibility: Any = None) -> None:
    """One ``ConfigError`` naming the study file, the table and the rule for the first given config the engine's
    argument check or SGLang's cross-flag rules refuse; nothing when all pass. ``engine``: the study's engine (None:
    no argument check); ``feasibility``: the planner (None for a model without a profile: no cross-flag check)."""
    file = str(cfg.path) if cfg.path else None
    for role, label, config in cfg.given():
        where = table_of(role, label)
        if engine is not None:
            try:
                engine.check(config)
            except ConfigError as exc:
                raise exc.at(file=file, key=f"{where} {exc.key}" if exc.key else where) from None
        if feasibility is None:
            continue
        memory_plan = feasibility.predict(config, inert=False)
        if memory_plan.failure == "bad_args":
            raise ConfigError(
                f"SGLang refuses this config: {memory_plan.message}",
                file=file,
                key=where,
                fix="change the flags the rule names, in this table or in [engine.fixed]; nothing was launched",
            )


def check_study(cfg: StudyConfig) -> None:
    """``check_given`` with the study's own engine and planner: what ``autotune sweep`` runs before it starts any
    worker (each worker's sweep runs it again, for a worker started on its own)."""
    check_given(cfg, engine=study_engine(cfg), feasibility=CorrectedFeasibility.from_config(cfg))
