"""The worst case before the crown: the confirmation's winner (and a runner-up it could not separate from it) runs
the stress phase, read from its last confirmation launch where that ran it, else one more launch; a config whose
server dies there is demoted and the confirmation decided again, ``STRESS_MAX`` launches at most, each recorded as it
happens. docs/search.md ("The worst case before the crown").
"""

from __future__ import annotations

import dataclasses
import threading

import optuna

from autotune.config import StudyConfig
from autotune.harness.stress import StressStep, stress_line
from autotune.results import StressResult, TrialResult
from autotune.search.confirm.decision import Verdict, decide
from autotune.search.confirm.record import Confirmation, Demotion, LaunchCost, StressRecord, StressRun
from autotune.search.confirm.samples import search_rates
from autotune.search.runner import RepeatingRunner, Runner
from autotune.search.seeding import launch_key

STRESS_MAX = 3  # stress launches of their own at most: the winner, a tied runner-up, one more after a demotion


def stress_winner(
    study: optuna.Study,
    cfg: StudyConfig,
    confirmation: Confirmation | None,
    *,
    runner: Runner,
    progress: object = None,
    stop_event: threading.Event | None = None,
) -> Confirmation | None:
    """Stress the confirmed winner (and a tied runner-up), demoting a failure; returns the confirmation as stored
    (the winner changed where one was demoted), or None when interrupted (a resume goes on from what is stored)."""
    if confirmation is None or not confirmation.complete:
        return confirmation
    stored = confirmation.stress or StressRecord()
    state = dataclasses.replace(
        stored, decided_trial=stored.decided_trial if confirmation.stress is not None else _winner(confirmation)
    )
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    if state.complete:  # a confirmation decided again on resume still excludes what the stress demoted
        redecided = _redecided(confirmation, state, trials, cfg)
        rest = _record_the_rest(confirmation, state)
        if rest is not state:  # a study stored before every stress phase was recorded
            return _save(study, redecided, rest)
        return redecided if redecided is confirmation else _save(study, redecided, state)
    while True:
        confirmation = _redecided(confirmation, state, trials, cfg)
        due = [n for n in _to_stress(confirmation) if not state.of(n)]
        shared = {n: run for n in due if (run := _from_confirmation(confirmation, n)) is not None}
        room = STRESS_MAX - _launches(state)
        if _winner(confirmation) is None or not due or (room <= 0 and not shared):
            break
        for n in [n for n in due if n in shared] + [n for n in due if n not in shared][: max(0, room)]:
            if stop_event is not None and stop_event.is_set():
                return _save(study, confirmation, state, interrupted=True)
            run = shared.get(n) or _stress_one(runner, trials[n], n, confirmation, progress)
            if run is None:  # interrupted: nothing recorded, a resume runs it again
                return _save(study, confirmation, state, interrupted=True)
            state = dataclasses.replace(state, runs=(*state.runs, run))
            if run.failed:  # its server died under the worst case: demoted, the confirmation decided again
                state = dataclasses.replace(state, demoted=(*state.demoted, Demotion(n, _line(run))))
            _save(study, confirmation, state)
    state = dataclasses.replace(_record_the_rest(confirmation, state), complete=True)
    return _save(study, confirmation, state)


def _record_the_rest(confirmation: Confirmation, state: StressRecord) -> StressRecord:
    """Record every stress phase a confirmation launch ran that the record lacks, winner or not (no winner, a
    runner-up the decision did not need stressed): ``apply --trial N`` reads them. Recorded only, never demoting:
    the verdict stands on what was due. ``state`` itself when none was added."""
    recorded = {run.trial for run in state.runs}
    trials = dict.fromkeys(r.trial for r in confirmation.runs)
    extra = [run for n in trials if n not in recorded and (run := _from_confirmation(confirmation, n)) is not None]
    return dataclasses.replace(state, runs=(*state.runs, *extra)) if extra else state


def _launches(state: StressRecord) -> int:
    """The stress launches of their own so far (a stress phase run inside a confirmation launch is not one)."""
    return sum(1 for run in state.runs if not run.in_confirmation)


def _from_confirmation(confirmation: Confirmation, number: int) -> StressRun | None:
    """Trial ``number``'s stress phase as its confirmation launch ran it after the windows (``stages.stressed_in``),
    as a stress record; None when none of its confirmation launches ran one."""
    for run in reversed(confirmation.runs):
        stress = run.result.stress
        if run.trial == number and stress is not None and not stress.interrupted:
            return StressRun(
                trial=number,
                repeat=run.repeat,
                status=run.result.status,
                result=stress,
                trial_dir=run.result.trial_dir,
                in_confirmation=True,
            )
    return None


def _winner(confirmation: Confirmation) -> int | None:
    return confirmation.verdict.winner_trial if confirmation.verdict is not None else None


