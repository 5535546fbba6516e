"""The confirmation stage: run (or reuse) the interleaved runs, stage by stage, saved as they land, and store the
verdict with them as the study's confirmation (``record.Confirmation``)."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import optuna

from autotune.config import StudyConfig
from autotune.harness.stress import StressStep
from autotune.harness.windows import WindowsStep
from autotune.results import TrialResult
from autotune.search.confirm.allocation import launch_costs, windows_per_launch
from autotune.search.confirm.decision import ContenderStat, Verdict, decide
from autotune.search.confirm.noise import estimates
from autotune.search.confirm.ranking import contenders, feasible, gains, in_reach
from autotune.search.confirm.record import ATTR, Confirmation, ConfirmationRun, DefaultsRun
from autotune.search.confirm.samples import by_contender, search_rates
from autotune.search.confirm.twins import study_held_tokens
from autotune.search.confirm.warmup import steady_warmup
from autotune.search.runner import RepeatingRunner, Runner
from autotune.search.seeding import finished
from autotune.search.seeding import launch_key as _key
from autotune.sglang.parallel import server_gpus


def confirm(
    study: optuna.Study,
    cfg: StudyConfig,
    *,
    runner: Runner,
    progress: Any = None,
    stop_event: threading.Event | None = None,
    defaults: Callable[[], DefaultsRun | None] | None = None,
) -> Confirmation | None:
    """Run (or reuse) the confirmation stage and store it as the study's confirmation (``record.Confirmation``)."""
    n_done = len(finished(study.get_trials(deepcopy=False)))
    stored = Confirmation.of(study)
    decided = "outcome" in (study.user_attrs.get(ATTR) or {})  # a verdict stored before outcomes is decided again
    if stored is not None and stored.complete and stored.n_trials == n_done and decided:
        return stored
    held = study_held_tokens(cfg, study.get_trials(deepcopy=False))
    top, baseline, refs = contenders(study, cfg.study.confirm_top_k, held=held)
    contenders_by_number = {t.number: t for t in [*top, *refs, *([baseline] if baseline else [])]}
    base_key = _key(baseline) if baseline is not None else None
    as_baseline = [n for n, t in contenders_by_number.items() if base_key is not None and _key(t) == base_key]
    base_n = baseline.number if baseline is not None and feasible(baseline) else None
    results = {n: _result(t) for n, t in contenders_by_number.items()}
    searched = search_rates(results)
    if stored is not None and stored.complete and stored.n_trials == n_done:
        # Decided before a winner equal to the baseline counted as none: the same runs, decided again.
        verdict = decide(
            stored.runs,
            stored.order,
            base_n,
            same_as_baseline=as_baseline,
            resolution=cfg.study.resolution,
            given=stored.given,
            searched=searched,
        )
        return dataclasses.replace(stored, verdict=verdict).store(study)
    order, given = _order(study, top, refs, baseline)
    if not order:
        return None
    # Every confirmation launch warms up until the search launch's first wave of requests would have turned over,
    # once before its windows: the claims are about the job's steady rate, not a search window's young requests.
    warmups = {n: steady_warmup(r, cfg.workload) for n, r in results.items()}
    runs: list[ConfirmationRun] = []
    if stored is not None and stored.n_trials == n_done and list(stored.order) in (order, [*order, base_n]):
        runs = list(stored.runs)  # a confirmation a killed sweep left half done
        if list(stored.order) != order:  # its stand-in baseline was being relaunched (below)
            order, given = list(stored.order), []
    launches = {n: Contender(result=r, warmup_s=warmups[n]) for n, r in results.items()}
    while True:
        state = Confirmation(
            order=tuple(order), n_trials=n_done, given=tuple(given), warmup_s={n: warmups[n] for n in order}
        )
        verdict_now = functools.partial(
            decide,
            runs,
            order,
            base_n,
            same_as_baseline=as_baseline,
            resolution=cfg.study.resolution,
            given=given,
            searched=searched,
        )
        if not _run_stages(
            study, cfg, state, runs, launches, verdict_now, runner=runner, progress=progress, stop_event=stop_event
        ):
            return None
        verdict = verdict_now()
        if base_n is None or base_n in order or base_n not in verdict.contention:
            break
        # The baseline's one search reading, standing in, leaves open whether anything beat it (the leader's
        # search figure that put it out of reach read high): it is relaunched as a contender, and the stages go on.
        order, given = [*order, base_n], []
    # The stress stage runs on this verdict once it is stored (``sweep.run_sweep``: ``stress.stress_winner``); a
    # contender that fails it is demoted through ``decide(demoted=…)`` and the next one stressed.
    measured = defaults() if defaults is not None else None
    if measured is not None and measured.status == "interrupted":
        dataclasses.replace(state, runs=tuple(runs)).store(study)  # a resume measures the defaults again
        return None
    return dataclasses.replace(state, complete=True, runs=tuple(runs), verdict=verdict, defaults=measured).store(study)


