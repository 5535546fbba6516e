"""A lease: one server of a running fleet lent to a study (``sweep --borrow``) and given back when it ends.

Lending drains the server out of the router, stops it and writes the lease (``run/lease.json``: the server, the
study, the sweep's pid and start time) under the fleet's lock, so no rollout, rollback or second lease moves while
it is out; the keeper leaves the lent server alone (it has no server record while lent) and gives it back itself
once the sweep's process is gone (a SIGKILLed sweep). Giving back starts the server on the config the fleet file
records, waits for ``/health`` and puts it back into the router. See docs/fleet.md#tune-in-place.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import psutil

from autotune.deploy import router
from autotune.deploy.drain import DRAIN_TIMEOUT_S, wait_idle
from autotune.deploy.fleet import (
    drift,
    server_config,
    server_info,
    serving,
    start_server,
    stop_server,
    wait_gpus_free,
)
from autotune.deploy.fleetfile import Fleet, load_fleet, replace_file
from autotune.deploy.fleetlog import FleetLog
from autotune.deploy.leasefile import Lease, current, lease_path
from autotune.deploy.rolloutlog import locked
from autotune.errors import FleetError


def refuse_while_lent(fleet: Fleet, what: str) -> None:
    """FleetError in one line when a server of the fleet is lent: ``what`` (a rollout, …) waits for its return."""
    lease = current(fleet)
    if lease is not None:
        raise FleetError(
            f"{lease.line}: {what} waits until it is back (the sweep gives it back when it ends; "
            f"autotune fleet status shows the lease)"
        )


def borrow(fleet_path: Path, name: str, study: str, *, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> Lease:
    """Take server ``name`` out of the job's traffic and stop it, for study ``study`` run by this process."""
    fleet = load_fleet(fleet_path)
    server = fleet.server(name)
    with locked(fleet, holder=f"the lease of {name} to study {study}", wait_s=30.0):
        refuse_while_lent(fleet, "a second lease")
        if not server.local or fleet.launcher != "local":
            raise FleetError(
                f"server {name} runs on {server.host} through the {fleet.launcher} launcher: only this "
                "host's local servers are lent (the study runs here)"
            )
        if not serving(fleet, server):
            raise FleetError(f"server {name} is not serving (autotune fleet status): lend a serving one")
        others = [s.name for s in fleet.servers if s.name != name and serving(fleet, s)]
        if not others:
            raise FleetError(f"server {name} is the fleet's last serving server: it is never lent")
        record = router.running(fleet)
        if record is not None:  # the router sends it nothing more; what it has finishes before it stops
            router.remove_worker(record, server.url)
            wait_idle(server, drain_timeout_s, record=record)
        lease = Lease(
            server=name,
            study=study,
            pid=os.getpid(),
            started=psutil.Process().create_time(),
            since=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            serving=len(others),
            total=len(fleet.servers),
        )
        # before the stop: a sweep killed from here on leaves a lease the keeper returns
        replace_file(lease_path(fleet), json.dumps(asdict(lease)) + "\n")
        stop_server(fleet, server, grace_s=30.0)
        FleetLog.of(fleet).append(
            "lent",
            f"lent to study {study} (sweep pid {lease.pid}); {len(others)} of "
            f"{len(fleet.servers)} servers serve the job meanwhile",
            server=name,
        )
        return lease


def give_back(fleet_path: Path, *, reason: str) -> str | None:
    """Return the lent server (under the fleet's lock); its line, None when nothing is lent."""
    fleet = load_fleet(fleet_path)
    with locked(fleet, holder="the return of a lent server", wait_s=120.0):
        return returned(fleet, reason=reason)


def returned(fleet: Fleet, *, reason: str) -> str | None:
    """``give_back`` for a holder of the fleet's lock (the keeper): start the lent server on its recorded config,
    wait for ``/health``, put it back into the router, end the lease. FleetError (the lease kept) if it does not
    start."""
    lease = current(fleet)
    if lease is None:
        return None
    server = fleet.server(lease.server)
    began = time.monotonic()
    if not serving(fleet, server):  # the study's last server may still be letting go of the GPUs (its watchdog)
        wait_gpus_free(fleet, server, timeout_s=120.0)
        start_server(fleet, server, server_config(fleet, server), timeout_s=fleet.keeper.start_timeout_s)
    changed = drift(server_config(fleet, server), server_info(server) or {})
    record = router.running(fleet)
    if record is not None:
        router.add_worker(record, server.url)
    lease_path(fleet).unlink(missing_ok=True)
    since = dt.datetime.fromisoformat(lease.since)
    out_s = (dt.datetime.now(dt.UTC) - since).total_seconds()
    line = (
        f"back from study {lease.study} ({reason}) after {out_s:.0f} s out: serving on {server.config}"
        + (" and back in the router" if record is not None else "")
        + f", {time.monotonic() - began:.1f} s after the return began"
        + (f"; it runs other values for {', '.join(changed)}" if changed else "")
    )
    FleetLog.of(fleet).append(
        "returned", line, server=server.name, seconds=round(out_s, 1), return_s=round(time.monotonic() - began, 1)
    )
    return f"{server.name}: {line}"
