"""The Optuna loop: baseline and enqueued configs first, then the sampler; planner pre-check; resume.

Every outcome is data (an OOM a completed trial with a violated constraint, a crash a failed one), and the study is
written after every step, so a sweep killed at any moment resumes: docs/search.md ("Nothing is lost"), the
statuses in docs/contracts.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.config.pool import sweep_gpus
from autotune.errors import DiskError, GpuBusyError
from autotune.launch.gpulocks import hold_sweep_gpus
from autotune.launch.groups import group_label
from autotune.progress import PlainProgress
from autotune.results import PORT_TAKEN, REPEAT, WRITE_ERROR, TrialResult
from autotune.search.correction import CorrectedFeasibility, known_failure, replay, skip_was_wrong
from autotune.search.edges import EdgeStarts
from autotune.search.numerics import record_reference
from autotune.search.objective import make_sampler, objective_values, open_study
from autotune.search.preflight import check_given
from autotune.search.runner import DeviceCheck, Runner, SweepRunner, sweep_runner
from autotune.search.seeding import (
    INFEASIBLE,
    claimed_by,
    drop_duplicate,
    finished,
    launched,
    measured_before,
    recover,
    repeat_result,
    run_again,
    running_twin,
    seed_trials,
)
from autotune.search.signals import sigint_stops
from autotune.search.skips import skip_reason
from autotune.search.space import Space, config_diff, key_of
from autotune.search.stopping import Patience, stopped_early
from autotune.search.storage import Liveness, node_lock, storage_file
from autotune.search.storage.diskguard import Ballast, Room, disk_error, starved
from autotune.search.wall import FRACTION, PLACED_ATTR, Wall
from autotune.search.warm import record_of, warm_config, warm_planner
from autotune.sglang.parallel import group_line, server_gpus

POLL_S = 1.0  # how often a sweep whose remaining trials run elsewhere looks again
MAX_ASKS_PER_LAUNCH = 10

optuna.logging.set_verbosity(optuna.logging.WARNING)


# --- what the sweep holds --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchParts:
    """What a sweep searches with: its study, the space as the study file gives it and the planner (None: none).
    ``of`` opens the study file's; a benchmark passes its own (an in-memory study, another planner)."""

    study: optuna.Study
    space: Space
    feasibility: CorrectedFeasibility | None

    @classmethod
    def of(cls, cfg: StudyConfig, *, study: optuna.Study | None = None) -> SearchParts:
        """The study file's parts (``study``: another study than the one its storage holds)."""
        return cls(study or open_study(cfg), Space.from_config(cfg), CorrectedFeasibility.from_config(cfg))


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` settles before the first ask, read by the loop and never changed after."""

    space: Space  # without the flags the planner finds inert and the memory fraction the wall places
    wall: Wall | None  # where the memory fraction leaves the sampler
    edges: EdgeStarts  # the memory-edge starts, placed one at a time once the baseline has run
    liveness: Liveness  # this worker's claim on its running trial
    room: Room  # free space against what the study will write


@dataclass
class InFlight:
    """The trial between ask and tell (``run_one``'s): failed as ``write_error`` if a write fails."""

    trial: optuna.Trial | None = None
    tenant: str | None = None  # why it OOMed because of another process
    disk: DiskError | None = None  # the write that failed in it


# --- the loop ----------------------------------------------------------------------------------------------
class Sweep:
    """One sweep over a study: what it is given (``parts``, its runner), what ``prepare`` settles (``ready``),
    the trial in flight (``flight``), and what ``close`` releases (``held``)."""

    def __init__(
        self,
        cfg: StudyConfig,
        *,
        runner: Runner | None = None,
        progress: Any = None,
        stop_event: threading.Event | None = None,
        device_check: DeviceCheck | None = None,
        shared: int | None = None,
        run_dir: Path | None = None,
        parts: SearchParts | None = None,
    ):
        self.cfg = cfg
        # ``shared``: this worker's number among workers sharing the pool ``[engine] gpus`` through the GPU locks
        # (its sweep lock is its slot; the supervisor holds the pool's); None: this sweep has the pool to itself.
        self.shared = shared
        self.gpus = sweep_gpus(cfg)
        self.progress = progress or PlainProgress()
        self.stop = stop_event or threading.Event()
        self.parts = parts or SearchParts.of(cfg)
        # ``device_check``: a given runner's GPU pre-check; the harness checks each launch's own group
        self.runner: SweepRunner = sweep_runner(
            cfg,
            runner,
            check=device_check,
            stop_event=self.stop,
            progress=self.progress,
            study=self.study,
            run_dir=run_dir,
        )
        self.state_dir = cfg.work_dir / "workers"  # heartbeat files and the node's ask lock
        self.db_path = storage_file(cfg.storage_url, cfg.base_dir)
        self.ballast = Ballast(self.db_path)  # room to fail the trial in flight when the database's disk fills
        self.ready: Prepared | None = None
        self.flight = InFlight()
        self.held = contextlib.ExitStack()  # the GPU locks, the reserve file, the heartbeat

    @property
    def study(self) -> optuna.Study:
        return self.parts.study

    @property
    def feasibility(self) -> CorrectedFeasibility | None:
        return self.parts.feasibility

    @property
    def plan(self) -> Prepared:
        assert self.ready is not None, "prepare() first"
        return self.ready

    def _lock(self) -> None:
        """One sweep per GPU of a study at a time (two servers on one GPU would skew both): a lock file per GPU of
        its pool, all taken or none, so sweeps on overlapping GPUs refuse and sweeps on disjoint ones (or other
        nodes) share the study: a live worker's trials are never failed as stale. Workers sharing one pool hold
        their slot; their supervisor holds the pool's GPUs (``hold_sweep_gpus``)."""
        if self.shared is not None:
            names = [f"{group_label(self.gpus)}-worker{self.shared}"]
        else:
            names = [str(g) for g in self.gpus]
        for lock in hold_sweep_gpus(self.cfg, names):
            self.held.enter_context(lock)

    def _busy_line(self, gpus: tuple[int, ...]) -> str:
        return f"{group_line(gpus)} {'is' if len(gpus) == 1 else 'are'} busy"

    def prepare(self) -> Prepared:
        warm = record_of(self.study)  # started from an earlier study (``--from``): its configs and corrections
        cfg = warm_config(self.cfg, warm)  # with its configs enqueued: checked and seeded, not searched otherwise
        study, feasibility, space = self.study, self.feasibility, self.parts.space
        check_given(cfg, engine=self.runner.engine, feasibility=feasibility)  # SGLang refuses it: one line, no launch
        self._lock()
        study.set_user_attr("autotune", cfg.to_dict())
        self.runner.start()  # orphans stopped, the GPUs checked: GpuBusyError before anything is queued or launched
        trials_dir = self.runner.folder or cfg.work_dir / "trials"  # where its trials write
        self.ballast.place()
        self.held.callback(self.ballast.release)
        # Named by the GPUs its baseline runs on, as its trials' results name theirs (the per-GPU calibration).
        home = self.gpus[: server_gpus(cfg.baseline_config())]
        label = group_label(home) + (f"/worker{self.shared}" if self.shared is not None else "")
        liveness = Liveness(
            study, gpu=label if len(home) > 1 or self.shared is not None else home[0], state_dir=self.state_dir
        )
        self.held.callback(liveness.close)
        if feasibility is not None:
            warm_planner(feasibility, warm)
            replay(feasibility, finished(study.get_trials(deepcopy=False)))
            inert = feasibility.inert_everywhere(space, cfg.given_configs())
            for name, why in inert.items():
                self.progress.log(f"not searching {name}: {why}")
            space = space.without(set(inert))
        with node_lock(self.state_dir):  # workers starting together seed the queue once
            self._recover()
            seed_trials(study, cfg)
        # edge starts are placed one at a time once the baseline has run (edges.py), not queued here; they keep the
        # whole space: they choose their memory fraction with their running cap
        edges = EdgeStarts(cfg, space, feasibility)
        # the sampler's proposals at the highest memory fraction the planner expects to start (``wall``)
        wall = Wall.of(cfg, space, feasibility)
        if wall is not None:
            space = space.without({FRACTION})
            study.set_user_attr(PLACED_ATTR, [FRACTION])
        study.sampler = make_sampler(cfg, salt=len(study.get_trials(deepcopy=False)))
        room = Room(trials_dir, self.db_path)
        trials = study.get_trials(deepcopy=False)
        left = cfg.study.trials - len(launched(trials))
        warning = room.warning(left, len(trials)) if left > 0 else None
        if warning:
            self.progress.log(warning)
        self.ready = Prepared(space=space, wall=wall, edges=edges, liveness=liveness, room=room)
        return self.ready

    def _recover(self) -> None:
        for number in recover(self.study, self.state_dir):
            self.progress.log(f"trial {number} was left running by a stopped sweep: failed it, queued it again")

    def close(self) -> None:
        """Release the study lock (also released when the process dies, however it dies), the reserve file and the
        heartbeat."""
        self.held.close()

    def run(self) -> optuna.Study:
        """The search; the lock is kept for a confirmation that follows and released by ``close``. A failed
        write anywhere ends as one ``DiskError`` with the trial in flight failed, never left RUNNING."""
        try:
            self._search()
        except BaseException as exc:
            err = self.flight.disk or disk_error(exc, db_path=self.db_path, fallback=self.cfg.work_dir)
            if err is None:
                raise
            self._fail_current(err)
            raise err from None
        return self.study

    def _search(self) -> None:
        self.prepare()
        target = self.cfg.study.trials
        rule = Patience.from_config(self.cfg)
        with sigint_stops(self.stop):
            while not self.stop.is_set():
                if stopped_early(self.study, rule, target, self.progress):
                    return
                trial, done = self._ask(target)
                if trial is not None:
                    self.run_one(done, target, trial=trial)
                elif done >= target:
                    break
                else:  # the last trials run on other workers: wait until they finish, or die and are retried
                    self.stop.wait(POLL_S)

    def _fail_current(self, err: DiskError) -> None:
        """The storage could not record the trial in flight: give back the reserve and fail it as ``write_error``
        (a later sweep's recovery fails it if even that does not fit)."""
        trial, self.flight.trial = self.flight.trial, None
        if trial is None:
            return
        self.ballast.release()
        try:
            config = dict(trial.user_attrs.get("config") or {})
            result = TrialResult(status="write_error", config=config, engine=self.cfg.engine.kind, reason=str(err))
            self._record(trial, result, 0.0)
        except Exception as exc:  # noqa: BLE001 - the sweep stops with ``err`` either way
            self.progress.log(
                f"trial {trial.number} could not be failed in the study ({type(exc).__name__}); "
                "the next sweep of this study fails it and queues it again"
            )

    def _ask(self, target: int) -> tuple[optuna.Trial | None, int]:
        """The next trial, tagged as this worker's; None when launched + running trials reach the target
        (other workers' included). Counting and asking hold the node's lock, so this node's workers never
        overshoot the target."""
        plan = self.plan
        with node_lock(self.state_dir):
            self._recover()
            trials = self.study.get_trials(deepcopy=False)
            done = len(launched(trials))
            # The budget is launches: a config the planner rejects costs no GPU time, so it does not count
            # (bounded, so a space the planner rejects everywhere still ends).
            if done >= target or len(trials) >= MAX_ASKS_PER_LAUNCH * target:
                return None, target
            if done + sum(t.state == TrialState.RUNNING for t in trials) >= target:
                return None, done
            plan.room.check()  # DiskError before a trial exists that the disk could not record
            plan.edges.place(self.study, trials)  # the next memory-edge start, placed with what is known now
            trial = self._take()
            plan.liveness.claim(trial)
            return trial, done

    def _take(self) -> optuna.Trial:
        """The next queued trial (the storage's claim is atomic), else a sampled one. The baseline and each enqueued
        config run once per study: a later queued copy of one (two nodes seeded at once) is dropped unrun."""
        while True:
            trial = self.study.ask()
            owner = claimed_by(self.study.get_trials(deepcopy=False), trial)
            if owner is None:
                return trial
            drop_duplicate(self.study, trial, owner)

    def run_one(self, done: int, target: int, trial: optuna.Trial) -> None:
        plan, flight = self.plan, self.flight
        flight.trial = trial
        attrs = trial.user_attrs
        role = attrs.get("role", "search")
        if "config" in attrs:
            config = dict(attrs["config"])
            plan.space.record(trial, config)
        else:
            config = plan.space.suggest(trial)
            if plan.wall is not None:
                config = plan.wall.place(config)
        memory_plan = self.feasibility.predict(config) if self.feasibility else None
        launch = config
        if memory_plan is not None and role == "search" and memory_plan.inert:
            # Only searched flags: fixed and derived ones are the user's, and launched as written.
            dropped = set(memory_plan.inert) & set(plan.space.names)
            launch = {k: v for k, v in config.items() if k not in dropped}
        key = key_of(launch)
        for name, value in (("role", role), ("config", config), ("launch_key", key)):
            trial.set_user_attr(name, value)
        self.progress.trial_started(
            trial.number, done, target, role, attrs.get("label"), config_diff(launch, self.cfg.baseline_config())
        )
        started = time.monotonic()
        try:
            result = self._outcome(trial, launch, key, memory_plan, role=role)
        except BaseException as exc:  # an environment error or a second Ctrl-C: not this config's fault
            err = disk_error(exc, db_path=self.db_path, fallback=self.cfg.work_dir / "trials")
            if err is not None:  # a trial file or the database could not be written: fail it, stop the sweep
                flight.disk = err  # the first failed write is the one to name, should recording it fail too
                result = TrialResult(status="write_error", config=launch, engine=self.cfg.engine.kind, reason=str(err))
                self._record(trial, result, time.monotonic() - started)
                flight.trial = None
                raise err from None
            reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
            result = TrialResult(status="interrupted", config=launch, engine=self.cfg.engine.kind, reason=reason)
            self._record(trial, result, time.monotonic() - started)
            flight.trial = None
            raise
        if memory_plan is not None and result.plan is None:
            result = TrialResult.from_dict({**result.to_dict(), "plan": memory_plan.to_dict()})
        self._record(trial, result, time.monotonic() - started)
        flight.trial = None
        tenant, flight.tenant = flight.tenant, None
        if tenant is not None:  # recorded and queued again; the next launch would meet the same tenant
            group = tuple(result.gpus or self.gpus)
            raise GpuBusyError(
                f"{self._busy_line(group)}: trial {trial.number} {tenant}. Stop what holds "
                f"{group_line(group)} or pick other GPUs ([engine] gpu / gpus / --gpus)",
                gpu=group[0],
            )

    def _outcome(
        self, trial: optuna.Trial, launch: dict[str, Any], key: str, memory_plan: Any, *, role: str = "search"
    ) -> TrialResult:
        trials = self._after_twin(trial.number, key)
        # The search's proposals only: a hand-written config runs as written, once (``_take``).
        measured = measured_before(trials, key) if role not in ("baseline", "enqueued") else None
        if measured is not None:  # never launched twice: the sampler is told the earlier figure (``_store``)
            trial.set_user_attr("reused_from", measured.number)
            return repeat_result(measured, launch, self.cfg.engine.kind)
        prior = known_failure(trials, key)  # launched failures; skips are re-judged
        if prior is not None:
            trial.set_user_attr("reused_from", prior.number)
            return TrialResult(
                status="skipped_infeasible",
                config=launch,
                engine=self.cfg.engine.kind,
                reason=f"trial {prior.number} with this config ended {prior.user_attrs['status']}: "
                f"{prior.user_attrs.get('reason') or ''}".rstrip(": "),
            )
        if memory_plan is not None and self.feasibility is not None and self.feasibility.sure_failure(memory_plan):
            return TrialResult(
                status="skipped_infeasible", config=launch, engine=self.cfg.engine.kind, reason=skip_reason(memory_plan)
            )  # SGLang's line and which pool took it
        too_big = self._over_pool(launch)
        if too_big is not None:
            return TrialResult(status="skipped_infeasible", config=launch, engine=self.cfg.engine.kind, reason=too_big)
        result = self.runner(launch, trial.number)  # GpuBusyError: not launched
        if (full := starved(result)) is not None:
            raise full  # the server died for want of room for its log: a write_error, not the config's failure
        if self.feasibility is not None:
            note = self.feasibility.tenant_oom(launch, result)
            if note is not None:  # the tenant's OOM: not this config's outcome, so neither the wall nor a skip later
                trial.set_user_attr("tenant_oom", True)
                self.flight.tenant = note
                return TrialResult.from_dict(
                    {**result.to_dict(), "status": "interrupted", "reason": f"{note}: {result.reason}"}
                )
            for name, value in self.feasibility.learn_trial(launch, result).items():
                trial.set_user_attr(name, value)
            note = skip_was_wrong(self.feasibility, self.study.get_trials(deepcopy=False), key, launch, result)
            if note is not None:
                trial.set_user_attr("planner_skip_wrong", True)
                result = TrialResult.from_dict({**result.to_dict(), "reason": note})
        return result

    def _after_twin(self, number: int, key: str) -> list[FrozenTrial]:
        """The study's trials once no earlier trial runs this config on another worker (waits for its figure)."""
        while True:
            trials = self.study.get_trials(deepcopy=False)
            if not running_twin(trials, number, key) or self.stop.is_set():
                return trials
            self.progress.phase("waiting for the same config's run on another worker", {})
            self.stop.wait(POLL_S)
            with node_lock(self.state_dir):
                self._recover()

    def _over_pool(self, launch: dict[str, Any]) -> str | None:
        """Why a config the space proposed cannot run here: it spans more GPUs than this sweep's pool."""
        pool = self.cfg.engine.pool
        need = server_gpus(launch)
        if pool is None or need <= len(pool):
            return None
        return (
            f"spans {need} GPUs (tp_size × pp_size × dp_size) but this sweep's pool has {len(pool)} "
            f"({group_label(pool)}): not launched"
        )

    def _record(self, trial: optuna.Trial, result: TrialResult, elapsed: float) -> None:
        try:
            self._store(trial, result, elapsed)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Its heartbeat looked stale to another worker (a stalled node), which failed it and queued a retry.
            self.progress.log(f"trial {trial.number} was failed by another worker meanwhile; its retry runs it again")
        finally:
            if self.ready is not None:
                self.ready.liveness.release()

    def _store(self, trial: optuna.Trial, result: TrialResult, elapsed: float) -> None:
        study = self.study
        if result.gpus:  # the group the server ran on names the trial's GPU (a shared pool's workers move around)
            host = self.ready.liveness.tag.host if self.ready else ""
            trial.set_user_attr("gpu", f"{host}:{group_label(result.gpus)}")
        for name, value in (
            ("result", result.to_dict()),
            ("status", result.status),
            ("reason", result.reason),
            ("log_path", result.log_path),
            ("elapsed_s", round(elapsed, 2)),
        ):
            trial.set_user_attr(name, value)
        record_reference(study, result)  # the baseline's launch recorded the fidelity probe's reference
        if result.status == "interrupted":
            run_again(study, trial, interrupted=result.reason or "interrupted (Ctrl-C)")
            study.tell(trial, state=TrialState.FAIL)
        elif result.status in (WRITE_ERROR, PORT_TAKEN):  # the disk's or the host's, not the config's: run it again
            trial.set_user_attr("failure", result.status)
            run_again(study, trial)
            study.tell(trial, state=TrialState.FAIL)
        elif result.status == REPEAT:  # the measured trial's values and constraint: what the sampler learns
            prior = study.get_trials(deepcopy=False)[trial.user_attrs["reused_from"]]
            trial.set_user_attr("constraint", prior.user_attrs.get("constraint", [0.0]))
            study.tell(trial, prior.values)
        elif result.status == "ok" or result.status in INFEASIBLE:
            values, violation = objective_values(self.cfg, result)
            trial.set_user_attr("constraint", violation)
            study.tell(trial, values)
        else:  # crash, timeout: the sampler should not read these as the memory wall
            trial.set_user_attr("failure", result.status)
            study.tell(trial, state=TrialState.FAIL)
        self.progress.trial_finished(trial.number, result, best_value(study))


def best_value(study: optuna.Study) -> float | None:
    ok = [
        t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("status") == "ok"
    ]
    return max((t.values[0] for t in ok), default=None)


def run_study(
    cfg: StudyConfig,
    *,
    runner: Runner | None = None,
    progress: Any = None,
    stop_event: threading.Event | None = None,
    device_check: DeviceCheck | None = None,
) -> optuna.Study:
    """Run (or resume) the search until ``cfg.study.trials`` trials are finished; returns the study."""
    sweep = Sweep(cfg, runner=runner, progress=progress, stop_event=stop_event, device_check=device_check)
    try:
        return sweep.run()
    finally:
        sweep.close()
