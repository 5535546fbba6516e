"""Confirmation: re-measure the top configs and the baseline, interleaved, and pick the winner honestly.

One search measurement per config is noisy and the search keeps the lucky ones, so the winner is decided
here: the top-k distinct configs, the baseline and the hand-written configs are run ``repeats`` times each in
the order A B C base A B C base … (drift hits everyone alike); the winner has the best median; the gain over
the baseline carries a seeded bootstrap confidence interval; contenders whose intervals overlap are a tie,
which goes to the fastest median unless its memory headroom is under ``TIE_HEADROOM_FLOOR_GIB``; then to the
roomiest. A best config that runs the baseline's own flags, or whose
interval overlaps the baseline's, did not beat it: then there is no winner (``winner_trial`` None, ``outcome``
``"baseline"``) and nothing to apply.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.progress import PlainProgress
from autotune.results import TrialResult
from autotune.search.diskguard import disk_error
from autotune.search.gpus import gains
from autotune.search.jobview import job_for_study
from autotune.search.objective import per_gpu
from autotune.search.runner import DEFAULTS_RUN, CheckedRunner, Runner, predict
from autotune.search.seeding import finished
from autotune.search.study import Sweep, sigint_stops
from autotune.search.summary import baseline_failure, summarize, unsettled
from autotune.search.summary import launch_key as _key

BOOTSTRAP = 2000


def _feasible(trial: FrozenTrial) -> bool:
    return trial.user_attrs.get("status") == "ok" and all(c <= 0 for c in trial.user_attrs.get("constraint", [0]))


def contenders(study: optuna.Study, top_k: int) -> tuple[list[FrozenTrial], FrozenTrial | None, list[FrozenTrial]]:
    """(top-k distinct feasible trials, the baseline trial, the ok enqueued trials), by search value."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    gain = gains(study)  # swept on several GPUs: rank by tok/s ÷ the trial's own GPU's baseline
    ranked = sorted((t for t in done if _feasible(t) and not unsettled(t)),  # an unsettled figure is never crowned
                    key=lambda t: -gain.get(t.number, t.values[0]))
    seen: set[str | None] = set()
    top: list[FrozenTrial] = []
    for t in ranked:
        key = t.user_attrs.get("launch_key")
        if key in seen or t.user_attrs.get("reused_from") is not None:
            continue
        seen.add(key)
        if len(top) < top_k:
            top.append(t)
    baseline = next((t for t in done if t.user_attrs.get("role") == "baseline"), None)
    refs = [t for t in done if t.user_attrs.get("role") == "enqueued" and _feasible(t)
            and t not in top and t.user_attrs.get("launch_key") != (baseline and baseline.user_attrs.get("launch_key"))]
    return top, baseline, refs


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


def _interval(rng: np.random.Generator, values: list[float]) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median."""
    if len(values) < 2:
        v = _median(values)
        return v, v
    samples = rng.choice(values, size=(BOOTSTRAP, len(values)), replace=True)
    meds = np.median(samples, axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _gain_interval(rng: np.random.Generator, win: list[float], base: list[float]) -> tuple[float, float]:
    a = rng.choice(win, size=(BOOTSTRAP, len(win)), replace=True)
    b = rng.choice(base, size=(BOOTSTRAP, len(base)), replace=True)
    mb = np.median(b, axis=1)
    ratios = np.median(a, axis=1) / np.where(mb > 0, mb, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return float("nan"), float("nan")
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def _headroom(results: list[TrialResult]) -> float | None:
    """Memory left on the device at peak: measured when the GPU monitor saw it, else the planner's figure."""
    seen = [r.gpu.headroom_gib for r in results if r.gpu and r.gpu.headroom_gib is not None]
    if seen:
        return min(seen)
    planned = [r.plan["gib"]["headroom"] for r in results if r.plan and r.plan.get("gib")]
    return min(planned) if planned else None


# A tie goes to the fastest median; only when that config's measured headroom is below this floor does the
# roomiest tied config win instead: the roomier config is usually the slower one (benchmarks/README.md).
TIE_HEADROOM_FLOOR_GIB = 4.0


