"""The winner against the baseline: the headline numbers (confirmed speed and the capacity behind it), the
gain, the flags that differ, and the one-row-per-study summary of ``--compare``.

Apart from ``report.data`` because these read the confirmation stage's results (``study.user_attrs``), not
the trials alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import optuna
import pandas as pd

from autotune.report.data import baseline_trial, model_name, winner_trial
from autotune.results import TrialResult
from autotune.search.confirm.record import Confirmation
from autotune.search.views.jobview import job_for_study
from autotune.search.views.settings import device_name
from autotune.search.views.summary import confirmation_line, confirmed, confirmed_rate, verdict_note
from autotune.search.views.worstcase import worst_case_line


@dataclass(frozen=True)
class HeadlineRow:
    """The baseline's or the winner's row of the headline table: its speed (confirmed where the confirmation
    measured it) and the capacity behind it. NaN where the trial or the figure is absent."""

    trial: float  # the trial number (NaN: no such trial)
    label: str
    tok_s: float
    gpus: int
    tok_s_per_gpu: float
    tok_s_low: float
    tok_s_high: float
    repeats: int  # clean confirmation launches
    max_running_requests: float
    kv_tokens: float
    mamba_slots: float
    spec_steps: float
    headroom_gib: float
    peak_gib: float
    ttft_p99_ms: float
    itl_p99_ms: float


@dataclass(frozen=True)
class Gain:
    """The winner's speed over the baseline's (``gain``: 2.0 = twice as fast; None when the confirmation crowned
    none) with the confirmation's 95 % interval or the ``note`` saying why there is none, and the header's other
    lines: the ratio over SGLang's defaults, the job's hours, the worst case under stress and the noise."""

    gain: float | None
    ci_low: float | None = None
    ci_high: float | None = None
    note: str | None = None
    over_defaults: float | None = None
    defaults_how: str | None = None
    job: str | None = None  # ``[job]``: the job's hours before and after, one line
    worst_case: str | None = None  # the stress phase's verdict on the winner
    noise: str | None = None  # the confirmation's launches and noise


@dataclass(frozen=True)
class VerdictFacts:
    """The confirmation's verdict as the header states it: ``outcome`` (``"winner"``, ``"baseline"``: no config
    beat it, ``"none"``: no contender ran cleanly, or ``"unconfirmed"``: no finished confirmation, the fastest
    search trial is shown as not confirmed) and its ``note``, the reason the sweep printed."""

    outcome: str
    note: str


def headline_frame(frame: pd.DataFrame, study: optuna.Study) -> pd.DataFrame:
    """Winner vs baseline on the numbers that explain the win: speed (the confirmed estimate and its 95 % interval
    when there was a confirmation stage, ``summary.confirmed_rate``, else the search figure) and the capacity that
    produced it."""
    numbers = {"baseline": baseline_trial(frame, study), "winner": winner_trial(frame, study)}
    by_trial = frame.set_index("trial")
    confirmation = Confirmation.of(study)
    rows: dict[str, HeadlineRow] = {}
    for role, number in numbers.items():
        info = by_trial.loc[number] if number is not None and number in by_trial.index else None
        gpus = int(info["gpus"]) if info is not None and "gpus" in info and info["gpus"] == info["gpus"] else 1
        confirmed = confirmed_rate(confirmation, number, gpus) if number is not None else None
        if confirmed is not None:
            tok_s, (low, high) = confirmed[0], confirmed[1] or (math.nan, math.nan)
        else:
            tok_s = float(info["tok_s"]) if info is not None else math.nan
            low = high = math.nan

        def figure(key: str, info: pd.Series | None = info) -> float:
            return float(info[key]) if info is not None else math.nan

        rows[role] = HeadlineRow(
            trial=number if number is not None else math.nan,
            label=info["label"] if info is not None else "",
            tok_s=tok_s,
            gpus=gpus,
            tok_s_per_gpu=tok_s / gpus,
            tok_s_low=float(low),
            tok_s_high=float(high),
            repeats=_launches(confirmation, number),
            max_running_requests=figure("max_running_requests"),
            kv_tokens=figure("kv_tokens"),
            mamba_slots=figure("mamba_slots"),
            spec_steps=figure("spec_steps"),
            headroom_gib=figure("headroom_gib"),
            peak_gib=figure("peak_gib"),
            ttft_p99_ms=figure("ttft_p99_ms"),
            itl_p99_ms=figure("itl_p99_ms"),
        )
    return pd.DataFrame.from_dict({role: asdict(row) for role, row in rows.items()}, orient="index")


def _launches(confirmation: Confirmation | None, number: int | None) -> int:
    """How many confirmation launches ``number`` ran cleanly, as the verdict counted them (a baseline whose search
    run stood in: none; a confirmation not finished: none, the headline shows search figures then)."""
    verdict = confirmed(confirmation)
    stats = verdict.stat(number) if verdict is not None else None
    if not stats or stats.from_search:
        return 0
    return stats.runs - stats.failed


def gain(study: optuna.Study, headline: pd.DataFrame) -> Gain:
    """Winner/baseline speed ratio (2.0 = twice as fast), with the confirmation stage's CI when there is one,
    the ratio over SGLang's own defaults when the confirmation measured (or predicted) them, and, with ``[job]``,
    the job's hours before and after (``job``: one line)."""
    confirmation = Confirmation.of(study)
    win = headline.loc["winner", "tok_s_per_gpu"]  # per GPU, as the study ranks (tok/s for 1-GPU servers)
    defaults = confirmation.defaults if confirmation is not None else None
    base_defaults = (defaults.tok_s_per_gpu or defaults.output_tok_s) if defaults is not None else None
    over_defaults = win / base_defaults if base_defaults and not math.isnan(win) else None
    number = headline.loc["winner", "trial"]
    job = job_for_study(study, None if number != number else int(number))  # [job]: the job's hours, both ways
    common = Gain(
        gain=None,
        over_defaults=over_defaults,
        defaults_how=defaults.how if defaults is not None else None,
        job=job["line"] if job else None,
        worst_case=worst_case_line(confirmation, int(number)) if number == number else None,  # stress
        noise=confirmation_line(confirmation) if confirmation is not None and confirmation.complete else None,
    )  # its noise
    verdict = confirmation.verdict if confirmation is not None else None
    if verdict is not None and verdict.gain is not None:
        return replace(
            common, gain=float(verdict.gain), ci_low=verdict.ci_low, ci_high=verdict.ci_high, note=verdict.note
        )
    if number != number and confirmed(confirmation) is not None:  # the confirmation crowned none: no gain to give
        return replace(common, note=verdict_facts(study).note)
    base = headline.loc["baseline", "tok_s_per_gpu"]
    value = win / base if base and not math.isnan(base) and base > 0 else math.nan
    return replace(common, gain=value, note="single measurement (no confirmation stage)")


