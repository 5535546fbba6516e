"""A config's worst case as a study records it: the stress phase's verdict (``confirmation["stress"]``, written by
``search.confirm.stress``) read back for every view — the sweep's summary, ``trials``, the report, and ``apply``,
which refuses a config not known to survive it unless told to (``--allow-unstressed``)."""

from __future__ import annotations

from typing import Any

from autotune.errors import StudyError
from autotune.harness.stress import StressResult, stress_line

ATTR = "stress"  # the confirmation's key for the stress phase


def passed(confirmation: dict[str, Any] | None, trial: int | None) -> StressResult | None:
    """The stress phase ``trial`` passed in this confirmation, or None (never stressed, or it failed)."""
    for run in ((confirmation or {}).get(ATTR) or {}).get("runs") or ():
        res = StressResult.from_dict(run.get("result"))
        if run.get("trial") == trial and res is not None and res.survived:
            return res
    return None


def stress_of(confirmation: dict[str, Any] | None, trial: int | None) -> dict[str, Any] | None:
    """The last stress record of ``trial`` (``{"trial", "status", "reason", "result"}``), None when never stressed."""
    runs = [r for r in ((confirmation or {}).get(ATTR) or {}).get("runs") or () if r.get("trial") == trial]
    return runs[-1] if runs else None


def worst_case_line(confirmation: dict[str, Any] | None, trial: int | None) -> str:
    """The one line every view prints for ``trial``: its stress verdict, or why it has none."""
    run = stress_of(confirmation, trial)
    if run is not None:
        line = stress_line(run.get("result"))
        if line is not None:
            return line
        return f"worst case: not measured ({run.get('reason') or run.get('status') or 'no stress phase ran'})"
    if not (confirmation or {}).get("complete"):
        return "worst case: not stressed (the stress phase runs after the confirmation; confirmation is off or unfinished)"
    return "worst case: not stressed"


class Unstressed(StudyError):
    """The config to deploy never passed the stress phase (failed it, or never ran it)."""


def worst_case_block(study_attrs: dict[str, Any], trial: int) -> dict[str, Any]:
    """What ``apply`` says and writes into ``provenance.json`` about ``trial`` of a study (its user attrs: the
    confirmation and the settings): ``{"line", "passed", "stress", "problem"}``, ``problem`` naming why it is not
    known to survive its worst case (None when it passed)."""
    confirmation, settings = study_attrs.get("confirmation") or {}, study_attrs.get("autotune") or {}
    run = stress_of(confirmation, trial)
    result = (run or {}).get("result")
    ok = passed(confirmation, trial) is not None
    problem = None
    if not ok:
        problem = _unstressed_why(confirmation, trial, run, settings)
    return {"line": worst_case_line(confirmation, trial), "passed": ok, "stress": result, "problem": problem}


def _unstressed_why(confirmation: dict[str, Any] | None, trial: int, run: dict[str, Any] | None,
                    settings: dict[str, Any]) -> str:
    conf = confirmation or {}
    if run is not None:
        return f"trial {trial} failed the stress phase ({worst_case_line(conf, trial)})"
    top_k = (settings.get("study") or {}).get("confirm_top_k")
    if top_k == 0:
        return (f"trial {trial} never ran the stress phase: it runs in the confirmation, which this study turns off "
                "([study] confirm_top_k = 0); set confirm_top_k = 1 or more and re-run autotune sweep")
    if conf.get("winner_trial") not in (None, trial):
        return (f"trial {trial} never ran the stress phase (only the confirmed winner, and a runner-up tied with it, "
                f"are stressed; the winner is trial {conf.get('winner_trial')})")
    return (f"trial {trial} never ran the stress phase (the study's confirmation did not reach it, or predates it); "
            "re-run autotune sweep to stress it")


def check_stressed(block: dict[str, Any], *, allow: bool = False) -> None:
    """Raise ``Unstressed`` for a config not known to survive its worst case, unless ``allow``."""
    if block.get("problem") and not allow:
        raise Unstressed(f"{block['problem']}; deploy it anyway with --allow-unstressed")
