"""``autotune report``: parse, call ``autotune.report.page.report``, print where the page went."""

from __future__ import annotations

from pathlib import Path

import click

from autotune.config.studyref import study_file
from autotune.report.page import report as run_report


@click.command("report")
@click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path),
    help="Study TOML (gives the study name and storage; default: studies/example.toml).",
)
@click.option("--study", "study", help="Study name (default: the only study in the storage).")
@click.option("--storage", "storage", help="Optuna storage URL (default: sqlite:///studies/<study>.db).")
@click.option(
    "--out",
    "out",
    type=click.Path(path_type=Path),
    help="Output file (html, json) or directory (csv). Default: reports/<study>.html; csv/json print.",
)
@click.option(
    "--compare",
    "compare",
    multiple=True,
    metavar="STUDY",
    help="Overlay another study: a name, or its study .toml (repeatable or comma-separated), "
    "e.g. the same model on another GPU.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["html", "csv", "json"]),
    default="html",
    show_default=True,
    help="html: the page; csv/json: the tables behind it.",
)
def report(
    config: Path | None, study: str | None, storage: str | None, out: Path | None, compare: tuple[str, ...], fmt: str
) -> None:
    """Write a self-contained HTML report that explains why the winner wins."""
    names = [name.strip() for item in compare for name in item.split(",") if name.strip()]
    written, text = run_report(
        study=study, storage=storage, config=study_file(config, study, storage), out=out, compare=names, fmt=fmt
    )
    if text is not None:
        click.echo(text)
    elif written is not None:
        click.echo(f"Wrote {written}")
