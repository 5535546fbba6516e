"""The worst case before the crown: after the confirmation decides, its winner (and a runner-up it could not
separate from it) runs the stress phase (``harness.stress``); a config whose server dies there is demoted with
its reason, the confirmation is decided again without it, and the new winner is stressed, ``STRESS_MAX`` launches
at most.

The top two's last launch of the confirmation's second stage already ran the stress phase after its windows
(``stages.stressed_in``): a contender due for stress that has one is read from there, costing no launch. Any other
is a dedicated launch of the config (``runner.repeat`` with the ``StressStep`` after its window, filed as one more
confirmation run of the trial): its window is recorded with it but does not join the confirmation's runs, so the
decision reads the same runs it was made on. Everything lands in ``confirmation["stress"]`` as it
happens (``{"runs": [{"trial", "repeat", "status", "reason", "result"}], "demoted": [{"trial", "reason"}],
"decided_trial", "complete"}``), so a sweep killed mid-stress resumes without redoing a finished one. Every
stress phase a confirmation launch ran is recorded there too, winner or not (``_record_the_rest``: ``apply --trial
N`` reads it); the readers (``stress_of``, ``passed``) read a confirmation launch's own stress phase where a study
stored before that lacks the record.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import optuna

from autotune.config import StudyConfig
from autotune.harness.stress import StressStep, stress_line
from autotune.results import StressResult, TrialResult
from autotune.search.confirm.decision import Verdict, decide
from autotune.search.runner import Runner
from autotune.search.seeding import launch_key

ATTR = "stress"  # the confirmation's key for the stress phase
STRESS_MAX = 3  # stress launches of their own at most: the winner, a tied runner-up, one more after a demotion


def stress_winner(study: optuna.Study, cfg: StudyConfig, confirmation: dict[str, Any] | None, *, runner: Runner,
                  progress: Any = None, stop_event: threading.Event | None = None) -> dict[str, Any] | None:
    """Stress the confirmed winner (and a tied runner-up), demoting a failure; returns the confirmation as stored
    (the winner changed where one was demoted), or None when interrupted (a resume goes on from what is stored)."""
    if not confirmation or not confirmation.get("complete"):
        return confirmation
    state = dict(confirmation.get(ATTR) or {})
    state.setdefault("runs", [])
    state.setdefault("demoted", [])
    state.setdefault("decided_trial", _winner(confirmation))
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    if state.get("complete"):  # a confirmation decided again on resume still excludes what the stress demoted
        redecided = _redecided(confirmation, state, trials, cfg)
        if _record_the_rest(confirmation, state):  # a study stored before every stress phase was recorded
            return _save(study, redecided, state)
        return redecided if redecided is confirmation else _save(study, redecided, state)
    while True:
        confirmation = _redecided(confirmation, state, trials, cfg)
        due = [n for n in _to_stress(confirmation) if stress_of({ATTR: state}, n) is None]
        shared = {n: run for n in due if (run := _from_confirmation(confirmation, n)) is not None}
        room = STRESS_MAX - _launches(state)
        if _winner(confirmation) is None or not due or (room <= 0 and not shared):
            break
        for n in [n for n in due if n in shared] + [n for n in due if n not in shared][:max(0, room)]:
            if stop_event is not None and stop_event.is_set():
                return _save(study, confirmation, state, interrupted=True)
            run = shared.get(n) or _stress_one(runner, trials[n], n, confirmation, progress)
            if run is None:  # interrupted: nothing recorded, a resume runs it again
                return _save(study, confirmation, state, interrupted=True)
            state["runs"].append(run)
            if _failed(run):  # its server died under the worst case: demoted, the confirmation decided again
                state["demoted"].append({"trial": n, "reason": worst_case_line({ATTR: state}, n)})
            _save(study, confirmation, state)
    _record_the_rest(confirmation, state)
    state["complete"] = True
    return _save(study, confirmation, state)


def _record_the_rest(confirmation: dict[str, Any], state: dict[str, Any]) -> bool:
    """Record every stress phase a confirmation launch ran that the record lacks, winner or not (no winner, a
    runner-up the decision did not need stressed): ``apply --trial N`` reads them. Recorded only, never demoting:
    the verdict stands on what was due. Whether any was added."""
    recorded = {run.get("trial") for run in state["runs"]}
    trials = dict.fromkeys(r.get("trial") for r in confirmation.get("runs") or ())
    extra = [run for n in trials if n not in recorded and (run := _from_confirmation(confirmation, n)) is not None]
    state["runs"].extend(extra)
    return bool(extra)


def _launches(state: dict[str, Any]) -> int:
    """The stress launches of their own so far (a stress phase run inside a confirmation launch is not one)."""
    return sum(1 for run in state["runs"] if not run.get("in_confirmation"))


def _from_confirmation(confirmation: Mapping[str, Any], number: int) -> dict[str, Any] | None:
    """Trial ``number``'s stress phase as its confirmation launch ran it after the windows (``stages.stressed_in``),
    as a stress record; None when none of its confirmation launches ran one."""
    for run in reversed(confirmation.get("runs") or ()):
        result = run.get("result") or {}
        stress = StressResult.from_dict(result.get("stress"))
        if run.get("trial") == number and stress is not None and not stress.interrupted:
            return {"trial": number, "repeat": run.get("repeat"), "status": result.get("status"), "reason": None,
                    "result": stress.to_dict(), "trial_dir": result.get("trial_dir"), "in_confirmation": True}
    return None


def _winner(confirmation: dict[str, Any]) -> int | None:
    verdict = Verdict.from_dict(confirmation)
    return verdict.winner_trial if verdict is not None else None


def _to_stress(confirmation: dict[str, Any]) -> list[int]:
    """The winner, and the runner-up when the confirmation could not separate them (a tie)."""
    verdict = Verdict.from_dict(confirmation) or Verdict(outcome="none")
    winner, runner_up = verdict.winner_trial, verdict.runner_up_trial
    out = [winner] if winner is not None else []
    if runner_up is not None and not verdict.resolved and runner_up not in (winner, verdict.baseline_trial):
        out.append(runner_up)
    return out


def _failed(run: dict[str, Any]) -> bool:
    """The server died under the stress phase (a launch with no stress phase at all is not stressed, not failed)."""
    res = StressResult.from_dict(run.get("result"))
    return res is not None and not res.survived


def _stress_one(runner: Runner, trial: optuna.trial.FrozenTrial, number: int, confirmation: dict[str, Any],
                progress: Any) -> dict[str, Any] | None:
    """One stress launch of trial ``number``; its record, or None when the launch was interrupted."""
    stored = TrialResult.of(trial)
    config = dict(stored.config) if stored is not None else {}
    k = sum(1 for r in confirmation.get("runs") or () if r.get("trial") == number)
    if progress is not None and hasattr(progress, "log"):
        progress.log(f"stress: trial {number}: the sample's longest prompts, max_tokens, the full running cap at once")
    step = StressStep(plan=stored.plan if stored is not None else None)
    repeat = getattr(runner, "repeat", None)
    if not callable(repeat):  # a plain runner cannot run follow-up steps: nothing to stress with
        return {"trial": number, "repeat": k, "status": "not_run", "result": None,
                "reason": "this study's runner runs no follow-up steps"}
    result: TrialResult = repeat(config, number, k, after=[step])
    if result.status == "interrupted":
        return None
    stress = result.stress
    if stress is not None and stress.interrupted:
        return None
    reason = None if stress is not None else (
        f"its stress launch ended before the stress phase: {result.status}" + (f": {result.reason}" if result.reason
                                                                                else ""))
    run = {"trial": number, "repeat": k, "status": result.status, "reason": reason,
           "result": stress.to_dict() if stress is not None else None, "trial_dir": result.trial_dir,
           **_cost(result)}
    if stress is None and result.status in ("runtime_oom", "startup_oom", "crash", "timeout"):
        # the launch died before its stress phase could start: as much a failure of the config under load
        run["result"] = StressResult(survived=False, failure=result.status, reason=result.reason,
                                     ended="server exited").to_dict()
    if progress is not None and hasattr(progress, "log"):
        progress.log(f"stress: trial {number}: {worst_case_line({ATTR: {'runs': [run]}}, number)}")
    return run


def _cost(result: TrialResult) -> dict[str, Any]:
    """What the study's bill reads of a launch kept apart from the confirmation's runs (``views.spend``)."""
    return {"durations_s": dict(result.durations_s), "modelled_startup_s": result.modelled_startup_s,
            "gpus": result.gpus}


def _redecided(confirmation: dict[str, Any], state: dict[str, Any], trials: dict[int, Any],
               cfg: StudyConfig) -> dict[str, Any]:
    """The confirmation decided again from its own runs, the demoted trials barred from winning (``decide``'s
    ``demoted``: their reasons join the note); as stored when none is demoted."""
    demoted = {d["trial"]: d["reason"] for d in state.get("demoted") or ()}
    if not demoted:
        return confirmation
    order = list(confirmation.get("order") or ())
    base = confirmation.get("baseline_trial")  # as stored: a confirmation decided before a verdict had none
    base_key = launch_key(trials[base]) if base in trials else None
    twins = [n for n in order if base_key is not None and n in trials and launch_key(trials[n]) == base_key]
    verdict = decide(list(confirmation.get("runs") or ()), order, base, same_as_baseline=twins,
                     resolution=cfg.study.resolution, demoted=demoted, given=confirmation.get("given") or ())
    return {**confirmation, **verdict.to_dict()}


def _save(study: optuna.Study, confirmation: dict[str, Any], state: dict[str, Any], *,
          interrupted: bool = False) -> dict[str, Any] | None:
    stored = {**confirmation, ATTR: state}
    study.set_user_attr("confirmation", stored)
    return None if interrupted else stored


# --- the stress record read back (every view prints ``worst_case_line``) ---------------------------------------
def passed(confirmation: Mapping[str, Any] | None, trial: int | None) -> StressResult | None:
    """The stress phase ``trial`` passed in this confirmation, or None (never stressed, or it failed)."""
    runs = [r for r in ((confirmation or {}).get(ATTR) or {}).get("runs") or () if r.get("trial") == trial]
    for run in runs or [stress_of(confirmation, trial) or {}]:
        res = StressResult.from_dict(run.get("result"))
        if res is not None and res.survived:
            return res
    return None


def stress_of(confirmation: Mapping[str, Any] | None, trial: int | None) -> Mapping[str, Any] | None:
    """The last stress record of ``trial`` (``{"trial", "status", "reason", "result"}``), None when never stressed;
    a stress phase its confirmation launch ran counts though the record lacks it (a study stored before every one
    was recorded: ``_record_the_rest``)."""
    runs = [r for r in ((confirmation or {}).get(ATTR) or {}).get("runs") or () if r.get("trial") == trial]
    if runs:
        return runs[-1]
    return _from_confirmation(confirmation, trial) if confirmation and trial is not None else None


def worst_case_line(confirmation: Mapping[str, Any] | None, trial: int | None) -> str:
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
