"""``autotune inspect``: parse, call ``autotune.inspect.diagnose.inspect_servers``, print (and write a sweep file)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from autotune.inspect.diagnose import InspectError, inspect_servers
from autotune.inspect.render import render
from autotune.inspect.sweep_file import sweep_toml


@click.command("inspect")
@click.argument("urls", nargs=-1, required=True, metavar="URL [URL ...]")
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as JSON.")
@click.option("--model", help="Model profile or config.json for the planner (default: inferred from /model_info).")
@click.option("--gpu", help="GPU profile b200|h200|h100 (default: matched by the device's total memory).")
@click.option(
    "--sweep-out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write an `autotune sweep` study file centred on the first suggestion.",
)
@click.option(
    "--prompts",
    help="Prompt file the sweep file's [workload] names "
    "(default: examples/prompts.jsonl if present, else prompts.jsonl beside the file).",
)
@click.option(
    "--log",
    "logs",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="A server's startup log, once per URL in the same order: SGLang states its Mamba pools' size only "
    "there (its `Mamba Cache is allocated` line). Without it that size is reported as unknown.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds per HTTP request.",
)
def inspect(
    urls: tuple[str, ...],
    as_json: bool,
    model: str | None,
    gpu: str | None,
    sweep_out: Path | None,
    prompts: str | None,
    logs: tuple[Path, ...],
    timeout_s: float,
) -> None:
    """Diagnose running SGLang servers (read-only): binding limit, pool usage, idle memory, next step."""
    inspection = inspect_servers(list(urls), model=model, gpu=gpu, timeout_s=timeout_s, logs=list(logs))
    if as_json:
        click.echo(json.dumps(inspection.to_dict(), indent=2, default=str))
    else:
        render(inspection, Console(soft_wrap=False))
    if not inspection.ok:
        raise InspectError(f"no server could be inspected ({len(inspection.failures)} failed; see the lines above)")
    if sweep_out is not None:
        base = next((d for d in inspection.servers if d.advice and d.advice.suggestions), inspection.servers[0])
        shipped = Path("examples/prompts.jsonl")
        if prompts is None and shipped.is_file():
            prompts = str(shipped.resolve())  # the bundled sample, so the file runs as written
        try:
            sweep_out.write_text(sweep_toml(base, prompts=prompts), encoding="utf-8")
        except OSError as exc:
            raise InspectError(f"{sweep_out}: cannot write the sweep file ({exc.strerror})") from None
        click.echo(f"Wrote {sweep_out} (sweep centred on {base.url})", err=as_json)
