"""Study trials → pandas DataFrames: the numbers every report figure and table draws (trials, memory, Pareto front,
failures, kept and labelled, never dropped), computed once and tested; latency, importances and the headline have
modules of their own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from autotune.config.sections import NumericsLimits
from autotune.harness.fidelity import outputs_differ
from autotune.results import FidelityFigures, TrialResult, fidelity_summary
from autotune.search.confirm.decision import Verdict
from autotune.search.confirm.record import Confirmation
from autotune.search.numerics import contender_fidelity
from autotune.search.objective import gpus_spanned, per_gpu
from autotune.search.views.settings import engine_table
from autotune.search.wall import PLACED_ATTR

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
    "too_slow": ("too slow for the window", "failed"),  # alive and progressing, no token in the window
    "write_error": ("write failed (disk)", "failed"),  # the disk's failure, not the config's
    "port_taken": ("port taken by another process", "failed"),  # the host's, not the config's: run again
    "repeat": ("already measured (not launched)", "repeat"),  # the earlier trial's figure, not a launch of its own
}
MEMORY_PARTS = ("weights", "kv", "mamba_states", "spec_intermediates", "graphs", "activations", "other", "headroom")
PARAM_PREFIX = "params_"


def study_config(study: optuna.Study) -> dict[str, Any]:
    return dict(study.user_attrs.get("autotune") or {})


def model_name(config: Mapping[str, Any]) -> str:
    model = engine_table(config).get("model") or config.get("model")
    if isinstance(model, Mapping):
        return str(model.get("path") or model.get("name") or "model")
    return str(model or "model")


@dataclass(frozen=True)
class LaunchSettings:
    """The study's interpreter (None: ``python``), device and server environment: what the winner's launch line
    (``report.page.launch_command``) is run with."""

    python: str | None = None
    device: str = "cuda"
    env: dict[str, str] = field(default_factory=dict)


def launch_settings(config: Mapping[str, Any]) -> LaunchSettings:
    """The study's interpreter, device and environment, from its stored ``[engine]`` table."""
    engine = engine_table(config)
    env = engine.get("env")
    env = env if isinstance(env, Mapping) else {}
    return LaunchSettings(
        python=engine.get("python") or None,
        device=str(engine.get("device") or "cuda"),
        env={str(k): str(v) for k, v in env.items()},
    )


def second_objective(config: Mapping[str, Any]) -> str:
    second = (config.get("objective") or {}).get("second")
    if isinstance(second, Mapping) and second.get("metric"):
        return str(second["metric"])
    return "second objective"


def _status(trial: optuna.trial.FrozenTrial, result: TrialResult | None) -> str:
    if result is not None:
        return result.status
    # A FAIL trial without a stored result died in the harness itself; call it what Optuna saw.
    return "interrupted" if trial.state == optuna.trial.TrialState.FAIL else "crash"


def attr_or_nan(obj: Any, name: str) -> float:
    """``obj.name`` as a float; NaN where the object or the attribute is missing."""
    value = getattr(obj, name, None) if obj is not None else None
    return float(value) if value is not None else math.nan


def tuned_flags(study: optuna.Study) -> list[str]:
    """Flags the search varied, in the order they first appear: the sampler's, then those the sweep placed for it
    (``search.wall``: the memory fraction, read from each trial's launched config)."""
    names: dict[str, None] = {}
    for trial in study.get_trials(deepcopy=False):
        names.update(dict.fromkeys(trial.params))
    names.update(dict.fromkeys(study.user_attrs.get(PLACED_ATTR) or ()))
    return list(names)


def numerics_limits(config: Mapping[str, Any]):
    """The study's ``[objective] numerics`` (probe size and limits) from its stored config; defaults if absent."""
    raw = (config.get("objective") or {}).get("numerics") if isinstance(config.get("objective"), Mapping) else None
    try:
        return NumericsLimits(**raw) if isinstance(raw, Mapping) else NumericsLimits()
    except Exception:  # noqa: BLE001 - stored by another version: show the figures without limits
        return NumericsLimits()


def trial_fidelity(trial: optuna.trial.FrozenTrial, confirmation: Confirmation | None) -> FidelityFigures | None:
    """What is known of a trial's outputs against the baseline: its contender probe in the confirmation where it
    ran one, else its search launch's probe (``search.numerics.contender_fidelity``); None when neither."""
    result = TrialResult.of(trial)
    probe = confirmation.probe(trial.number) if confirmation is not None else None
    return contender_fidelity(result.fidelity if result else None, probe)


