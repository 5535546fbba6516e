"""The fidelity probe's figures as a trial stores them (``FidelityFigures``, filled by ``harness.fidelity``) and
the short lines tables, progress and reports say them in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autotune.results.stored import Sparse


@dataclass(frozen=True, kw_only=True)
class FidelityFigures(Sparse):
    """The fidelity probe's figures (``harness.fidelity``): greedy outputs of fixed prompts against the study's
    reference config. ``role``: "probe" (compared), "reference" (the run that recorded it)."""

    role: str | None = None
    prompts: int | None = None
    tokens: int | None = None
    duration_s: float | None = None
    reference: Mapping[str, Any] | None = None  # where the reference is kept: path, sha256, trial
    changes: tuple[Mapping[str, Any], ...] = ()  # the output-changing flags against the reference: {flag, value, …}
    prefix_match_mean: float | None = None
    prefix_match_min: int | None = None
    exact_share: float | None = None
    mean_abs_logprob_delta: float | None = None
    scored_tokens: int | None = None
    first_difference: tuple[int | None, ...] | None = None
    outputs_differ: bool | None = None
    unexpected: bool | None = None  # outputs differ though no output-changing flag did (``harness.fidelity.verdict``)
    differs: tuple[Mapping[str, Any], ...] = ()  # every flag set differently from the reference: {flag, value, …}
    error: str | None = None  # why the probe could not measure

    @property
    def probed(self) -> bool:
        return self.role == "probe"


def fidelity_summary(fidelity: FidelityFigures | None) -> str:
    """One short line for a trial's fidelity figures (tables, progress): "" when the trial changed no
    output-changing flag, "reference" on the run that recorded the reference outputs."""
    if not fidelity:
        return ""
    if fidelity.error:
        return "probe failed"
    if fidelity.role == "reference":
        return "reference"
    if fidelity.outputs_differ is False and not fidelity.changes:
        return "same as baseline"
    figures = _probe_figures(fidelity)
    # no output-changing flag explains the difference: the contender probe's catch (``harness.fidelity.verdict``)
    return f"changed unexpectedly · {figures}" if fidelity.unexpected else figures


def _probe_figures(fidelity: FidelityFigures) -> str:
    prefix, exact, delta = fidelity.prefix_match_mean, fidelity.exact_share, fidelity.mean_abs_logprob_delta
    parts = []
    if prefix is not None:
        parts.append(f"{prefix:.0f}/{fidelity.tokens} match")
    if exact is not None:
        parts.append(f"{exact:.0%} exact")
    if delta is not None:
        parts.append(f"|Δlp| {delta:.3f}")
    return " · ".join(parts) or "probed"


def flag_list(entries: Iterable[Mapping[str, Any]], *, unset: bool = False) -> str:
    """``--flag value, …`` of ``{flag, value}`` entries (``unset``: a None value reads "unset")."""
    return ", ".join(
        f"--{str(d.get('flag', '')).replace('_', '-')} "
        f"{'unset' if unset and d.get('value') is None else d.get('value')}"
        for d in entries
    )


def differing_flags(fidelity: FidelityFigures | None) -> str:
    """``--flag value, …``: the flags a contender probe found its config setting differently from the baseline."""
    return flag_list(fidelity.differs if fidelity else (), unset=True) or "no flag"


def numerics_line(fidelity: FidelityFigures | None) -> str | None:
    """ "outputs differ from the baseline (--flag value, …): <probe figures>" for a config whose probe measured an
    output-changing flag, "outputs changed unexpectedly (…)" for one whose outputs differ though none changed; None
    when its outputs matched or cannot differ (or no probe ran)."""
    if not fidelity or not fidelity.probed:
        return None
    if fidelity.unexpected:  # the contender probe: outputs differ though no table flag changed
        return (
            f"outputs changed unexpectedly (it differs from the baseline in {differing_flags(fidelity)}, none of "
            f"them a flag known to change outputs): {_probe_figures(fidelity)}"
        )
    if not fidelity.changes:  # the baseline's numerics: matched (nothing to say), or the check failed
        return f"outputs not checked against the baseline: {fidelity.error}" if fidelity.error else None
    flags = flag_list(fidelity.changes)
    return f"outputs differ from the baseline ({flags or 'output-changing flags'}): {fidelity_summary(fidelity)}"
