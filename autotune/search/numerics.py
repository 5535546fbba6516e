"""A study's numerics: which trials the fidelity probe runs on, the reference it compares with, the constraint.

The baseline records the reference outputs; a trial that changes an output-changing flag against it is probed
after its window, and every confirmed contender in its first confirmation launch; limits in ``[objective]
numerics`` become constraint entries. Who is probed, where the reference lives and how a resume records it
again: docs/numerics.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autotune.config import StudyConfig
from autotune.config.sections import UNSET
from autotune.errors import ConfigError
from autotune.harness.fidelity import FidelityProbe, FlagChange, Reference, ReferenceInfo, choose_prompts
from autotune.results import FidelityFigures, TrialResult
from autotune.sglang.numerics import NumericsChange, changes_numerics, numerics_flag

REFERENCE_FILE = "numerics-reference.json"
REFERENCE_ATTR = "numerics_reference"  # study user attr: {path, sha256, trial, prompts, tokens}
REFERENCE_RUN = "reference"  # the trial directory of a reference-only launch (``trials/reference/``)


def reference_config(cfg: StudyConfig) -> dict[str, Any]:
    """The study's reference config: its baseline, fixed flags included."""
    return cfg.baseline_config()


def model_defaults(cfg: StudyConfig) -> dict[str, Any] | None:
    """Reference values the model decides (a hybrid model's own ``mamba_ssm_dtype``), when its profile loads."""
    from autotune.sglang.profiles import load_model

    try:
        profile = load_model(cfg.engine.profile or cfg.engine.model)
    except Exception:  # noqa: BLE001 - a checkpoint the planner has no profile for: SGLang's own reference
        return None
    return {"mamba_ssm_dtype": profile.ssm_dtype} if profile.has_mamba else None


def changes(cfg: StudyConfig, config: Mapping[str, Any]) -> list[NumericsChange]:
    """The output-changing flags ``config`` sets differently from the study's reference config."""
    return changes_numerics(config, reference_config(cfg), defaults=model_defaults(cfg))


def candidate_configs(cfg: StudyConfig) -> list[dict[str, Any]]:
    """Configs that stand for every numerics value the study can launch: the enqueued ones and, per table flag of
    the space, the reference with that flag at each of its choices."""
    ref = reference_config(cfg)
    out = cfg.given_configs()[1:]  # the enqueued ones
    for name, spec in cfg.space.items():
        if numerics_flag(name) is None:
            continue
        if spec.kind != "categorical":
            return [*out, {**ref, name: object()}]  # a numeric range of a table flag: assume it differs
        for value in spec.choices or []:
            out.append({k: v for k, v in ref.items() if k != name} if value == UNSET else {**ref, name: value})
    return out


def aware(cfg: StudyConfig) -> bool:
    """Whether any config the study can launch changes numerics against its reference (then it probes)."""
    if any(numerics_flag(name) is not None for name in cfg.derived):
        return True  # a derived table flag: its value is only known per trial
    for config in candidate_configs(cfg):
        if any(not isinstance(v, str | int | float | bool) and v is not None for v in config.values()):
            return True
        try:
            if changes(cfg, config):
                return True
        except ConfigError:
            return True  # a value the table cannot read: probe rather than assume equal
    return False


def constrained(cfg: StudyConfig) -> bool:
    """Whether the study's constraint vector carries numerics entries (aware and a limit set)."""
    return bool(cfg.objective.numerics.limits()) and aware(cfg)


def constraint_entries(cfg: StudyConfig, result: TrialResult) -> list[float]:
    """The numerics entries of a COMPLETE trial's constraint vector (empty when the study has none); a trial that
    never served leaves them at 0 (its memory-wall entry is already violated)."""
    if not constrained(cfg):
        return []
    limits = cfg.objective.numerics
    if result.status != "ok":
        return [0.0] * len(limits.limits())
    return limits.violations(result.fidelity.to_dict() if result.fidelity else None)


def record_reference(study: Any, result: TrialResult) -> None:
    """Keep the reference's path and sha256 with the study when ``result``'s launch recorded it."""
    fidelity = result.fidelity
    if fidelity and fidelity.role == "reference" and isinstance(fidelity.reference, Mapping) and not fidelity.error:
        study.set_user_attr(
            REFERENCE_ATTR, {**fidelity.reference, "prompts": fidelity.prompts, "tokens": fidelity.tokens}
        )


