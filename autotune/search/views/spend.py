"""What a study spent, by phase: launches and GPU-hours, as measured here and, on the simulator, with the startup a
real GPU takes in place of the measured one. docs/search.md ("Stopping when the next launch will not pay").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from optuna.trial import FrozenTrial

from autotune.results import TrialResult
from autotune.search.confirm.record import Confirmation
from autotune.search.seeding import launches

# "stress": the stress phase's own launches (one a confirmation launch ran is in its bill); "defaults": SGLang's
# defaults measured once on a real engine (the simulator predicts them, no launch).
PHASES = ("search", "confirmation", "stress", "defaults")


@dataclasses.dataclass(frozen=True)
class PhaseSpend:
    """One phase's launches and GPU-hours (``gpu_h`` measured, ``modelled_gpu_h`` with the reported startups);
    ``untimed``: launches whose durations were not stored, in ``launches`` but not in the hours."""

    phase: str
    launches: int
    gpu_h: float
    modelled_gpu_h: float
    untimed: int = 0


@dataclasses.dataclass(frozen=True)
class Spend:
    """A study's bill, phase by phase in ``PHASES`` order (a phase with no launch left out); ``simulated``: the
    engine was the simulator, whose startups take seconds (the line then gives the modelled bill beside)."""

    phases: tuple[PhaseSpend, ...]
    simulated: bool = False
    device: str = "GPU"  # what a launch occupied: "GPU", or "server" for SGLang's CPU backend (no GPU time)

    @property
    def launches(self) -> int:
        return sum(p.launches for p in self.phases)

    @property
    def gpu_h(self) -> float:
        return sum(p.gpu_h for p in self.phases)

    @property
    def modelled_gpu_h(self) -> float:
        return sum(p.modelled_gpu_h for p in self.phases)

    def line(self) -> str:
        """``spent: 8 search launches 4.3 GPU-min, 4 confirmation launches 5.0 GPU-min; 9.3 GPU-min in all, 1.42
        GPU-h with the startups the modelled GPU takes``; the modelled figure on the simulator only."""
        unit = self.device
        parts = [
            f"{p.launches} {p.phase} launch{'es' if p.launches != 1 else ''} {_h(p.gpu_h, unit)}"
            + (f" ({p.untimed} untimed)" if p.untimed else "")
            for p in self.phases
        ]
        text = "spent: " + ", ".join(parts) + f"; {_h(self.gpu_h, unit)} in all"
        if unit != "GPU":
            text += " on SGLang's CPU backend"
        if self.simulated and self.modelled_gpu_h > self.gpu_h:
            text += f", {_h(self.modelled_gpu_h, unit)} with the startups the modelled GPU takes"
        return text


def _h(hours: float, unit: str = "GPU") -> str:
    """Hours from one up, minutes below: a simulated study's minutes read as minutes, a real study's hours as hours
    (``unit``: what a launch occupied, a GPU or a CPU backend's server)."""
    return f"{hours:.2f} {unit}-h" if hours >= 1.0 else f"{hours * 60:.1f} {unit}-min"


class Timed(Protocol):
    """What the bill reads of a launch: a stored result (``TrialResult``) or a cost kept apart from the
    confirmation's runs (``LaunchCost``: a stress launch of its own, the defaults' launch)."""

    @property
    def durations_s(self) -> Mapping[str, float]: ...

    @property
    def modelled_startup_s(self) -> float | None: ...

    @property
    def gpus_spanned(self) -> int: ...


def launch_seconds(result: Timed) -> tuple[float, float] | None:
    """(measured, modelled) GPU-seconds of one launch: its stored durations times its GPUs, the modelled one with
    the server-reported startup in place of the measured; None when it stored no durations."""
    durations = result.durations_s
    if not durations:
        return None
    wall = sum(float(v) for v in durations.values())
    startup = float(durations.get("startup") or 0.0)
    modelled = wall - startup + (result.modelled_startup_s if result.modelled_startup_s is not None else startup)
    return wall * result.gpus_spanned, max(wall, modelled) * result.gpus_spanned


def phase_spend(phase: str, results: Iterable[Timed | None]) -> PhaseSpend:
    """One phase's bill from its launches' results (None: a launch that stored no result)."""
    launches = untimed = 0
    measured = modelled = 0.0
    for result in results:
        launches += 1
        seconds = launch_seconds(result) if result is not None else None
        if seconds is None:
            untimed += 1
            continue
        measured, modelled = measured + seconds[0], modelled + seconds[1]
    return PhaseSpend(phase, launches, measured / 3600.0, modelled / 3600.0, untimed)


def spend(by_phase: Mapping[str, Sequence[Timed | None]], *, simulated: bool = False, cpu: bool = False) -> Spend:
    """The study's bill from each phase's launches (phases in ``PHASES`` order; empty ones left out); ``cpu``: the
    servers ran on SGLang's CPU backend (the bill in CPU-server time, not GPU time)."""
    return Spend(
        tuple(phase_spend(p, by_phase[p]) for p in PHASES if by_phase.get(p)), simulated, "server" if cpu else "GPU"
    )


def study_spend(
    trials: Sequence[FrozenTrial], confirmation: Confirmation | None, *, simulated: bool, cpu: bool = False
) -> Spend:
    """The bill of a stored study: its search launches (``seeding.launches``), the confirmation's runs, the
    stress phase's own launches and a measured defaults run."""
    conf = confirmation or Confirmation()
    stress_runs = conf.stress.runs if conf.stress is not None else ()
    defaults = conf.defaults
    return spend(
        {
            "search": [TrialResult.of(t) for t in launches(list(trials))],
            "confirmation": [r.result for r in conf.runs],
            "stress": [r.cost for r in stress_runs if not r.in_confirmation and r.status != "not_run"],
            "defaults": [defaults.cost]
            if defaults is not None and str(defaults.how or "").startswith("measured")
            else [],
        },
        simulated=simulated,
        cpu=cpu,
    )
