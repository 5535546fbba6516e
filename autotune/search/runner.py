"""A study's trial runner: the engine it launches, ``HarnessRunner`` (one real trial per call) and the
engine's in-process prediction where it has one (the simulator's virtual clock)."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autotune.config import StudyConfig, Timeouts
from autotune.harness.engines import Engine, make_engine
from autotune.harness.fidelity import FidelityProbe
from autotune.harness.trial import run_trial
from autotune.harness.workload import PromptSample, WorkloadSpec
from autotune.results import TrialResult
from autotune.search.numerics import REFERENCE_RUN, ProbePlanner, missing_reference

Runner = Callable[[dict[str, Any], int], TrialResult]
# The number a runner gets for the confirmation's "SGLang defaults" measurement: no Optuna trial has it, so the
# run never lands in (or is counted as a repeat of) a real trial's directory; HarnessRunner writes it under
# ``trials/defaults/``.
DEFAULTS_RUN = -1


def study_engine(cfg: StudyConfig) -> Engine:
    """The engine the study's ``[engine]`` section names (the sim engine runs the profile, when given)."""
    eng = cfg.engine
    model = eng.profile if eng.kind == "sim" and eng.profile else eng.model
    return make_engine(eng.kind, model_path=model, python=eng.python, env=eng.env, sim_gpu=eng.sim_gpu,
                       sim_options=eng.sim_options, device=eng.device)


@functools.lru_cache(maxsize=8)
def prompt_texts(path: Path, n: int, seed: int) -> tuple[str, ...]:
    """The study's prompt sample as texts (loaded once per process)."""
    return tuple(row.as_text() for row in PromptSample.load(path, n, seed).rows)


def predict(cfg: StudyConfig, config: Mapping[str, Any], *, seed: int = 0) -> TrialResult | None:
    """``config`` on the engine's virtual clock (the sim engine's ``predict``: the same model, GPU and
    workload, no server), or None for an engine that can only measure."""
    engine_predict = getattr(study_engine(cfg), "predict", None)  # optional: the sim engine's only
    if engine_predict is None:
        return None
    wl = cfg.workload
    return engine_predict(config, wl, prompt_texts(wl.prompts, wl.sample_size, wl.seed), seed=seed)


class HarnessRunner:
    """The real trial: ``run_trial`` with the study's engine. Directory ``trials/<n>/`` (``trials/defaults/``
    for ``DEFAULTS_RUN``); repeats go inside it."""

    def __init__(self, cfg: StudyConfig, *, stop_event: threading.Event, on_phase: Callable[..., None] | None = None):
        eng, wl = cfg.engine, cfg.workload
        self.engine = study_engine(cfg)
        self.workload = WorkloadSpec(**wl.model_dump())  # the section's fields are the spec's
        self.timeouts = Timeouts(**eng.timeouts)
        self.sample = PromptSample.load(wl.prompts, wl.sample_size, wl.seed)  # once: every trial replays the same
        self.cfg, self.stop_event, self.on_phase = cfg, stop_event, on_phase
        self.run_dir = cfg.work_dir / "runs"  # pid files of this GPU's servers (workers use one per GPU)
        self.numerics = ProbePlanner(cfg, self.sample.rows, timeout_s=self.timeouts.request_s)  # the fidelity probe

    def trial_dir(self, number: int | str) -> Path:
        base = self.cfg.work_dir / "trials" / ("defaults" if number == DEFAULTS_RUN else str(number))
        if not base.exists():
            return base
        k = 1
        while (base / f"repeat-{k}").exists():
            k += 1
        return base / f"repeat-{k}"

    def __call__(self, config: dict[str, Any], trial_number: int) -> TrialResult:
        trial_dir = self.trial_dir(trial_number)
        probe = None
        if trial_number != DEFAULTS_RUN and not trial_dir.name.startswith("repeat-"):
            # The fidelity probe on a trial's first launch only (confirmation repeats re-measure speed).
            probe, failed = self.numerics.probe_for(config, trial_number, record=self._record_reference)
            if failed is not None:
                return missing_reference(failed, config)
        return run_trial(self.engine, config, self.workload, trial_dir=trial_dir,
                         gpu_index=self.cfg.engine.gpu, port=self.cfg.engine.port, timeouts=self.timeouts,
                         on_phase=self.on_phase, stop_event=self.stop_event, run_dir=self.run_dir,
                         sample=self.sample, probe=probe)

    def _record_reference(self, probe: FidelityProbe) -> TrialResult:
        """A launch of the reference config that only records the probe's reference outputs (its window cut to
        a second): for a resumed study whose reference file is missing."""
        if self.on_phase is not None:
            self.on_phase("recording the numerics reference (baseline config)", {})
        short = dataclasses.replace(self.workload, warmup_s=0.0, measure_s=1.0)
        return run_trial(self.engine, self.numerics.reference_cfg, short, trial_dir=self.trial_dir(REFERENCE_RUN),
                         gpu_index=self.cfg.engine.gpu, port=self.cfg.engine.port, timeouts=self.timeouts,
                         on_phase=self.on_phase, stop_event=self.stop_event, run_dir=self.run_dir,
                         sample=self.sample, probe=dataclasses.replace(probe, only=True))
