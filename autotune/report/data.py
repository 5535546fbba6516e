"""Study trials → pandas DataFrames: the numbers every report figure and table draws, computed once and tested.

Pure functions of an Optuna study (and, for latency distributions, the per-request ``records.jsonl`` files
trials leave behind). Failed trials are kept and labelled, never dropped: an OOM is information about where the
memory wall is.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd

from autotune.config import NumericsLimits
from autotune.results import TrialResult, fidelity_summary
from autotune.search.settings import device_name, engine_table

# status → the outcome class a reader sees; the group decides the marker a figure uses.
OUTCOMES: dict[str, tuple[str, str]] = {
    "ok": ("ok", "ok"),
    "startup_oom": ("OOM at startup", "oom"),
    "runtime_oom": ("OOM under load", "oom"),
    "skipped_infeasible": ("infeasible (planner)", "infeasible"),
    "crash": ("crash", "failed"),
    "timeout": ("timeout", "failed"),
    "bad_args": ("bad arguments", "failed"),
    "interrupted": ("interrupted", "failed"),
    "invalid_measurement": ("invalid measurement (sim lagged)", "failed"),
    "client_bound": ("client-bound measurement", "failed"),
    "probe_error": ("fidelity probe failed", "failed"),
}
MEMORY_PARTS = ("weights", "kv", "mamba_states", "spec_intermediates", "graphs", "activations", "other", "headroom")
QUANTILES = {"p5": 5, "p25": 25, "p50": 50, "p75": 75, "p90": 90, "p95": 95, "p99": 99}
PARAM_PREFIX = "params_"


def study_config(study: optuna.Study) -> dict[str, Any]:
    return dict(study.user_attrs.get("autotune") or {})


def model_name(config: Mapping[str, Any]) -> str:
    model = engine_table(config).get("model") or config.get("model")
    if isinstance(model, Mapping):
        return str(model.get("path") or model.get("name") or "model")
    return str(model or "model")


def launch_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The study's interpreter, device and environment, as ``report.launch_command`` takes them."""
    engine = engine_table(config)
    env = engine.get("env") if isinstance(engine.get("env"), Mapping) else {}
    return {"python": engine.get("python") or None, "device": str(engine.get("device") or "cuda"),
            "env": {str(k): str(v) for k, v in env.items()}}


def second_objective(config: Mapping[str, Any]) -> str:
    second = (config.get("objective") or {}).get("second")
    if isinstance(second, Mapping) and second.get("metric"):
        return str(second["metric"])
    return "second objective"


def trial_result(trial: optuna.trial.FrozenTrial) -> TrialResult | None:
    data = trial.user_attrs.get("result")
    return TrialResult.from_dict(data) if isinstance(data, Mapping) else None


def _status(trial: optuna.trial.FrozenTrial, result: TrialResult | None) -> str:
    if result is not None:
        return result.status
    # A FAIL trial without a stored result died in the harness itself; call it what Optuna saw.
    return "interrupted" if trial.state == optuna.trial.TrialState.FAIL else "crash"


def _get(obj: Any, name: str) -> float:
    value = getattr(obj, name, None) if obj is not None else None
    return float(value) if value is not None else math.nan


def tuned_flags(study: optuna.Study) -> list[str]:
    """Flags the search varied, in the order they first appear."""
    names: dict[str, None] = {}
    for trial in study.get_trials(deepcopy=False):
        names.update(dict.fromkeys(trial.params))
    return list(names)


def numerics_limits(config: Mapping[str, Any]):
    """The study's ``[objective] numerics`` (probe size and limits) from its stored config; defaults if absent."""
    raw = (config.get("objective") or {}).get("numerics") if isinstance(config.get("objective"), Mapping) else None
    try:
        return NumericsLimits(**raw) if isinstance(raw, Mapping) else NumericsLimits()
    except Exception:  # noqa: BLE001 - stored by another version: show the figures without limits
        return NumericsLimits()


