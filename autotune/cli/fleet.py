"""``autotune fleet up|status|down [--fleet fleet.toml]``: the servers a fleet file describes (by default the
fleet the last ``autotune apply`` wrote, ``config.studyref.locate_fleet``)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from autotune.config.studyref import locate_fleet
from autotune.deploy import keeperproc, leasefile
from autotune.deploy.fleet import Fleet, foreign_note, load_fleet
from autotune.deploy.fleet import down as fleet_down
from autotune.deploy.fleet import status as fleet_status
from autotune.deploy.fleet import up as fleet_up
from autotune.deploy.fleetlog import FleetLog, events_path, shown
from autotune.deploy.keeper import Keeper
from autotune.deploy.lease import give_back
from autotune.deploy.router import running as router_running
from autotune.deploy.router import wanted as router_wanted
from autotune.deploy.routerview import view as router_view

FLEET_OPTION = click.option(
    "--fleet",
    "fleet_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The fleet file (default: the fleet.toml the last `autotune apply` wrote for the "
    "default study, else ./fleet.toml).",
)
SERVER_OPTION = click.option("--server", "names", multiple=True, help="Only this server (repeatable).")


def _load(fleet_file: Path | None) -> tuple[Fleet, Path]:
    """The fleet file named, or the default one (said on stderr, so --json stays clean), loaded."""
    found = locate_fleet(fleet_file)
    if found.said:
        click.echo(found.said, err=True)
    return load_fleet(found.path), found.path


@click.group("fleet")
def fleet() -> None:
    """Start, inspect or stop the servers of a fleet file (local processes or Slurm jobs, by its launcher; remote
    hosts over SSH)."""


@fleet.command("up")
@FLEET_OPTION
@SERVER_OPTION
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=900.0,
    show_default=True,
    help="Seconds each server may take to become healthy.",
)
@click.option(
    "--keeper/--no-keeper",
    default=None,
    help="Leave the fleet's keeper running beside it (default: [keeper] keep, true unless set).",
)
def up(fleet_file: Path | None, names: tuple[str, ...], timeout: float, keeper: bool | None) -> None:
    """Start every server that is not running (detached: they keep running after this command), then the router
    and the keeper, which restarts a server that dies."""
    fleet, path = _load(fleet_file)
    lent = leasefile.current(fleet)
    if lent is not None and not lent.holder_alive():  # a sweep killed while it held a server: the server comes back
        click.echo(give_back(path, reason="its sweep is gone") or "")
    elif lent is not None:
        click.echo(f"lease: {lent.line} (left to its study)")
    started = fleet_up(fleet, timeout_s=timeout, names=names or None)
    click.echo(f"started: {', '.join(started)}" if started else "all servers already running")
    if fleet.keeper.keep if keeper is None else keeper:
        kept = keeperproc.start(fleet)
        click.echo(f"keeper: pid {kept.pid}, restarts a server that dies (log {kept.log}; events {events_path(fleet)})")
    record = router_running(fleet)
    if record is not None:
        click.echo(
            f"router: point the job at {record.url} (pid {record.pid}, {len(record.worker_urls)} workers, "
            f"log {record.log})"
        )
    elif len(fleet.servers) > 1:
        click.echo(f"no router: {router_wanted(fleet)}")


@fleet.command("status")
@FLEET_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(fleet_file: Path | None, as_json: bool) -> None:
    """Health, effective capacity, config in use and tok/s of every server."""
    fleet, fleet_file = _load(fleet_file)
    rows = fleet_status(fleet)
    seen = router_view(fleet)
    if as_json:  # the servers' list, as before; the router's view rides on the first entry's side
        click.echo(json.dumps([r.to_dict() for r in rows] + ([{"router": seen.to_dict()}] if seen else []), indent=2))
        return
    table = Table(title=str(fleet_file))
    # The capacity columns are what each server allocated at startup (its caps), not what it holds now.
    for column in (
        "server",
        "host",
        "gpus",
        "port",
        "state",
        "running cap",
        "KV tokens (cap)",
        "Mamba slots (cap)",
        "tok/s (last)",
        "config",
    ):
        table.add_column(column, justify="left" if column in ("server", "host", "state", "config") else "right")
    for r in rows:
        cap = r.capacity
        config = r.config + (f" (differs: {', '.join(r.drift)})" if r.drift else "")
        table.add_row(
            r.name,
            r.host,
            ",".join(str(g) for g in r.gpus) or "-",
            str(r.port),
            r.state,
            *(
                str(getattr(cap, k)) if cap and getattr(cap, k) is not None else "-"
                for k in ("max_running_requests", "kv_tokens", "mamba_slots")
            ),
            f"{r.tok_s:.0f}" if r.tok_s is not None else "-",
            config,
        )
    Console(width=max(Console().width, 150)).print(table)  # whole headers and configs, as trials prints
    for r in rows:
        if r.note:
            click.echo(r.note)
    for line in keeper_lines(fleet):
        click.echo(line)
    for line in (
        seen.lines()
        if seen is not None
        else ([f"no router: {router_wanted(fleet) or 'not running'}"] if len(fleet.servers) > 1 else [])
    ):
        click.echo(line)


@fleet.command("down")
@FLEET_OPTION
@SERVER_OPTION
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds SGLang may drain in-flight requests before SIGKILL.",
)
def down(fleet_file: Path | None, names: tuple[str, ...], grace: float) -> None:
    """Stop the fleet's servers (SIGTERM, then SIGKILL after --grace, through the launcher that started each),
    and with all of them the router; a server on a fleet port that is not the fleet's is named and left running."""
    fleet = _load(fleet_file)[0]
    had_router = router_running(fleet) is not None and not names
    had_keeper = keeperproc.running(fleet) is not None and not names
    stopped = fleet_down(fleet, grace_s=grace, names=names or None)
    if had_keeper:
        click.echo("keeper stopped")
    if had_router:
        click.echo("router stopped")
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "no server was running")
    for server in fleet.servers:
        note = None if server.name in stopped or (names and server.name not in names) else foreign_note(fleet, server)
        if note:
            click.echo(note)


@fleet.command("keep")
@FLEET_OPTION
def keep(fleet_file: Path | None) -> None:
    """Run the fleet's keeper in the foreground until SIGTERM or Ctrl-C (``fleet up`` leaves one running detached):
    it restarts a server that died or stopped answering and keeps the router on the fleet's own servers."""
    fleet, path = _load(fleet_file)
    keeper = Keeper(path)
    with keeperproc.only_keeper(fleet), stop_on_signals(keeper.stop):
        keeper.run()


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM (``fleet down``) and Ctrl-C set ``stop``: the keeper ends its look and lets go of the fleet."""
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def keeper_lines(fleet: Fleet, *, count: int = 5) -> list[str]:
    """The keeper's state and its latest events, as ``fleet status`` prints them."""
    kept = keeperproc.running(fleet)
    events = FleetLog.of(fleet).recent(count)
    head = (
        f"keeper: running (pid {kept.pid})"
        if kept is not None
        else "keeper: not running (autotune fleet up starts it; nothing restarts a server that dies)"
    )
    lent = leasefile.current(fleet)
    return [head, *(f"  {shown(e)}" for e in events), *([f"lease: {lent.line}"] if lent is not None else [])]