def _probe_figure(fidelity: FidelityFigures | None, figure: str) -> float:
    """A probe's figure, NaN where the trial was not probed or the figure is absent."""
    value = getattr(fidelity, figure) if fidelity is not None and fidelity.probed else None
    return float(value) if value is not None else math.nan


@dataclass(frozen=True)
class TrialRow:
    """One finished trial as the trials frame shows it (``trials_frame``: one column per field, in this order,
    then one ``params_<flag>`` column per tuned flag). NaN where a figure is absent."""

    trial: int
    state: str  # Optuna's state name
    status: str  # the stored outcome (``OUTCOMES``' keys)
    outcome: str  # what a reader sees
    group: str  # the outcome class: the marker a figure uses
    role: str
    label: str
    feasible: bool
    tok_s: float
    gpus: int
    tok_s_per_gpu: float | None  # the score the search ranks by: tok/s ÷ the GPUs the server spanned
    max_running_requests: float
    kv_tokens: float
    mamba_slots: float
    spec_steps: float
    headroom_gib: float
    peak_gib: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p99_ms: float
    accept_length: float
    # The fidelity probe against the reference config (``harness.fidelity``); NaN where not probed.
    outputs_differ: bool
    outputs_unexpected: bool  # though no table flag changed
    numerics: str
    prefix_match: float
    exact_share: float
    logprob_delta: float
    over_numerics_limit: bool
    planner_note: str
    reason: str
    log_path: str
    trial_dir: str


def _row(
    trial: optuna.trial.FrozenTrial,
    result: TrialResult | None,
    limits: Any = None,
    confirmation: Confirmation | None = None,
) -> TrialRow:
    status = _status(trial, result)
    outcome, group = OUTCOMES.get(status, (status, "failed"))
    config = result.config if result else {}
    plan = (result.plan if result else None) or {}
    cap, metrics, gpu = (result.capacity, result.metrics, result.peaks) if result else (None, None, None)
    violated = any(float(c) > 0 for c in trial.user_attrs.get("constraint") or [])
    complete = trial.state == optuna.trial.TrialState.COMPLETE
    feasible = complete and status == "ok" and not violated
    fidelity = trial_fidelity(trial, confirmation)
    probed = fidelity is not None and fidelity.probed
    over_numerics = bool(
        probed
        and limits is not None
        and fidelity is not None
        and any(v > 0 for v in limits.violations(fidelity.to_dict()))
    )
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
    return TrialRow(
        trial=trial.number,
        state=trial.state.name,
        status=status,
        outcome=outcome,
        group=group,
        role=trial.user_attrs.get("role", "search"),
        label=trial.user_attrs.get("label") or f"trial {trial.number}",
        feasible=feasible,
        tok_s=tok_s,
        gpus=gpus_spanned(result) if result else 1,
        tok_s_per_gpu=(
            per_gpu(result) if result and status == "ok" and metrics is not None else (0.0 if complete else math.nan)
        ),
        max_running_requests=float(mrr) if mrr else math.nan,
        kv_tokens=attr_or_nan(cap, "kv_tokens") if cap else float(plan.get("kv_tokens") or math.nan),
        mamba_slots=attr_or_nan(cap, "mamba_slots") if cap else float(plan.get("max_mamba_cache_size") or math.nan),
        spec_steps=float(spec) if spec is not None else math.nan,
        headroom_gib=attr_or_nan(gpu, "headroom_gib"),
        peak_gib=attr_or_nan(gpu, "peak_used_gib"),
        ttft_p50_ms=attr_or_nan(metrics.ttft_ms, "p50") if metrics else math.nan,
        ttft_p99_ms=attr_or_nan(metrics.ttft_ms, "p99") if metrics else math.nan,
        itl_p50_ms=attr_or_nan(metrics.itl_ms, "p50") if metrics else math.nan,
        itl_p99_ms=attr_or_nan(metrics.itl_ms, "p99") if metrics else math.nan,
        e2e_p99_ms=attr_or_nan(metrics.e2e_ms, "p99") if metrics else math.nan,
        accept_length=attr_or_nan(metrics, "accept_length"),
        outputs_differ=bool(fidelity and probed and not fidelity.error and outputs_differ(fidelity)),
        outputs_unexpected=bool(fidelity and probed and fidelity.unexpected),
        numerics=fidelity_summary(fidelity),
        prefix_match=_probe_figure(fidelity, "prefix_match_mean"),
        exact_share=_probe_figure(fidelity, "exact_share"),
        logprob_delta=_probe_figure(fidelity, "mean_abs_logprob_delta"),
        over_numerics_limit=over_numerics,
        planner_note=planner_note(plan) if status in ("skipped_infeasible", "startup_oom") else "",
        reason=(result.reason if result else None) or trial.user_attrs.get("reason") or "",
        log_path=(result.log_path if result else None) or "",
        trial_dir=(result.trial_dir if result else None) or "",
    )


