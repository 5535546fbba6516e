"""The ``autotune`` command: a thin click group. Each subcommand lives in its own module here and only
parses, calls one library function and prints. Known errors are one line on stderr and exit 1; usage
errors exit 2 (click's convention); a traceback only with ``--debug``.
"""

from __future__ import annotations

import importlib
import sys

import click

from autotune.errors import AutotuneError

# name -> (module, attribute, one-line help). Imported only when the command runs, so `autotune --help`
# stays fast and a heavy dependency of one command never slows another.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "sweep": ("autotune.cli.sweep", "sweep", "Run (or resume) a study: search configs, then confirm the winner."),
    "trials": ("autotune.cli.trials", "trials", "Print a study's trials as a table, CSV or JSON."),
    "measure": ("autotune.cli.measure", "measure", "Run one trial outside any study."),
    "plan": ("autotune.cli.plan", "plan", "Print SGLang's memory plan for a model, GPU and flags."),
    "report": ("autotune.cli.report", "report", "Write a self-contained HTML report of a study."),
    "apply": ("autotune.cli.apply", "apply", "Write the winner's fleet artifacts, or roll it out to a fleet."),
    "fleet": ("autotune.cli.fleet", "fleet", "Start, inspect or stop a local fleet of servers."),
    "inspect": (
        "autotune.cli.inspect",
        "inspect",
        "Diagnose running SGLang servers: binding limit, idle memory, next step.",
    ),
    "sim": ("autotune.cli.sim", "sim", "Run the simulated SGLang server (same flags as SGLang)."),
    "watch": ("autotune.cli.watch", "watch", "Watch a tuned fleet and report when its traffic drifts from the tuning."),
}
# Commands autotune starts itself, not a user: runnable (``python -m autotune worker …``), never listed.
HIDDEN: dict[str, tuple[str, str, str]] = {
    "worker": ("autotune.cli.worker", "worker", "One sweep worker on its GPUs (started by autotune sweep)."),
}


# What a Ctrl-C (or SIGINT) prints, whichever stage it stopped: every command resumes or is safe to re-run.
INTERRUPTED = "Interrupted: run the same command again to resume"


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name) or HIDDEN.get(cmd_name)
        if entry is None:
            return None
        module_name, attr, _ = entry
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][2]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for known errors.")
@click.version_option(package_name="autotune")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Find the fastest safe SGLang configuration for an offline generation job, and roll it out."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        rc = cli.main(args=args, prog_name="autotune", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns a Ctrl-C into Abort
        click.echo(INTERRUPTED, err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AutotuneError as exc:
        if debug:
            raise
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)
