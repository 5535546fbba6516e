"""The phases of one launch after its window: the context every phase shares (``Launch``) and the follow-up steps
(``AfterWindow``) a caller adds to a trial — the fidelity probe here, more windows and the stress phase elsewhere.

A step runs in the launch that measured the window, so it costs seconds, not a restart (minutes on a real GPU).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast

from autotune.config import Timeouts
from autotune.harness.engines.base import Engine, GpuReader
from autotune.harness.fidelity import FidelityProbe, ProbeError, run_probe
from autotune.harness.files import writing
from autotune.harness.setup import PhaseCallback
from autotune.harness.workload import PromptSample, ReplayRecords, WorkloadSpec
from autotune.launch import ServerHandle
from autotune.results import FidelityFigures, Outcome, StressResult, Window


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """What every phase of one launch needs; ``durations`` and ``later`` are the parts the phases fill in."""

    engine: Engine
    workload: WorkloadSpec
    sample: PromptSample
    trial_dir: Path
    timeouts: Timeouts
    phase: PhaseCallback
    stop_event: threading.Event | None
    reader: GpuReader | None = None  # the device's reader: the monitor's, and the launcher's release check
    windows: int = 1  # windows the launch's closed loop measures in a row (``harness.windows``)
    durations: dict[str, float] = dataclasses.field(default_factory=dict)
    later: list[ReplayRecords] = dataclasses.field(default_factory=list)  # windows 2.. of the loop, once measured


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What a follow-up step adds to the trial's result or replaces in it: its figures (``fidelity``, ``windows``,
    ``stress``) and, when it ended the launch's run of steps, the status and why. None: left as it was."""

    status: str | None = None
    reason: str | None = None
    exit_code: int | None = None
    log_tail: str | None = None
    fidelity: FidelityFigures | None = None
    windows: tuple[Window, ...] | None = None
    stress: StressResult | None = None

    def fields(self) -> Outcome:
        """The result's fields this outcome sets (its None ones left out), by ``TrialResult`` field name."""
        return cast(
            Outcome,
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None},
        )


class AfterWindow(Protocol):
    """A follow-up step in the launch that measured the window (``run_trial(after=…)``): the probe, more windows,
    the stress phase. ``fields`` is the result so far (``status``, ``capacity``, ``metrics``, …); the step returns
    what it adds or replaces (``StepOutcome``), and records its own duration in ``launch.durations`` (the later
    windows' is the replay's, ``windows``: they ran in the first window's loop)."""

    def runs_after(self, fields: Mapping[str, Any], server: ServerHandle) -> bool:
        """Whether the step runs at all after ``fields`` (usually: the status is ``ok`` and the server alive)."""
        ...

    def __call__(self, server: ServerHandle, launch: Launch, fields: Mapping[str, Any]) -> StepOutcome: ...


def after_ok(fields: Mapping[str, Any], server: ServerHandle) -> bool:
    """The usual precondition of a follow-up step: a trusted window and a live server."""
    return fields.get("status") == "ok" and server.alive


@dataclasses.dataclass(frozen=True)
class ProbeStep:
    """The fidelity probe as a follow-up step: after a trusted window, or (a probe that ``only`` records the
    reference) after any window the server survived."""

    probe: FidelityProbe

    def runs_after(self, fields: Mapping[str, Any], server: ServerHandle) -> bool:
        return fields.get("status") == "ok" or (
            self.probe.only and server.alive and fields.get("status") != "interrupted"
        )

    def __call__(self, server: ServerHandle, launch: Launch, fields: Mapping[str, Any]) -> StepOutcome:
        return _probe(server, self.probe, launch.trial_dir, launch.durations, launch.phase)


def _probe(
    server: ServerHandle, probe: FidelityProbe, trial_dir: Path, durations: dict[str, float], phase: PhaseCallback
) -> StepOutcome:
    """The fidelity probe, after the window in the same launch: figures in ``fidelity``, or ``probe_error``."""
    phase(
        "probing numerics",
        {
            "prompts": len(probe.prompts),
            "tokens": probe.tokens,
            "mode": "recording the reference" if probe.records else "comparing with the reference",
        },
    )
    t0 = time.monotonic()
    try:
        with writing(trial_dir / "fidelity.json"):  # and the reference, when this launch records it
            figures = run_probe(server.base_url, probe, trial_dir=trial_dir)
    except ProbeError as exc:
        durations["probe"] = round(time.monotonic() - t0, 3)
        return StepOutcome(
            status="probe_error",
            reason=f"fidelity probe: {exc}",
            fidelity=FidelityFigures(
                role="reference" if probe.records else "probe",
                error=str(exc),
                changes=tuple(c.to_dict() for c in probe.changes),
                prompts=len(probe.prompts),
                tokens=probe.tokens,
            ),
        )
    durations["probe"] = round(time.monotonic() - t0, 3)
    if not server.alive:  # the probe's requests took the server down: that is this config's outcome too
        return StepOutcome(
            status="probe_error",
            reason="fidelity probe: the server exited during the probe",
            fidelity=dataclasses.replace(figures, error="the server exited during the probe"),
        )
    return StepOutcome(fidelity=figures)
