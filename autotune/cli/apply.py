"""``autotune apply``: write the winner's artifacts, show what would change, or roll it out to a fleet."""

from __future__ import annotations

from pathlib import Path

import click

from autotune.config.studyref import locate, locate_fleet, record_apply, study_file
from autotune.deploy import fleetkeys, rollout, router
from autotune.deploy import ports as fleet_ports
from autotune.deploy.apply import load_winner, winner_from_yaml, write_artifacts, yaml_header
from autotune.deploy.fleet import load_fleet, server_config
from autotune.deploy.inflight import client_advice, read_advice
from autotune.deploy.numerics import check_numerics
from autotune.deploy.sglang_yaml import config_diff
from autotune.errors import ConfigError
from autotune.launch.groups import parse_gpus
from autotune.redaction import looks_secret
from autotune.results import numerics_line
from autotune.search.views.worstcase import check_stressed


def _winner(config: Path | None, study: str | None, storage: str | None, trial: int | None):
    if config is not None and config.suffix in (".yaml", ".yml"):
        if study or storage or trial is not None:
            raise ConfigError("give either an sglang.yaml or a study, not both", key="--config")
        return winner_from_yaml(config)
    study, storage, base_dir = locate(config, study, storage)  # as sweep, trials and report find it
    if not storage:
        raise ConfigError("no study to read", key="--storage", fix="pass --config study.toml or --storage URL")
    return load_winner(storage, study, trial=trial, base_dir=base_dir)


def _default_fleet() -> Path:
    """The fleet a rollout goes to when --fleet is not given: the one the last apply wrote (``locate_fleet``)."""
    found = locate_fleet(None)
    click.echo(found.said, err=True)
    return found.path


def _dry_run(winner, fleet_file: Path | None) -> None:
    if fleet_file is not None:
        fleet = load_fleet(fleet_file)
        targets = [(f"{s.name} ({s.config})", server_config(fleet, s)) for s in fleet.servers]
    elif winner.baseline_config is not None:
        targets = [("study baseline", winner.baseline_config)]
    else:
        raise ConfigError("nothing to compare with", key="--dry-run", fix="pass --fleet fleet.toml")
    click.echo(f"study {winner.study}, trial {winner.trial}: {winner.tok_s or 0:.0f} tok/s")
    for label, current in targets:
        changes = config_diff(current, winner.config)
        click.echo(f"{label}: {len(changes)} flag(s) change" + (":" if changes else ""))
        for key, old, new in changes:
            click.echo(f"  {key}: {old!r} -> {new!r}")


def _say_skipped_ports(fleet) -> None:
    """One line when ports from the default up were in use, so the servers listen elsewhere than 30000, 30001, …"""
    ports = [s.port for s in fleet.servers if s.local]
    first = fleet_ports.DEFAULT_BASE_PORT
    taken = sorted(set(range(first, max(ports, default=first) + 1)) - set(ports))
    if taken:
        click.echo(
            f"port(s) {', '.join(map(str, taken))} in use on this host: the servers listen on "
            + ", ".join(f"{s.name} {s.port}" for s in fleet.servers)
        )


def _worst_case(winner, *, allow: bool) -> None:
    """The stress phase's line; a config not known to survive it is refused unless ``allow`` (an sglang.yaml
    deployed as is, without the provenance.json apply wrote beside it, has no study to say)."""
    block = winner.worst_case
    if block is None:
        return
    check_stressed(block, allow=allow)
    click.echo(f"--allow-unstressed: {block.problem}" if block.problem else block.line)


