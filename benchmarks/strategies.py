"""The search strategies the tuner is compared against, and the simulated launch they all pay for.

Every strategy proposes configs of the same study space and "launches" them through one ``Oracle``: the
simulator's in-process evaluator (``autotune.sim.evaluate``) memoised per config, with measurement noise drawn
per launch, and the modelled GPU time each launch would cost on the real machine. Memoising is what makes
thousands of trials affordable; the noise model keeps the search as noisy as a real sweep.

The noise has one term (``noise_cv``: the whole spread of a launch) or, with ``launch_cv`` set, the confirmation's
two: a launch term of that stated CV, drawn once per launch, and a window term drawn per window, each config's own
from its simulated window (the settle rule's 95 % half-width of the window's mean over 1.96). A confirmation launch
of ``W`` windows (``runner.repeat(…, after=[WindowsStep(W − 1)])``) costs its startup and warm-up once and W
windows: its windows are consecutive spans of one closed loop (``harness.windows``), so their window terms are
correlated through the requests they share: windows i and j correlate max(0, 1 − |i − j| · L / D) (``window_corr``),
L the window, D a request's mean life in the loop (Little's law on the simulated window: requests running at once
over requests finished per second). A loop of answers far longer than its windows has windows that move together.

The stress phase (``harness.stress``: the full running cap of the sample's longest prompts, every one decoding to
``max_tokens``) is modelled by its cost only: it runs until every running request reached ``max_tokens``, i.e.
``running × max_tokens ÷ tok/s`` of the config, at most the phase's cap (``DEFAULT_CAP_S``), times the GPUs a server
spans. In a confirmation launch (``stages.stressed_in``) it follows the windows; a stress launch of its own
(``confirm.stress``) adds a startup and a window. Every config is taken to survive it: whether a config dies under
the stress batch is the simulator's own test (``tests/test_stress_stage.py``), not this table's.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from autotune.config import StudyConfig
from autotune.harness.stress import DEFAULT_CAP_S, StressStep
from autotune.harness.windows import WindowsStep
from autotune.harness.workload import settling_figures
from autotune.results import GpuPeaks, MeasurementVerdict, StressResult, TrialResult, Window
from autotune.search.confirm import confirm
from autotune.search.confirm.stress import stress_winner
from autotune.search.confirm.warmup import steady_warmup, turnover_s
from autotune.search.correction import CorrectedFeasibility
from autotune.search.objective import directions, make_sampler
from autotune.search.pruning import PRUNED, PruningSettler, SlicePruner
from autotune.search.space import Feasibility, Space, key_of
from autotune.search.study import SearchParts, Sweep
from autotune.search.warm import WARM_KEY
from autotune.settle import with_warmup
from autotune.sim import SimWorkload, evaluate
from autotune.sim.truth import Deviation

BAD_ARGS_S = 10.0  # SGLang rejects bad arguments while parsing them, before any weight is loaded
OOM = frozenset({"startup_oom", "runtime_oom"})


@dataclass(frozen=True, kw_only=True)
class Truth:
    """The hidden truth: how the benchmark's simulated machine and workload differ from what the study assumes.
    Drawn per case and workload (``search_efficiency.draw_truth``); the study, its planner and its prior never see
    it — it reaches only ``autotune.sim.evaluate`` (memory, speed) and the requests (acceptance, output length)."""

    deviation: Deviation = Deviation()
    acceptance: float = 0.825
    output_mean: float = 2500.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.deviation.to_dict(),
            "acceptance": round(self.acceptance, 4),
            "output_mean": round(self.output_mean, 1),
        }


_SPACES: dict[tuple[str, int], Space] = {}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a study (space, baseline, workload) on one simulated model and GPU."""

    name: str
    cfg: StudyConfig
    workload: SimWorkload
    tp: int  # GPUs one server occupies: GPU time = wall time × tp
    truth: Truth = Truth()

    @property
    def baseline(self) -> dict[str, Any]:
        return self.cfg.baseline_config()

    @property
    def space(self) -> Space:
        """The study's space after the study's own inert-flag pruning: every strategy searches this one (computed
        once per process; kept out of the instance so a case still pickles for worker processes)."""
        key = (self.name, id(self.cfg))
        if key not in _SPACES:
            _SPACES[key] = self._pruned()
        return _SPACES[key]

    def _pruned(self) -> Space:
        space = Space.from_config(self.cfg)
        feas = Feasibility.from_config(self.cfg)
        if feas is None:
            return space
        contexts = self.cfg.given_configs()
        return space.without(set(feas.inert_everywhere(space, contexts)))


