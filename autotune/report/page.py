"""``autotune report``: load a study (and any to compare with), build its tables, draw them, write one page.

The page is self-contained (plotly.js inlined once, no network) so it can be mailed or archived next to the
study. ``--format csv|json`` emits the same tables instead, for anyone who wants the numbers, not the pictures.
"""

from __future__ import annotations

import html
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from autotune.config.studyref import locate
from autotune.errors import AutotuneError, ConfigError, StudyError
from autotune.redaction import env_for_files, redact_url, reference
from autotune.report import data as data
from autotune.report import figures as figures
from autotune.report import numerics as report_numerics
from autotune.report.header import Facts, header_html
from autotune.report.header import num as _num
from autotune.report.header import table as _table
from autotune.report.headline import (
    compare_frame,
    confirmed_frame,
    flag_diff,
    gain,
    headline_frame,
    trial_config,
    verdict_facts,
)
from autotune.report.importance import NOT_ENOUGH_TO_RANK, importance_frame
from autotune.report.latency import latency_frame
from autotune.report.stability import STABILITY_SECTION, stability_frame
from autotune.search.storage import load_study, study_names
from autotune.search.views.gpus import per_gpu_frame
from autotune.search.views.settings import device_name, engine_kind
from autotune.search.views.summary import defaults_lead
from autotune.sglang.flags import FlagTable

FORMATS = ("html", "csv", "json")


@dataclass
class Report:
    """Everything one page shows: the study, its tables, and the studies it is compared with."""

    study: optuna.Study
    tables: dict[str, pd.DataFrame]
    facts: Facts
    compare: dict[str, pd.DataFrame] = field(default_factory=dict)


def resolve(
    *, config: Path | None, study: str | None, storage: str | None
) -> tuple[str | None, str | None, Path | None]:
    """Study name, storage URL and the directory a relative journal path resolves against, as every command finds
    them (``config.studyref.locate``)."""
    return locate(config, study, storage)


def open_study(study: str | None, storage: str | None, base_dir: Path | None = None) -> optuna.Study:
    """Load an existing study (``search.storage.load_study``: never creates one)."""
    if not storage:
        raise StudyError("no study given (pass --study NAME, --config FILE or --storage URL)")
    return load_study(storage, study, base_dir=base_dir)


def build(study: optuna.Study, *, base_dir: Path, compare: Sequence[optuna.Study] = ()) -> Report:
    """Trials → tables (the tested numbers), plus the facts the header card states."""
    trials = _trials(study)
    headline = headline_frame(trials, study)
    base_no, win_no = data.baseline_trial(trials, study), data.winner_trial(trials, study)
    base_cfg, win_cfg = trial_config(study, base_no), trial_config(study, win_no)
    config = data.study_config(study)
    tables = {
        "trials": trials,
        "headline": headline.reset_index(names="role"),
        "flag_diff": flag_diff(base_cfg, win_cfg),
        "memory": data.memory_frame(trials, study),
        "latency": latency_frame(trials, study, base_dir=base_dir),
        "pareto": data.pareto_frame(study, trials),
        "importance": importance_frame(study),
        "failures": data.failures_frame(trials, base_dir=base_dir),
        "numerics": report_numerics.numerics_frame(trials, study),  # the fidelity probe's figures per trial
        "confirmed": confirmed_frame(trials, study),  # every confirmed estimate (the header's when none won)
    }
    per_gpu = per_gpu_frame(study)
    if len(per_gpu) > 1:  # a study swept on several GPUs: show the device-to-device spread
        tables["per_gpu"] = per_gpu
    verdict = verdict_facts(study)  # outcome and note: the confirmation's verdict, as the sweep printed it
    facts = Facts(
        study=study.study_name,
        model=data.model_name(config),
        gpu=device_name(config),
        engine=engine_kind(config),
        gain=gain(study, headline),
        winner=win_no,
        baseline=base_no,
        launch=launch_command(win_cfg, data.model_name(config), data.launch_settings(config))
        if win_no is not None
        else None,
        second_objective=data.second_objective(config),
        outcome=verdict.outcome,
        note=verdict.note,
        defaults_lead=defaults_lead(study),
        host_memory=data.launch_settings(config).device == "cpu",
    )
    frames: dict[str, pd.DataFrame] = {}
    if compare:
        frames = {study.study_name: trials}
        configs = {study.study_name: config}
        for other in compare:
            frames[other.study_name] = _trials(other)
            configs[other.study_name] = data.study_config(other)
        tables["compare"] = compare_frame(frames, configs)
    return Report(study=study, tables=tables, facts=facts, compare=frames)


def _trials(study: optuna.Study) -> pd.DataFrame:
    trials = data.trials_frame(study)
    if trials.empty or not (trials["state"] == "COMPLETE").any():
        raise StudyError(f"study '{study.study_name}' has no completed trials yet (run or resume `autotune sweep`)")
    return trials


