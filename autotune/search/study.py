"""The Optuna loop: baseline and enqueued configs first, then the sampler; planner pre-check; resume.

Every outcome is data. OOMs and infeasible configs are COMPLETE trials with value 0 and a violated constraint
(the sampler learns where the wall is); crashes and timeouts are FAIL with their class and log. The study is
written after every step, so a sweep killed at any moment resumes where it stopped: a trial left RUNNING by a
dead process is failed as interrupted and its config queued again, once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.errors import ConfigError, StorageError, StudyError
from autotune.results import OOM_STATUSES, TrialResult
from autotune.search.space import Feasibility, Space, config_diff, key_of
from autotune.search.storage import Liveness, dead_running, fail_stale, node_lock, open_storage, redact

Runner = Callable[[dict[str, Any], int], TrialResult]
INFEASIBLE = OOM_STATUSES | {"bad_args"}  # deterministic: the same config fails the same way
WORST = 1e9  # the second objective's value for a config that never served (finite: plots and samplers cope)
POLL_S = 1.0  # how often a sweep whose remaining trials run elsewhere looks again
# The number a runner gets for the confirmation's "SGLang defaults" measurement: no Optuna trial has it, so the
# run never lands in (or is counted as a repeat of) a real trial's directory; HarnessRunner writes it under
# ``trials/defaults/``.
DEFAULTS_RUN = -1

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


# --- storage -----------------------------------------------------------------------------------------------
def constraints(trial: FrozenTrial) -> list[float]:
    """Optuna's constraints_func: values > 0 are violations (stored by the loop as ``user_attrs["constraint"]``)."""
    return list(trial.user_attrs.get("constraint", [0.0]))