def _row(trial: optuna.trial.FrozenTrial, flags: Iterable[str], limits: Any = None) -> dict[str, Any]:
    result = trial_result(trial)
    status = _status(trial, result)
    outcome, group = OUTCOMES.get(status, (status, "failed"))
    config = result.config if result else {}
    plan = (result.plan if result else None) or {}
    cap, metrics, gpu = (result.capacity, result.metrics, result.gpu) if result else (None, None, None)
    violated = any(float(c) > 0 for c in trial.user_attrs.get("constraint") or [])
    complete = trial.state == optuna.trial.TrialState.COMPLETE
    feasible = complete and status == "ok" and not violated
    fidelity = (result.fidelity if result else None) or {}
    probed = fidelity.get("role") == "probe"
    over_numerics = bool(probed and limits is not None and any(v > 0 for v in limits.violations(fidelity)))
    if status == "ok" and violated:  # measured, but over a latency SLO: not a candidate winner
        outcome, group = "violates SLO", "slo"
        if over_numerics:
            outcome = "outputs differ beyond the numerics limit"
    if metrics is not None and status == "ok":
        tok_s = metrics.output_tok_s
    elif complete:
        tok_s = 0.0  # the stored objective of an OOM / infeasible trial
    else:
        tok_s = math.nan
    mrr = cap.max_running_requests if cap and cap.max_running_requests else plan.get("max_running_requests")
    spec = config.get("speculative_num_steps") if config.get("speculative_algorithm") else 0
    row: dict[str, Any] = {
        "trial": trial.number, "state": trial.state.name, "status": status, "outcome": outcome, "group": group,
        "role": trial.user_attrs.get("role", "search"), "label": trial.user_attrs.get("label") or f"trial {trial.number}",
        "feasible": feasible, "tok_s": tok_s,
        "max_running_requests": float(mrr) if mrr else math.nan,
        "kv_tokens": _get(cap, "kv_tokens") if cap else float(plan.get("kv_tokens") or math.nan),
        "mamba_slots": _get(cap, "mamba_slots") if cap else float(plan.get("max_mamba_cache_size") or math.nan),
        "spec_steps": float(spec) if spec is not None else math.nan,
        "headroom_gib": _get(gpu, "headroom_gib"), "peak_gib": _get(gpu, "peak_used_gib"),
        "ttft_p50_ms": _get(metrics.ttft_ms, "p50") if metrics else math.nan,
        "ttft_p99_ms": _get(metrics.ttft_ms, "p99") if metrics else math.nan,
        "itl_p50_ms": _get(metrics.itl_ms, "p50") if metrics else math.nan,
        "itl_p99_ms": _get(metrics.itl_ms, "p99") if metrics else math.nan,
        "e2e_p99_ms": _get(metrics.e2e_ms, "p99") if metrics else math.nan,
        "accept_length": _get(metrics, "accept_length"),
        # The fidelity probe against the reference config (``harness.fidelity``); NaN where not probed.
        "outputs_differ": bool(probed and (fidelity.get("exact_share") is None or fidelity["exact_share"] < 1.0)),
        "numerics": fidelity_summary(fidelity or None),
        "prefix_match": float(fidelity["prefix_match_mean"]) if probed and fidelity.get("prefix_match_mean") is not None else math.nan,
        "exact_share": float(fidelity["exact_share"]) if probed and fidelity.get("exact_share") is not None else math.nan,
        "logprob_delta": (float(fidelity["mean_abs_logprob_delta"])
                          if probed and fidelity.get("mean_abs_logprob_delta") is not None else math.nan),
        "over_numerics_limit": over_numerics,
        "planner_note": planner_note(plan) if status in ("skipped_infeasible", "startup_oom") else "",
        "reason": (result.reason if result else None) or trial.user_attrs.get("reason") or "",
        "log_path": (result.log_path if result else None) or "",
        "trial_dir": (result.trial_dir if result else None) or "",
    }
    for flag in flags:
        row[PARAM_PREFIX + flag] = trial.params.get(flag, config.get(flag))
    return row


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per finished trial (COMPLETE or FAIL), failures labelled, with the best-so-far feasible tok/s."""
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state.is_finished() and t.state != optuna.trial.TrialState.PRUNED]
    flags = tuned_flags(study)
    limits = numerics_limits(study_config(study))
    frame = pd.DataFrame([_row(t, flags, limits) for t in finished])
    if frame.empty:
        return frame
    frame = frame.sort_values("trial", ignore_index=True)
    frame.insert(0, "study", study.study_name)
    frame["best_so_far"] = frame["tok_s"].where(frame["feasible"]).cummax().ffill()
    return frame


def param_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if c.startswith(PARAM_PREFIX)]


def memory_frame(frame: pd.DataFrame, study: optuna.Study) -> pd.DataFrame:
    """The planner's predicted split of device memory per trial, beside the peak the GPU monitor observed.

    The parts add up to the device total: ``other`` is what the plan does not itemise (CUDA context, runtime),
    and ``headroom`` is negative where the plan predicts an OOM.
    """
    rows = []
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for _, info in frame.iterrows():
        result = trial_result(by_number[info["trial"]])
        plan = (result.plan if result else None) or {}
        gib, extra = plan.get("gib") or {}, plan.get("extra") or {}
        if not gib:
            continue
        parts = {
            "weights": gib.get("weights", 0.0), "kv": gib.get("kv", 0.0),
            "mamba_states": gib.get("mamba_ssm", 0.0) + gib.get("mamba_conv", 0.0),
            "spec_intermediates": gib.get("intermediate_ssm", 0.0) + gib.get("intermediate_conv", 0.0),
            "graphs": gib.get("graphs", 0.0), "activations": gib.get("activations", 0.0),
            "headroom": gib.get("headroom", 0.0),
        }
        itemised = sum(parts.values())
        total = extra.get("total_gib")
        if total is None and result and result.gpu and result.gpu.total_gib:
            total = result.gpu.total_gib
        total = float(total) if total is not None else itemised
        parts["other"] = max(total - itemised, 0.0)
        rows.append({
            "trial": info["trial"], "label": info["label"], "outcome": info["outcome"], "group": info["group"],
            **{k: float(parts[k]) for k in MEMORY_PARTS},
            "total_gib": total,
            "predicted_peak_gib": float(extra.get("peak_gib", total - parts["headroom"])),
            "observed_peak_gib": float(info["peak_gib"]),
        })
    return pd.DataFrame(rows, columns=["trial", "label", "outcome", "group", *MEMORY_PARTS, "total_gib",
                                       "predicted_peak_gib", "observed_peak_gib"])


def key_trials(frame: pd.DataFrame, study: optuna.Study, top: int = 3) -> list[int]:
    """Baseline first, then the ``top`` fastest feasible trials (the ones a latency figure can show legibly)."""
    numbers = []
    base = baseline_trial(frame, study)
    if base is not None:
        numbers.append(base)
    fastest = frame[frame["feasible"]].sort_values("tok_s", ascending=False)["trial"]
    numbers += [int(n) for n in fastest if n != base][:top]
    return numbers


def _records(trial_dir: str, base_dir: Path | None) -> list[dict[str, Any]]:
    if not trial_dir:
        return []
    path = Path(trial_dir) / "records.jsonl"
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def latency_frame(frame: pd.DataFrame, study: optuna.Study, *, top: int = 3,
                  base_dir: Path | None = None) -> pd.DataFrame:
    """TTFT and ITL quantiles (ms) for the baseline and the top trials.

    From per-request records when the trial kept them (every quantile), else from the stored percentiles
    (p50/p90/p99 only). Summaries, not raw samples, keep the page small with any number of requests.
    """
    rows = []
    by_trial = frame.set_index("trial")
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for number in key_trials(frame, study, top):
        info = by_trial.loc[number]
        records = _records(info["trial_dir"], base_dir)
        result = trial_result(by_number[number]) if number in by_number else None
        stored = result.metrics if result else None
        for metric in ("ttft", "itl"):
            row = {"trial": number, "label": info["label"], "role": info["role"], "metric": metric}
            values = _record_values(records, metric)
            if values.size:
                row.update({k: float(np.percentile(values, q)) for k, q in QUANTILES.items()})
                row.update({"mean": float(values.mean()), "n": int(values.size), "source": "records"})
            elif stored is not None:
                pct = stored.ttft_ms if metric == "ttft" else stored.itl_ms
                row.update({k: math.nan for k in QUANTILES})
                row.update({"p50": _get(pct, "p50"), "p90": _get(pct, "p90"), "p99": _get(pct, "p99"),
                            "mean": _get(pct, "mean"), "n": 0, "source": "stored percentiles"})
            else:
                continue
            rows.append(row)
    return pd.DataFrame(rows, columns=["trial", "label", "role", "metric", *QUANTILES, "mean", "n", "source"])


def _record_values(records: list[dict[str, Any]], metric: str) -> np.ndarray:
    """Seconds → ms, from either the replay client's records (``sent`` + ``chunks`` of (arrival, tokens), ITL
    spread over a chunk's tokens as the metrics do) or pre-computed ``ttft_s`` / ``itl_s`` fields."""
    values: list[float] = []
    for rec in records:
        if rec.get("error"):
            continue
        if "chunks" in rec and rec.get("sent") is not None:
            arrivals = [(float(t), int(n)) for t, n in rec["chunks"] if int(n) > 0]
            if metric == "ttft" and arrivals:
                values.append(arrivals[0][0] - float(rec["sent"]))
            elif metric == "itl":
                for (prev, _), (t, n) in zip(arrivals, arrivals[1:], strict=False):
                    values.extend([(t - prev) / n] * n)
        elif metric == "ttft" and rec.get("ttft_s") is not None:
            values.append(rec["ttft_s"])
        elif metric == "itl":
            values.extend(rec.get("itl_s") or [])
    return np.asarray(values, dtype=float) * 1000.0


