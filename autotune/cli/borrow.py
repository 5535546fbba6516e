"""``autotune sweep --borrow SERVER``: the study on one server of the running fleet, lent and given back
(``deploy.lease``); what the job runs at meanwhile is said before and after."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.config.studyref import locate_fleet
from autotune.deploy.fleetfile import Fleet, load_fleet
from autotune.deploy.lease import borrow, give_back
from autotune.errors import ConfigError
from autotune.search.scaleout.workers import on_gpus
from autotune.search.sweep import run_sweep


def borrowed_sweep(cfg: Any, name: str, fleet_file: Path | None, *, echo: Callable[[str], None], progress: Any) -> Any:
    """Lend ``name``, run the study on its GPUs, give it back however the study ends; the sweep's summary."""
    found = locate_fleet(fleet_file)
    if found.said:
        echo(found.said)
    fleet = load_fleet(found.path)
    server = fleet.server(name)
    if fleet.engine != cfg.engine.kind:
        raise ConfigError(
            f"the study runs engine {cfg.engine.kind!r}, the fleet {fleet.engine!r}",
            key="engine.kind",
            fix=f'borrow from a fleet of the study\'s engine, or set [engine] kind = "{fleet.engine}"',
        )
    if fleet.simulated and fleet.sim_gpu and cfg.engine.sim_gpu and fleet.sim_gpu != cfg.engine.sim_gpu:
        raise ConfigError(
            f"the study plans for {cfg.engine.sim_gpu}, the fleet's servers run on {fleet.sim_gpu}",
            key="engine.sim_gpu",
            fix=f'set sim_gpu = "{fleet.sim_gpu}" (the lent server\'s GPU)',
        )
    if server.gpus:
        cfg = on_gpus(cfg, server.gpus, cfg.engine.port, key="--borrow")
    tuned_on = _tuned_prompts(fleet)
    if tuned_on is not None and Path(cfg.workload.prompts).resolve() != tuned_on.resolve():
        echo(
            f"note: the study replays {cfg.workload.prompts}; the fleet's running config was tuned on {tuned_on} "
            "(its provenance.json): set [workload] prompts to it to tune for the fleet's own traffic"
        )
    serving = len(fleet.servers) - 1
    echo(
        f"lending {name} ({server.where}) to study {cfg.name}: the job runs on {serving} of {len(fleet.servers)} "
        f"servers until the study ends{_advice(fleet, serving)}"
    )
    lease = borrow(found.path, name, cfg.name)
    began, summary = time.monotonic(), None
    try:
        summary = run_sweep(cfg, progress=progress)
    finally:
        reason = (
            "the study was interrupted"
            if summary is not None and summary.interrupted
            else "the study ended"
            if summary is not None
            else "the study failed"
        )
        said = give_back(found.path, reason=reason)
        echo(said or f"{name}: no lease to give back (already returned)")
        echo(f"the job ran on {lease.serving} of {lease.total} servers for {time.monotonic() - began:.0f} s")
    if summary.best is not None and cfg.path is not None:
        echo(f"roll the winner out: autotune apply --config {cfg.path} --fleet {found.path} --rolling")
    return summary


def _advice(fleet: Fleet, serving: int) -> str:
    """``; keep about 86 requests in flight …`` from the fleet's ``client.json``, when ``apply`` wrote one."""
    try:
        per_server = json.loads(fleet.resolve("client.json").read_text()).get("per_server")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(per_server, int):
        return ""
    return f"; keep about {per_server * serving} requests in flight meanwhile ({per_server} per serving server)"


def _tuned_prompts(fleet: Fleet) -> Path | None:
    """The prompt file the fleet's running config was tuned on (``provenance.json`` beside the fleet), if known."""
    try:
        prompts = json.loads(fleet.resolve("provenance.json").read_text())["workload"]["prompts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return fleet.resolve(prompts) if isinstance(prompts, str) else None
