"""``autotune trials``: a study's trials as a table, CSV or JSON (read from the study alone)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import optuna
import pandas as pd
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from autotune.config import load_config
from autotune.config.studyref import resolve_config
from autotune.results import FidelityFigures, TrialResult, fidelity_summary, granted_line, numerics_line
from autotune.search.confirm.record import Confirmation
from autotune.search.numerics import contender_fidelity
from autotune.search.objective import gpus_spanned, open_study, per_gpu
from autotune.search.space import config_diff
from autotune.search.storage import load_study
from autotune.search.views.jobview import job_for_study
from autotune.search.views.origin import origin_line
from autotune.search.views.summary import confirmation_line, confirmed, confirmed_rate, verdict_note
from autotune.search.views.worstcase import stress_of, worst_case_line
from autotune.search.warm import record_of

COLUMNS = [
    "number",
    "state",
    "status",
    "role",
    "params",
    "output_tok_s",
    "gpus",
    "tok_s_per_gpu",
    "max_running_requests",
    "granted",
    "kv_tokens",
    "mamba_slots",
    "peak_gib",
    "numerics",
    "reason",
    "winner",
    "confirmed_tok_s",
    "worst_case",
]


@dataclass(frozen=True)
class TrialRow:
    """One trial as ``autotune trials`` shows it: the columns above (in that order, with ``fidelity`` after
    ``numerics``), capacity and peak memory from the stored ``TrialResult``. ``--json`` prints its fields."""

    number: int
    state: str  # Optuna's state name
    status: str
    role: str  # "role:label" where the label says more than the role
    params: dict[str, Any]  # the SGLang flags it launched with (by dest)
    output_tok_s: float | None
    gpus: int | None
    tok_s_per_gpu: float | None  # the score trials are ranked by: tok/s ÷ the GPUs the server spanned
    max_running_requests: int | None
    kv_tokens: int | None
    granted: str | None  # below the config's max_running_requests: what it asked for and the pool that bound it
    mamba_slots: int | None
    peak_gib: float | None  # a CPU server's peak is host memory
    numerics: str  # the fidelity probe's figures against the reference config ("" when outputs cannot differ)
    fidelity: FidelityFigures | None  # the contender probe of its first confirmation run where it ran one
    reason: str | None
    winner: bool  # the confirmed winner
    confirmed_tok_s: float | None  # the confirmed median server tok/s (the figure the crown rests on)
    worst_case: str | None  # the stress phase's verdict, for the stressed configs


def rows(study: optuna.Study) -> list[TrialRow]:
    """One row per trial, in trial order."""
    out = []
    conf = Confirmation.of(study)
    verdict = confirmed(conf)
    winner = verdict.winner_trial if verdict is not None else None
    for t in study.get_trials(deepcopy=False):
        stored = TrialResult.of(t)  # the one reader of a stored trial's result
        cap, gpu = (stored.capacity, stored.peaks) if stored is not None else (None, None)
        role = t.user_attrs.get("role", "")
        label = t.user_attrs.get("label")
        rate = confirmed_rate(conf, t.number, gpus_spanned(stored) if stored else 1)  # (median, interval) | None
        stat = verdict.stat(t.number) if verdict is not None else None
        if stat is not None and stat.from_search:
            rate = None  # a baseline far behind the leader: its search run stood in, nothing was confirmed
        fidelity = contender_fidelity(
            stored.fidelity if stored else None, conf.probe(t.number) if conf is not None else None
        )
        out.append(
            TrialRow(
                number=t.number,
                state=t.state.name,
                status=t.user_attrs.get("status", ""),
                role=f"{role}:{label}" if label and label != role else role,
                params=(stored.config if stored else None) or t.user_attrs.get("config") or t.params,
                output_tok_s=stored.output_tok_s if stored else None,
                gpus=gpus_spanned(stored) if stored else None,
                tok_s_per_gpu=per_gpu(stored) if stored else None,
                max_running_requests=cap.max_running_requests if cap else None,
                kv_tokens=cap.kv_tokens if cap else None,
                granted=granted_line(stored.config, stored.capacity) if stored else None,
                mamba_slots=cap.mamba_slots if cap else None,
                peak_gib=gpu.peak_used_gib if gpu else None,
                numerics=fidelity_summary(fidelity),
                fidelity=fidelity,
                reason=t.user_attrs.get("reason"),
                winner=t.number == winner,
                confirmed_tok_s=rate[0] if rate else None,
                worst_case=worst_case_line(conf, t.number) if stress_of(conf, t.number) else None,
            )
        )
    return out


def natural_width(table: Table) -> int:
    """The table's width with no cell wrapped. Printed narrower, rich crops the last columns (it cannot honour
    the flags column's min_width and fit), which cut "outputs vs baseline" to "outputs vs b" at 160 columns."""
    wide = Console(width=10_000)
    return Measurement.get(wide, wide.options, table).maximum