def simulate(
    case: Case, config: Mapping[str, Any], workload: SimWorkload | None = None, *, seed: int = 0, noise: float = 0.0
) -> Any:
    """``config`` on the case's hidden truth (its model, GPU, deviations, acceptance and output length), over the
    case's workload or ``workload``: the one way the benchmark runs the simulator."""
    eng, truth = case.cfg.engine, case.truth
    return evaluate(
        dict(config),
        workload or case.workload,
        model=eng.profile or eng.model,
        gpu=eng.sim_gpu,
        seed=seed,
        noise=noise,
        deviation=truth.deviation,
        acceptance=truth.acceptance,
        output_mean=truth.output_mean,
    )


@dataclass(frozen=True)
class Outcome:
    """What launching a config once, noise-free, gives: status, tok/s, and the modelled seconds it costs."""

    status: str
    tok_s: float
    cost_s: float  # GPU-seconds of one launch: startup (+ warm-up + window, or until the OOM hit) × tp
    result: TrialResult
    drift: float = 0.0  # the window's ``window_drift``: how far its halves' tokens differ (an unsettled load)
    window_cv: float = 0.0  # the window term: the settle rule's half-width of the window's mean ÷ 1.96
    window_s: float = 0.0  # GPU-seconds of one more window in the same launch (the loop goes on): window × tp
    request_life_s: float = 0.0  # a request's mean life in the loop (Little's law), for ``window_corr``
    settling: Any = None  # the window's slices (``autotune.settle.Settling``), for the slice pruner's proposal row


@dataclass(frozen=True)
class Launch:
    """One trial of a strategy. ``observed`` is what the strategy saw; ``true`` what the config is worth."""

    config: dict[str, Any]
    status: str  # a TrialResult status; "skipped_infeasible" is not a launch and costs nothing
    observed: float
    true: float
    cost_s: float

    @property
    def launched(self) -> bool:
        return self.status != "skipped_infeasible"


