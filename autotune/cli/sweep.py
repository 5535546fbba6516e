"""``autotune sweep``: run (or resume) a study, confirm the winner, print the summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click

from autotune.cli import INTERRUPTED
from autotune.cli.borrow import borrowed_sweep
from autotune.cli.fromstudy import start_from
from autotune.config import load_config
from autotune.config.studyref import resolve_config
from autotune.errors import ConfigError
from autotune.harness.engines import ENGINES
from autotune.launch import LAUNCHERS
from autotune.launch.groups import parse_gpus
from autotune.progress import make_progress
from autotune.search.objective import open_study
from autotune.search.preflight import check_study
from autotune.search.scaleout.workers import on_gpus, run_workers, with_launcher
from autotune.search.sweep import run_sweep
from autotune.search.views.gpus import render_gpus
from autotune.search.views.summary import BaselineEntry, SweepSummary, TrialEntry
from autotune.sglang.flags import FlagTable


def _x(value: float | None) -> str:
    return f"{value:.2f}×" if value else "n/a"


def _tok(value: float | None) -> str:
    return f"{value:,.0f} tok/s" if value is not None else "n/a"


def _score(entry: TrialEntry | BaselineEntry | None, multi: bool) -> str:
    """A trial's tok/s, and, in a study whose servers span several GPUs, its per-GPU score and GPU count."""
    if not entry:
        return "n/a"
    text = _tok(entry.output_tok_s)
    if multi and entry.tok_s_per_gpu is not None:
        gpus = entry.gpus or 1
        text += f" on {gpus} GPU{'s' if gpus > 1 else ''}, {entry.tok_s_per_gpu:,.0f} tok/s per GPU"
    return text


