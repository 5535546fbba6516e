"""The confirmation stage: run (or reuse) the interleaved runs, stage by stage, saved as they land, and store the
verdict in ``study.user_attrs["confirmation"]``."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import optuna

from autotune.config import StudyConfig
from autotune.results import TrialResult
from autotune.search.confirm.decision import decide
from autotune.search.confirm.ranking import contenders, feasible
from autotune.search.runner import Runner
from autotune.search.seeding import finished
from autotune.search.summary import launch_key as _key


def repeat_stages(first: int, most: int) -> list[int]:
    """Cumulative repeats per sequential stage: 3 → 5 → 8 for (3, 8); one stage when ``most`` ≤ ``first``."""
    stages = [first]
    for step in (2, 3):
        if stages[-1] < most:
            stages.append(min(most, stages[-1] + step))
    if stages[-1] < most:
        stages.append(most)
    return stages


def confirm(study: optuna.Study, cfg: StudyConfig, *, runner: Runner, progress: Any = None,
            stop_event: threading.Event | None = None,
            defaults: Callable[[], dict[str, Any] | None] | None = None) -> dict[str, Any] | None:
    """Run (or reuse) the confirmation stage and store it as ``study.user_attrs["confirmation"]``."""
    n_done = len(finished(study.get_trials(deepcopy=False)))
    stored = study.user_attrs.get("confirmation")
    if stored and stored.get("complete") and stored.get("n_trials") == n_done and "outcome" in stored:
        return stored
    top, baseline, refs = contenders(study, cfg.study.confirm_top_k)
    contenders_by_number = {t.number: t for t in [*top, *refs, *([baseline] if baseline else [])]}
    base_key = _key(baseline) if baseline is not None else None
    twins = [n for n, t in contenders_by_number.items() if base_key is not None and _key(t) == base_key]
    base_n = baseline.number if baseline is not None and feasible(baseline) else None
    if stored and stored.get("complete") and stored.get("n_trials") == n_done:
        # Decided before a winner equal to the baseline counted as none: the same runs, decided again.
        verdict = decide(stored["runs"], stored["order"], base_n, cfg.study.seed, same_as_baseline=twins)
        confirmation = {**stored, **verdict}
        study.set_user_attr("confirmation", confirmation)
        return confirmation
    order = [t.number for t in top + refs]
    if baseline is not None and baseline.number not in order and feasible(baseline):
        order.append(baseline.number)
    if not order:
        return None
    configs = {n: t.user_attrs["result"]["config"] for n, t in contenders_by_number.items()}
    runs: list[dict[str, Any]] = []
    if stored and stored.get("n_trials") == n_done and stored.get("order") == order:
        runs = list(stored.get("runs", []))  # a confirmation a killed sweep left half done
    state = {"order": order, "n_trials": n_done, "complete": False}
    verdict_now = functools.partial(decide, runs, order, base_n, cfg.study.seed, same_as_baseline=twins)
    if not _run_stages(study, cfg, state, runs, configs, verdict_now, runner=runner, progress=progress,
                       stop_event=stop_event):
        return None
    verdict = verdict_now()
    measured = defaults() if defaults is not None else None
    if measured is not None and measured.get("status") == "interrupted":
        study.set_user_attr("confirmation", {**state, "runs": runs})  # a resume measures the defaults again
        return None
    verdict["defaults"] = measured
    confirmation = {**state, "complete": True, "runs": runs, **verdict}
    study.set_user_attr("confirmation", confirmation)
    return confirmation


def _run_stages(study: optuna.Study, cfg: StudyConfig, state: dict[str, Any], runs: list[dict[str, Any]],
                configs: dict[int, dict[str, Any]], verdict_now: Callable[[], dict[str, Any]], *, runner: Runner,
                progress: Any, stop_event: threading.Event | None) -> bool:
    """The interleaved runs, stage by stage (``repeat_stages``), each saved as it lands so a killed sweep resumes;
    stages after the first re-run only the contenders still in contention. False when interrupted."""
    order = state["order"]
    done = {(r["trial"], r["repeat"]) for r in runs}
    repeats = cfg.study.confirm_repeats
    stages = repeat_stages(repeats, max(repeats, cfg.study.confirm_max_repeats))
    total = repeats * len(order)
    active, first = list(order), 0
    for stage, upto in enumerate(stages):
        if stage:  # the previous stage did not resolve the winner: only the contenders still in contention
            verdict = verdict_now()
            ci = verdict.get("runner_up_ci") or [0.0, 1.0]
            if verdict.get("resolved") or not verdict.get("contention") or ci[0] == ci[1]:
                break  # resolved, or an exact tie without noise that no repeat can resolve
            active = [n for n in order if n in verdict["contention"]]
            total += (upto - first) * len(active)
        for k in range(first, upto):
            for n in active:
                if (n, k) in done:
                    continue
                if stop_event is not None and stop_event.is_set():
                    study.set_user_attr("confirmation", {**state, "runs": runs})
                    return False
                if progress is not None:
                    progress.confirm_started(len(runs) + 1, total, n, k)
                result = _repeat(runner, dict(configs[n]), n, k)
                if result.status == "interrupted":
                    study.set_user_attr("confirmation", {**state, "runs": runs})
                    return False
                runs.append({"trial": n, "repeat": k, "result": result.to_dict()})
                study.set_user_attr("confirmation", {**state, "runs": runs})
                if progress is not None:
                    progress.confirm_finished(n, result)
        first = upto
    return True


def _repeat(runner: Runner, config: dict[str, Any], number: int, k: int) -> TrialResult:
    """Confirmation run ``k`` of trial ``number``: a runner that files repeats apart (``HarnessRunner.repeat``:
    its own directory, no fidelity probe) is told it is one; a plain runner gets the trial's number."""
    repeat = getattr(runner, "repeat", None)
    return repeat(config, number, k) if callable(repeat) else runner(config, number)
