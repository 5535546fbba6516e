"""A fleet server that runs as a Slurm job: its record, its state, its stop.

``fleet up`` submits the job through the slurm launcher and forgets it; ``status``, ``down`` and the rollout run in
other processes and find the job again by its record (``run/<name>.job.json``, beside where a local server's pid
file goes): no local process stands for a batch job, so a pid file cannot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autotune.deploy.fleetfile import Fleet, FleetServer
from autotune.errors import FleetError
from autotune.launch import LaunchSpec
from autotune.launch.slurm import ACTIVE, SlurmJob


def record_path(fleet: Fleet, server: FleetServer) -> Path:
    return fleet.resolve(server.pid).with_suffix(".job.json")


def write_record(fleet: Fleet, server: FleetServer, job_id: str, name: str) -> None:
    """Written as soon as ``sbatch`` answers: a command killed while the server loads leaves the job findable."""
    path = record_path(fleet, server)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"launcher": "slurm", "job_id": job_id, "name": name, "port": server.port}) + "\n")
    os.replace(tmp, path)


def read_record(fleet: Fleet, server: FleetServer) -> dict[str, Any] | None:
    try:
        record = json.loads(record_path(fleet, server).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("job_id") else None


def attach(fleet: Fleet, server: FleetServer) -> SlurmJob | None:
    """The recorded job as the launcher's handle (state, stop), without submitting anything; None without a record."""
    record = read_record(fleet, server)
    if record is None:
        return None
    spec = LaunchSpec(argv=[], port=server.port, host=server.bind, log_path=fleet.resolve(server.log),
                      run_dir=fleet.resolve(server.pid).parent, detach=True)
    job = SlurmJob(spec, str(record.get("name") or ""))
    job.job_id = str(record["job_id"])
    return job


def job_state(fleet: Fleet, server: FleetServer) -> tuple[str | None, str | None]:
    """(job id, Slurm's state now) of the recorded job; (None, None) without a record, state None once forgotten."""
    job = attach(fleet, server)
    return (None, None) if job is None else (job.job_id, job.state())


def active_job(fleet: Fleet, server: FleetServer) -> str | None:
    """The recorded job's id while it is pending or running."""
    job_id, state = job_state(fleet, server)
    return job_id if state in ACTIVE else None


def stop_job(fleet: Fleet, server: FleetServer, *, grace_s: float, release_timeout_s: float) -> bool:
    """The launcher's stop (scancel TERM, KILL after ``grace_s``) until the job has left the queue; True if it was
    pending or running. The record goes only once the queue no longer holds the job."""
    job = attach(fleet, server)
    if job is None:
        return False
    was_active = job.state() in ACTIVE
    job.stop(grace_s=grace_s, release_timeout_s=release_timeout_s)
    if job.teardown_error and "queue" in job.teardown_error:
        raise FleetError(f"server {server.name}: {job.teardown_error} (scancel {job.job_id} by hand)")
    record_path(fleet, server).unlink(missing_ok=True)
    return was_active