@click.command("apply")
@click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path, dir_okay=False),
    help="A study TOML (the study to read), or an sglang.yaml to deploy as is.",
)
@click.option("--study", help="Study name (default: the only study in the storage).")
@click.option("--storage", help="Optuna storage URL, e.g. sqlite:///study.db.")
@click.option("--trial", type=int, help="Deploy this trial instead of the confirmed winner.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), help="Write the artifacts here.")
@click.option(
    "--gpus",
    help="GPUs of the fleet the artifacts describe, e.g. 0-7 or 0,2,5: one server per group "
    "of as many GPUs as the winner spans (0-7 and TP=2: four servers on pairs; required "
    "unless --fleet names a fleet file whose servers to reuse).",
)
@click.option(
    "--base-port",
    type=click.IntRange(1, 65535),
    help="The first server's port (the next servers take the ports after it; one in use is an error). "
    "Default: 30000 and up, skipping ports in use.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address the servers listen on; beyond loopback the fleet runs with keys (keys/ beside fleet.toml).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Write a fleet that listens beyond loopback without keys (anyone who reaches its ports can use it).",
)
@click.option(
    "--python", "python", help="Interpreter in the scripts (default: the study's engine.python, else this one)."
)
@click.option("--model", help="Model path for the launch command (default: the study's).")
@click.option(
    "--fleet",
    "fleet_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fleet.toml: the fleet to compare with, roll out to, or (with --out) whose servers to reuse.",
)
@click.option("--dry-run", is_flag=True, help="Print what would change and write nothing.")
@click.option("--rolling", is_flag=True, help="Roll the config out to --fleet, one server at a time.")
@click.option("--resume", is_flag=True, help="Finish an interrupted rollout of --fleet.")
@click.option("--rollback", is_flag=True, help="Return every server of --fleet to its previous config.")
@click.option("--prompts", type=click.Path(path_type=Path, dir_okay=False), help="Canary prompts (JSONL).")
@click.option(
    "--canary-s",
    type=click.FloatRange(min=0),
    default=20.0,
    show_default=True,
    help="Canary measured window per server; 0 checks capacity only.",
)
@click.option("--canary-warmup-s", type=click.FloatRange(min=0), default=5.0, show_default=True)
@click.option("--canary-concurrency", type=click.IntRange(min=1), help="Default: the study's.")
@click.option(
    "--tolerance",
    type=click.FloatRange(0, 1),
    help="How much slower than the study's tok/s a canary may run (default 0.15; 0.5 on SGLang's CPU "
    "backend, whose servers share the host).",
)
@click.option(
    "--kv-tolerance",
    type=click.FloatRange(0, 1),
    help="Relative KV-token difference allowed (default 0: a GPU server's pool is set by its config; not "
    "compared on SGLang's CPU backend, whose pool follows the host memory free at its start).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds SGLang may drain in-flight requests before SIGKILL.",
)
@click.option("--startup-timeout", type=click.FloatRange(min=1), default=900.0, show_default=True)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Seconds a server out of the router may take to finish its requests in flight before it stops.",
)
@click.option("--keep-partial", is_flag=True, help="On a failure keep verified servers on the new config.")
@click.option(
    "--accept-numerics",
    is_flag=True,
    help="Deploy a winner whose outputs differ from the baseline's without a measured fidelity probe, "
    "or beyond the study's numerics limit.",
)
@click.option(
    "--allow-unstressed",
    is_flag=True,
    help="Deploy a config that never passed the stress phase (failed it, was never stressed, or comes from "
    "a study with the confirmation off).",
)
def apply(
    config,
    study,
    storage,
    trial,
    out,
    gpus,
    base_port,
    host,
    insecure,
    python,
    model,
    fleet_file,
    dry_run,
    rolling,
    resume,
    rollback,
    prompts,
    canary_s,
    canary_warmup_s,
    canary_concurrency,
    tolerance,
    kv_tolerance,
    grace,
    startup_timeout,
    drain_timeout,
    keep_partial,
    accept_numerics,
    allow_unstressed,
) -> None:
    """Write the winner's sglang.yaml, launch_fleet.sh, fleet.toml and provenance.json, or roll it out."""
    # --dry-run may accompany --rolling (show what the rollout would change); the other modes exclude each other.
    modes = [
        m
        for m, on in (
            ("--rolling", rolling and not dry_run),
            ("--resume", resume),
            ("--rollback", rollback),
            ("--dry-run", dry_run),
        )
        if on
    ]
    if len(modes) > 1:
        raise click.UsageError(f"choose one of {', '.join(modes)}")
    timing = rollout.Timing(grace_s=grace, startup_timeout_s=startup_timeout, drain_timeout_s=drain_timeout)
    if (resume or rollback or rolling) and not dry_run and fleet_file is None:
        fleet_file = _default_fleet()
    if resume or rollback:
        report = (rollout.resume if resume else rollout.rollback)(fleet_file, timing=timing, say=click.echo)
        click.echo(report.summary())
        return
    winner = _winner(config, study, storage, trial)
    if dry_run:
        _dry_run(winner, fleet_file)
        return
    numerics = check_numerics(winner, accept=accept_numerics)  # refuses outputs that differ unmeasured or too much
    if numerics and numerics.accepted:
        click.echo(f"--accept-numerics: {numerics.problem}")
    elif numerics_line(winner.result.fidelity):  # within the study's limits: said once, with the probe's figures
        click.echo(numerics_line(winner.result.fidelity))
    _worst_case(winner, allow=allow_unstressed)
    if rolling:
        fleet = load_fleet(fleet_file)  # its device sets the tolerances; the rolled-out sglang.yaml its header
        kv_tolerance, tolerance, said = rollout.device_tolerances(fleet, kv_tolerance, tolerance)
        for line in said:
            click.echo(line)
        expect = rollout.Expectation.from_winner(winner, kv_tolerance=kv_tolerance, tok_s_tolerance=tolerance)
        canary = None
        if canary_s > 0:
            canary = rollout.Canary.from_workload(
                winner.settings.workload,
                prompts=str(prompts) if prompts else None,
                warmup_s=canary_warmup_s,
                measure_s=canary_s,
                concurrency=canary_concurrency,
            )
        client = router.advise(client_advice(winner, servers=len(fleet.servers)), fleet.router)
        report = rollout.start(
            fleet_file,
            winner.config,
            expect=expect,
            canary=canary,
            timing=timing,
            rollback_on_failure=not keep_partial,
            say=click.echo,
            source={"study": winner.study, "trial": winner.trial},
            header=yaml_header(winner, client),
        )
        click.echo(report.summary())
        return
    if out is None:
        raise click.UsageError("give --out DIR (or --dry-run, --rolling, --resume, --rollback)")
    if gpus is not None and fleet_file is not None:
        raise click.UsageError("give --gpus or --fleet (whose servers to reuse), not both")
    layout = None
    if fleet_file is not None:
        layout = load_fleet(fleet_file)
    paths = write_artifacts(
        winner,
        out,
        gpus=parse_gpus(gpus) if gpus is not None else None,
        layout=layout,
        base_port=base_port,
        host=host,
        python=python,
        model=model,
        insecure=insecure,
    )
    if insecure and (open_to := fleetkeys.exposed(load_fleet(out / "fleet.toml"))):
        click.echo(
            f"insecure: {'; '.join(open_to)}, without keys: anyone who reaches these ports can send requests "
            "and add or remove the router's workers"
        )
    click.echo(f"study {winner.study}, trial {winner.trial}: wrote " + ", ".join(str(p) for p in paths))
    if base_port is None and layout is None:
        _say_skipped_ports(load_fleet(Path(out) / "fleet.toml"))
    click.echo(str(read_advice(out)))  # the in-flight requests client.json holds, as written
    source = None if config is not None and config.suffix in (".yaml", ".yml") else study_file(config, study, storage)
    if source is not None:  # fleet up, fleet status, fleet down and watch read this fleet when none is named
        record_apply(source, Path(out) / "fleet.toml", trial=winner.trial)
    if winner.job is not None:
        click.echo(winner.job["line"])
    for name in sorted(k for k, v in winner.env.items() if looks_secret(k, v)):
        click.echo(f"{name} looks like a secret: not written; the launcher and fleet up read it from ${name}")