def make_sampler(cfg: StudyConfig, *, salt: int = 0) -> optuna.samplers.BaseSampler:
    """The configured sampler. ``salt`` (trials already stored) keeps a resumed sweep from replaying the
    random start-up proposals of the first run."""
    seed, kind = cfg.study.seed + salt, cfg.study.sampler
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, constraints_func=constraints)
    if kind == "cmaes":
        if cfg.objective.second:
            raise ConfigError("CMA-ES cannot optimise two objectives", file=str(cfg.path), key="study.sampler",
                              fix='use sampler = "tpe"')
        return optuna.samplers.CmaEsSampler(seed=seed)
    # Multivariate + group TPE models the flags jointly (memory levers interact) and copes with conditions.
    startup = max(4, min(10, cfg.study.trials // 4))
    # constant_liar: parallel workers see each other's running trials and do not propose the same config.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=startup,
                                      constraints_func=constraints, constant_liar=True)


def directions(cfg: StudyConfig) -> list[str]:
    second = cfg.objective.second
    return ["maximize"] + ([second.direction] if second else [])


def open_study(cfg: StudyConfig, *, create: bool = True) -> optuna.Study:
    """Create or resume the study (``load_if_exists``: re-running continues it)."""
    url = cfg.storage_url
    if url.startswith("sqlite:///"):
        db = Path(url.removeprefix("sqlite:///"))
        if not create and not db.exists():  # a read must not leave an empty database behind
            raise StudyError(f"no study named {cfg.name!r}: {db} does not exist; run `autotune sweep` first")
        db.parent.mkdir(parents=True, exist_ok=True)
    storage = open_storage(url, base_dir=cfg.base_dir)  # StorageError (one line, redacted) when unusable
    try:
        if not create:
            return optuna.load_study(study_name=cfg.name, storage=storage, sampler=make_sampler(cfg))
        return optuna.create_study(study_name=cfg.name, storage=storage, sampler=make_sampler(cfg),
                                   directions=directions(cfg), load_if_exists=True)
    except KeyError:
        raise StudyError(f"no study named {cfg.name!r} in {redact(url)}; run `autotune sweep` first") from None
    except ImportError:
        raise StorageError(f"no database driver for {redact(url)}: install it (PostgreSQL: pip install "
                           "psycopg2-binary, and write postgresql+psycopg2://...)") from None
    except ValueError as exc:
        raise StudyError(f"study {cfg.name!r} in {redact(url)} cannot be used: {exc}") from None
    except Exception as exc:  # SQLAlchemy's errors for malformed or unreachable URLs
        if type(exc).__module__.startswith(("sqlalchemy", "optuna")):
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StorageError(f"cannot open storage {redact(url)}: {first}") from None
        raise


# --- the trial runner --------------------------------------------------------------------------------------
class HarnessRunner:
    """The real trial: ``run_trial`` with the study's engine. Directory ``trials/<n>/`` (``trials/defaults/``
    for ``DEFAULTS_RUN``); repeats go inside it."""

    def __init__(self, cfg: StudyConfig, *, stop_event: threading.Event, on_phase: Callable[..., None] | None = None):
        from autotune.harness.engines import make_engine
        from autotune.harness.trial import Timeouts
        from autotune.harness.workload import PromptSample, WorkloadSpec

        eng, wl = cfg.engine, cfg.workload
        model = eng.profile if eng.kind == "sim" and eng.profile else eng.model
        self.engine = make_engine(eng.kind, model_path=model, python=eng.python, env=eng.env, sim_gpu=eng.sim_gpu,
                                  sim_options=eng.sim_options, device=eng.device)
        self.workload = WorkloadSpec(prompts=wl.prompts, sample_size=wl.sample_size, seed=wl.seed,
                                     max_tokens=wl.max_tokens, concurrency=wl.concurrency, warmup_s=wl.warmup_s,
                                     measure_s=wl.measure_s, endpoint=wl.endpoint, ignore_eos=wl.ignore_eos)
        self.timeouts = Timeouts(**eng.timeouts)
        self.sample = PromptSample.load(wl.prompts, wl.sample_size, wl.seed)  # once: every trial replays the same
        self.cfg, self.stop_event, self.on_phase = cfg, stop_event, on_phase
        self.run_dir = cfg.work_dir / "runs"  # pid files of this GPU's servers (workers use one per GPU)

    def trial_dir(self, number: int) -> Path:
        base = self.cfg.work_dir / "trials" / ("defaults" if number == DEFAULTS_RUN else str(number))
        if not base.exists():
            return base
        k = 1
        while (base / f"repeat-{k}").exists():
            k += 1
        return base / f"repeat-{k}"

    def __call__(self, config: dict[str, Any], trial_number: int) -> TrialResult:
        from autotune.harness.trial import run_trial

        return run_trial(self.engine, config, self.workload, trial_dir=self.trial_dir(trial_number),
                         gpu_index=self.cfg.engine.gpu, port=self.cfg.engine.port, timeouts=self.timeouts,
                         on_phase=self.on_phase, stop_event=self.stop_event, run_dir=self.run_dir,
                         sample=self.sample)


@functools.lru_cache(maxsize=8)
def _prompt_texts(path: Path, n: int, seed: int) -> tuple[str, ...]:
    from autotune.harness.workload import PromptSample

    return tuple(row.as_text() for row in PromptSample.load(path, n, seed).rows)


def simulate(cfg: StudyConfig, config: Mapping[str, Any], *, seed: int = 0) -> TrialResult:
    """One trial on the simulator's virtual clock (no server, no waiting): the same model, GPU and workload."""
    from autotune.sim import SimWorkload, evaluate

    wl = cfg.workload
    workload = SimWorkload(prompts=list(_prompt_texts(wl.prompts, wl.sample_size, wl.seed)),
                           max_tokens=wl.max_tokens, concurrency=wl.concurrency, warmup_s=wl.warmup_s,
                           measure_s=wl.measure_s, ignore_eos=wl.ignore_eos)
    options = cfg.engine.sim_options
    ev = evaluate(dict(config), workload, model=cfg.engine.profile or cfg.engine.model, gpu=cfg.engine.sim_gpu,
                  seed=seed, noise=float(options.get("noise", 0.0)))
    status = ev.status if ev.status in ("ok", "startup_oom", "runtime_oom", "bad_args", "crash", "timeout") else "crash"
    return TrialResult(status=status, config=dict(config), engine="sim", capacity=ev.capacity, metrics=ev.metrics,
                       reason=ev.reason, modelled_startup_s=ev.startup_s, plan=ev.plan)


def simulated_runner(cfg: StudyConfig) -> Runner:
    """A runner on the simulator's virtual clock, seeded per trial: for benchmarks and fast tests."""
    calls: dict[int, int] = {}

    def run(config: dict[str, Any], number: int) -> TrialResult:
        calls[number] = calls.get(number, 0) + 1  # a repeat of the same trial gets fresh noise, like a re-run
        return simulate(cfg, config, seed=(cfg.study.seed * 100_003 + number) * 101 + calls[number])

    return run


# --- bookkeeping -------------------------------------------------------------------------------------------
def result_of(trial: FrozenTrial) -> TrialResult | None:
    data = trial.user_attrs.get("result")
    return TrialResult.from_dict(data) if data else None


MAX_ASKS_PER_LAUNCH = 10


def launched(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Finished trials that started a server: what the trial budget counts."""
    return [t for t in finished(trials) if t.user_attrs.get("status") != "skipped_infeasible"]


def launches(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that started a server, in every session of the study (what the summary reports): finished ones
    and those a stopped or killed sweep interrupted (their re-run is another launch). Not counted: configs the
    planner or a known outcome skipped, and configs the engine rejected before launching (``bad_args`` from a
    trial directory with no startup time)."""
    out = []
    for t in trials:
        status = t.user_attrs.get("status")
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL) or status == "skipped_infeasible":
            continue
        result = t.user_attrs.get("result") or {}
        if status == "bad_args" and result.get("trial_dir") and "startup" not in (result.get("durations_s") or {}):
            continue
        out.append(t)
    return out


def finished(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that count toward the target: everything done except interrupted ones (they run again). A FAIL
    without a status is one Optuna's heartbeat failed after its worker died: interrupted too."""
    return [t for t in trials if t.state == TrialState.COMPLETE
            or (t.state == TrialState.FAIL and t.user_attrs.get("status") not in (None, "interrupted"))]


def _requeue(study: optuna.Study, trial: FrozenTrial, trials: list[FrozenTrial]) -> None:
    """Queue an interrupted trial's config again unless an earlier resume already did."""
    if trial.user_attrs.get("requeued_from") is not None:
        return  # interrupted twice: once is enough
    if any(t.user_attrs.get("requeued_from") == trial.number for t in trials):
        return
    attrs = {k: trial.user_attrs[k] for k in ("role", "label", "config") if k in trial.user_attrs}
    study.enqueue_trial(trial.params, user_attrs={**attrs, "requeued_from": trial.number})


def _mark_interrupted(study: optuna.Study, trial_id: int, reason: str) -> None:
    handle = optuna.Trial(study, trial_id)
    handle.set_user_attr("status", "interrupted")
    handle.set_user_attr("reason", reason)
    if "result" not in handle.user_attrs and "config" in handle.user_attrs:
        handle.set_user_attr("result", TrialResult(status="interrupted", config=handle.user_attrs["config"],
                                                   reason=reason).to_dict())


def recover(study: optuna.Study, state_dir: Path | None = None) -> list[int]:
    """Fail trials a dead sweep left RUNNING and queue their configs again; trials of live workers (this
    host's by pid, others' by heartbeat: ``storage.dead_running``) are left alone. Returns their numbers."""
    stale = dead_running(study, state_dir)
    for trial in stale:
        try:
            _mark_interrupted(study, trial._trial_id, "the sweep process died during this trial")
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
    fixed = cfg.engine.fixed
    wanted = [("baseline", cfg.baseline.label, {**fixed, **cfg.baseline.flags})]
    wanted += [("enqueued", e.label, {**fixed, **e.flags}) for e in cfg.enqueue]
    for role, label, config in wanted:
        if (role, label) not in present:
            params = {k: v for k, v in config.items() if k in cfg.space}
            study.enqueue_trial(params, user_attrs={"role": role, "label": label, "config": config})


def seed_edges(study: optuna.Study, cfg: StudyConfig, space: Space, feasibility: Feasibility | None) -> None:
    """Enqueue the planner's starting points on the memory wall once, after the baseline and enqueued configs."""
    from autotune.search.starts import edge_configs

    n = cfg.study.edge_starts
    if not n or feasibility is None or any(t.user_attrs.get("role") == "prior" for t in study.get_trials(deepcopy=False)):
        return
    wl = cfg.workload
    chars = [len(text) for text in _prompt_texts(wl.prompts, wl.sample_size, wl.seed)]
    given = [{**cfg.engine.fixed, **cfg.baseline.flags}, *({**cfg.engine.fixed, **e.flags} for e in cfg.enqueue)]
    configs = edge_configs(space, feasibility, prompt_chars=chars, max_tokens=wl.max_tokens, n=n, seed=cfg.study.seed,
                           exclude=given, hold=given[0])
    for i, config in enumerate(configs, 1):
        params = {k: v for k, v in config.items() if k in space.names}
        study.enqueue_trial(params, user_attrs={"role": "prior", "label": f"memory edge {i}", "config": config})


def known_outcome(trials: list[FrozenTrial], key: str) -> FrozenTrial | None:
    """A finished trial that launched exactly this config and failed deterministically (OOM, bad args)."""
    for t in trials:
        if t.state == TrialState.COMPLETE and t.user_attrs.get("launch_key") == key:
            if t.user_attrs.get("status") in INFEASIBLE:
                return t
    return None


def objective_values(cfg: StudyConfig, result: TrialResult) -> tuple[list[float], list[float]]:
    """(values, constraint) for a COMPLETE trial. Constraint entries > 0 are violations."""
    second = cfg.objective.second
    slos = cfg.objective.parsed_constraints()
    if result.status != "ok" or result.metrics is None:
        worst = [WORST if second and second.direction == "minimize" else 0.0] if second else []
        return [0.0, *worst], [1.0] + [0.0] * len(slos)
    values = [result.metrics.output_tok_s]
    if second:
        values.append(_metric(result, second.metric) or (WORST if second.direction == "minimize" else 0.0))
    violations = [-1.0]
    for metric, op, limit in slos:
        value = _metric(result, metric)
        if value is None:
            violations.append(0.0)
        else:
            violations.append(value - limit if op in ("<=", "<") else limit - value)
    return values, violations


def _metric(result: TrialResult, name: str) -> float | None:
    m = result.metrics
    if m is None:
        return None
    if name in ("output_tok_s", "request_s", "accept_length"):
        return getattr(m, name)
    stat, family, _ = name.split("_")
    return getattr(getattr(m, f"{family}_ms"), stat)


# --- the loop ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def sigint_stops(stop: threading.Event) -> Iterator[None]:
    """First Ctrl-C: stop the current server cleanly and end the sweep. Second: give up at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Sweep:
    """One sweep over a study: holds the study, space, planner check, runner and progress sink."""

    def __init__(self, cfg: StudyConfig, *, runner: Runner | None = None, progress: Any = None,
                 stop_event: threading.Event | None = None):
        from autotune.progress import PlainProgress

        self.cfg = cfg
        self.progress = progress or PlainProgress()
        self.stop = stop_event or threading.Event()
        self.space = Space.from_config(cfg)
        self.feasibility = Feasibility.from_config(cfg)
        self.study = open_study(cfg)
        self.harness = runner is None
        self.runner: Runner = runner or HarnessRunner(cfg, stop_event=self.stop, on_phase=self.progress.phase)
        self.state_dir = cfg.work_dir / "workers"  # heartbeat files and the node's ask lock
        self.liveness: Liveness | None = None
        self._baseline_tried = False

    def _lock(self) -> None:
        """One sweep per GPU of a study at a time (two servers on one GPU would skew both); sweeps on other
        GPUs or nodes share the study: a live worker's trials are never failed as stale."""
        self.cfg.work_dir.mkdir(parents=True, exist_ok=True)
        # Keyed by storage too: the same study name in two storages (benchmarks, seeds) is two studies.
        tag = hashlib.sha1(self.cfg.storage_url.encode()).hexdigest()[:10]
        path = self.cfg.work_dir / f"sweep-{tag}-gpu{self.cfg.engine.gpu}.lock"
        self._lock_file = open(path, "a+")  # noqa: SIM115  (held for the sweep's lifetime)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "another process"
            self._lock_file.close()
            raise StudyError(f"study {self.cfg.name!r} is being swept on GPU {self.cfg.engine.gpu} by pid {holder}; "
                             "wait for it, stop it or use another GPU "
                             f"(the lock is {path})") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def prepare(self) -> None:
        cfg, study = self.cfg, self.study
        self._lock()
        study.set_user_attr("autotune", cfg.to_dict())
        if self.harness:
            from autotune.harness.server import cleanup_orphans

            for pid in cleanup_orphans(self.runner.run_dir):
                self.progress.log(f"stopped orphan server pid {pid} left by an earlier sweep")
        self.liveness = Liveness(study, gpu=cfg.engine.gpu, state_dir=self.state_dir)
        if self.feasibility is not None:
            for trial in finished(study.get_trials(deepcopy=False)):
                r = result_of(trial)
                if r and r.ok and r.capacity and r.status == "ok" and not trial.user_attrs.get("reused_from"):
                    self.feasibility.learn(r.config, r.capacity.kv_tokens)
            contexts = [{**cfg.engine.fixed, **cfg.baseline.flags}, *({**cfg.engine.fixed, **e.flags} for e in cfg.enqueue)]
            inert = self.feasibility.inert_everywhere(self.space, contexts)
            for name, why in inert.items():
                self.progress.log(f"not searching {name}: {why}")
            self.space = self.space.without(set(inert))
        with node_lock(self.state_dir):  # workers starting together seed the queue once
            self._recover()
            seed_trials(study, cfg)
            seed_edges(study, cfg, self.space, self.feasibility)
        study.sampler = make_sampler(cfg, salt=len(study.get_trials(deepcopy=False)))

    def _recover(self) -> None:
        for number in recover(self.study, self.state_dir):
            self.progress.log(f"trial {number} was left running by a stopped sweep: failed it, queued it again")

    def close(self) -> None:
        """Release the study lock (also released when the process dies, however it dies)."""
        if self.liveness is not None:
            self.liveness.close()
        lock = getattr(self, "_lock_file", None)
        if lock is not None and not lock.closed:
            lock.close()

    def run(self) -> optuna.Study:
        """The search; the lock is kept for a confirmation that follows and released by ``close``."""
        self.prepare()
        target = self.cfg.study.trials
        with sigint_stops(self.stop):
            while not self.stop.is_set():
                trial, done = self._ask(target)
                if trial is not None:
                    self.run_one(done, target, trial=trial)
                elif done >= target:
                    break
                else:  # the last trials run on other workers: wait until they finish, or die and are retried
                    self.stop.wait(POLL_S)
        return self.study

    def _ask(self, target: int) -> tuple[optuna.Trial | None, int]:
        """The next trial, tagged as this worker's; None when launched + running trials reach the target
        (other workers' included). Counting and asking hold the node's lock, so this node's workers never
        overshoot the target."""
        assert self.liveness is not None, "prepare() first"
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
            trial = self._gpu_baseline(trials) or self.study.ask()
            self.liveness.claim(trial)
            return trial, done

    def _gpu_baseline(self, trials: list[FrozenTrial]) -> optuna.Trial | None:
        """The baseline on this GPU, once per sweep, when the study has none from it yet: per-GPU calibration,
        so a slow device is seen as one. Takes the queued baseline if there is one, else adds one."""
        if self._baseline_tried or self.liveness is None:
            return None
        self._baseline_tried = True
        label = self.liveness.tag.label
        for t in trials:  # an untagged baseline is an older sweep's, or one being claimed: count it as ours
            running_or_done = t.state in (TrialState.COMPLETE, TrialState.RUNNING)
            if running_or_done and t.user_attrs.get("role") == "baseline" and t.user_attrs.get("gpu", label) == label:
                return None
        storage = self.study._storage
        for t in trials:
            if t.state == TrialState.WAITING and t.user_attrs.get("role") == "baseline":
                with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                    if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                        return optuna.Trial(self.study, t._trial_id)
        template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={
            "role": "baseline", "label": self.cfg.baseline.label, "config": self._baseline_config()})
        return optuna.Trial(self.study, storage.create_new_trial(self.study._study_id, template_trial=template))

    def _baseline_config(self) -> dict[str, Any]:
        return {**self.cfg.engine.fixed, **self.cfg.baseline.flags}

    def run_one(self, done: int, target: int, trial: optuna.Trial | None = None) -> None:
        study = self.study
        if trial is None:
            trial = study.ask()
            if self.liveness is not None:
                self.liveness.claim(trial)
        attrs = trial.user_attrs
        role = attrs.get("role", "search")
        if "config" in attrs:
            config = dict(attrs["config"])
            self.space.record(trial, config)
        else:
            config = self.space.suggest(trial)
        memory_plan = self.feasibility.predict(config) if self.feasibility else None
        launch = config
        if memory_plan is not None and role == "search" and memory_plan.inert:
            # Only searched flags: fixed and derived ones are the user's, and launched as written.
            dropped = set(memory_plan.inert) & set(self.space.names)
            launch = {k: v for k, v in config.items() if k not in dropped}
        key = key_of(launch)
        for name, value in (("role", role), ("config", config), ("launch_key", key)):
            trial.set_user_attr(name, value)
        self.progress.trial_started(trial.number, done, target, role, attrs.get("label"),
                                    config_diff(launch, self._baseline_config()))
        started = time.monotonic()
        try:
            result = self._outcome(trial, launch, key, memory_plan)
        except BaseException as exc:  # an environment error or a second Ctrl-C: not this config's fault
            reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
            result = TrialResult(status="interrupted", config=launch, engine=self.cfg.engine.kind, reason=reason)
            self._record(trial, result, time.monotonic() - started)
            raise
        if memory_plan is not None and result.plan is None:
            result = TrialResult.from_dict({**result.to_dict(), "plan": memory_plan.to_dict()})
        self._record(trial, result, time.monotonic() - started)

    def _outcome(self, trial: optuna.Trial, launch: dict[str, Any], key: str, memory_plan: Any) -> TrialResult:
        prior = known_outcome(self.study.get_trials(deepcopy=False), key)
        if prior is not None:
            trial.set_user_attr("reused_from", prior.number)
            return TrialResult(status="skipped_infeasible", config=launch, engine=self.cfg.engine.kind,
                               reason=f"trial {prior.number} with this config ended {prior.user_attrs['status']}: "
                                      f"{prior.user_attrs.get('reason') or ''}".rstrip(": "))
        if memory_plan is not None and self.feasibility.sure_failure(memory_plan):
            return TrialResult(status="skipped_infeasible", config=launch, engine=self.cfg.engine.kind,
                               reason=memory_plan.message or f"planner: {memory_plan.failure}")
        result = self.runner(launch, trial.number)
        if self.feasibility is not None and result.ok and result.capacity is not None:
            offset = self.feasibility.learn(launch, result.capacity.kv_tokens)
            if offset is not None:
                trial.set_user_attr("planner_offset_gib", round(offset, 3))
        return result

    def _record(self, trial: optuna.Trial, result: TrialResult, elapsed: float) -> None:
        try:
            self._store(trial, result, elapsed)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Its heartbeat looked stale to another worker (a stalled node), which failed it and queued a retry.
            self.progress.log(f"trial {trial.number} was failed by another worker meanwhile; its retry runs it again")
        finally:
            if self.liveness is not None:
                self.liveness.release()

    def _store(self, trial: optuna.Trial, result: TrialResult, elapsed: float) -> None:
        study = self.study
        for name, value in (("result", result.to_dict()), ("status", result.status),
                            ("reason", result.reason), ("log_path", result.log_path), ("elapsed_s", round(elapsed, 2))):
            trial.set_user_attr(name, value)
        if result.status == "interrupted":
            reason = result.reason or "interrupted (Ctrl-C)"
            _mark_interrupted(study, trial._trial_id, reason)
            frozen = study.get_trials(deepcopy=False)
            _requeue(study, next(t for t in frozen if t.number == trial.number), frozen)
            study.tell(trial, state=TrialState.FAIL)
        elif result.status == "ok" or result.status in INFEASIBLE:
            values, violation = objective_values(self.cfg, result)
            trial.set_user_attr("constraint", violation)
            study.tell(trial, values)
        else:  # crash, timeout: the sampler should not read these as the memory wall
            trial.set_user_attr("failure", result.status)
            study.tell(trial, state=TrialState.FAIL)
        self.progress.trial_finished(trial.number, result, best_value(study))


def best_value(study: optuna.Study) -> float | None:
    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if t.user_attrs.get("status") == "ok"]
    return max((t.values[0] for t in ok), default=None)


def run_study(cfg: StudyConfig, *, runner: Runner | None = None, progress: Any = None,
              stop_event: threading.Event | None = None) -> optuna.Study:
    """Run (or resume) the search until ``cfg.study.trials`` trials are finished; returns the study."""
    sweep = Sweep(cfg, runner=runner, progress=progress, stop_event=stop_event)
    try:
        return sweep.run()
    finally:
        sweep.close()