def _order(
    study: optuna.Study,
    top: list[optuna.trial.FrozenTrial],
    refs: list[optuna.trial.FrozenTrial],
    baseline: optuna.trial.FrozenTrial | None,
) -> tuple[list[int], list[ConfirmationRun]]:
    """(the contenders in launch order, the search runs standing in): the top k, the hand-written configs in reach,
    and the baseline, relaunched when in reach of the leader, else its search run standing in (``ranking.IN_REACH``)."""
    order = [t.number for t in top + refs]
    given: list[ConfirmationRun] = []
    if baseline is not None and baseline.number not in order and feasible(baseline):
        if in_reach(baseline, top, gains(study)):
            order.append(baseline.number)
        else:  # far behind the leader: its search run stands in for a launch
            given.append(ConfirmationRun(trial=baseline.number, repeat=-1, search=True, result=_result(baseline)))
    return order, given


def next_launches(
    order: list[int], launched: Mapping[int, int], verdict: Verdict, *, first: int, most: int
) -> list[tuple[int, int]]:
    """The next stage's launches, (trial, repeat) in the order they run; none when the confirmation is done
    (``next_stage`` without the stage's number)."""
    return next_stage(order, launched, verdict, first=first, most=most)[1]


def next_stage(
    order: list[int],
    launched: Mapping[int, int],
    verdict: Verdict,
    *,
    first: int,
    most: int,
    most_windows: int | None = None,
) -> tuple[int, list[tuple[int, int]]]:
    """(the stage, its launches as (trial, repeat) in the order they run); no launches when the confirmation is done.

    1. Every contender once (``W`` windows each, in ``order``: drift hits everyone alike).
    2. The top two by estimate up to ``first`` launches each (``confirm_repeats``), interleaved, so the launch
       term is estimated from the study's own relaunches; skipped when the pooled launch term already has the
       degrees of freedom these would give, 2 × (``first`` − 1) (a resumed confirmation, earlier stages).
    3. While a contender is open against the best (``decide``): one more launch of each in ``contention``, up to
       ``most`` launches each (``confirm_max_repeats``) and ``most_windows`` windows (most × ``confirm_windows``:
       a launch of more windows counts for more), each of as many windows as buy the most precision per second
       (``allocation.windows_per_launch``)."""
    fresh = [(n, 0) for n in order if not launched.get(n)]
    if fresh:
        return 1, fresh
    top_two = leaders(order, verdict)
    if verdict.noise.get("launch_df", 0) < 2 * (first - 1):
        short = [(n, k) for k in range(first) for n in top_two if k >= launched[n]]
        if short:
            return 2, short
    if verdict.decided:
        return 3, []
    room = [n for n in order if launched[n] < most and (most_windows is None or _windows(verdict, n) < most_windows)]
    return 3, [(n, launched[n]) for n in room if n in verdict.contention]


