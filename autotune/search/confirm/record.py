"""The stored confirmation as one typed record: what ``stages`` and ``stress`` write and every view reads.

A study keeps its confirmation as plain data in ``study.user_attrs["confirmation"]``; this module is the one place
that converts it (``Confirmation.from_dict`` / ``to_dict``, the keys stored studies hold, old ones included: a key
a study stored before it existed reads as its default and is written back only where the writer writes it) and
the one reader (``Confirmation.of``). Everything between the layers passes the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from autotune.results import FidelityFigures, StressResult, TrialResult
from autotune.search.confirm.decision import Verdict
from autotune.search.confirm.samples import ConfirmationRun

__all__ = [
    "ATTR",
    "VERDICT_KEYS",
    "Confirmation",
    "ConfirmationRun",
    "DefaultsRun",
    "Demotion",
    "LaunchCost",
    "StressRecord",
    "StressRun",
]

ATTR = "confirmation"  # the study's user attribute
# The keys ``Verdict.to_dict`` writes beside the confirmation's own (its fields, by name): any of them stored means
# a verdict was.
VERDICT_KEYS = frozenset(f.name for f in dataclasses.fields(Verdict))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchCost:
    """What the study's bill (``views.spend``) reads of a launch kept apart from the confirmation's runs (a stress
    launch of its own, the defaults' measured launch): its durations, the startup its server reported, its GPUs.
    Stored flat beside the launch's own keys (its fields, as ``dataclasses.asdict`` writes them)."""

    durations_s: dict[str, float]
    modelled_startup_s: float | None = None
    gpus: list[int] | None = None

    @property
    def gpus_spanned(self) -> int:
        """How many GPUs the launch held (``TrialResult.gpus_spanned``'s rule)."""
        return max(1, len(self.gpus or ()))

    @classmethod
    def of(cls, result: TrialResult) -> LaunchCost:
        return cls(durations_s=dict(result.durations_s), modelled_startup_s=result.modelled_startup_s, gpus=result.gpus)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchCost | None:
        """The cost stored flat in ``data``; None where it stored none (a study stored before the bill)."""
        durations = data.get("durations_s")
        if not isinstance(durations, Mapping):
            return None
        return cls(
            durations_s=dict(durations), modelled_startup_s=data.get("modelled_startup_s"), gpus=data.get("gpus")
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StressRun:
    """A contender's stress phase (``stress``): its own launch, or the one a confirmation launch ran after its
    windows (``in_confirmation``); ``result`` None when no stress phase ran (``reason`` says why)."""

    trial: int
    repeat: int | None = None
    status: str | None = None
    reason: str | None = None
    result: StressResult | None = None
    trial_dir: str | None = None
    in_confirmation: bool = False
    cost: LaunchCost | None = None  # a launch of its own: what it took

    def to_dict(self) -> dict[str, Any]:
        """The stored form (``trial_dir`` only when known, ``in_confirmation`` only when set, the cost's keys only
        for a launch of its own)."""
        return {
            "trial": self.trial,
            "repeat": self.repeat,
            "status": self.status,
            "reason": self.reason,
            "result": self.result.to_dict() if self.result is not None else None,
            **({"trial_dir": self.trial_dir} if self.trial_dir is not None else {}),
            **({"in_confirmation": True} if self.in_confirmation else {}),
            **(dataclasses.asdict(self.cost) if self.cost is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StressRun:
        return cls(
            trial=int(data["trial"]),
            repeat=data.get("repeat"),
            status=data.get("status"),
            reason=data.get("reason"),
            result=StressResult.from_dict(data.get("result")),
            trial_dir=data.get("trial_dir"),
            in_confirmation=bool(data.get("in_confirmation")),
            cost=LaunchCost.from_dict(data),
        )

    @property
    def failed(self) -> bool:
        """The server died under the stress phase (a launch with no stress phase at all is not stressed, not
        failed)."""
        return self.result is not None and not self.result.survived


@dataclasses.dataclass(frozen=True)
class Demotion:
    """A contender barred from winning: its server died under the stress phase (``reason``: its line)."""

    trial: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StressRecord:
    """The stress stage as it happens (``stress.stress_winner``): every stress phase recorded, who was demoted,
    the winner it started from, and whether it finished (a killed sweep resumes from here)."""

    runs: tuple[StressRun, ...] = ()
    demoted: tuple[Demotion, ...] = ()
    decided_trial: int | None = None
    complete: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The stored form (``complete`` only once finished)."""
        return {
            "runs": [r.to_dict() for r in self.runs],
            "demoted": [{"trial": d.trial, "reason": d.reason} for d in self.demoted],
            "decided_trial": self.decided_trial,
            **({"complete": True} if self.complete else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StressRecord:
        return cls(
            runs=tuple(StressRun.from_dict(r) for r in data.get("runs") or ()),
            demoted=tuple(Demotion(int(d["trial"]), str(d["reason"])) for d in data.get("demoted") or ()),
            decided_trial=data.get("decided_trial"),
            complete=bool(data.get("complete")),
        )

    def of(self, trial: int | None) -> tuple[StressRun, ...]:
        """``trial``'s stress phases in the order they ran."""
        return tuple(r for r in self.runs if r.trial == trial)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DefaultsRun:
    """SGLang's defaults for the tuned flags as the confirmation measured (or predicted) them
    (``defaults._defaults``): one that did not run cleanly has no tok/s."""

    status: str | None = None
    output_tok_s: float | None = None
    tok_s_per_gpu: float | None = None
    reason: str | None = None
    how: str | None = None
    config: dict[str, Any] | None = None
    trial_dir: str | None = None
    log_path: str | None = None
    cost: LaunchCost | None = None  # measured (not predicted): what its launch took

    def to_dict(self) -> dict[str, Any]:
        """The stored form (the cost's keys only for a measured run)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cost"}
        return {**out, **(dataclasses.asdict(self.cost) if self.cost is not None else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> DefaultsRun | None:
        if not data:
            return None
        names = {f.name for f in dataclasses.fields(cls)} - {"cost"}
        return cls(**{k: v for k, v in data.items() if k in names}, cost=LaunchCost.from_dict(data))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Confirmation:
    """A study's confirmation: the contenders in ``order`` (trial numbers), the ``n_trials`` finished when it
    started, its ``runs`` (and the ``given`` search runs standing in for a baseline not relaunched), each
    contender's warm-up floor (``warmup_s``), the ``verdict`` once decided, SGLang's ``defaults`` and the
    ``stress`` stage. ``complete``: every stage ran (the verdict is final but for the stress stage's demotions).
    ``Confirmation()`` is the empty one: nothing stored."""

    order: tuple[int, ...] = ()
    n_trials: int | None = None
    complete: bool = False
    runs: tuple[ConfirmationRun, ...] = ()
    given: tuple[ConfirmationRun, ...] = ()
    warmup_s: Mapping[int, float] | None = None
    verdict: Verdict | None = None
    defaults: DefaultsRun | None = None
    stress: StressRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the keys stored studies hold (``n_trials``, ``given``, ``warmup_s`` and ``stress`` only
        when there are some, ``defaults`` once complete, the verdict's keys beside the confirmation's own)."""
        out: dict[str, Any] = {
            **({"order": list(self.order)} if self.order else {}),
            **({"n_trials": self.n_trials} if self.n_trials is not None else {}),
            "complete": self.complete,
            **({"given": [g.to_dict() for g in self.given]} if self.given else {}),
            **({"warmup_s": {str(n): s for n, s in self.warmup_s.items()}} if self.warmup_s is not None else {}),
            "runs": [r.to_dict() for r in self.runs],
        }
        if self.verdict is not None:
            out.update(self.verdict.to_dict())
        if self.complete:
            out["defaults"] = self.defaults.to_dict() if self.defaults is not None else None
        if self.stress is not None:
            out["stress"] = self.stress.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Confirmation:
        """The record of a stored confirmation, as any version stored it (a complete one always has a verdict)."""
        warmup = data.get("warmup_s")
        stress = data.get("stress")
        complete = bool(data.get("complete"))
        return cls(
            order=tuple(int(n) for n in data.get("order") or ()),
            n_trials=data.get("n_trials"),
            complete=complete,
            runs=tuple(ConfirmationRun.from_dict(r) for r in data.get("runs") or ()),
            given=tuple(ConfirmationRun.from_dict(g) for g in data.get("given") or ()),
            warmup_s={int(n): float(s) for n, s in warmup.items()} if isinstance(warmup, Mapping) else None,
            verdict=Verdict.from_dict(data) if complete or not VERDICT_KEYS.isdisjoint(data) else None,
            defaults=DefaultsRun.from_dict(data.get("defaults")),
            stress=StressRecord.from_dict(stress) if isinstance(stress, Mapping) else None,
        )

    @classmethod
    def of(cls, source: Any) -> Confirmation | None:
        """The confirmation a study stored (``source``: the study, or its ``user_attrs``); None when none is."""
        attrs = source if isinstance(source, Mapping) else getattr(source, "user_attrs", None) or {}
        stored = attrs.get(ATTR)
        return cls.from_dict(stored) if isinstance(stored, Mapping) and stored else None

    def store(self, study: Any) -> Confirmation:
        """Save it as the study's confirmation (plain data, ``to_dict``); itself, for the caller to pass on."""
        study.set_user_attr(ATTR, self.to_dict())
        return self

    @property
    def confirmed(self) -> Verdict | None:
        """The verdict of a finished confirmation; None while it runs."""
        return self.verdict if self.complete else None

    def runs_of(self, trial: int | None) -> tuple[ConfirmationRun, ...]:
        """``trial``'s confirmation launches in the order they ran."""
        return tuple(r for r in self.runs if r.trial == trial)

    def probe(self, trial: int) -> FidelityFigures | None:
        """The fidelity figures of ``trial``'s first confirmation launch (its contender probe), None if none ran."""
        for run in self.runs:
            if run.trial == trial and run.repeat == 0:
                figures = run.result.fidelity
                if figures is not None and figures.probed:
                    return figures
        return None

    def unexpected(self) -> list[int]:
        """The confirmed contenders whose outputs changed though no output-changing flag did, in the order they
        ran."""
        out: list[int] = []
        for run in self.runs:
            figures = self.probe(run.trial) if run.repeat == 0 else None
            if figures is not None and figures.unexpected and run.trial not in out:
                out.append(run.trial)
        return out
