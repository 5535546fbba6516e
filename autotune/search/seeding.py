"""What a sweep puts in the queue and what it recovers: the baseline and enqueued configs, the planner's
memory-edge starts, known outcomes, and trials a dead sweep left RUNNING (failed as interrupted, queued
again once). Also the bookkeeping the loop and the confirmation count trials with."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.results import OOM_STATUSES, PORT_TAKEN, REPEAT, WRITE_ERROR, TrialResult
from autotune.search.pruning import pruned
from autotune.search.space import key_of
from autotune.search.storage import dead_running, fail_stale, trial_handle, trial_id

INFEASIBLE = OOM_STATUSES | {"bad_args"}  # deterministic: the same config fails the same way
DUPLICATE = "duplicate"  # a later queued copy of a given config another trial runs: ended unrun
NOT_LAUNCHED = frozenset({"skipped_infeasible", REPEAT})  # recorded, but no server started: free of the budget
RUN_AGAIN = frozenset({None, "interrupted", WRITE_ERROR, PORT_TAKEN})  # failed, not by the config: not counted


# --- bookkeeping -------------------------------------------------------------------------------------------
def launched(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Finished trials that started a server: what the trial budget counts."""
    return [t for t in finished(trials) if t.user_attrs.get("status") not in NOT_LAUNCHED]