def _param_values(trial: optuna.trial.FrozenTrial, result: TrialResult | None, flags: Iterable[str]) -> list[Any]:
    """The trial's value of each flag, in order: what the search suggested, else what it launched with."""
    config = result.config if result else {}
    return [trial.params.get(flag, config.get(flag)) for flag in flags]


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per finished trial (COMPLETE or FAIL), failures labelled, with the best-so-far feasible tok/s."""
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state.is_finished() and t.state != optuna.trial.TrialState.PRUNED]
    if not finished:
        return pd.DataFrame()
    flags = tuned_flags(study)
    limits = numerics_limits(study_config(study))
    confirmation = Confirmation.of(study)
    results = [TrialResult.of(t) for t in finished]
    # the rows' fields as columns (their values are scalars: no deep copy as ``asdict`` makes)
    rows = pd.DataFrame([vars(_row(t, r, limits, confirmation)) for t, r in zip(finished, results, strict=True)])
    params = pd.DataFrame(
        [_param_values(t, r, flags) for t, r in zip(finished, results, strict=True)],
        columns=[PARAM_PREFIX + f for f in flags],
    )
    frame = pd.concat([rows, params], axis=1)
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
        result = TrialResult.of(by_number[info["trial"]])
        plan = (result.plan if result else None) or {}
        gib, extra = plan.get("gib") or {}, plan.get("extra") or {}
        if not gib:
            continue
        parts = {
            "weights": gib.get("weights", 0.0),
            "kv": gib.get("kv", 0.0),
            "mamba_states": gib.get("mamba_ssm", 0.0) + gib.get("mamba_conv", 0.0),
            "spec_intermediates": gib.get("intermediate_ssm", 0.0) + gib.get("intermediate_conv", 0.0),
            "graphs": gib.get("graphs", 0.0),
            "activations": gib.get("activations", 0.0),
            "headroom": gib.get("headroom", 0.0),
        }
        itemised = sum(parts.values())
        total = extra.get("total_gib")
        if total is None and result and result.peaks and result.peaks.total_gib:
            total = result.peaks.total_gib
        total = float(total) if total is not None else itemised
        parts["other"] = max(total - itemised, 0.0)
        rows.append(
            {
                "trial": info["trial"],
                "label": info["label"],
                "outcome": info["outcome"],
                "group": info["group"],
                **{k: float(parts[k]) for k in MEMORY_PARTS},
                "total_gib": total,
                "predicted_peak_gib": float(extra.get("peak_gib", total - parts["headroom"])),
                "observed_peak_gib": float(info["peak_gib"]),
            }
        )
    return pd.DataFrame(
        rows,
        columns=[
            "trial",
            "label",
            "outcome",
            "group",
            *MEMORY_PARTS,
            "total_gib",
            "predicted_peak_gib",
            "observed_peak_gib",
        ],
    )


def pareto_frame(study: optuna.Study, frame: pd.DataFrame) -> pd.DataFrame:
    """Feasible trials of a two-objective study with their second objective and Pareto-front membership."""
    if len(study.directions) < 2:
        return pd.DataFrame(columns=["trial", "label", "tok_s", "second", "on_front"])
    maximize = [d == optuna.study.StudyDirection.MAXIMIZE for d in study.directions[:2]]
    feasible = set(frame.loc[frame["feasible"], "trial"])
    points = [
        (t.number, t.values[0], t.values[1])
        for t in study.get_trials(deepcopy=False)
        if t.number in feasible and t.values and len(t.values) >= 2
    ]
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


def baseline_trial(frame: pd.DataFrame, study: optuna.Study) -> int | None:
    verdict = _verdict(study)
    if verdict is not None and verdict.baseline_trial is not None:
        return int(verdict.baseline_trial)
    baselines = frame.loc[frame["role"] == "baseline", "trial"]
    return int(baselines.iloc[0]) if len(baselines) else None


def winner_trial(frame: pd.DataFrame, study: optuna.Study) -> int | None:
    """The confirmation's winner, as the sweep printed it; None when a finished confirmation crowned none (no
    config beat the baseline). Without a finished confirmation, the fastest feasible trial per GPU (the report
    says it is not confirmed: ``headline.verdict_facts``)."""
    confirmation = Confirmation.of(study)
    verdict = confirmation.verdict if confirmation is not None else None
    if verdict is not None and verdict.winner_trial is not None:
        return int(verdict.winner_trial)
    if confirmation is not None and confirmation.complete:
        return None
    feasible = frame[frame["feasible"]]
    return int(feasible.loc[feasible["tok_s_per_gpu"].idxmax(), "trial"]) if len(feasible) else None  # per GPU


def _verdict(study: optuna.Study) -> Verdict | None:
    """The verdict the study's confirmation stored, finished or not (None without one)."""
    confirmation = Confirmation.of(study)
    return confirmation.verdict if confirmation is not None else None