def pareto_frame(study: optuna.Study, frame: pd.DataFrame) -> pd.DataFrame:
    """Feasible trials of a two-objective study with their second objective and Pareto-front membership."""
    if len(study.directions) < 2:
        return pd.DataFrame(columns=["trial", "label", "tok_s", "second", "on_front"])
    maximize = [d == optuna.study.StudyDirection.MAXIMIZE for d in study.directions[:2]]
    feasible = set(frame.loc[frame["feasible"], "trial"])
    points = [(t.number, t.values[0], t.values[1]) for t in study.get_trials(deepcopy=False)
              if t.number in feasible and t.values and len(t.values) >= 2]
    signs = [-1.0 if m else 1.0 for m in maximize]  # minimise both after flipping signs
    rows = []
    labels = frame.set_index("trial")["label"]
    for number, a, b in points:
        dominated = any(
            signs[0] * a2 <= signs[0] * a and signs[1] * b2 <= signs[1] * b and (a2, b2) != (a, b)
            for _, a2, b2 in points
        )
        rows.append({"trial": number, "label": labels[number], "tok_s": a, "second": b, "on_front": not dominated})
    return pd.DataFrame(rows, columns=["trial", "label", "tok_s", "second", "on_front"])


IMPORTANCE_MIN_TRIALS = 5  # completed trials that set a flag before its importance is computed
NOT_ENOUGH_TO_RANK = "not enough trials to rank flags"


