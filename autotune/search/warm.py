"""A study started from an earlier one (``autotune sweep --from STUDY``): the record the sweep reads back (its configs
join ``[[enqueue]]``, its scaled corrections become the planner's ``Prior``), the same in every process of the study.
docs/search.md ("Re-tuning from an earlier study").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast

import optuna

from autotune.config import StudyConfig
from autotune.config.sections import Enqueued
from autotune.search.correction import CorrectedFeasibility, Prior

WARM_KEY = "warm_start"  # the study's user attribute holding the record


class Corrections(TypedDict):
    """What a study's planner learnt, as the record stores it: the free-memory offsets (GiB), the room at peak and
    an OOM's planned headroom, each as [activation GiB, GiB]."""

    offsets: list[float]
    room: list[list[float]]
    ooms: list[list[float]]


class Carried(TypedDict, total=False):
    """The record's ``corrections``: ``Corrections`` scaled to this GPU, the ratio and both GPUs' memory (GiB);
    empty when the earlier study's model or GPU had no planner profile."""

    offsets: list[float]
    room: list[list[float]]
    ooms: list[list[float]]
    scale: float
    memory_gib: list[float]


class WarmConfig(TypedDict):
    """One of the earlier study's best configs, translated and fitted: its label, trial number and config."""

    label: str
    trial: int
    config: dict[str, Any]


class WarmRecord(TypedDict):
    """``user_attrs["warm_start"]``, as ``search.views.origin.warm_record`` writes it (these keys, stored)."""

    study: str
    storage: str  # redacted
    sglang_version: str
    gpu: str
    model: str | None
    to: dict[str, str]  # this study's sglang_version and gpu
    configs: list[WarmConfig]
    corrections: Carried
    notes: list[str]


def record_of(study: optuna.Study) -> WarmRecord | None:
    """The study's warm-start record, None for a study started cold."""
    record = study.user_attrs.get(WARM_KEY)
    return cast(WarmRecord, dict(record)) if isinstance(record, Mapping) else None


def warm_config(cfg: StudyConfig, record: WarmRecord | None) -> StudyConfig:
    """``cfg`` with the record's configs appended to ``[[enqueue]]`` (unchanged without a record; a config the
    study file already enqueues under the same label is not added twice)."""
    if not record:
        return cfg
    labels = {e.label for e in cfg.enqueue}
    extra = [
        Enqueued(label=str(c["label"]), flags=dict(c["config"]))
        for c in record.get("configs") or ()
        if str(c["label"]) not in labels
    ]
    return cfg.model_copy(update={"enqueue": [*cfg.enqueue, *extra]}) if extra else cfg


def prior_of(corrections: Carried | None) -> Prior:
    """The planner's ``Prior`` from a record's (already scaled) corrections."""
    c: Carried = corrections or {}
    return Prior(
        offsets=tuple(float(x) for x in c.get("offsets") or ()),
        room=tuple((float(a), float(d)) for a, d in c.get("room") or ()),
        ooms=tuple((float(a), float(h)) for a, h in c.get("ooms") or ()),
    )


def warm_planner(feasibility: Any, record: WarmRecord | None) -> None:
    """Start the corrected planner from the record's corrections (nothing for a cold study or no planner)."""
    if record and isinstance(feasibility, CorrectedFeasibility):
        feasibility.prior = prior_of(record.get("corrections"))


def learnt(feasibility: CorrectedFeasibility) -> Corrections:
    """What a study's planner learnt (after ``correction.replay``), as the record stores it, unscaled."""
    return {
        "offsets": [round(x, 4) for x in feasibility.offsets],
        "room": [[round(a, 4), round(d, 4)] for a, d in feasibility.room],
        "ooms": [[round(a, 4), round(h, 4)] for a, h in feasibility.ooms],
    }


def scaled(corrections: Corrections, ratio: float) -> dict[str, Any]:
    """The corrections moved to a GPU with ``ratio`` × the memory: every GiB the planner was off by (the free-memory
    offset, the room at peak, an OOM's planned headroom) scales with the device; the activation memory a room point
    or OOM was measured at is the config's (its batch and chunk), the same on any device, so it is kept. A plain dict:
    ``search.views.origin`` adds the scale and both GPUs' memory to it (the record's ``Carried``)."""
    return {
        "offsets": [round(x * ratio, 4) for x in corrections.get("offsets") or ()],
        "room": [[a, round(d * ratio, 4)] for a, d in corrections.get("room") or ()],
        "ooms": [[a, round(h * ratio, 4)] for a, h in corrections.get("ooms") or ()],
    }
