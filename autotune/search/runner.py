"""A study's trial runners: ``HarnessRunner`` (one real trial per call, filed in the study's own trials folder, with
the tenancy check of each launch's GPUs), ``GivenRunner`` (a test's or a benchmark's runner as the sweep drives it)
and the engine's in-process prediction where it has one. Where a launch is filed and whether it is probed comes
from the caller, never from what is on disk. docs/contracts.md (``search/runner.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import optuna

from autotune.config import StudyConfig, Timeouts
from autotune.config.pool import sweep_gpus
from autotune.errors import GpuBusyError
from autotune.harness.engines import Engine, make_engine
from autotune.harness.engines.base import Predictor
from autotune.harness.fidelity import FidelityProbe
from autotune.harness.setup import TrialHooks, TrialSetup
from autotune.harness.steps import AfterWindow
from autotune.harness.tenancy import Occupancy, check_engine_gpus
from autotune.harness.trial import run_trial
from autotune.harness.workload import PromptSample, WorkloadSpec
from autotune.launch.gpulocks import GpuLocks, Stopped, lock_dir
from autotune.launch.process import cleanup_orphans
from autotune.launch.registry import make_launcher
from autotune.results import MeasurementVerdict, TrialResult
from autotune.search.folders import fresh, study_folder
from autotune.search.numerics import (
    REFERENCE_ATTR,
    REFERENCE_FILE,
    REFERENCE_RUN,
    ProbePlanner,
    missing_reference,
    without_reference,
)
from autotune.search.objective import open_study
from autotune.settle import with_warmup
from autotune.sglang.parallel import group_line, server_gpus

Runner = Callable[[dict[str, Any], int], TrialResult]


@runtime_checkable
class RepeatingRunner(Protocol):
    """A runner that files confirmation runs apart and runs follow-up steps in their launch (``HarnessRunner``,
    ``confirm.stages.Checked``); a plain ``Runner`` measures a repeat as the trial itself."""

    def __call__(self, config: dict[str, Any], trial_number: int) -> TrialResult: ...

    def repeat(
        self,
        config: dict[str, Any],
        trial_number: int,
        k: int,
        *,
        after: Sequence[AfterWindow] = (),
        warmup_s: float | None = None,
    ) -> TrialResult: ...


class SweepRunner(RepeatingRunner, Protocol):
    """What a sweep drives (``HarnessRunner``, ``GivenRunner``): the engine it launches (None: a given runner that
    measures without one), the folder its trials write to (None: the study's default), and ``start``, run once
    before the first launch (``GpuBusyError`` there: nothing is queued or launched)."""

    @property
    def engine(self) -> Engine | None: ...

    @property
    def folder(self) -> Path | None: ...

    def start(self) -> None: ...


DeviceCheck = Callable[[], Occupancy | None]
# The number a runner gets for the confirmation's "SGLang defaults" measurement: no Optuna trial has it, so the
# run never lands in (or is counted as a repeat of) a real trial's directory; HarnessRunner writes it under
# ``trials/defaults/``.
DEFAULTS_RUN = -1


def study_engine(cfg: StudyConfig) -> Engine:
    """The engine the study's ``[engine]`` section names (the sim engine runs the profile, when given)."""
    eng = cfg.engine
    model = eng.profile if eng.simulated and eng.profile else eng.model
    return make_engine(
        eng.kind,
        model_path=model,
        python=eng.python,
        env=eng.env,
        sim_gpu=eng.sim_gpu,
        sim_options=eng.sim_options,
        device=eng.device,
    )


@functools.lru_cache(maxsize=8)
def prompt_texts(path: Path, n: int, seed: int) -> tuple[str, ...]:
    """The study's prompt sample as texts (loaded once per process)."""
    return tuple(row.as_text() for row in PromptSample.load(path, n, seed).rows)


def predict(cfg: StudyConfig, config: Mapping[str, Any], *, seed: int = 0) -> TrialResult | None:
    """``config`` on the engine's virtual clock (the sim engine's ``predict``: the same model, GPU and
    workload, no server), or None for an engine that can only measure."""
    engine = study_engine(cfg)
    if not isinstance(engine, Predictor):  # optional: the sim engine's only
        return None
    wl = cfg.workload
    return engine.predict(config, wl, prompt_texts(wl.prompts, wl.sample_size, wl.seed), seed=seed)


class HarnessRunner:
    """The real trial: ``run_trial`` with the study's engine, filed in the study's own trials folder:
    ``<n>/`` for trial ``n``'s search launch, ``<n>/repeat-<k>/`` for its confirmation runs, ``defaults/`` for
    ``DEFAULTS_RUN``. ``study``: the study it runs for (default: the config's, opened on first use)."""

    def __init__(
        self,
        cfg: StudyConfig,
        *,
        stop_event: threading.Event,
        on_phase: Callable[..., None] | None = None,
        study: optuna.Study | None = None,
        log: Callable[[str], None] | None = None,
        run_dir: Path | None = None,
    ):
        eng, wl = cfg.engine, cfg.workload
        self.engine = study_engine(cfg)
        self.workload: WorkloadSpec = wl  # the study file's [workload], as every trial replays it
        self.timeouts = Timeouts(**eng.timeouts)
        self.sample = PromptSample.load(wl.prompts, wl.sample_size, wl.seed)  # once: every trial replays the same
        self.cfg, self.stop_event, self.on_phase = cfg, stop_event, on_phase
        # where its servers run: the launcher [engine] names, with its [launcher.<name>] table
        self.launcher = make_launcher(eng.launcher, cfg.launcher.settings(eng.launcher))
        # Pid files of its servers (a worker's own: ``scaleout.workers.gpu_run_dir``). Shared by the studies of this
        # work dir on purpose: orphan cleanup stops only servers whose harness is dead, so a deleted study's goes too.
        self.run_dir = run_dir or cfg.work_dir / "runs"
        self.numerics = ProbePlanner(cfg, self.sample.rows, timeout_s=self.timeouts.request_s)  # the fidelity probe
        # Every launch takes its GPUs here first (``launch.gpulocks``): a free aligned group of the pool
        # ``[engine] gpus`` (a worker's own group, or the pool its workers share), else the GPUs counted up from
        # ``[engine] gpu``.
        self.locks = GpuLocks(lock_dir(cfg.work_dir), eng.pool, first=eng.first_gpu)
        self.gpus = sweep_gpus(cfg)  # every GPU the sweep may use, checked for tenants by ``start``
        self.log = log
        self._study = study
        self._folder: Path | None = None

    @property
    def folder(self) -> Path:
        """The study's trials folder (``folders.study_folder``), chosen on first use; the numerics reference
        is kept in it (a study that recorded one elsewhere, before identities, keeps its stored path)."""
        if self._folder is None:
            study = self._study if self._study is not None else open_study(self.cfg)
            phase = self.on_phase
            folder = study_folder(self.cfg, study, log=(lambda line: phase(line, {})) if phase is not None else None)
            stored = (study.user_attrs.get(REFERENCE_ATTR) or {}).get("path")
            self.numerics.path = Path(stored) if stored else folder / REFERENCE_FILE
            self._folder = folder
            return folder
        return self._folder

    def start(self) -> None:
        """Before the first launch: servers an earlier sweep left are stopped, and every GPU the sweep may use is
        checked for tenants (``GpuBusyError`` before anything is queued or launched)."""
        for pid in cleanup_orphans(self.run_dir):
            if self.log is not None:
                self.log(f"stopped orphan server pid {pid} left by an earlier sweep")
        self.check_gpus()

    def check_gpus(self, group: tuple[int, ...] | None = None) -> Occupancy | None:
        """The tenancy check of ``group`` (a launch's GPUs; None: every GPU the sweep may use): ``GpuBusyError``,
        else what other processes hold (``measurement.device_at_launch``)."""
        eng, gpus = self.cfg.engine, group or self.gpus
        try:
            return check_engine_gpus(self.engine, gpus, mode=eng.busy_gpu, wait_s=eng.busy_wait_s, on_wait=self.log)
        except GpuBusyError as exc:
            if len(gpus) <= 1:
                raise
            raise GpuBusyError(
                f"{exc} ({'the group' if group else 'this sweep'}'s {group_line(gpus)})",
                gpu=exc.gpu,
                holders=exc.holders,
                held_gib=exc.held_gib,
            ) from None

    def trial_dir(self, number: int | str, repeat: int | None = None) -> Path:
        """Where trial ``number``'s launch (or its confirmation run ``repeat``, counted from 1) is written: a
        folder no earlier launch used (an interrupted attempt's stays beside it)."""
        base = self.folder / ("defaults" if number == DEFAULTS_RUN else str(number))
        return fresh(base if repeat is None else base / f"repeat-{repeat}")

    def __call__(self, config: dict[str, Any], trial_number: int) -> TrialResult:
        """Trial ``trial_number``'s search launch, with the fidelity probe when its numerics differ."""
        trial_dir = self.trial_dir(trial_number)
        probe = None
        if trial_number != DEFAULTS_RUN:
            probe, failed = self.numerics.probe_for(config, trial_number, record=self._record_reference)
            if failed is not None:
                return missing_reference(failed, config)
        return self._run(config, trial_dir, probe)

    def repeat(
        self,
        config: dict[str, Any],
        trial_number: int,
        k: int,
        *,
        after: Sequence[AfterWindow] = (),
        warmup_s: float | None = None,
    ) -> TrialResult:
        """Confirmation launch ``k`` (from 0) of trial ``trial_number``, in ``<n>/repeat-<k+1>/``: speed, then the
        follow-up steps ``after`` in the same launch (more windows, the stress phase), every window after a warm-up
        floor of ``warmup_s`` (None: the study's; ``confirm.warmup``). The first launch of every
        contender but the baseline's own flags runs the fidelity probe before them, table or not
        (``ProbePlanner.confirmation_probe``); its figures are the run's ``fidelity``."""
        probe = failed = None
        if k == 0 and trial_number != DEFAULTS_RUN:
            probe, failed = self.numerics.confirmation_probe(config, record=self._record_reference)
        result = self._run(
            config, self.trial_dir(trial_number, repeat=k + 1), probe, with_warmup(self.workload, warmup_s), after=after
        )
        if failed is not None and result.fidelity is None:  # no reference to compare with: said, not passed
            result = dataclasses.replace(result, fidelity=without_reference(failed))
        return result

    def _run(
        self,
        config: dict[str, Any],
        trial_dir: Path,
        probe: FidelityProbe | None,
        workload: WorkloadSpec | None = None,
        *,
        after: Sequence[AfterWindow] = (),
    ) -> TrialResult:
        """One launch on a group of GPUs held for it (checked for tenants first), released once the server is gone."""
        if self.engine.device == "cpu":  # the CPU backend holds no GPU
            return run_trial(
                self._setup(workload or self.workload, None),
                config,
                trial_dir=trial_dir,
                probe=probe,
                hooks=self._hooks(),
                after=after,
            )
        phase = self.on_phase
        try:
            with self.locks.holding(
                server_gpus(config),
                stop=self.stop_event,
                on_wait=(lambda line: phase(line, {})) if phase is not None else None,
            ) as group:
                seen = self.check_gpus(group)  # GpuBusyError: no launch
                result = run_trial(
                    self._setup(workload or self.workload, group),
                    config,
                    trial_dir=trial_dir,
                    probe=probe,
                    hooks=self._hooks(),
                    after=after,
                )
        except Stopped as stopped:  # Ctrl-C while other servers held the GPUs: nothing launched, run it again later
            return TrialResult(status="interrupted", config=config, engine=self.engine.name, reason=str(stopped))
        return with_device(result, seen)

    def _record_reference(self, probe: FidelityProbe) -> TrialResult:
        """A launch of the reference config that only records the probe's reference outputs (its window cut to
        a second): for a resumed study whose reference file is missing."""
        if self.on_phase is not None:
            self.on_phase("recording the numerics reference (baseline config)", {})
        short = self.workload.model_copy(update={"warmup_s": 0.0, "measure_s": 1.0})
        return self._run(
            dict(self.numerics.reference_cfg),
            self.trial_dir(REFERENCE_RUN),
            dataclasses.replace(probe, only=True),
            short,
        )

    def _setup(self, workload: WorkloadSpec, group: tuple[int, ...] | None) -> TrialSetup:
        """Every launch of this runner: the study's engine, the GPUs it holds, port, launcher and prompt sample."""
        first = group[0] if group else self.cfg.engine.first_gpu
        return TrialSetup(
            engine=self.engine,
            workload=workload,
            sample=self.sample,
            launcher=self.launcher,
            gpu_index=first,
            gpus=group or None,
            port=self.cfg.engine.port,
            timeouts=self.timeouts,
            run_dir=self.run_dir,
        )

    def _hooks(self) -> TrialHooks:
        return TrialHooks(on_phase=self.on_phase, stop_event=self.stop_event)


def with_device(result: TrialResult, seen: Occupancy | None) -> TrialResult:
    """``result`` with what the GPU held by others at launch in ``measurement.device_at_launch``."""
    if seen is None:
        return result
    measurement = dataclasses.replace(result.measurement or MeasurementVerdict(), device_at_launch=seen.to_dict())
    return dataclasses.replace(result, measurement=measurement)


class GivenRunner:
    """A runner given to the sweep (a test's, a benchmark's oracle), with no engine or folder of its own: ``check``
    (the caller's GPU pre-check, raising ``GpuBusyError``) is read before every launch, search and confirmation
    alike, and what it saw is the result's ``measurement.device_at_launch``, as the harness records its own."""

    engine: Engine | None = None
    folder: Path | None = None

    def __init__(self, runner: Runner, check: DeviceCheck | None = None):
        self.runner, self.check = runner, check

    def start(self) -> None:
        self._seen()

    def _seen(self) -> Occupancy | None:
        return self.check() if self.check is not None else None

    def __call__(self, config: dict[str, Any], trial_number: int) -> TrialResult:
        seen = self._seen()
        return with_device(self.runner(config, trial_number), seen)

    def repeat(
        self,
        config: dict[str, Any],
        trial_number: int,
        k: int,
        *,
        after: Sequence[AfterWindow] = (),
        warmup_s: float | None = None,
    ) -> TrialResult:
        """Confirmation run ``k``: the runner's own ``repeat`` where it has one (its own folder, the first run
        probed, every window after ``warmup_s``), else the trial itself."""
        seen = self._seen()
        if not isinstance(self.runner, RepeatingRunner):
            return with_device(self.runner(config, trial_number), seen)
        return with_device(self.runner.repeat(config, trial_number, k, after=after, warmup_s=warmup_s), seen)


def sweep_runner(
    cfg: StudyConfig,
    given: Runner | None,
    *,
    check: DeviceCheck | None,
    stop_event: threading.Event,
    progress: Any,
    study: optuna.Study,
    run_dir: Path | None,
) -> SweepRunner:
    """The sweep's runner: the study's harness (``check`` unused: it checks each launch's own GPUs), else ``given``
    wrapped so it meets the same interface (already a ``SweepRunner`` class: as is)."""
    if given is None:
        return HarnessRunner(
            cfg, stop_event=stop_event, on_phase=progress.phase, study=study, log=progress.log, run_dir=run_dir
        )
    if isinstance(given, (HarnessRunner, GivenRunner)):
        return given
    return GivenRunner(given, check)