def importance_frame(study: optuna.Study) -> pd.DataFrame:
    """Optuna's parameter importances for reaching the top tok/s (PED-ANOVA: deterministic and needs no
    scikit-learn, unlike fANOVA). OOMs count as 0 tok/s, so feasibility shapes them too.

    Each flag is scored over the completed trials that *have* it (a conditional flag, such as the radix-cache
    strategy only when the cache is on, leaves other trials out; requiring every flag at once would leave too few
    trials, and PED-ANOVA then returns zeros that normalise to a meaningless uniform split). PED-ANOVA scores
    each flag on its own marginal, so per-flag scores are comparable. Empty (``NOT_ENOUGH_TO_RANK``) when no
    flag has enough trials or the evaluator cannot tell the flags apart: never a uniform chart."""
    empty = pd.DataFrame(columns=["param", "importance", "trials"])
    complete = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.params]
    searched = [t for t in complete if t.user_attrs.get("role", "search") == "search"]
    flags = list(dict.fromkeys(p for t in (searched or complete) for p in t.params))
    raw: dict[str, float] = {}
    counts: dict[str, int] = {}
    for flag in flags:
        have = [t for t in complete if flag in t.params]
        if len(have) < IMPORTANCE_MIN_TRIALS or len({repr(t.params[flag]) for t in have}) < 2:
            continue
        try:
            with warnings.catch_warnings():
                # PED-ANOVA is "experimental" and warns that it ranks low targets; the negated tok/s is exactly that.
                warnings.simplefilter("ignore")
                scores = optuna.importance.get_param_importances(
                    study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(), params=[flag],
                    target=lambda t: -t.values[0], normalize=False)
        except (ValueError, RuntimeError, ZeroDivisionError):
            continue
        value = float(scores.get(flag, 0.0))
        if math.isfinite(value):  # zero is a finding too (the top trials spread like all of them)
            raw[flag], counts[flag] = max(value, 0.0), len(have)
    total = sum(raw.values())
    if len(raw) < 2 or total <= 0:
        return empty
    shares = {k: v / total for k, v in raw.items()}
    if max(shares.values()) - min(shares.values()) < 1e-9:  # the evaluator cannot tell the flags apart
        return empty
    ordered = sorted(shares, key=shares.get, reverse=True)
    return pd.DataFrame({"param": ordered, "importance": [shares[k] for k in ordered],
                         "trials": [counts[k] for k in ordered]})