def verdict_facts(study: optuna.Study) -> VerdictFacts:
    """The confirmation's verdict as the header states it (``VerdictFacts``)."""
    verdict = confirmed(Confirmation.of(study))
    return VerdictFacts(outcome=verdict.outcome if verdict is not None else "unconfirmed", note=verdict_note(study))


def confirmed_frame(frame: pd.DataFrame, study: optuna.Study) -> pd.DataFrame:
    """Every config the confirmation launched, fastest first: its confirmed estimate (server tok/s) and 95 %
    interval, clean launches, and its ratio to the baseline's estimate (empty without a finished confirmation).
    What the header shows when no config beat the baseline."""
    confirmation = Confirmation.of(study)
    verdict = confirmed(confirmation)
    columns = ["trial", "label", "role", "confirmed_tok_s", "tok_s_low", "tok_s_high", "launches", "vs_baseline"]
    if verdict is None:
        return pd.DataFrame(columns=columns)
    by_trial = frame.set_index("trial")
    base = verdict.stat(verdict.baseline_trial)
    rows = []
    for key, stats in verdict.stats.items():
        number = int(key)
        info = by_trial.loc[number] if number in by_trial.index else None
        gpus = int(info["gpus"]) if info is not None and "gpus" in info and info["gpus"] == info["gpus"] else 1
        rate = confirmed_rate(confirmation, number, gpus)
        if rate is None or stats.from_search:
            continue
        low, high = rate[1] or (math.nan, math.nan)
        rows.append(
            {
                "trial": number,
                "label": info["label"] if info is not None else "",
                "role": info["role"] if info is not None else "",
                "confirmed_tok_s": rate[0],
                "tok_s_low": low,
                "tok_s_high": high,
                "launches": _launches(confirmation, number),
                "vs_baseline": (stats.median or math.nan) / base.median if base and base.median else math.nan,
            }
        )
    return pd.DataFrame(rows, columns=columns).sort_values("confirmed_tok_s", ascending=False, ignore_index=True)


def trial_config(study: optuna.Study, number: int | None) -> dict[str, Any]:
    if number is None:
        return {}
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
    result = TrialResult.of(trial) if trial else None
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
        rows.append(
            {
                "study": name,
                "model": model_name(configs[name]),
                "gpu": device_name(configs[name]),
                "trials": len(frame),
                "feasible": len(feasible),
                "failed": int((frame["status"] != "ok").sum()),
                "baseline_tok_s": base_tok,
                "best_tok_s": best,
                "gain": best / base_tok if base_tok and base_tok > 0 else math.nan,
            }
        )
    return pd.DataFrame(rows)