class Oracle:
    """Noise-free evaluation of each distinct config once (seed 0), shared by every strategy and seed."""

    def __init__(self, case: Case, *, noise_cv: float, launch_cv: float | None = None):
        self.case, self.noise_cv, self.launch_cv = case, noise_cv, launch_cv
        self.memo: dict[str, Outcome] = {}
        self.asked: set[str] = (
            set()
        )  # the configs a strategy evaluated (the memo also holds the grid's, when not cached)
        eng = case.cfg.engine
        self.model, self.gpu = eng.profile or eng.model, eng.sim_gpu  # the ground truth's planner reads them

    def outcome(self, config: Mapping[str, Any], warmup_s: float | None = None) -> Outcome:
        """``config``'s launch with the study's warm-up, or with a longer warm-up floor ``warmup_s`` (a confirmation
        window's, ``confirm.warmup``: evaluated and memoised apart)."""
        key = key_of(config)
        self.asked.add(key)
        workload = with_warmup(self.case.workload, warmup_s)
        if workload is not self.case.workload:
            key = f"{key}@{workload.warmup_s:g}"
        if key not in self.memo:
            self.memo[key] = self._evaluate(dict(config), workload)
        return self.memo[key]

    def _evaluate(self, config: dict[str, Any], wl: SimWorkload) -> Outcome:
        ev = simulate(self.case, config, wl)
        startup = ev.startup_s or 0.0
        status = ev.status if ev.status in ("ok", "startup_oom", "runtime_oom", "bad_args") else "crash"
        if status == "ok":
            wall = startup + wl.warmup_s + wl.measure_s
        elif status == "startup_oom":
            wall = startup  # the load (and capture) until the failure
        elif status == "runtime_oom":
            wall = startup + ev.sim_s  # served until the batch that did not fit
        else:
            wall = BAD_ARGS_S
        # What a real trial reports: capacity from the log, NVML's peak, the failure line. Not the simulator's plan:
        # it holds the truth's deviations, which the study must not see (it stores its own planner's prediction).
        gpu = None
        if status == "ok" and ev.plan:
            x = ev.plan["extra"]
            total = float(x.get("total_gib") or 0.0)
            gpu = GpuPeaks(
                peak_used_gib=float(x["peak_gib"]),
                total_gib=total,
                headroom_gib=total - float(x["peak_gib"]),
                samples=1,
            )
        # The modelled seconds, recorded as the harness records its own: the confirmation splits windows and
        # relaunches by them (``search.confirm.allocation``).
        durations = {"startup": startup, "warmup": wl.warmup_s, "measure": wl.measure_s} if status == "ok" else {}
        result = TrialResult(
            status=status,
            config=config,
            engine="sim",
            capacity=ev.capacity,
            metrics=ev.metrics,
            gpu=gpu,
            reason=ev.reason,
            modelled_startup_s=ev.startup_s,
            durations_s=durations,
        )
        half = ev.settling.half_width if ev.settling is not None and ev.settling.half_width else 0.0
        return Outcome(
            status=status,
            tok_s=ev.output_tok_s if status == "ok" else 0.0,
            cost_s=wall * self.case.tp,
            result=result,
            drift=ev.window_drift,
            window_cv=half / 1.96,
            window_s=wl.measure_s * self.case.tp,
            settling=ev.settling,
            request_life_s=_request_life(result, wl.max_tokens),
        )

    def stress_s(self, config: Mapping[str, Any]) -> float:
        """GPU-seconds of the stress phase after a launch's windows (see the module docstring); 0 for a config that
        served nothing."""
        out = self.outcome(config)
        if not out.tok_s:
            return 0.0
        running = (out.result.capacity.max_running_requests if out.result.capacity else None) or 1
        return min(DEFAULT_CAP_S, running * self.case.workload.max_tokens / out.tok_s) * self.case.tp

    def launch(
        self, config: Mapping[str, Any], rng: np.random.Generator, windows: int = 1, warmup_s: float | None = None
    ) -> tuple[Launch, TrialResult]:
        """One measured launch of ``windows`` windows, each after the warm-up floor ``warmup_s`` (None: the study's):
        the true value times the noise, the way a re-run scatters (one term, or the launch term once and the window
        term per window: see the module docstring)."""
        out = self.outcome(config, warmup_s)
        if not out.tok_s:
            return Launch(dict(config), out.status, 0.0, out.tok_s, out.cost_s), out.result
        if self.launch_cv is None:
            seen = [out.tok_s * (1.0 + self.noise_cv * float(rng.standard_normal())) for _ in range(windows)]
        else:
            shift = self.launch_cv * float(rng.standard_normal())
            corr = window_corr(windows, self.case.workload.measure_s, out.request_life_s)
            terms = np.linalg.cholesky(corr) @ rng.standard_normal(windows)
            seen = [out.tok_s * math.exp(shift + out.window_cv * float(z)) for z in terms]
        durations = {
            **out.result.durations_s,
            **({"windows": (windows - 1) * out.window_s / self.case.tp} if windows > 1 else {}),
        }
        result = dataclasses.replace(
            out.result,
            metrics=dataclasses.replace(out.result.metrics, output_tok_s=seen[0]),
            windows=tuple(_window(i + 2, v) for i, v in enumerate(seen[1:])) or None,
            durations_s=durations,
        )
        cost = out.cost_s + (windows - 1) * out.window_s
        return Launch(dict(config), out.status, seen[0], out.tok_s, cost), result


def _request_life(result: TrialResult, max_tokens: int) -> float:
    """A request's mean life in the loop, by Little's law on the simulated window: the requests running at once
    (the streams, at most the server's cap) over the requests finished per second; a window that finished none
    bounds it by a ``max_tokens`` answer at the per-request rate (``confirm.warmup.turnover_s``); 0 without a rate."""
    metrics = result.metrics
    if metrics is None or not metrics.output_tok_s:
        return 0.0
    if not metrics.request_s:
        return turnover_s(result, max_tokens) or 0.0
    cap = result.capacity.max_running_requests if result.capacity is not None else None
    running = min(metrics.concurrency, cap) if metrics.concurrency and cap else metrics.concurrency or cap or 0
    return running / metrics.request_s


