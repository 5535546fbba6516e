"""``autotune sim ARGS...``: the simulated SGLang server, exactly ``python -m autotune.sim ARGS...``."""

from __future__ import annotations

import click

from autotune.harness.engines.sim import serve


@click.command(
    "sim",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sim(args: tuple[str, ...]) -> None:
    """Run the simulated SGLang server (SGLang 0.5.23's flags plus --sim-*; --help lists them)."""
    raise SystemExit(serve(list(args)))