def failures_frame(frame: pd.DataFrame, *, base_dir: Path | None = None) -> pd.DataFrame:
    """Every trial that did not measure: its class, the log line that decided it, and a link to its log
    (relative to ``base_dir``, where the report lives, so the link survives moving both together)."""
    failed = frame[frame["status"] != "ok"]
    links = [_relative(p, base_dir) for p in failed["log_path"]]
    notes = failed["planner_note"] if "planner_note" in failed else pd.Series("", index=failed.index)
    # SGLang's message, and on a second line what the planner saw when the message alone misleads a reader.
    reasons = [f"{r}\n{n}" if n else r for r, n in zip(failed["reason"], notes.fillna(""), strict=True)]
    return pd.DataFrame(
        {
            "trial": failed["trial"].astype(int),
            "outcome": failed["outcome"],
            "status": failed["status"],
            "reason": reasons,
            "log": links,
        }
    ).reset_index(drop=True)


def planner_note(plan: Mapping[str, Any] | None) -> str:
    """What the planner saw behind SGLang's "Loaded weights leave no GPU memory for the KV cache under
    --mem-fraction-static=F. Raise --mem-fraction-static above X" when X < F: not the weights but the Mamba pool
    took the static budget (SGLang's message computes X from the weights alone). "" when it does not apply."""
    if not plan or not str(plan.get("message") or "").startswith(
        ("ValueError: Loaded weights leave no GPU memory", "Loaded weights leave no GPU memory")
    ):
        return ""
    gib, extra = plan.get("gib") or {}, plan.get("extra") or {}
    mfs, pre = plan.get("mem_fraction_static"), extra.get("pre_gib")
    weights, mamba, rest = gib.get("weights"), gib.get("mamba_total"), extra.get("rest_gib")
    if mfs is None or pre is None or weights is None or mamba is None or rest is None:
        return ""
    budget = float(mfs) * float(pre)
    slots = plan.get("max_mamba_cache_size")
    pool = "the Mamba state pool" + (f" ({slots} slots with speculative scratch)" if slots else "")
    if float(mamba) >= float(weights) or float(weights) < budget:
        taker, fix = (
            "the Mamba pool",
            "fewer Mamba slots (--max-mamba-cache-size, --mamba-full-memory-ratio) free it; raising "
            "--mem-fraction-static alone does not",
        )
    else:
        taker, fix = "the weights", "raise --mem-fraction-static"
    return (
        f"planner: --mem-fraction-static {float(mfs):g} × {float(pre):.1f} GiB = {budget:.1f} GiB of static "
        f"pools; the weights take {float(weights):.1f} GiB and {pool} {float(mamba):.1f} GiB, leaving "
        f"{float(rest):.1f} GiB{' (nothing)' if float(rest) <= 0 else ''} for the KV cache. "
        f"{taker[0].upper() + taker[1:]} "
        f"took the memory: {fix}."
    )


def _relative(path: str, base_dir: Path | None) -> str:
    if not path or base_dir is None:
        return path or ""
    return Path(os.path.relpath(Path(path).resolve(), Path(base_dir).resolve())).as_posix()