def leaders(order: list[int], verdict: Verdict) -> list[int]:
    """The top two contenders by estimate among those with a clean launch."""
    clean = [n for n in order if (s := verdict.stat(n)) and s.runs and not s.failed]
    return sorted(clean, key=lambda n: -(_stat(verdict, n).median or 0.0))[:2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contender:
    """A contender as its confirmation launches run it: its search launch (the config, launched again, and the
    planner's plan, read by the stress phase) and the warm-up floor of its launches (``warmup.steady_warmup``)."""

    result: TrialResult
    warmup_s: float


def _stat(verdict: Verdict, n: int) -> ContenderStat:
    return verdict.stat(n) or ContenderStat()


def _windows(verdict: Verdict, n: int) -> int:
    return _stat(verdict, n).windows


def _run_stages(
    study: optuna.Study,
    cfg: StudyConfig,
    state: Confirmation,
    runs: list[ConfirmationRun],
    contenders: Mapping[int, Contender],
    verdict_now: Callable[[], Verdict],
    *,
    runner: Runner,
    progress: Any,
    stop_event: threading.Event | None,
) -> bool:
    """Stage after stage (``next_stage``), each run saved as it lands so a killed sweep resumes where it was.
    False when interrupted. The top two's last launch of stage 2 runs the stress phase after its windows
    (``stressed_in``), so the winner is usually stressed without a launch of its own (``confirm.stress``).
    ``contenders``: per trial its search launch and the warm-up floor of its launches."""
    order = list(state.order)
    first = cfg.study.confirm_repeats
    most = max(first, cfg.study.confirm_max_repeats)
    while True:
        launched = {n: sum(1 for r in runs if r.trial == n) for n in order}
        verdict = verdict_now()
        stage, plan = next_stage(
            order, launched, verdict, first=first, most=most, most_windows=most * cfg.study.confirm_windows
        )
        if not plan:
            return True
        stressed = stressed_in(plan, leaders(order, verdict), first=first)
        windows = (
            cfg.study.confirm_windows
            if stage < 3
            else windows_per_launch(
                estimates(by_contender(runs, order))[0], launch_costs(runs), base=cfg.study.confirm_windows
            )
        )
        total = len(runs) + len(plan)
        for n, k in plan:
            if stop_event is not None and stop_event.is_set():
                dataclasses.replace(state, runs=tuple(runs)).store(study)
                return False
            if progress is not None:
                progress.confirm_started(len(runs) + 1, total, n, k)
            contender = contenders[n]
            stress = StressStep(plan=contender.result.plan) if (n, k) in stressed else None
            result = _repeat(
                runner, dict(contender.result.config), n, k, windows=windows, stress=stress, warmup_s=contender.warmup_s
            )
            if result.status == "interrupted":
                dataclasses.replace(state, runs=tuple(runs)).store(study)
                return False
            runs.append(ConfirmationRun(trial=n, repeat=k, result=result))
            dataclasses.replace(state, runs=tuple(runs)).store(study)
            if progress is not None:
                progress.confirm_finished(n, result)


def stressed_in(plan: list[tuple[int, int]], top_two: list[int], *, first: int) -> set[tuple[int, int]]:
    """The launches of ``plan`` that run the stress phase after their windows: the top two's last launch of stage 2
    (repeat ``first`` − 1, at least the second). The winner is nearly always one of them; a winner that is not gets
    a stress launch of its own after the decision."""
    return {(n, k) for n, k in plan if n in top_two and k == first - 1 and k >= 1}


def _repeat(
    runner: Runner,
    config: dict[str, Any],
    number: int,
    k: int,
    *,
    windows: int,
    stress: StressStep | None = None,
    warmup_s: float | None = None,
) -> TrialResult:
    """Confirmation launch ``k`` of trial ``number``: a runner that files repeats apart (``HarnessRunner.repeat``:
    its own directory, no fidelity probe) measures ``windows`` windows of one closed loop in it (``harness.windows``)
    after a warm-up floor of ``warmup_s`` (None: the study's), then the stress phase when given; a plain runner gets the
    trial's number and measures one."""
    if not isinstance(runner, RepeatingRunner):
        return runner(config, number)
    after: list[Any] = [WindowsStep(windows - 1, span=server_gpus(config))]
    if stress is not None:
        after.append(stress)
    return runner.repeat(config, number, k, after=after, warmup_s=warmup_s)


def _result(trial: optuna.trial.FrozenTrial) -> TrialResult:
    """A contender's stored result (contenders are finished trials: each stored one)."""
    result = TrialResult.of(trial)
    if result is None:
        raise KeyError(f"trial {trial.number} stored no result")
    return result