def _to_stress(confirmation: Confirmation) -> list[int]:
    """The winner, and the runner-up when the confirmation could not separate them (a tie)."""
    verdict = confirmation.verdict or Verdict(outcome="none")
    winner, runner_up = verdict.winner_trial, verdict.runner_up_trial
    out = [winner] if winner is not None else []
    if runner_up is not None and not verdict.resolved and runner_up not in (winner, verdict.baseline_trial):
        out.append(runner_up)
    return out


def _stress_one(
    runner: Runner, trial: optuna.trial.FrozenTrial, number: int, confirmation: Confirmation, progress: object
) -> StressRun | None:
    """One stress launch of trial ``number``; its record, or None when the launch was interrupted."""
    stored = TrialResult.of(trial)
    config = dict(stored.config) if stored is not None else {}
    k = len(confirmation.runs_of(number))
    log = getattr(progress, "log", None)
    if log is not None:
        log(f"stress: trial {number}: the sample's longest prompts, max_tokens, the full running cap at once")
    step = StressStep(plan=stored.plan if stored is not None else None)
    if not isinstance(runner, RepeatingRunner):  # a plain runner cannot run follow-up steps: nothing to stress with
        return StressRun(trial=number, repeat=k, status="not_run", reason="this study's runner runs no follow-up steps")
    result = runner.repeat(config, number, k, after=[step])
    if result.status == "interrupted":
        return None
    stress = result.stress
    if stress is not None and stress.interrupted:
        return None
    reason = (
        None
        if stress is not None
        else (
            f"its stress launch ended before the stress phase: {result.status}"
            + (f": {result.reason}" if result.reason else "")
        )
    )
    if stress is None and result.status in ("runtime_oom", "startup_oom", "crash", "timeout"):
        # the launch died before its stress phase could start: as much a failure of the config under load
        stress = StressResult(survived=False, failure=result.status, reason=result.reason, ended="server exited")
    run = StressRun(
        trial=number,
        repeat=k,
        status=result.status,
        reason=reason,
        result=stress,
        trial_dir=result.trial_dir,
        cost=LaunchCost.of(result),
    )
    if log is not None:
        log(f"stress: trial {number}: {_line(run)}")
    return run


def _redecided(
    confirmation: Confirmation, state: StressRecord, trials: dict[int, optuna.trial.FrozenTrial], cfg: StudyConfig
) -> Confirmation:
    """The confirmation decided again from its own runs, the demoted trials barred from winning (``decide``'s
    ``demoted``: their reasons join the note); as stored when none is demoted."""
    demoted = {d.trial: d.reason for d in state.demoted}
    if not demoted:
        return confirmation
    order = list(confirmation.order)
    # as stored: a confirmation decided before a verdict had none
    base = confirmation.verdict.baseline_trial if confirmation.verdict is not None else None
    base_key = launch_key(trials[base]) if base in trials else None
    twins = [n for n in order if base_key is not None and n in trials and launch_key(trials[n]) == base_key]
    searched = search_rates({n: TrialResult.of(trials[n]) for n in order if n in trials})
    verdict = decide(
        confirmation.runs,
        order,
        base,
        same_as_baseline=twins,
        resolution=cfg.study.resolution,
        demoted=demoted,
        given=confirmation.given,
        searched=searched,
    )
    return dataclasses.replace(confirmation, verdict=verdict)


def _save(
    study: optuna.Study, confirmation: Confirmation, state: StressRecord, *, interrupted: bool = False
) -> Confirmation | None:
    stored = dataclasses.replace(confirmation, stress=state).store(study)
    return None if interrupted else stored


# --- the stress record read back (every view prints ``worst_case_line``) ---------------------------------------
def passed(confirmation: Confirmation | None, trial: int | None) -> StressResult | None:
    """The stress phase ``trial`` passed in this confirmation, or None (never stressed, or it failed)."""
    runs = (confirmation.stress or StressRecord()).of(trial) if confirmation is not None else ()
    last = stress_of(confirmation, trial)
    for run in runs or ([last] if last is not None else []):
        if run.result is not None and run.result.survived:
            return run.result
    return None


def stress_of(confirmation: Confirmation | None, trial: int | None) -> StressRun | None:
    """The last stress record of ``trial``, None when never stressed; a stress phase its confirmation launch ran
    counts though the record lacks it (a study stored before every one was recorded: ``_record_the_rest``)."""
    if confirmation is None or trial is None:
        return None
    runs = (confirmation.stress or StressRecord()).of(trial)
    return runs[-1] if runs else _from_confirmation(confirmation, trial)


def worst_case_line(confirmation: Confirmation | None, trial: int | None) -> str:
    """The one line every view prints for ``trial``: its stress verdict, or why it has none."""
    run = stress_of(confirmation, trial)
    if run is not None:
        return _line(run)
    if confirmation is None or not confirmation.complete:
        return (
            "worst case: not stressed (the stress phase runs after the confirmation; confirmation is off or unfinished)"
        )
    return "worst case: not stressed"


def _line(run: StressRun) -> str:
    """A stress record's line: its verdict, or why it has none."""
    line = stress_line(run.result)
    if line is not None:
        return line
    return f"worst case: not measured ({run.reason or run.status or 'no stress phase ran'})"