def launch_command(config: Mapping[str, Any], model: str, settings: data.LaunchSettings | None = None) -> str:
    """The winner's launch line, rendered by the flag table when available (exact SGLang spelling), with the
    study's interpreter, device and environment; a secret-looking value is shown as ``"$NAME"``, never itself."""
    settings = settings or data.LaunchSettings()
    flags = dict(config)
    model = str(flags.pop("model_path", None) or model)
    head = [settings.python or "python", "-m", "sglang.launch_server", "--model-path", model]
    if settings.device == "cpu" and not flags.get("device"):
        head += ["--device", "cpu"]
    try:
        argv = list(FlagTable.bundled().to_argv(flags))
    except (ImportError, AttributeError, AutotuneError):
        argv = _plain_argv(flags)
    assignments = [
        f'{key}="${name}"' if (name := reference(value)) else shlex.quote(f"{key}={value}")
        for key, value in env_for_files(settings.env).items()
    ]
    return " ".join([*assignments, shlex.join(head + argv)])


def _plain_argv(flags: Mapping[str, Any]) -> list[str]:
    argv = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def figures_for(report: Report) -> dict[str, go.Figure]:
    """Section key → figure, skipping figures whose data is absent (e.g. no second objective)."""
    t = report.tables
    out: dict[str, go.Figure] = {
        "history": figures.history_figure(t["trials"]),
        "capacity": figures.capacity_figure(t["trials"]),
    }
    if data.param_columns(t["trials"]):
        out["slices"] = figures.slices_figure(t["trials"])
        out["parallel"] = figures.parallel_figure(t["trials"])
    if not t["importance"].empty:
        out["importance"] = figures.importance_figure(t["importance"])
    if not t["memory"].empty:
        out["memory"] = figures.memory_figure(t["memory"])
    if not t["latency"].empty:
        out["latency"] = figures.latency_figure(t["latency"])
    if not t["pareto"].empty:
        out["pareto"] = figures.pareto_figure(t["pareto"], report.facts.second_objective)
    if not (stability := stability_frame(report.study)).empty:  # every measured trial's per-slice tok/s
        out["stability"] = figures.stability_figure(stability)
    if report.compare:
        out["compare"] = figures.compare_figure(report.compare)
    return out


def write_tables(tables: Mapping[str, pd.DataFrame], fmt: str, out: Path | None) -> str | None:
    """CSV: one file per table in the ``out`` directory (or all on stdout); JSON: one object of tables."""
    if fmt == "json":
        text = json.dumps(
            {name: json.loads(frame.to_json(orient="records")) for name, frame in tables.items()}, indent=2
        )
        if out is None:
            return text
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        return None
    if out is None:
        return "\n".join(f"# {name}\n{frame.to_csv(index=False)}" for name, frame in tables.items())
    out.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        frame.to_csv(out / f"{name}.csv", index=False)
    return None