def _open(config_path: Path | None, study_name: str | None, storage: str | None) -> optuna.Study:
    if config_path is not None or storage is None:
        cfg = load_config(resolve_config(config_path), name=study_name, storage=storage)
        return open_study(cfg, create=False)
    return load_study(storage, study_name)  # SQLite, journal files and database URLs alike


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help="Study file.")
@click.option("--study", "study_name", help="Study name.")
@click.option("--storage", help="Optuna storage URL.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def trials(config_path: Path | None, study_name: str | None, storage: str | None, as_csv: bool, as_json: bool) -> None:
    """Print a study's trials as a table, CSV or JSON."""
    if as_csv and as_json:
        raise click.UsageError("--csv and --json are exclusive")
    study = _open(config_path, study_name, storage)
    data = rows(study)
    if as_json:
        # each row's fields, the fidelity figures as the trial stores them
        plain = [{**asdict(r), "fidelity": r.fidelity.to_dict() if r.fidelity else None} for r in data]
        click.echo(json.dumps(plain, indent=2, default=str))
        return
    if as_csv:
        frame = pd.DataFrame([asdict(r) for r in data], columns=COLUMNS)
        frame["params"] = frame["params"].map(lambda p: json.dumps(p, sort_keys=True))
        click.echo(frame.to_csv(index=False), nl=False)
        return
    # The table shows each config as its difference from the baseline; CSV and JSON carry the full flags.
    base = next((r.params for r in data if r.role.startswith("baseline")), None) or {}
    multi = any((r.gpus or 1) > 1 for r in data)  # servers over several GPUs: show the per-GPU score beside
    table = Table(
        *[
            "#",
            "status",
            "role",
            "flags vs baseline",
            "tok/s",
            *(["GPUs", "tok/s per GPU"] if multi else []),
            "running",
            "KV tokens",
            "Mamba slots",
            "peak GiB",
            "outputs vs baseline",
        ]
    )
    # whole flag names, one per line, never cut to "mamba_full_memory_ratio=u…"
    table.columns[3].overflow, table.columns[3].min_width = "fold", 36
    for r in data:
        diff = config_diff(r.params or {}, base)
        params = "\n".join(f"{k}={'unset' if v is None else v}" for k, v in diff.items()) or "="
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        per = [fmt(r.gpus, "d"), fmt(r.tok_s_per_gpu, ",.0f")] if multi else []
        role = f"★ winner\n{r.role}" if r.winner else r.role
        tok = fmt(r.output_tok_s, ",.0f")
        if r.confirmed_tok_s is not None:  # the confirmed median beside the search figure
            tok = f"{r.confirmed_tok_s:,.0f} confirmed ({tok} search)"
        table.add_row(
            str(r.number),
            r.status or r.state.lower(),
            role,
            params,
            tok,
            *per,
            fmt(r.max_running_requests, "d") + (f"\n({r.granted})" if r.granted else ""),
            fmt(r.kv_tokens, ","),
            fmt(r.mamba_slots, "d"),
            fmt(r.peak_gib, ".1f"),
            r.numerics,
        )
    Console(width=max(Console().width, 160, natural_width(table))).print(table)  # every column whole
    if (origin := origin_line(record_of(study))) is not None:  # a re-tune (``sweep --from``): where it started
        click.echo(origin)
    for r in data:  # a contender whose outputs differ though no output-changing flag did: one line each
        if r.fidelity is not None and r.fidelity.unexpected:
            click.echo(f"trial {r.number}: {numerics_line(r.fidelity)}")
    conf = Confirmation.of(study)
    for r in data:  # the stress phase's verdict on each stressed config (the winner's, or why it has none)
        if r.worst_case or r.winner:
            click.echo(
                f"trial {r.number}{' (winner)' if r.winner else ''}: {r.worst_case or worst_case_line(conf, r.number)}"
            )
    if conf is not None and conf.complete and confirmation_line(conf):  # the launches and noise the figures rest on
        click.echo(f"confirmation: {confirmation_line(conf)}")
    if note := verdict_note(study):  # the verdict in the words the summary, report and apply use
        click.echo(f"verdict: {note}")
    verdict = confirmed(conf)
    job = job_for_study(study, verdict.winner_trial if verdict is not None else None)
    if job is not None:  # [job]: the confirmed winner (or the baseline alone) as the job's hours
        click.echo(job["line"])