def render(summary: SweepSummary) -> str:
    """The human summary: statuses, baseline, winner, gains over the baseline and SGLang's defaults."""
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(summary.statuses.items()))
    lines = [f"Study {summary.study} ({summary.storage}): {summary.n_trials} trials ({statuses})"]
    if summary.origin:  # re-tuned from an earlier study (``--from``): where it started
        lines.append(f"  {summary.origin}")
    if summary.launched:
        share = 100 * summary.launched_oom / summary.launched
        again = summary.launched_interrupted or 0
        rerun = f" ({again} interrupted and run again)" if again else ""
        skipped = summary.statuses.get("skipped_infeasible", 0)
        tail = f"; the planner skipped {skipped} without launching" if skipped else ""
        lines.append(
            f"  launched {summary.launched} servers{rerun}, {summary.launched_oom} ran out of memory "
            f"({share:.0f} %){tail}"
        )
    base, best = summary.baseline, summary.best
    multi = bool(summary.multi_gpu)
    if multi:
        lines.append("  ranked by tok/s per GPU (a server's tok/s ÷ the GPUs it spans)")
    if base.failed:
        lines.append(f"  baseline {base.failed}")
    else:
        search = " (its search run: far behind the leader, not relaunched)" if base.from_search else ""
        lines.append(f"  baseline (trial {base.trial}): {_score(base, multi)}{search}")
    for e in summary.enqueued:
        lines.append(f"  {e.label} (trial {e.trial}): {_score(e, multi)}")
    if best:
        ci = f" (95 % CI {best.ci_low:,.0f}–{best.ci_high:,.0f})" if best.ci_low is not None else ""
        lines.append(f"  winner: trial {best.trial}: {_score(best, multi)}{ci}")
        flags = " ".join(FlagTable.bundled().to_argv(best.params or {}))  # store-true flags bare, as SGLang wants
        lines.append(f"    {flags}")
        gain_ci = summary.gain_ci
        ci = f" (95 % CI {gain_ci[0]:.2f}–{gain_ci[1]:.2f}×)" if gain_ci and gain_ci[0] is not None else ""
        lines.append(f"  gain over baseline: {_x(summary.gain_over_baseline)}{ci}")
        if best.numerics:  # the winner changes outputs: its probe's figures, before anyone applies it
            lines.append(f"  {best.numerics}")
        if best.worst_case:  # the stress phase: peak, retractions, survived (or the failure, or none ran)
            lines.append(f"  {best.worst_case}")
    elif summary.outcome == "no_baseline":
        lines.append("  winner: none, no measured baseline to compare with (nothing to apply)")
    elif summary.outcome == "baseline" and summary.above_baseline:  # measured above, not crowned
        lines.append("  winner: none, no config was shown to beat the baseline (keep the baseline; see the note)")
    elif summary.outcome == "baseline":
        lines.append("  winner: none, no config beat the baseline (keep the baseline; nothing to apply)")
    else:
        lines.append("  winner: none (nothing to apply)")
    for other in summary.unexpected or ():  # another finalist whose outputs changed though no table flag did
        lines.append(f"  trial {other.trial}: {other.line}")
    if summary.job:
        lines.append(f"  {summary.job['line']}")
    defaults = summary.defaults
    if defaults and defaults.output_tok_s and best:
        lines.append(
            f"  gain over SGLang 0.5.23 defaults ({_tok(defaults.output_tok_s)}, {defaults.how}): "
            f"{_x(summary.gain_over_defaults)}"
        )
    elif defaults and defaults.output_tok_s:
        lines.append(f"  SGLang 0.5.23 defaults (fixed flags kept): {_tok(defaults.output_tok_s)}, {defaults.how}")
    elif defaults:
        why = f"{defaults.status or 'failed'}" + (f": {defaults.reason}" if defaults.reason else "")
        lines.append(
            f"  SGLang 0.5.23 defaults (fixed flags kept) failed, {defaults.how}: {why}; no gain over defaults"
        )
    if summary.defaults_lead:  # the defaults beat everything the space reached: say so, with what to do
        lines.append(f"  {summary.defaults_lead}")
    if summary.search_stop is not None:  # the budget spent, or the rule that stopped the search before it
        lines.append(f"  {summary.search_stop.line}")
    if summary.spend is not None and summary.spend.phases:  # launches and GPU-hours by phase (``views.spend``)
        lines.append(f"  {summary.spend.line()}")
    if summary.confirmation:  # launches, windows and the two noise terms the verdict was read with
        lines.append(f"  confirmation: {summary.confirmation}")
    if summary.twins:  # one server at two memory fractions, confirmed once (``confirm.twins``)
        said = "; ".join(f"trial {n} for {', '.join(str(m) for m in others)}" for n, others in summary.twins.items())
        lines.append(
            f"  confirmed as one server: {said} (the same config at another --mem-fraction-static, the "
            "same running cap, each KV pool holding the batch)"
        )
    if summary.note:
        lines.append(f"  note: {summary.note}")
    if summary.interrupted:
        lines.append("  interrupted: run the same command again to resume")
    return "\n".join(lines)


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Study file (default: studies/example.toml).",
)
@click.option("--study", "study_name", help="Study name (default: [study] name, else the file name).")
@click.option("--storage", help="Optuna storage URL (default: sqlite beside the study file).")
@click.option("--trials", type=click.IntRange(min=1), help="Total number of trials (counting finished ones).")
@click.option("--engine", type=click.Choice(sorted(ENGINES)), help="Override [engine] kind.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--gpus",
    help="GPUs of this node, e.g. 0-7 or 0,1,2,3: one worker per GPU group (as many GPUs as "
    "a server spans), all sharing the study.",
)
@click.option(
    "--launcher",
    type=click.Choice(sorted(LAUNCHERS)),
    help="Override [engine] launcher; slurm with --gpus or --workers runs each worker as its own Slurm job.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="With --launcher slurm: this many worker jobs, each asking Slurm for a server's GPUs.",
)
@click.option(
    "--from",
    "from_study",
    metavar="STUDY",
    help="Re-tune from an earlier study (FILE.toml, NAME or STORAGE_URL): its best configs first, its planner "
    "corrections scaled to this GPU.",
)
@click.option(
    "--borrow",
    "borrow",
    metavar="SERVER",
    help="Tune in place: lend this server of the running fleet to the study (drained out of the router, "
    "stopped), run the study on its GPUs, give it back on its production config when the study ends.",
)
@click.option(
    "--fleet",
    "fleet_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="With --borrow: the fleet file (default: the fleet the last `autotune apply` wrote).",
)
def sweep(
    config_path: Path | None,
    study_name: str | None,
    storage: str | None,
    trials: int | None,
    engine: str | None,
    as_json: bool,
    gpus: str | None,
    launcher: str | None,
    workers: int | None,
    from_study: str | None,
    borrow: str | None,
    fleet_file: Path | None,
) -> None:
    """Run (or resume) a study: search configs, then confirm the winner."""
    cfg = load_config(resolve_config(config_path), name=study_name, storage=storage, trials=trials, engine=engine)
    cfg = with_launcher(cfg, launcher)
    for note in cfg.notes:  # e.g. a prompt file shorter than sample_size
        click.echo(f"Warning: {note}", err=True)
    if workers is not None and gpus:
        raise ConfigError(
            "--workers and --gpus both name the workers",
            key="--workers",
            fix="give --gpus 0-3 (workers on these GPUs) or --workers N (N Slurm jobs), not both",
        )
    if workers is not None and cfg.engine.launcher != "slurm":
        raise ConfigError(
            "--workers needs the slurm launcher",
            key="--workers",
            fix="add --launcher slurm, or give --gpus 0-3 to run workers on this node",
        )
    check_study(cfg)  # a baseline or [[enqueue]] SGLang refuses: one line, before any worker or server starts
    if from_study:  # the earlier study's best configs and planner corrections, recorded in this study
        start_from(cfg, from_study, echo=lambda line: click.echo(line, err=as_json))
    if borrow is not None:
        if gpus or workers is not None:
            raise ConfigError(
                "--borrow runs the study on the lent server's GPUs",
                key="--borrow",
                fix="give --borrow SERVER alone, or --gpus / --workers without it",
            )
        summary = borrowed_sweep(
            cfg,
            borrow,
            fleet_file,
            echo=lambda line: click.echo(line, err=as_json),
            progress=make_progress(quiet_stdout=as_json),
        )
    else:
        if gpus or workers is not None:
            cfg = _search_on(cfg, gpus, workers, err=as_json)
        summary = run_sweep(cfg, progress=make_progress(quiet_stdout=as_json))
    click.echo(json.dumps(dataclasses.asdict(summary), indent=2, default=str) if as_json else render(summary))
    if (gpus or workers is not None) and not as_json:
        click.echo(render_gpus(open_study(cfg, create=False)))
    if summary.interrupted:
        raise SystemExit(130)
    if summary.error:  # no measured baseline: the sweep did not do its job, whatever it printed
        click.echo(f"Error: {summary.error}", err=True)
        raise SystemExit(1)


def _search_on(cfg: Any, gpus: str | None, workers: int | None, *, err: bool) -> Any:
    """The search on one worker per GPU group (``autotune.search.scaleout.workers``), or on ``workers`` Slurm jobs; the
    confirmation then runs here, on the pool (its launches take a free group from the same GPU locks)."""
    indices = parse_gpus(gpus) if gpus else None
    pinned = on_gpus(cfg, indices, cfg.engine.port) if indices else cfg  # a pool too small: one line, nothing started
    try:
        run_workers(cfg, indices, echo=lambda line: click.echo(line, err=err), count=workers)
    except KeyboardInterrupt:
        click.echo(INTERRUPTED, err=True)
        raise SystemExit(130) from None
    return pinned