def report(
    *,
    study: str | None = None,
    storage: str | None = None,
    config: Path | None = None,
    out: Path | None = None,
    compare: Sequence[str] = (),
    fmt: str = "html",
) -> tuple[Path | None, str | None]:
    """Run ``autotune report``: returns (the file or directory written, text to print)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format '{fmt}'", key="--format", fix=f"use one of {', '.join(FORMATS)}")
    name, url, journal_dir = resolve(config=config, study=study, storage=storage)
    main = open_study(name, url, journal_dir)
    others = [_open_compare(other, url, journal_dir) for other in compare]
    if fmt == "html" and out is None:
        out = Path("reports") / f"{main.study_name}.html"
    base_dir = (out.parent if fmt == "html" else out) if out is not None else Path.cwd()
    built = build(main, base_dir=base_dir, compare=others)
    if fmt != "html":
        text = write_tables(built.tables, fmt, out)
        return out, text
    assert out is not None  # an html report always has a file (the default above)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(built, figures_for(built)), encoding="utf-8")
    return out, None


def _open_compare(name: str, storage: str | None, base_dir: Path | None) -> optuna.Study:
    """A study to overlay: a study file (``*.toml``), a study in the main storage, or ``studies/<name>.db``.
    A storage that cannot be read is an error, never skipped."""
    if name.endswith(".toml"):
        return open_study(*resolve(config=Path(name), study=None, storage=None))
    default = f"sqlite:///studies/{name}.db"
    if not storage or storage == default:
        return open_study(name, default)
    names = study_names(storage, base_dir=base_dir)
    if name in names:
        return open_study(name, storage, base_dir)
    if not Path(default.removeprefix("sqlite:///")).is_file():
        raise StudyError(
            f"no study named {name!r} to compare with: not in {redact_url(storage)} (studies there: "
            f"{', '.join(sorted(names)) or 'none'}), and no studies/{name}.db; pass its study file"
        )
    return open_study(name, default)


# Section key → (title, what the figure shows and why it matters).
SECTIONS: dict[str, tuple[str, str]] = {
    "history": (
        "Optimization history",
        "Every trial's measured throughput in the order it ran; the green step "
        "line is the best feasible result so far. Trials that never measured stay on the chart at 0 tok/s "
        "in their own mark: an OOM says where the memory wall is, which is why the sampler keeps them.",
    ),
    "capacity": (
        "Throughput vs effective concurrency",
        "Throughput against the max running requests SGLang "
        "actually allowed (after the Mamba-slot cap), coloured by speculative steps. On hybrid models "
        "this is usually the binding limit: more slots → more running requests → more tok/s until "
        "memory bandwidth saturates.",
    ),
    "slices": (
        "Throughput vs each tuned flag",
        "One panel per flag the search varied (darker = later trial). "
        "A clear trend means the flag matters on its own; a cloud means it only matters through others.",
    ),
    "importance": (
        "Parameter importance",
        "How much each flag decides whether a trial reaches the top tok/s "
        "(Optuna PED-ANOVA; OOMs count as 0, so flags that cause OOMs score high too).",
    ),
    "parallel": (
        "All trials across the flags",
        "Each line is one completed trial, coloured by tok/s. Drag on an "
        "axis to keep a range and see which combinations the fast trials share.",
    ),
    "memory": (
        "Where the memory goes",
        "The planner's predicted split of device memory per trial (weights, KV "
        "cache, Mamba states, speculative intermediates, CUDA graphs, activations, headroom) beside the "
        "peak the GPU monitor observed. Headroom below zero is a predicted OOM; an observed peak far from "
        "the prediction means the plan and the server disagree.",
    ),
    "latency": (
        "Latency of the baseline and the top trials",
        "Time to first token and inter-token latency "
        "(boxes: p25–p75 with the median, whiskers p5–p99, from per-request records; p50/p90/p99 markers "
        "where only stored percentiles exist). Throughput gains that cost too much latency show here.",
    ),
    "pareto": (
        "Throughput vs tail latency",
        "The second objective against tok/s; red points are the Pareto "
        "front, configurations no other trial beats on both.",
    ),
    "stability": STABILITY_SECTION,
    "compare": (
        "Studies compared",
        "The best-so-far curves and throughput vs concurrency of each study, "
        "overlaid (e.g. the same model on two GPU types).",
    ),
}
# The cards whose words differ on SGLang's CPU backend (its memory is the host's).
HOST_SECTIONS: dict[str, tuple[str, str]] = {
    "memory": (
        "Where the memory goes",
        "The planner's predicted split of the host memory SGLang's CPU backend "
        "sized its pools from (a share of what the host had free at the server's start: weights, KV cache, "
        "Mamba states, speculative intermediates, activations, headroom) beside the peak the host monitor "
        "observed (the server's processes and its /dev/shm files).",
    ),
}
CSS = """
body{margin:0;background:#f3f4f6;color:#111827;
  font:14px/1.5 Inter,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif}