def baseline_trial(frame: pd.DataFrame, study: optuna.Study) -> int | None:
    confirmation = study.user_attrs.get("confirmation") or {}
    if confirmation.get("baseline_trial") is not None:
        return int(confirmation["baseline_trial"])
    baselines = frame.loc[frame["role"] == "baseline", "trial"]
    return int(baselines.iloc[0]) if len(baselines) else None


def winner_trial(frame: pd.DataFrame, study: optuna.Study) -> int | None:
    confirmation = study.user_attrs.get("confirmation") or {}
    if confirmation.get("winner_trial") is not None:
        return int(confirmation["winner_trial"])
    feasible = frame[frame["feasible"]]
    return int(feasible.loc[feasible["tok_s"].idxmax(), "trial"]) if len(feasible) else None


def failures_frame(frame: pd.DataFrame, *, base_dir: Path | None = None) -> pd.DataFrame:
    """Every trial that did not measure: its class, the log line that decided it, and a link to its log
    (relative to ``base_dir``, where the report lives, so the link survives moving both together)."""
    failed = frame[frame["status"] != "ok"]
    links = [_relative(p, base_dir) for p in failed["log_path"]]
    notes = failed["planner_note"] if "planner_note" in failed else pd.Series("", index=failed.index)
    # SGLang's message, and on a second line what the planner saw when the message alone misleads a reader.
    reasons = [f"{r}\n{n}" if n else r for r, n in zip(failed["reason"], notes.fillna(""), strict=True)]
    return pd.DataFrame({"trial": failed["trial"].astype(int), "outcome": failed["outcome"],
                         "status": failed["status"], "reason": reasons, "log": links}).reset_index(drop=True)


def planner_note(plan: Mapping[str, Any] | None) -> str:
    """What the planner saw behind SGLang's "Loaded weights leave no GPU memory for the KV cache under
    --mem-fraction-static=F. Raise --mem-fraction-static above X" when X < F: not the weights but the Mamba pool
    took the static budget (SGLang's message computes X from the weights alone). "" when it does not apply."""
    if not plan or not str(plan.get("message") or "").startswith(("ValueError: Loaded weights leave no GPU memory",
                                                                     "Loaded weights leave no GPU memory")):
        return ""
    gib, extra = plan.get("gib") or {}, plan.get("extra") or {}
    mfs, pre = plan.get("mem_fraction_static"), extra.get("pre_gib")
    weights, mamba, rest = gib.get("weights"), gib.get("mamba_total"), extra.get("rest_gib")
    if None in (mfs, pre, weights, mamba, rest):
        return ""
    budget = float(mfs) * float(pre)
    slots = plan.get("max_mamba_cache_size")
    pool = "the Mamba state pool" + (f" ({slots} slots with speculative scratch)" if slots else "")
    if float(mamba) >= float(weights) or float(weights) < budget:
        taker, fix = "the Mamba pool", "fewer Mamba slots (--max-mamba-cache-size, --mamba-full-memory-ratio) free it; raising " \
                           "--mem-fraction-static alone does not"
    else:
        taker, fix = "the weights", "raise --mem-fraction-static"
    return (f"planner: --mem-fraction-static {float(mfs):g} × {float(pre):.1f} GiB = {budget:.1f} GiB of static "
            f"pools; the weights take {float(weights):.1f} GiB and {pool} {float(mamba):.1f} GiB, leaving "
            f"{float(rest):.1f} GiB{' (nothing)' if float(rest) <= 0 else ''} for the KV cache. {taker[0].upper() + taker[1:]} "
            f"took the memory: {fix}.")


def _relative(path: str, base_dir: Path | None) -> str:
    if not path or base_dir is None:
        return path or ""
    return Path(os.path.relpath(Path(path).resolve(), Path(base_dir).resolve())).as_posix()


def _confirmed(study: optuna.Study, number: int | None) -> list[float]:
    runs = (study.user_attrs.get("confirmation") or {}).get("runs") or []
    values = []
    for run in runs:
        if run.get("trial") == number and isinstance(run.get("result"), Mapping):
            result = TrialResult.from_dict(run["result"])
            if result.ok and result.output_tok_s is not None:
                values.append(result.output_tok_s)
    return values