def decide(runs: list[dict[str, Any]], order: list[int], baseline: int | None, seed: int, *,
           same_as_baseline: Collection[int] = ()) -> dict[str, Any]:
    """Winner, gain and interval from confirmation runs (``{"trial", "repeat", "result"}``), no study needed.

    ``same_as_baseline``: contenders that launched the baseline's exact flags (its launch key). When the best
    contender is the baseline or one of these, or the baseline's interval overlaps the best's (not resolved
    from it), no config beat the baseline: ``winner_trial`` is None, ``outcome`` ``"baseline"``, no gain.
    ``outcome`` is ``"winner"`` when there is one and ``"none"`` when no contender ran cleanly throughout.
    """
    rng = np.random.default_rng(seed)
    tok, stats = _run_stats(rng, runs, order)
    candidates = [n for n in order if stats[n]["runs"] and not stats[n]["failed"]]
    nothing = {"winner_trial": None, "baseline_trial": baseline, "gain": None, "ci_low": None, "ci_high": None}
    if not candidates:
        return {**nothing, "outcome": "none", "note": "no contender ran cleanly in every confirmation run",
                "stats": _jsonable(stats)}
    top = max(candidates, key=lambda n: stats[n]["median"])
    tied = [n for n in candidates if stats[n]["ci"][1] >= stats[top]["ci"][0]]
    twins = {n for n in same_as_baseline if n != baseline}
    unresolved = _baseline_holds(stats, top, tied, baseline, twins)
    if unresolved is not None:
        # the baseline tied with the best: more repeats may separate them (sequential confirmation)
        contention = sorted({top, *(n for n in tied if n not in twins)} | ({baseline} if baseline in candidates else set()))
        return {**nothing, "outcome": "baseline", "note": f"no config beat the baseline: {unresolved}",
                "stats": _jsonable(stats), "resolved": top == baseline or top in twins, "contention": contention}
    tied = [n for n in tied if n not in twins]  # noise around the baseline's flags is no candidate
    resolution = _resolution(rng, tok, stats, top, [n for n in candidates if n not in twins])
    winner, note = _break_tie(stats, top, tied)
    gain = ci_low = ci_high = None
    if baseline is not None and stats.get(baseline, {}).get("median"):
        gain = stats[winner]["median"] / stats[baseline]["median"]
        ci_low, ci_high = _gain_interval(rng, tok[winner], tok[baseline])
    elif baseline is not None:
        note = (note + "; " if note else "") + "the baseline failed in confirmation, so no gain is given"
    if not resolution["resolved"] and resolution["runner_up_trial"] is not None:
        low, high = resolution["runner_up_ci"]
        why = note or f"trial {winner} has the fastest median"
        note = (f"tied: trial {top}'s gain over the runner-up (trial {resolution['runner_up_trial']}) is not resolved "
                f"after {max(stats[top]['runs'], 1)} repeats (95 % CI {low:.3f}–{high:.3f}×); {why}")
    return {"winner_trial": winner, "baseline_trial": baseline, "gain": gain, "ci_low": ci_low,
            "ci_high": ci_high, "outcome": "winner", "note": note, "stats": _jsonable(stats),
            "contention": sorted(set(tied) | ({baseline} if baseline in candidates else set())), **resolution}


def _run_stats(rng: np.random.Generator, runs: list[dict[str, Any]],
               order: list[int]) -> tuple[dict[int, list[float]], dict[int, dict[str, Any]]]:
    """Per trial: its tok/s per run (a failed run counts 0) and their median, interval, failures and headroom."""
    results: dict[int, list[TrialResult]] = {n: [] for n in order}
    for run in runs:
        results.setdefault(run["trial"], []).append(TrialResult.from_dict(run["result"]))
    tok = {n: [(per_gpu(r) or 0.0) if r.ok else 0.0 for r in rs] for n, rs in results.items()}  # the score
    stats = {n: {"median": _median(v), "ci": _interval(rng, v), "runs": len(v),
                 "failed": sum(1 for r in results[n] if not r.ok), "headroom_gib": _headroom(results[n])}
             for n, v in tok.items()}
    return tok, stats