def window_corr(windows: int, window_s: float, life_s: float) -> np.ndarray:
    """The correlation of the window terms of ``windows`` consecutive windows of one loop: the share of a window's
    requests still running ``|i − j|`` windows later, max(0, 1 − |i − j| · window / life) (a triangle: a valid
    correlation), with a small ridge so the Cholesky factor exists when windows are far shorter than a life."""
    lag = np.abs(np.subtract.outer(np.arange(windows), np.arange(windows)))
    corr = np.clip(1.0 - lag * window_s / life_s, 0.0, None) if life_s > 0 else np.eye(windows)
    return corr + 1e-9 * np.eye(windows)


def _window(index: int, tok_s: float) -> Window:
    """A later window of a launch as the harness stores it (``results.Window``)."""
    return Window(
        index=index,
        status="ok",
        output_tok_s=tok_s,
        tok_s_per_gpu=None,
        output_tokens=0,
        window_s=0.0,
        settled=True,
        first_pass=index - 1,
        last_pass=index - 1,
    )


Strategy = Callable[[Case, Oracle, int, int], list[Launch]]


# --- ours: the real study loop ------------------------------------------------------------------------------
class _Quiet:
    """A progress sink that prints nothing (the benchmark prints its own summary)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class Launches(list):
    """A strategy's launches, plus what its whole pipeline names (after confirmation, where it has one)."""

    named: float | None = None  # true tok/s of the config the pipeline names (None: its best observed launch)
    named_config: dict[str, Any] | None = None
    confirm_launches: int = 0
    confirm_cost_s: float = 0.0  # the confirmation's launches, less their stress phases
    confirm_note: str = ""
    stress_launches: int = 0  # stress launches of their own (a stress phase in a confirmation launch is not one)
    stress_cost_s: float = 0.0  # every stress phase, and the whole of a stress launch of its own
    confirm: dict[str, Any] | None = None  # the confirmation's verdict as the study stores it (``calibration``)
    trial_configs: dict[int, dict[str, Any]] | None = None  # trial number → the config it launched
    steady: float = 0.0  # the steady-state rate per GPU of the config the pipeline names (``steady_truth``)
    search_stop: dict[str, Any] | None = None  # how ours' search ended (``search.stopping``): budget or patience
    pruned: int = 0  # search launches the slice pruner ended early (the ``ours-pruned`` proposal)
    study: Any = None  # the run's study (a warm start reads the earlier one: ``warm_start.py``)


class _Uncorrected(CorrectedFeasibility):
    """Ablation: the planner never learns (no capacity offset, no room correction)."""

    def learn(self, config, kv_tokens):
        return None

    def learn_trial(self, config, result):
        return {}


class _NoPrecheck(CorrectedFeasibility):
    """Ablation: the planner places edge starts and learns, but never skips a config."""

    def sure_failure(self, memory_plan) -> bool:
        return False