def headline_frame(frame: pd.DataFrame, study: optuna.Study) -> pd.DataFrame:
    """Winner vs baseline on the numbers that explain the win: speed (confirmed when there was a confirmation
    stage: median and range of the repeats) and the capacity that produced it."""
    numbers = {"baseline": baseline_trial(frame, study), "winner": winner_trial(frame, study)}
    by_trial = frame.set_index("trial")
    rows: dict[str, dict[str, Any]] = {}
    for role, number in numbers.items():
        info = by_trial.loc[number] if number is not None and number in by_trial.index else None
        repeats = _confirmed(study, number)
        tok_s = float(np.median(repeats)) if repeats else (float(info["tok_s"]) if info is not None else math.nan)
        # The confirmation stage's bootstrap interval of the median when it stored one, else the repeats' range.
        stats = ((study.user_attrs.get("confirmation") or {}).get("stats") or {}).get(str(number)) or {}
        ci = stats.get("ci")
        if not (isinstance(ci, list | tuple) and len(ci) == 2 and None not in ci):
            ci = (min(repeats), max(repeats)) if repeats else (math.nan, math.nan)
        low, high = ci
        rows[role] = {
            "trial": number if number is not None else math.nan,
            "label": info["label"] if info is not None else "",
            "tok_s": tok_s,
            "tok_s_low": float(low),
            "tok_s_high": float(high),
            "repeats": len(repeats),
            **{k: (float(info[k]) if info is not None else math.nan) for k in (
                "max_running_requests", "kv_tokens", "mamba_slots", "spec_steps", "headroom_gib", "peak_gib",
                "ttft_p99_ms", "itl_p99_ms")},
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def gain(study: optuna.Study, headline: pd.DataFrame) -> dict[str, Any]:
    """Winner/baseline speed ratio (2.0 = twice as fast), with the confirmation stage's CI when there is one,
    and the ratio over SGLang's own defaults when the confirmation measured (or predicted) them."""
    confirmation = study.user_attrs.get("confirmation") or {}
    win = headline.loc["winner", "tok_s"]
    defaults = confirmation.get("defaults") or {}
    over_defaults = (win / defaults["output_tok_s"] if defaults.get("output_tok_s") and not math.isnan(win)
                     else None)
    if confirmation.get("gain") is not None:
        return {"gain": float(confirmation["gain"]), "ci_low": confirmation.get("ci_low"),
                "ci_high": confirmation.get("ci_high"), "note": confirmation.get("note") or "",
                "over_defaults": over_defaults, "defaults_how": defaults.get("how")}
    base = headline.loc["baseline", "tok_s"]
    value = win / base if base and not math.isnan(base) and base > 0 else math.nan
    return {"gain": value, "ci_low": None, "ci_high": None, "note": "single measurement (no confirmation stage)",
            "over_defaults": over_defaults, "defaults_how": defaults.get("how")}


def trial_config(study: optuna.Study, number: int | None) -> dict[str, Any]:
    if number is None:
        return {}
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
    result = trial_result(trial) if trial else None
    return dict(result.config) if result else dict(trial.params if trial else {})


def flag_diff(baseline: Mapping[str, Any], winner: Mapping[str, Any]) -> pd.DataFrame:
    """Flags whose value differs between the two configs ("default" where a config leaves SGLang's default)."""
    rows = []
    for name in sorted(set(baseline) | set(winner)):
        old, new = baseline.get(name), winner.get(name)
        if old != new and not (old in (None, False) and new in (None, False)):
            rows.append({"flag": "--" + name.replace("_", "-"), "baseline": _show(old), "winner": _show(new)})
    return pd.DataFrame(rows, columns=["flag", "baseline", "winner"])


def _show(value: Any) -> str:
    if value is None or value is False:
        return "default"
    return "on" if value is True else str(value)


def compare_frame(frames: Mapping[str, pd.DataFrame], configs: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """One row per study: where it ran and what it found, for ``--compare``."""
    rows = []
    for name, frame in frames.items():
        feasible = frame[frame["feasible"]]
        base = frame.loc[(frame["role"] == "baseline") & frame["feasible"], "tok_s"]
        best = float(feasible["tok_s"].max()) if len(feasible) else math.nan
        base_tok = float(base.iloc[0]) if len(base) else math.nan
        rows.append({"study": name, "model": model_name(configs[name]), "gpu": device_name(configs[name]),
                     "trials": len(frame), "feasible": len(feasible), "failed": int((frame["status"] != "ok").sum()),
                     "baseline_tok_s": base_tok, "best_tok_s": best,
                     "gain": best / base_tok if base_tok and base_tok > 0 else math.nan})
    return pd.DataFrame(rows)