def _baseline_holds(stats: dict[int, dict[str, Any]], top: int, tied: list[int], baseline: int | None,
                    twins: set[int]) -> str | None:
    """Why no config beat the baseline (the best runs its flags, or is within its noise); None when one did."""
    if top == baseline or top in twins:
        return (f"the fastest confirmed config (trial {top}) runs the baseline's own flags" if top != baseline
                else "the baseline has the fastest confirmed median")
    if baseline is not None and baseline in tied:
        return (f"trial {top}'s median ({stats[top]['median']:,.0f} tok/s) is within the baseline's "
                f"run-to-run noise ({stats[baseline]['median']:,.0f} tok/s; 95 % intervals overlap)")
    return None


def _break_tie(stats: dict[int, dict[str, Any]], top: int, tied: list[int]) -> tuple[int, str]:
    """(winner, note) among statistically tied contenders: the fastest median unless it is short of headroom."""
    if len(tied) <= 1:
        return top, ""
    roomy = max(tied, key=lambda n: (stats[n]["headroom_gib"] if stats[n]["headroom_gib"] is not None
                                     else float("-inf"), stats[n]["median"]))
    top_room = stats[top]["headroom_gib"]
    if top_room is not None and top_room >= TIE_HEADROOM_FLOOR_GIB:
        return top, (f"trials {', '.join(map(str, tied))} are statistically tied (95 % intervals overlap); "
                     f"trial {top} has the fastest median and {top_room:.1f} GiB headroom "
                     f"(≥ {TIE_HEADROOM_FLOOR_GIB:.0f} GiB, so headroom does not decide)")
    if roomy != top and stats[roomy]["headroom_gib"] is not None:
        extra = stats[roomy]["headroom_gib"] - (stats[top]["headroom_gib"] or 0.0)
        return roomy, (f"trials {', '.join(map(str, tied))} are statistically tied (95 % intervals overlap); "
                       f"chose trial {roomy} over the fastest median (trial {top}) for {extra:.1f} GiB more headroom")
    return top, (f"trials {', '.join(map(str, tied))} are statistically tied (95 % intervals overlap); "
                 f"trial {top} has the fastest median and the most headroom")


def repeat_stages(first: int, most: int) -> list[int]:
    """Cumulative repeats per sequential stage: 3 → 5 → 8 for (3, 8); one stage when ``most`` ≤ ``first``."""
    stages = [first]
    for step in (2, 3):
        if stages[-1] < most:
            stages.append(min(most, stages[-1] + step))
    if stages[-1] < most:
        stages.append(most)
    return stages


def _resolution(rng: np.random.Generator, tok: dict[int, list[float]], stats: dict[int, dict[str, Any]], top: int,
                candidates: list[int]) -> dict[str, Any]:
    """Whether the best median's gain over the runner-up is resolved: its bootstrap 95 % interval excludes 1."""
    others = [n for n in candidates if n != top]
    if not others:
        return {"runner_up_trial": None, "runner_up_gain": None, "runner_up_ci": None, "resolved": True}
    runner = max(others, key=lambda n: stats[n]["median"])
    gain = stats[top]["median"] / stats[runner]["median"] if stats[runner]["median"] else float("inf")
    low, high = _gain_interval(rng, tok[top], tok[runner])
    resolved = bool(np.isfinite(low) and low > 1.0) or not stats[runner]["median"]
    return {"runner_up_trial": runner, "runner_up_gain": gain, "runner_up_ci": [low, high], "resolved": resolved}