def launches(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that started a server, in every session of the study (what the summary reports): finished ones
    and those a stopped or killed sweep interrupted (their re-run is another launch). Not counted: configs the
    planner or a known outcome skipped, and configs the engine rejected before launching (``bad_args`` from a
    trial directory with no startup time), and configs already measured (``REPEAT``)."""
    out = []
    for t in trials:
        status = t.user_attrs.get("status")
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL) or status in NOT_LAUNCHED:
            continue
        result = TrialResult.of(t)
        if status == "bad_args" and result is not None and result.trial_dir and "startup" not in result.durations_s:
            continue
        out.append(t)
    return out


def launch_key(trial: FrozenTrial) -> str:
    """The config a trial launched (its stored launch key; older studies: the key of its result's config)."""
    key = trial.user_attrs.get("launch_key")
    result = TrialResult.of(trial)
    return key if key is not None else key_of(result.config if result is not None else {})


def unsettled(trial: FrozenTrial) -> bool:
    """Whether the trial's window reached its cap before the settle rule was met (``autotune.settle``): its figure
    is recorded and learnt from, but never crowned."""
    result = TrialResult.of(trial)
    return result is not None and result.measurement is not None and result.measurement.settled is False


def window_pruned(trial: FrozenTrial) -> bool:
    """Whether the trial's window was pruned (``pruning``: stopped clearly below the best so far): unsettled, and
    no contender nor a gain left unconfirmed."""
    result = TrialResult.of(trial)
    return pruned(result.measurement if result is not None else None)


def finished(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that count toward the target: everything done except interrupted ones, failed writes and ports
    another process took (they run again: none is the config's outcome). A FAIL without a status is one Optuna's
    heartbeat failed after its worker died: interrupted too. A port taken again on the run-again counts: a host
    where every pick races another process must still end its study."""
    return [t for t in trials if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and _counted(t))]


def _counted(trial: FrozenTrial) -> bool:
    """Whether a failed trial was the config's outcome (``RUN_AGAIN``: not), or a port taken on its run-again."""
    status = trial.user_attrs.get("status")
    return status not in RUN_AGAIN or (status == PORT_TAKEN and trial.user_attrs.get("requeued_from") is not None)


def _requeue(study: optuna.Study, trial: FrozenTrial, trials: list[FrozenTrial]) -> None:
    """Queue an interrupted trial's config again unless an earlier resume already did."""
    if trial.user_attrs.get("requeued_from") is not None:
        return  # interrupted twice: once is enough
    if any(t.user_attrs.get("requeued_from") == trial.number for t in trials):
        return
    attrs: dict[str, Any] = {k: trial.user_attrs[k] for k in ("role", "label", "config") if k in trial.user_attrs}
    study.enqueue_trial(trial.params, user_attrs={**attrs, "requeued_from": trial.number})


def _mark_interrupted(study: optuna.Study, trial: optuna.Trial | FrozenTrial, reason: str) -> None:
    handle = trial_handle(study, trial_id(trial))
    handle.set_user_attr("status", "interrupted")
    handle.set_user_attr("reason", reason)
    if "result" not in handle.user_attrs and "config" in handle.user_attrs:
        handle.set_user_attr(
            "result", TrialResult(status="interrupted", config=handle.user_attrs["config"], reason=reason).to_dict()
        )


def run_again(study: optuna.Study, trial: optuna.Trial, *, interrupted: str | None = None) -> None:
    """Queue the config of ``trial`` (still running) again, once: it was interrupted (``interrupted`` says why:
    marked so) or failed for the disk's or the host's sake, not the config's."""
    if interrupted is not None:
        _mark_interrupted(study, trial, interrupted)
    frozen = study.get_trials(deepcopy=False)
    _requeue(study, next(t for t in frozen if t.number == trial.number), frozen)


def recover(study: optuna.Study, state_dir: Path | None = None) -> list[int]:
    """Fail trials a dead sweep left RUNNING and queue their configs again; trials of live workers (this
    host's by pid, others' by heartbeat: ``storage.dead_running``) are left alone. Returns their numbers."""
    stale = dead_running(study, state_dir)
    for trial in stale:
        try:
            _mark_interrupted(study, trial, "the sweep process died during this trial")
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first
    fail_stale(study)  # other hosts' silent workers (SQL storages): failed and retried once by Optuna
    trials = study.get_trials(deepcopy=False)
    for trial in trials:
        if trial.state == TrialState.FAIL and trial.user_attrs.get("status") == "interrupted":
            _requeue(study, trial, trials)
    return [t.number for t in stale]


def seed_trials(study: optuna.Study, cfg: StudyConfig) -> None:
    """Enqueue the baseline (trial 0 of a new study) and the hand-written configs, once each."""
    present = {(t.user_attrs.get("role"), t.user_attrs.get("label")) for t in study.get_trials(deepcopy=False)}
    for role, label, config in cfg.given():
        if (role, label) not in present:
            params = {k: v for k, v in config.items() if k in cfg.space}
            study.enqueue_trial(params, user_attrs={"role": role, "label": label, "config": config})


def repeat_result(measured: FrozenTrial, launch: Mapping[str, Any], engine: str) -> TrialResult:
    """The record of a search proposal the study already measured: not launched, the earlier trial's figure stands."""
    earlier = TrialResult.of(measured)
    tok_s = (earlier.output_tok_s if earlier is not None else None) or 0.0
    return TrialResult(
        status=REPEAT,
        config=dict(launch),
        engine=engine,
        reason=f"trial {measured.number} measured this config ({tok_s:,.0f} tok/s); its figure "
        "stands, not launched again",
    )


def running_twin(trials: list[FrozenTrial], number: int, key: str) -> bool:
    """Whether an earlier trial than ``number`` is running this same config (on another worker) right now."""
    return any(
        t.state == TrialState.RUNNING and t.number < number and t.user_attrs.get("launch_key") == key for t in trials
    )


def claimed_by(trials: list[FrozenTrial], trial: optuna.Trial) -> FrozenTrial | None:
    """The earlier copy of a queued baseline or enqueued config that owns it, when ``trial`` (just taken from the
    queue) is a later copy: two nodes that seeded at once queue it twice, and the storage's claim of a queued trial
    is atomic, so the lowest-numbered live copy runs and every later one yields. A copy that ended interrupted (its
    requeue is the one to run) or was itself dropped owns nothing."""
    role, label = trial.user_attrs.get("role"), trial.user_attrs.get("label")
    if role not in ("baseline", "enqueued"):
        return None
    done = {t.number for t in finished(trials)}
    for t in sorted(trials, key=lambda t: t.number):
        if t.number >= trial.number:
            return None
        if (t.user_attrs.get("role"), t.user_attrs.get("label")) != (role, label):
            continue
        if t.state in (TrialState.WAITING, TrialState.RUNNING) or t.number in done:
            return t
    return None


def drop_duplicate(study: optuna.Study, trial: optuna.Trial, owner: FrozenTrial) -> None:
    """End a later queued copy unrun (``PRUNED``, status ``duplicate``): no launch, no figure, no budget."""
    trial.set_user_attr("status", DUPLICATE)
    trial.set_user_attr("reason", f"trial {owner.number} runs this {trial.user_attrs.get('role')} config")
    study.tell(trial, state=TrialState.PRUNED)


def measured_before(trials: list[FrozenTrial], key: str) -> FrozenTrial | None:
    """The trial that measured exactly this config (``ok``, the baseline's included): a search that proposes it
    again is told its figure instead of launching it (``REPEAT``)."""
    for t in sorted(trials, key=lambda t: t.number):
        if (
            t.state == TrialState.COMPLETE
            and t.user_attrs.get("launch_key") == key
            and t.user_attrs.get("status") == "ok"
            and t.user_attrs.get("reused_from") is None
        ):
            return t
    return None
