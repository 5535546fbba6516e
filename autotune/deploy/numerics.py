"""Whether a winner answers like the study's baseline: ``autotune apply``'s numerics gate and provenance block.

A winner that changes an output-changing flag (``autotune.sglang.numerics``) against the study's baseline is
deployed only with a measured fidelity probe (``TrialResult.fidelity``) within the study's limits
(``[objective] numerics``); otherwise ``apply`` refuses unless ``--accept-numerics`` is given. The probe's figures
go into ``provenance.json`` either way. A winner whose contender probe found its outputs changed although no table
flag did (``unexpected``, ``search.numerics.contender_fidelity``) is judged the same way, as a numerics change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autotune.errors import StudyError
from autotune.results import FidelityFigures, differing_flags

if TYPE_CHECKING:
    from autotune.search.views.settings import StudySettings
    from autotune.sglang.numerics import NumericsChange

__all__ = ["Numerics", "NumericsRefused", "check_numerics", "numerics_block"]
LIMITS = ("min_prefix_match", "max_mean_abs_logprob_delta", "min_exact_share")  # the limits provenance records


class NumericsRefused(StudyError):
    """The winner changed numerics without a measured probe, or broke the study's limit."""


@dataclass(frozen=True, kw_only=True)
class Numerics:
    """A winner's numerics against the baseline: the flags that change outputs, whether its outputs changed with
    none of them (None: the table could not compare), the probe's figures, the study's limits that are set, and
    the problem that refuses it (None: deployable); ``accepted``: ``--accept-numerics`` took it despite that."""

    changes: tuple[NumericsChange, ...] = ()
    unexpected: bool | None = None
    fidelity: FidelityFigures | None = None
    limits: tuple[tuple[str, float], ...] = ()
    problem: str | None = None
    accepted: bool = False

    def to_dict(self) -> dict[str, Any]:
        """As ``provenance.json`` stores it (``unexpected`` only where the table compared; never ``accepted``)."""
        return {
            "changes": [c.to_dict() for c in self.changes],
            **({"unexpected": self.unexpected} if self.unexpected is not None else {}),
            "fidelity": self.fidelity.to_dict() if self.fidelity is not None else None,
            "limits": dict(self.limits),
            "problem": self.problem,
        }


def _defaults(settings: StudySettings, model: str | None) -> dict[str, str] | None:
    from autotune.sglang.profiles import load_model

    name = settings.profile or settings.model or model
    if not name:
        return None
    try:
        profile = load_model(name)
    except Exception:  # noqa: BLE001 - no profile for this checkpoint: SGLang's own reference values
        return None
    return {"mamba_ssm_dtype": profile.ssm_dtype} if profile.has_mamba else None


def numerics_block(winner: Any) -> Numerics | None:
    """The winner's numerics for provenance: the flags that change outputs against the baseline, the probe's
    figures, the study's limits and the verdict. None when there is no baseline to compare with."""
    from autotune.sglang.numerics import changes_numerics

    if winner.baseline_config is None:
        return None
    try:
        changes = changes_numerics(
            winner.config, winner.baseline_config, defaults=_defaults(winner.settings, winner.model)
        )
    except Exception as exc:  # noqa: BLE001 - a value the table cannot read: say so, never pass silently
        return Numerics(fidelity=winner.result.fidelity, problem=f"cannot compare: {exc}")
    limits = winner.settings.numerics
    fidelity = winner.result.fidelity
    problem = None
    unexpected = bool(fidelity and fidelity.unexpected)  # no table flag changed, yet its outputs did
    if changes or unexpected:
        flags = ", ".join(f"--{c.flag.replace('_', '-')} {c.value}" for c in changes) or differing_flags(fidelity)
        if not fidelity or not fidelity.probed or fidelity.error:
            why = f" (the probe failed: {fidelity.error})" if fidelity and fidelity.error else ""
            problem = (
                f"trial {winner.trial} changes outputs against the baseline ({flags}) and no fidelity probe "
                f"measured how much{why}"
            )
        else:
            figures = fidelity.to_dict()
            broken = [
                f"{figure} {figures.get(figure)} (limit {op} {limit:g})"
                for (figure, op, limit), v in zip(limits.limits(), limits.violations(figures), strict=True)
                if v > 0
            ]
            if broken:
                what = (
                    f"changed its outputs unexpectedly (it differs from the baseline in {flags}, none of them a "
                    "flag known to change outputs)"
                    if unexpected
                    else f"changes outputs against the baseline ({flags})"
                )
                problem = f"trial {winner.trial} {what} beyond the study's limit: {'; '.join(broken)}"
    set_limits = tuple((k, v) for k, v in limits.model_dump().items() if k in LIMITS and v is not None)
    return Numerics(
        changes=tuple(changes), unexpected=unexpected, fidelity=fidelity, limits=set_limits, problem=problem
    )


def check_numerics(winner: Any, *, accept: bool = False) -> Numerics | None:
    """``numerics_block(winner)``; raises ``NumericsRefused`` when it names a problem and ``accept`` is False."""
    block = numerics_block(winner)
    if block and block.problem and not accept:
        raise NumericsRefused(
            f"{block.problem}; deploy it anyway with --accept-numerics, or pick a trial with --trial N"
        )
    return replace(block, accepted=bool(block.problem) and accept) if block is not None else None
