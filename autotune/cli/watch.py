"""``autotune watch``: parse, build a ``Watcher`` (``autotune.watch``), print and export each cycle, exit 0/1/2."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import click

from autotune.config.studyref import locate_fleet
from autotune.deploy import leasefile
from autotune.deploy.fleet import status as fleet_status
from autotune.deploy.fleetfile import Fleet, load_fleet
from autotune.deploy.fleetlog import FleetLog, shown
from autotune.deploy.routerview import view as router_view
from autotune.errors import ConfigError
from autotune.inspect.probe import normalise_url
from autotune.sglang.profiles import load_gpu, load_model
from autotune.watch.listen import MetricsServer, parse_listen
from autotune.watch.output import lines
from autotune.watch.prometheus import DriftCollector, write_prometheus
from autotune.watch.reference import load_tuned
from autotune.watch.rules import Limits
from autotune.watch.watcher import EXIT_UNREACHABLE, CycleReport, Watcher, WatchOptions, run

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, *, option: str) -> float:
    """``30s``, ``2m``, ``1.5h``, ``500ms`` or plain seconds → seconds (> 0)."""
    match = _DURATION.match(text)
    if not match or float(match[1]) <= 0:
        raise ConfigError(f"cannot read duration {text!r}", key=option, fix="write e.g. 30s, 2m or 1h")
    return float(match[1]) * _SECONDS[match[2] or "s"]


def _targets(urls: tuple[str, ...], fleet_file: Path | None) -> tuple[list[str], Path, Fleet | None]:
    """The servers to watch, the directory watch's files default to, and the fleet file that named them: the
    one given, or with no URLs the default fleet (the last ``autotune apply``'s, ``locate_fleet``)."""
    if fleet_file is None and urls:
        return list(urls), Path.cwd(), None
    found = locate_fleet(fleet_file)
    if found.said:
        click.echo(found.said, err=True)
    fleet = load_fleet(found.path)
    return [*urls, *(s.url for s in fleet.servers)], fleet.base_dir, fleet


@click.command("watch")
@click.argument("urls", nargs=-1, metavar="[URL ...]")
@click.option(
    "--fleet",
    "fleet_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fleet.toml (from autotune apply): watch every server in it (default with no URLs: the fleet "
    "the last `autotune apply` wrote, else ./fleet.toml).",
)
@click.option(
    "--study",
    "study",
    type=click.Path(path_type=Path),
    help="What the config was tuned for: provenance.json, the directory apply wrote, or the study "
    "TOML (default: the provenance.json beside --fleet, if any).",
)
@click.option("--interval", default="30s", show_default=True, help="Time between samples (30s, 2m, ...).")
@click.option("--window", default="10m", show_default=True, help="Rolling window the rules look at.")
@click.option(
    "--sustain",
    default="3m",
    show_default=True,
    help="How long throughput must stay below the confirmed interval before it is a finding.",
)
@click.option(
    "--once",
    is_flag=True,
    help="Take one sample, report, exit 0 (no drift), 1 (drift) or 2 (no "
    "server answered). Run it from cron: the state file keeps the window.",
)
@click.option(
    "--cycles", type=click.IntRange(min=1), help="Stop after this many samples (default: run until interrupted)."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per cycle, for alerting systems.")
@click.option(
    "--prom-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write autotune_drift{server,rule} here each cycle (node_exporter textfile collector).",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    help="Serve the same series over HTTP at /metrics for Prometheus to scrape (:9400 is "
    "127.0.0.1:9400; give 0.0.0.0:9400 to expose it beyond this host).",
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Rolling-window state file (default: watch-state.json beside the fleet file, or here).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where re-tuning study files go (default: watch/ beside the fleet file, or here).",
)
@click.option("--model", help="Model profile or config.json for the planner (default: inferred).")
@click.option("--gpu", help="GPU profile b200|h200|h100 for the planner (default: matched by memory).")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds per HTTP request.",
)
def watch(
    urls,
    fleet_file,
    study,
    interval,
    window,
    sustain,
    once,
    cycles,
    as_json,
    prom_file,
    listen,
    state_path,
    out_dir,
    model,
    gpu,
    timeout_s,
) -> None:
    """Watch a tuned fleet (read-only) and report when its traffic drifts from what it was tuned for."""
    address = parse_listen(listen) if listen is not None else None
    targets, home, fleet = _targets(urls, fleet_file)
    from_fleet = fleet is not None
    if model:
        load_model(model)
    if gpu:
        load_gpu(gpu)
    if study is None and from_fleet and (home / "provenance.json").is_file():
        study = home / "provenance.json"
    tuned = load_tuned(study) if study is not None else None
    interval_s = parse_duration(interval, option="--interval")
    options = WatchOptions(
        interval_s=interval_s,
        window_s=parse_duration(window, option="--window"),
        limits=Limits(sustain_s=parse_duration(sustain, option="--sustain")),
        model=model,
        gpu=gpu,
        timeout_s=timeout_s,
        out_dir=out_dir or home / "watch",
        state_path=state_path or home / "watch-state.json",
        fleet=fleet.path if fleet is not None else None,
        names={normalise_url(s.url): s.name for s in fleet.servers} if fleet is not None else {},
    )
    if tuned is None:
        click.echo("note: no --study: the length and throughput rules are off (they compare with the study)", err=True)
    else:
        for note in tuned.notes:
            click.echo(f"note: {note}", err=True)

    collector = DriftCollector()

    missing: list[str] = []  # the fleet's servers down or foreign at the last cycle

    def show(report: CycleReport) -> None:
        # the fleet's router, when it runs one: the job's throughput, queue and per-worker load through it
        seen = router_view(fleet, first_wait_s=0.0) if fleet is not None else None
        missing[:] = fleet_problems(fleet) if fleet is not None else []
        kept = [shown(e) for e in FleetLog.of(fleet).recent(3)] if fleet is not None else []
        lent = leasefile.current(fleet) if fleet is not None else None
        if as_json:
            said = {"problems": missing, "keeper": kept, "lease": lent.line if lent else None}
            click.echo(
                json.dumps(
                    {
                        **report.to_dict(),
                        **({"router": seen.to_dict()} if seen else {}),
                        **({"fleet": said} if fleet else {}),
                    },
                    default=str,
                )
            )
        else:
            for line in [
                *lines(report),
                *missing,
                *(seen.lines() if seen else []),
                *(f"keeper: {line}" for line in kept),
                *([f"lease: {lent.line}"] if lent else []),
            ]:
                click.echo(line)
        if prom_file is not None:
            write_prometheus(report, prom_file)
        collector.report = report  # what --listen serves from now on

    with contextlib.ExitStack() as stack:
        watcher = stack.enter_context(Watcher(targets, tuned, options))
        if address is not None:
            server = stack.enter_context(MetricsServer(*address, collector))
            click.echo(f"serving watch's metrics on {server.url}", err=True)
        last = run(watcher, cycles=1 if once else cycles, on_report=show)
    raise SystemExit(EXIT_UNREACHABLE if missing else last.exit_code)


def fleet_problems(fleet: Fleet) -> list[str]:
    """One line for each of the fleet's servers that is down, not answering, or whose port a process that is not
    the fleet's holds: watch's exit status says so (a third of the fleet down is not "no drift")."""
    out = []
    for row in fleet_status(fleet, figures=False):  # the states only: the watcher reads each server's figures
        if row.state == "lent":  # out on purpose, and given back when its study ends: said, not a problem
            continue
        if row.state == "foreign":
            out.append(f"{row.name}: {row.note}")
        elif row.state != "healthy":
            out.append(f"{row.name} ({row.host}, port {row.port}): {row.state}, not serving")
    return out