class ProbePlanner:
    """Per trial, the probe ``run_trial`` runs (or None), and the reference it needs, recorded once per study.

    ``record`` runs a reference-only launch of the baseline config (``run(config, trial_dir, probe)``: the
    runner's ``run_trial`` with a short window) when a probed trial finds no usable reference."""

    def __init__(self, cfg: StudyConfig, rows: Any, *, timeout_s: float = 600.0):
        self.cfg = cfg
        self.enabled = aware(cfg)
        self.confirms = cfg.study.confirm_top_k > 0  # every confirmed contender is probed: record the reference
        settings = cfg.objective.numerics
        chosen = choose_prompts(list(rows), settings.prompts)
        self.prompts = tuple(row.as_text() for row in chosen)
        self.lines = tuple(int(row.line) for row in chosen)
        self.tokens = settings.tokens
        self.path = cfg.work_dir / REFERENCE_FILE  # the runner points it into the study's folder before a launch
        self.reference_cfg = reference_config(cfg)
        self.defaults = model_defaults(cfg)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def _changes(self, config: Mapping[str, Any]) -> list[NumericsChange]:
        return changes_numerics(config, self.reference_cfg, defaults=self.defaults)

    def reference(self) -> Reference | None:
        """The stored reference when it was recorded for this study's prompts, tokens and reference config."""
        ref = Reference.load(self.path)
        if ref is None or not ref.matches(self.prompts, self.tokens):
            return None
        if ref.config and self._changes(ref.config):
            return None
        return ref

    def recording(self, trial: int | None) -> FidelityProbe:
        return FidelityProbe(
            prompts=self.prompts,
            tokens=self.tokens,
            lines=self.lines,
            record_to=self.path,
            reference_info=ReferenceInfo(path=str(self.path), trial=trial, config=self.reference_cfg),
            timeout_s=self.timeout_s,
        )

    def probe_for(
        self,
        config: Mapping[str, Any],
        trial: int,
        record: Callable[[FidelityProbe], TrialResult] | None = None,
    ) -> tuple[FidelityProbe | None, TrialResult | None]:
        """(the probe for trial ``trial`` launching ``config``, None) — the probe None when the trial needs none —
        or (None, the failed launch) when the reference had to be recorded first (``record``) and could not be."""
        if not (self.enabled or self.confirms):
            return None, None
        found = self._changes(config) if self.enabled else []
        if not found:  # the reference's numerics: the baseline's own launch records the reference, once
            with self._lock:  # workers of one process record the reference once
                ref = self.reference()
            return (self.recording(trial) if ref is None and dict(config) == self.reference_cfg else None), None
        return self._comparing(config, found, record)

    def confirmation_probe(
        self,
        config: Mapping[str, Any],
        record: Callable[[FidelityProbe], TrialResult] | None = None,
    ) -> tuple[FidelityProbe | None, TrialResult | None]:
        """The probe of a confirmed contender's first confirmation launch, table or not: (None, None) for the
        baseline's own flags (its twins included), else as ``probe_for``. Every flag the config sets differently
        from the baseline goes with it (``differs``), for a change no table flag explains."""
        if not flag_differences(config, self.reference_cfg):
            return None, None
        try:
            found = self._changes(config)
        except ConfigError:  # a value the table cannot read: compare all the same, against the flags that differ
            found = []
        return self._comparing(config, found, record)

    def _comparing(
        self,
        config: Mapping[str, Any],
        found: list[NumericsChange],
        record: Callable[[FidelityProbe], TrialResult] | None,
    ) -> tuple[FidelityProbe | None, TrialResult | None]:
        """A probe comparing with the reference, recorded first (``record``) when it is missing."""
        with self._lock:  # workers of one process record the reference once
            ref = self.reference()
            if ref is None and record is not None:
                outcome = record(self.recording(None))
                ref = self.reference()
                if ref is None:
                    return None, outcome
        if ref is None:
            return None, TrialResult(status="crash", config=dict(config), reason="no reference outputs recorded")
        info = ReferenceInfo(path=str(self.path), trial=ref.trial, sha256=_sha(self.path))
        return FidelityProbe(
            prompts=self.prompts,
            tokens=self.tokens,
            lines=self.lines,
            reference=ref,
            changes=tuple(FlagChange(flag=c.flag, value=c.value, reference=c.reference, why=c.why) for c in found),
            differs=tuple(flag_differences(config, self.reference_cfg)),
            reference_info=info,
            timeout_s=self.timeout_s,
        ), None


def _set(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config's flags as launched: None and False (absent, SGLang's default) dropped."""
    return {k: v for k, v in config.items() if v is not None and v is not False}


def flag_differences(config: Mapping[str, Any], reference: Mapping[str, Any]) -> list[FlagChange]:
    """Every flag ``config`` sets differently from ``reference``, with both values (None: unset)."""
    a, b = _set(config), _set(reference)
    return [
        FlagChange(flag=k, value=a.get(k), reference=b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    ]


def contender_fidelity(searched: FidelityFigures | None, confirmed: FidelityFigures | None) -> FidelityFigures | None:
    """What is known of a trial's outputs against the baseline: ``confirmed``, its contender probe in its first
    confirmation launch (``Confirmation.probe``), when that measured, else its search launch's figures (a table
    flag's probe, or the reference), else the contender probe's error."""
    if confirmed is not None and not confirmed.error:
        return confirmed
    if searched and (searched.role != "reference" or confirmed is None):
        return searched
    return confirmed


def _sha(path: Path) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def contender_result(result: TrialResult, confirmed: FidelityFigures | None) -> TrialResult:
    """A trial's result with ``contender_fidelity`` as its ``fidelity`` (what ``apply`` judges; ``confirmed``: its
    contender probe)."""
    return dataclasses.replace(result, fidelity=contender_fidelity(result.fidelity, confirmed))


def without_reference(failed: TrialResult) -> FidelityFigures:
    """A confirmation run's fidelity when the reference could not be recorded: said, never a silent pass."""
    return FidelityFigures(
        role="probe",
        error=f"no reference outputs: the baseline's reference launch ended "
        f"{failed.status}" + (f" ({failed.reason})" if failed.reason else ""),
    )


def missing_reference(result: TrialResult, config: Mapping[str, Any]) -> TrialResult:
    """A trial that needed the probe but whose reference could not be recorded: a ``probe_error`` without a launch."""
    return dataclasses.replace(
        TrialResult(status="probe_error", config=dict(config), engine=result.engine),
        reason=f"fidelity probe: no reference outputs: the baseline's reference launch ended {result.status}"
        + (f" ({result.reason})" if result.reason else ""),
        fidelity=FidelityFigures(role="probe", error="no reference outputs"),
    )