@functools.cache
def _workdir() -> Path:
    """A scratch folder for this process's studies, removed when it exits."""
    path = Path(tempfile.mkdtemp(prefix=f"autotune-bench-{os.getpid()}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class _SweepRunner:
    """The sweep's runner on the oracle: a search launch per call; ``repeat`` is a confirmation launch with the
    windows its follow-up steps ask for (``WindowsStep``), as ``HarnessRunner.repeat`` measures them, and the
    stress phase when one is asked for (``StressStep``): a launch with windows is the confirmation's, its stress
    phase the stress's; one with only a stress step is a stress launch of its own."""

    def __init__(
        self,
        oracle: Oracle,
        rng: np.random.Generator,
        launches: dict[int, Launch],
        confirm_runs: list[Launch],
        prune_resolution: float | None = None,
        turnover: bool = False,
    ):
        self.oracle, self.rng, self.launches, self.confirm_runs = oracle, rng, launches, confirm_runs
        self.turnover = turnover  # set: every search launch warms up until its first wave has turned over
        self.stress_runs: list[float] = []  # GPU-seconds of each stress phase (with its launch, when its own)
        self.stress_launches = 0
        self.prune_resolution = prune_resolution  # set: search launches run under the slice pruner (``search.pruning``)
        self.pruned = 0  # search launches the pruner ended early

    def __call__(self, config: dict[str, Any], number: int) -> TrialResult:
        warmup_s = None
        if self.turnover and number not in self.launches:  # the confirmation's warm-up rule on a search launch
            out = self.oracle.outcome(config)
            warmup_s = steady_warmup(out.result, self.oracle.case.workload) if out.status == "ok" else None
        launch, result = self.oracle.launch(config, self.rng, warmup_s=warmup_s)
        if number in self.launches:  # a confirmation repeat of a search trial (a plain runner's)
            self.confirm_runs.append(launch)
        else:
            launch, result = self._pruned(launch, result)
            self.launches[number] = launch
        return result

    def _pruned(self, launch: Launch, result: TrialResult) -> tuple[Launch, TrialResult]:
        """The launch as the slice pruner would have ended it, against the best measured so far: cut at the slice
        where it stopped (the GPU time after it not spent), its figure the window's mean so far times the launch's
        noise, recorded unsettled (never crowned). Unchanged when not pruned."""
        if self.prune_resolution is None or launch.status != "ok":
            return launch, result
        out = self.oracle.outcome(launch.config)
        best = max((x.observed for x in self.launches.values() if x.status == "ok"), default=0.0)
        if out.settling is None or not best:
            return launch, result
        settling = out.settling
        settler = PruningSettler(self.oracle.case.workload.rule, SlicePruner(best, self.prune_resolution))
        done = next((d for d in (settler.add(r * settling.slice_s) for r in settling.tok_s) if d is not None), None)
        if done is None or done.settled or not done.reason.startswith(PRUNED):
            return launch, result
        window = done.tok_s[done.warmup_slices :]
        seen = sum(window) / len(window) * (launch.observed / out.tok_s)
        saved = self.oracle.case.workload.warmup_s + self.oracle.case.workload.measure_s - done.total_s
        cost = launch.cost_s - max(0.0, saved) * self.oracle.case.tp
        metrics = dataclasses.replace(result.metrics, output_tok_s=seen) if result.metrics else None
        result = dataclasses.replace(
            result, metrics=metrics, measurement=MeasurementVerdict.from_dict(settling_figures(done))
        )
        self.pruned += 1
        return dataclasses.replace(launch, observed=seen, cost_s=cost), result

    def repeat(self, config: dict[str, Any], number: int, k: int, *, after=(), warmup_s=None) -> TrialResult:
        windows = 1 + sum(step.count for step in after if isinstance(step, WindowsStep))
        launch, result = self.oracle.launch(config, self.rng, windows, warmup_s)
        if not any(isinstance(step, StressStep) for step in after):
            self.confirm_runs.append(launch)
            return result
        stress_s = self.oracle.stress_s(config)
        if any(isinstance(step, WindowsStep) for step in after):
            self.confirm_runs.append(launch)
            self.stress_runs.append(stress_s)
        else:
            self.stress_runs.append(launch.cost_s + stress_s)
            self.stress_launches += 1
        if result.status != "ok":
            return result
        cap = result.capacity.max_running_requests if result.capacity else None
        gpu = result.gpu
        stress = StressResult(
            survived=True,
            ended="all requests done",
            duration_s=stress_s / self.oracle.case.tp,
            running_cap=cap,
            max_tokens=self.oracle.case.workload.max_tokens,
            peak_used_gib=gpu.peak_used_gib if gpu else None,
            total_gib=gpu.total_gib if gpu else None,
            reached_peak=True,
        )
        return dataclasses.replace(result, stress=stress)


def _sweep(
    case: Case,
    oracle: Oracle,
    budget: int,
    seed: int,
    *,
    edges: bool = True,
    precheck: bool = True,
    correction: bool = True,
    planner: bool = True,
    confirmation: bool = True,
    launches_cap: int | None = None,
    patience: int = 0,
    prune: bool = False,
    warm: Mapping[str, Any] | None = None,
    study: Mapping[str, Any] | None = None,
    turnover: bool = False,
) -> Launches:
    """``autotune.search.study``'s Sweep as shipped (then ``confirm`` as a sweep runs it), with the oracle as its
    runner; the keywords switch parts off for the ablation rows; ``warm``: the record ``sweep --from`` writes
    (``search.views.origin.warm_record``), the study started from an earlier one; ``study``: more ``[study]`` keys;
    ``turnover``: every search launch warms up as a confirmation launch does (``confirm.warmup.steady_warmup``).
    The run keeps its study (``Launches.study``)."""
    update = {
        "trials": launches_cap or budget,
        "seed": seed,
        "storage": "sqlite:///:memory:",
        "patience": patience,
        **(study or {}),
    }
    if not edges:
        update["edge_starts"] = 0
    # A study directory of this process's own: parallel benchmark workers running the same study file would
    # otherwise hold each other's sweep lock (one sweep per study and GPU).
    cfg = case.cfg.model_copy(
        update={"study": case.cfg.study.model_copy(update=update), "path": _workdir() / f"{case.cfg.name}.toml"}
    )
    rng = np.random.default_rng([seed, 0])
    launches: dict[int, Launch] = {}
    confirm_runs: list[Launch] = []
    runner = _SweepRunner(oracle, rng, launches, confirm_runs, cfg.study.resolution if prune else None, turnover)

    # The same loop on Optuna's in-memory storage: SQLite bookkeeping would cost more CPU than the simulator.
    parts = SearchParts.of(cfg, study=optuna.create_study(directions=directions(cfg), sampler=make_sampler(cfg)))
    if warm:
        parts.study.set_user_attr(WARM_KEY, dict(warm))
    feas = parts.feasibility
    if not planner:
        parts = dataclasses.replace(parts, feasibility=None, space=case.space)  # same pruned space, no planner
    elif feas is not None and not correction:
        parts = dataclasses.replace(parts, feasibility=_Uncorrected(feas.model, feas.gpu, margin_gib=feas.margin_gib))
    elif feas is not None and not precheck:
        parts = dataclasses.replace(parts, feasibility=_NoPrecheck(feas.model, feas.gpu, margin_gib=feas.margin_gib))
    sweep = Sweep(cfg, runner=runner, progress=_Quiet(), parts=parts)
    try:
        study = sweep.run()
        out = Launches()
        out.study = study
        out.search_stop = dict(study.user_attrs.get("search_stop") or {})
        out.pruned = runner.pruned
        for trial in study.get_trials(deepcopy=False):
            if trial.number in launches:
                out.append(launches[trial.number])
            elif trial.user_attrs.get("status") == "skipped_infeasible":
                out.append(Launch(dict(trial.user_attrs.get("config", {})), "skipped_infeasible", 0.0, 0.0, 0.0))
        if confirmation and cfg.study.confirm_top_k > 0:
            confirmed = confirm(study, cfg, runner=runner)
            confirmed = stress_winner(study, cfg, confirmed, runner=runner) or confirmed
            conf = confirmed.to_dict() if confirmed is not None else {}  # the stored form the tables read
            by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
            named = conf.get("winner_trial")
            if named is None:
                named = conf.get("baseline_trial")
            if named is not None and named in launches:
                out.named, out.named_config = launches[named].true, launches[named].config
            elif named is not None and named in by_number:
                out.named_config = by_number[named].user_attrs["result"]["config"]
                out.named = oracle.outcome(out.named_config).tok_s
            out.confirm_launches = len(confirm_runs)
            out.confirm_cost_s = sum(x.cost_s for x in confirm_runs)
            out.stress_launches, out.stress_cost_s = runner.stress_launches, sum(runner.stress_runs)
            out.confirm_note = str(conf.get("note") or "")
            out.confirm = dict(conf)
            out.trial_configs = {n: x.config for n, x in launches.items()}
        return out
    finally:
        sweep.close()


def ours(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    """``autotune.search.study``'s Sweep as shipped: baseline + enqueued first, the memory-edge starts placed one at a
    time with the corrected planner, TPE with OOM constraints, the planner pre-check, then confirmation."""
    return _sweep(case, oracle, budget, seed)


def ours_no_edges(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    return _sweep(case, oracle, budget, seed, edges=False)


def ours_no_precheck(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    return _sweep(case, oracle, budget, seed, precheck=False)


def ours_no_correction(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    return _sweep(case, oracle, budget, seed, correction=False)


def first_edge_alone(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    """The baseline, the enqueued configs and the first edge start, nothing else: the pick is the best of them."""
    given = 1 + len(case.cfg.enqueue)
    return _sweep(case, oracle, budget, seed, confirmation=False, launches_cap=min(budget, given + 1))


def tpe_constraints(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    """The study loop with no planner: TPE with OOM as a violated constraint, baseline and enqueued first."""
    return _sweep(case, oracle, budget, seed, planner=False, confirmation=False)


# --- what existing tools do ---------------------------------------------------------------------------------
def _sampled(
    case: Case, oracle: Oracle, budget: int, seed: int, sampler: optuna.samplers.BaseSampler, tag: int
) -> list[Launch]:
    """Ask/tell over the whole declared space with no planner: every proposal is launched, an OOM is FAIL."""
    space, rng = case.space, np.random.default_rng([seed, tag])
    study = optuna.create_study(direction="maximize", sampler=sampler)
    out = []
    for _ in range(budget):
        trial = study.ask()
        launch, _ = oracle.launch(space.suggest(trial), rng)
        out.append(launch)
        if launch.status == "ok":
            study.tell(trial, launch.observed)
        else:
            study.tell(trial, state=TrialState.FAIL)
    return out


def tpe_plain(case: Case, oracle: Oracle, budget: int, seed: int) -> list[Launch]:
    """Optuna's default TPE, OOM as a failed trial, no planner (how generic tuning scripts use Optuna)."""
    return _sampled(case, oracle, budget, seed, optuna.samplers.TPESampler(seed=seed), 1)


def random_search(case: Case, oracle: Oracle, budget: int, seed: int) -> list[Launch]:
    # Its own seed stream: TPE's start-up trials are random with the plain seed, and OOMs (FAIL) keep TPE in
    # start-up longer, so the two would otherwise propose the same configs.
    return _sampled(case, oracle, budget, seed, optuna.samplers.RandomSampler(seed=seed + 100_003), 2)


def _levels(dist: Any, n: int, rng: np.random.Generator) -> list[Any]:
    """``n`` evenly spaced values of a distribution (categoricals: all choices, shuffled if more than n)."""
    if isinstance(dist, CategoricalDistribution):
        choices = list(dist.choices)
        return choices if len(choices) <= n else list(rng.choice(np.array(choices, dtype=object), n, replace=False))
    if n <= 1:
        return [dist.high]
    raw = np.linspace(dist.low, dist.high, n)
    if isinstance(dist, IntDistribution):
        step = dist.step or 1
        return sorted({int(dist.low + round((v - dist.low) / step) * step) for v in raw})
    assert isinstance(dist, FloatDistribution)
    step = dist.step
    return sorted(
        {round(dist.low + round((v - dist.low) / step) * step, 6) if step else round(float(v), 6) for v in raw}
    )


class _Runner:
    """Launches configs for the grid strategies, stopping at the budget; remembers what each config scored."""

    def __init__(self, case: Case, oracle: Oracle, budget: int, rng: np.random.Generator):
        self.case, self.oracle, self.budget, self.rng = case, oracle, budget, rng
        self.space = case.space
        self.launches: list[Launch] = []
        self.seen: dict[str, float] = {}

    @property
    def full(self) -> bool:
        return len(self.launches) >= self.budget

    def run(self, values: Mapping[str, Any]) -> float:
        """The observed tok/s of a config (0 for a failure); a config already measured is not run again."""
        config = self.space.complete({**self.space.fixed, **values})
        key = key_of(config)
        if key not in self.seen and not self.full:
            launch, _ = self.oracle.launch(config, self.rng)
            self.launches.append(launch)
            self.seen[key] = launch.observed
        return self.seen.get(key, 0.0)


def tiered_grid(case: Case, oracle: Oracle, budget: int, seed: int) -> list[Launch]:
    """SGLang ``auto_benchmark`` style: from the baseline, sweep one knob at a time in tiers (keeping each
    tier's best), then a small factorial over the two best values of the first three knobs."""
    run = _Runner(case, oracle, budget, np.random.default_rng([seed, 3]))
    params = [p for p in run.space.params if p.spec.when is None and p.spec.condition is None]
    base = {k: v for k, v in case.baseline.items() if k not in case.cfg.engine.fixed}
    best, best_value = dict(base), run.run(base)
    factorial = min(8, budget // 4)
    per_knob = max(1, (budget - 1 - factorial) // max(1, len(params)))
    top: dict[str, list[Any]] = {}
    for param in params:
        scores = {}
        for value in _levels(param.distribution, per_knob, run.rng):
            scores[value] = run.run({**best, param.name: value})
        ranked = sorted(scores, key=lambda v: -scores[v])
        top[param.name] = ranked[:2]
        if ranked and scores[ranked[0]] > best_value:
            best, best_value = {**best, param.name: ranked[0]}, scores[ranked[0]]
    knobs = [p.name for p in params if len(top.get(p.name, [])) == 2][:3]
    for combo in itertools.product(*(top[k] for k in knobs)):
        run.run({**best, **dict(zip(knobs, combo, strict=True))})
    _fill_random(run, seed)
    return run.launches


def vllm_grid(case: Case, oracle: Oracle, budget: int, seed: int) -> list[Launch]:
    """vLLM ``auto_tune.sh`` style: a 2-knob grid, max running requests × the memory fraction (highest first),
    everything else at the baseline."""
    run = _Runner(case, oracle, budget, np.random.default_rng([seed, 4]))
    dists = {p.name: p.distribution for p in run.space.params}
    base = {k: v for k, v in case.baseline.items() if k not in case.cfg.engine.fixed}
    n_mem = 2 if budget < 20 else 4 if budget < 40 else 5
    n_seqs = max(1, budget // n_mem)
    seqs = _levels(dists["max_running_requests"], n_seqs, run.rng)
    mems = sorted(_levels(dists["mem_fraction_static"], n_mem, run.rng), reverse=True)
    for seqs_value, mem in itertools.product(seqs, mems):
        run.run({**base, "max_running_requests": seqs_value, "mem_fraction_static": mem})
    _fill_random(run, seed)
    return run.launches


def _fill_random(run: _Runner, seed: int) -> None:
    """Spend a budget the design left over (duplicates collapsed) on random configs, so budgets are equal."""
    sampler = optuna.samplers.RandomSampler(seed=seed + 7919)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    tries = 0
    while not run.full and tries < 50 * run.budget:
        tries += 1
        trial = study.ask()
        config = run.space.suggest(trial)
        study.tell(trial, state=TrialState.FAIL)
        run.run({k: v for k, v in config.items() if k not in run.space.fixed})


# Changes to the study loop or space, measured here before they are made (rows drawn dotted). Earlier ones, a
# budget of launches and Mamba slots derived from the running cap, were measured this way and are now shipped.
def ours_pruned(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
    """Ours with the slice pruner on every search launch (``search.pruning``), modelled on the launch's own slices."""
    return _sweep(case, oracle, budget, seed, prune=True)


def ours_with(patience: int = 0, turnover: bool = False, **keys: Any) -> Strategy:
    """Ours with ``[study] patience`` (the search stops after that many launches without a gain beyond the
    resolution; the budget stays the bound), other ``[study]`` keys (e.g. ``confirm_top_k``), and its search launches
    warmed up to a turnover when asked."""

    def strategy(case: Case, oracle: Oracle, budget: int, seed: int) -> Launches:
        return _sweep(case, oracle, budget, seed, patience=patience, study=keys, turnover=turnover)

    return strategy


PROPOSALS: dict[str, Strategy] = {
    "ours-patience-3": ours_with(3),
    "ours-patience-5": ours_with(5),
    "ours-pruned": ours_pruned,
    # measured and not adopted (docs/benchmarks.md): more contenders confirmed; search launches warmed up to a turnover
    "ours-top-5": ours_with(confirm_top_k=5),
    "ours-patience-5-top-5": ours_with(5, confirm_top_k=5),
    "ours-turnover": ours_with(turnover=True),
    "ours-turnover-patience-5": ours_with(5, turnover=True),
}

STRATEGIES: dict[str, Strategy] = {
    "ours": ours,
    "ours-no-edges": ours_no_edges,
    "ours-no-precheck": ours_no_precheck,
    "ours-no-correction": ours_no_correction,
    "first-edge-alone": first_edge_alone,
    "tpe-constraints-no-planner": tpe_constraints,
    "tpe-no-planner": tpe_plain,
    "random": random_search,
    "tiered-grid": tiered_grid,
    "vllm-2knob-grid": vllm_grid,
}


def best_so_far(launches: list[Launch]) -> list[float]:
    """After each trial: the true value of the config the strategy would pick (its best observed so far)."""
    out, pick, pick_obs = [], 0.0, -math.inf
    for launch in launches:
        if launch.status == "ok" and launch.observed > pick_obs:
            pick, pick_obs = launch.true, launch.observed
        out.append(pick)
    return out
