"""A config's worst case as a study records it: the stress phase's verdict (the confirmation's ``stress`` record,
written and read back by ``search.confirm.stress``) for every view — the sweep's summary, ``trials``, the report,
and ``apply``, which refuses a config not known to survive it unless told to (``--allow-unstressed``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotune.errors import StudyError
from autotune.results import StressResult
from autotune.search.confirm.record import Confirmation, StressRun
from autotune.search.confirm.stress import passed, stress_of, worst_case_line

__all__ = ["Unstressed", "WorstCase", "check_stressed", "passed", "stress_of", "worst_case_block", "worst_case_line"]


class Unstressed(StudyError):
    """The config to deploy never passed the stress phase (failed it, or never ran it)."""


@dataclass(frozen=True, kw_only=True)
class WorstCase:
    """What ``apply`` says and writes into ``provenance.json`` (as its ``asdict``) about a config's worst case: the
    line, whether it passed the stress phase, that phase's verdict, and why it is not known to survive (None when
    it passed)."""

    line: str
    passed: bool
    stress: StressResult | None
    problem: str | None


def worst_case_block(study_attrs: Mapping[str, Any], trial: int) -> WorstCase:
    """The worst case of ``trial`` of a study (its user attrs: the confirmation and the settings)."""
    confirmation, settings = Confirmation.of(study_attrs), study_attrs.get("autotune") or {}
    run = stress_of(confirmation, trial)
    ok = passed(confirmation, trial) is not None
    problem = None
    if not ok:
        problem = _unstressed_why(confirmation, trial, run, settings)
    return WorstCase(
        line=worst_case_line(confirmation, trial),
        passed=ok,
        problem=problem,
        stress=run.result if run is not None else None,
    )


def _unstressed_why(
    confirmation: Confirmation | None, trial: int, run: StressRun | None, settings: Mapping[str, Any]
) -> str:
    if run is not None:
        return f"trial {trial} failed the stress phase ({worst_case_line(confirmation, trial)})"
    top_k = (settings.get("study") or {}).get("confirm_top_k")
    if top_k == 0:
        return (
            f"trial {trial} never ran the stress phase: it runs in the confirmation, which this study turns off "
            "([study] confirm_top_k = 0); set confirm_top_k = 1 or more and re-run autotune sweep"
        )
    verdict = confirmation.verdict if confirmation is not None else None
    winner = verdict.winner_trial if verdict is not None else None
    if winner not in (None, trial):
        return (
            f"trial {trial} never ran the stress phase (only the confirmed winner, and a runner-up tied with it, "
            f"are stressed; the winner is trial {winner})"
        )
    return (
        f"trial {trial} never ran the stress phase (the study's confirmation did not reach it, or predates it); "
        "re-run autotune sweep to stress it"
    )


def check_stressed(block: WorstCase, *, allow: bool = False) -> None:
    """Raise ``Unstressed`` for a config not known to survive its worst case, unless ``allow``."""
    if block.problem and not allow:
        raise Unstressed(f"{block.problem}; deploy it anyway with --allow-unstressed")