main{max-width:1240px;margin:0 auto;padding:24px}
.card{background:#fff;border-radius:12px;box-shadow:0 1px 3px rgba(0,0,0,.08);padding:20px 24px;margin-bottom:20px}
header.card{border-top:6px solid #2563eb}
h1{font-size:24px;margin:0 0 4px} h2{font-size:18px;margin:0 0 6px} h3{font-size:14px;margin:18px 0 6px;color:#374151}
.meta{color:#6b7280;margin:0 0 16px} .why{font-size:15px;margin:4px 0 8px;color:#1f2937}
.explain{color:#4b5563;margin:0 0 12px;max-width:980px}
.kpis{display:grid;grid-template-columns:repeat(auto-fit,minmax(170px,1fr));gap:12px;margin:12px 0}
.kpi{background:#f9fafb;border:1px solid #e5e7eb;border-radius:10px;padding:10px 14px}
.kpi .label{font-size:12px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
.kpi .value{font-size:22px;font-weight:650} .kpi .sub{font-size:12px;color:#6b7280}
.good{color:#047857} .bad{color:#b91c1c}
table{border-collapse:collapse;width:100%;font-size:13px} td{white-space:pre-line}
th,td{padding:6px 10px;border-bottom:1px solid #e5e7eb;text-align:left;vertical-align:top}
th{background:#f9fafb;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#111827;color:#e5e7eb;padding:12px 14px;border-radius:8px;overflow-x:auto;white-space:pre-wrap;
  word-break:break-all}
nav a{margin-right:14px;color:#2563eb;text-decoration:none} .note{color:#6b7280;font-size:12px}
"""


def _section(key: str, fig: go.Figure, *, host_memory: bool = False) -> str:
    """One figure's card; a CPU study's memory card speaks of the host's memory."""
    title, explain = (HOST_SECTIONS.get(key) if host_memory else None) or SECTIONS[key]
    div = pio.to_html(
        fig,
        full_html=False,
        include_plotlyjs=False,
        div_id=f"fig-{key}",
        default_width="100%",
        config={"displaylogo": False, "responsive": True},
    )
    return (
        f'<section class="card figure-section" id="{key}"><h2>{html.escape(title)}</h2>'
        f'<p class="explain">{html.escape(explain)}</p>{div}</section>'
    )


def _numerics_section(report: Report) -> str:
    """The numerics card (``report.numerics``), when a trial was probed or the study sets a numerics limit."""
    t, f = report.tables, report.facts
    limits = data.numerics_limits(data.study_config(report.study))
    if t["numerics"].empty and not limits.limits():
        return ""
    return report_numerics.section_html(
        t["trials"], t["numerics"], report.study, winner=f.winner, baseline=f.baseline, table_html=_table
    )


def _importance_note(report: Report) -> str:
    """Where the importance chart would be when the evaluator cannot rank the flags: say so, never draw a
    uniform split."""
    if not data.param_columns(report.tables["trials"]):
        return ""
    title, _ = SECTIONS["importance"]
    return (
        f'<section class="card" id="importance"><h2>{html.escape(title)}</h2>'
        f"<p>{html.escape(NOT_ENOUGH_TO_RANK.capitalize())}: too few completed trials set each flag, or "
        "the top trials do not differ from the rest in any flag.</p></section>"
    )


def render(report: Report, figs: Mapping[str, go.Figure]) -> str:
    """One self-contained page: plotly.js inlined once in the head, then the header card and the sections."""
    sections = [
        _section(key, figs[key], host_memory=report.facts.host_memory) if key in figs else _importance_note(report)
        for key in SECTIONS
        if key in figs or key == "importance"
    ]
    numerics_html = _numerics_section(report)
    failures = report.tables["failures"]
    fail_html = "<p>Every trial measured.</p>"
    if len(failures):
        counts = ", ".join(f"{n} {k}" for k, n in failures["outcome"].value_counts().items())
        # A long table stays folded so the page ends with the figures, not 100 rows of log lines.
        fail_html = (
            f"<details{' open' if len(failures) <= 15 else ''}><summary>{len(failures)} trials: "
            f"{html.escape(counts)}</summary>{_table(failures, links=('log',))}</details>"
        )
    extra = ""
    if "compare" in report.tables:
        table = report.tables["compare"].assign(
            baseline_tok_s=lambda f: f["baseline_tok_s"].map(lambda v: _num(v)),
            best_tok_s=lambda f: f["best_tok_s"].map(lambda v: _num(v)),
            gain=lambda f: f["gain"].map(lambda v: _num(v, "{:.2f}×")),
        )
        extra = '<section class="card" id="compare-table"><h2>Compared studies</h2>' + _table(table) + "</section>"
    if "per_gpu" in report.tables:
        table = report.tables["per_gpu"].assign(
            baseline_tok_s=lambda f: f["baseline_tok_s"].map(lambda v: _num(v)),
            best_tok_s=lambda f: f["best_tok_s"].map(lambda v: _num(v)),
            best_gain=lambda f: f["best_gain"].map(lambda v: _num(v, "{:.2f}×")),
            vs_median=lambda f: f["vs_median"].map(lambda v: _num(v, "{:.3f}")),
        )
        extra += (
            '<section class="card" id="per-gpu"><h2>Per-GPU calibration</h2><p class="explain">Each GPU ran '
            "its own baseline; <code>vs_median</code> is its baseline against the median GPU's (the "
            "device-to-device spread). Trials are ranked by their gain over their own GPU's baseline, so a "
            "fast device does not crown its own trials.</p>" + _table(table) + "</section>"
        )
    nav = " ".join(f'<a href="#{k}">{html.escape(SECTIONS[k][0])}</a>' for k in SECTIONS if k in figs)
    if numerics_html:
        nav = '<a href="#numerics">Numerics</a> ' + nav
    title = html.escape(f"autotune report — {report.facts.study}")
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style>'
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body><main>'
        f'{header_html(report.facts, report.tables)}<nav class="card">{nav} <a href="#failures">Failures</a></nav>'
        + numerics_html
        + "".join(sections)
        + extra
        + '<section class="card" id="failures"><h2>Failures</h2><p class="explain">Every trial that did not '
        "measure: its class, the SGLang log line (or planner message) that classified it, and its log.</p>"
        + fail_html
        + '</section><p class="note">Generated by autotune from the study storage; figures are '
        "drawn from the same tables <code>autotune report --format csv</code> prints.</p></main></body></html>"
    )