def _jsonable(stats: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {str(n): {**s, "ci": list(s["ci"])} for n, s in stats.items()}


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
    base_n = baseline.number if baseline is not None and _feasible(baseline) else None
    if stored and stored.get("complete") and stored.get("n_trials") == n_done:
        # Decided before a winner equal to the baseline counted as none: the same runs, decided again.
        verdict = decide(stored["runs"], stored["order"], base_n, cfg.study.seed, same_as_baseline=twins)
        confirmation = {**stored, **verdict}
        study.set_user_attr("confirmation", confirmation)
        return confirmation
    order = [t.number for t in top + refs]
    if baseline is not None and baseline.number not in order and _feasible(baseline):
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


# Flags SGLang 0.5.23 chooses together: when the first is left to its default, the others must be unset too
# (speculative_hook.py asserts it), so "its default" for the first means SGLang's choice for the whole group.
CHOSEN_TOGETHER = {"speculative_num_steps": ("speculative_eagle_topk", "speculative_num_draft_tokens")}


def defaults_config(cfg: StudyConfig) -> dict[str, Any]:
    """What "SGLang's defaults" means for this study: SGLang's default for every tuned flag (searched or
    derived), with the study's fixed flags kept (the engine settings, model, device and environment, come with
    the runner). Bare defaults may not even start where the fixed flags are what makes the model run. A fixed
    flag SGLang only accepts beside a tuned one it picks together with (``CHOSEN_TOGETHER``) is left to SGLang."""
    tuned = set(cfg.space) | set(cfg.derived)
    config = {k: v for k, v in cfg.engine.fixed.items() if k not in tuned}
    for lead, group in CHOSEN_TOGETHER.items():
        if config.get(lead) is None:
            for name in group:
                config.pop(name, None)
    return config


def _defaults(cfg: StudyConfig, runner: Runner, progress: Any = None) -> Callable[[], dict[str, Any] | None]:
    """SGLang 0.5.23's defaults for the tuned flags (``defaults_config``): predicted on the sim, measured once
    otherwise, in its own directory (``trials/defaults/``, the runner's ``DEFAULTS_RUN``). A run that fails is
    stored as failed (status, reason, no tok/s), never as 0 tok/s."""
    def measure() -> dict[str, Any] | None:
        config = defaults_config(cfg)
        predicted = predict(cfg, config) if cfg.engine.kind == "sim" else None
        if predicted is not None:
            result = predicted
            how = "predicted by the simulator's virtual clock"
        else:
            if progress is not None:
                progress.log("confirm: SGLang's defaults for the tuned flags (fixed flags kept)")
            result = runner(dict(config), DEFAULTS_RUN)
            how = "measured once during confirmation"
        ok = result.ok and result.output_tok_s is not None
        status = "no_measurement" if result.ok and not ok else result.status
        reason = None if ok else (result.reason or "no measurement")
        if progress is not None and cfg.engine.kind != "sim":
            progress.log(f"  defaults: ok {result.output_tok_s:,.0f} tok/s" if ok else f"  defaults: {status}: {reason}")
        return {"status": status, "output_tok_s": result.output_tok_s if ok else None,
                "tok_s_per_gpu": per_gpu(result) if ok else None, "reason": reason,
                "how": how, "config": config, "trial_dir": result.trial_dir, "log_path": result.log_path}
    return measure


def run_sweep(cfg: StudyConfig, *, runner: Runner | None = None, progress: Any = None) -> dict[str, Any]:
    """Search, then confirm; returns the summary (``autotune sweep --json``).

    Ctrl-C is the same in every stage: one handler for the whole sweep (``sigint_stops``), installed even where
    SIGINT was ignored at start-up (a sweep started with ``&`` from a script), so the first SIGINT stops the
    current server and ends the sweep as interrupted, in the search and in the confirmation alike. No
    confirmation runs without a measured baseline: there would be nothing to confirm a gain over."""
    progress = progress or PlainProgress()
    stop = threading.Event()
    sweep = None
    with sigint_stops(stop):
        try:
            sweep = Sweep(cfg, runner=runner, progress=progress, stop_event=stop)
            study = sweep.run()
            failure = baseline_failure(study)
            if not stop.is_set() and cfg.study.confirm_top_k > 0 and failure is not None:
                progress.log(f"confirm: skipped, the baseline {failure}")
            elif not stop.is_set() and cfg.study.confirm_top_k > 0:
                checked = CheckedRunner(sweep.runner, sweep.device_check)  # every confirmation launch too
                try:
                    confirm(study, cfg, runner=checked, progress=progress, stop_event=stop,
                            defaults=_defaults(cfg, checked, progress))
                except BaseException as exc:  # a full disk here is one line, as in the search
                    err = disk_error(exc, db_path=sweep.db_path, fallback=cfg.work_dir)
                    if err is None:
                        raise
                    raise err from None
        finally:
            if sweep is not None:
                sweep.close()
            progress.close()
    summary = summarize(study, cfg)
    summary["job"] = job_for_study(study, (summary["best"] or {}).get("trial"))  # None without [job]
    summary["interrupted"] = stop.is_set()
    return summary
