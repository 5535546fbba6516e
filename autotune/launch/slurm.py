"""The ``slurm`` launcher: a server as a Slurm batch job (``sbatch``), stopped with ``scancel``.

The job script ``exec``s the engine's argv (``shlex.join``: the one shell line), the environment goes through
``sbatch``'s own, and the stop, the state and exit code, the /dev/shm cleanup and the keeper follow
docs/engines-and-launchers.md ("Slurm").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import ServerError
from autotune.launch.base import (
    Launcher,
    LaunchSpec,
    LogFile,
    MemoryReader,
    ReaderFactory,
    ServerHandle,
    ServerRecord,
    url_scheme,
)
from autotune.launch.health import wait_healthy
from autotune.launch.keeper import Keeper, Kept
from autotune.launch.ports import port_is_free
from autotune.launch.shm import SHM_DIR, ShmOwnership, clean_after_job, launch_ports, snapshot
from autotune.launch.stopping import Release, StopSteps, memory_baseline, stop_and_release

log = logging.getLogger(__name__)
GONE = -1  # the exit code of a job the controller forgot before its code was read (and no accounting)
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "REQUEUED")
CANCELLED_CODE = -15  # a cancelled job Slurm recorded as 0:0 (scancel signals SIGTERM first): never a clean exit
ALIVE_TTL_S = 0.5
COMPLETING_WAIT_S = 15.0  # longer than the cluster's KillWait: the job's final state follows
_CALL_TIMEOUT_S = 30.0
KEEPER_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmSettings:
    """``[launcher.slurm]``: where jobs go. Empty fields leave the cluster's defaults."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm's time limit syntax, e.g. "01:00:00"
    extra_args: tuple[str, ...] = ()  # more sbatch options, each one argument (e.g. "--constraint=h200")


def job_script(spec: LaunchSpec, device_env: dict[str, str]) -> str:
    """The batch script: the device fallback, then ``exec`` of the argv, every word quoted by ``shlex``."""
    lines = ["#!/bin/bash", "# written by autotune's Slurm launcher: the server's argv, quoted by shlex"]
    if device_env:
        exports = " ".join(shlex.quote(f"{k}={v}") for k, v in device_env.items())
        lines.append(f'if [ -z "${{SLURM_JOB_GPUS:-}}" ]; then export {exports}; fi  # Slurm bound none itself')
    lines.append(f"exec {shlex.join(spec.argv)}")
    return "\n".join(lines) + "\n"


def exit_code(slurm_code: str) -> int:
    """Slurm's ``ExitCode=a:b`` (status : signal) as ``Popen`` would report it."""
    status, _, signal_no = slurm_code.partition(":")
    sig = int(signal_no or 0)
    return -sig if sig else int(status or 0)


def read_shm_record(path: Path) -> ShmOwnership | None:
    """The listing ``watch_shm`` kept; None without one (then nothing is removed)."""
    try:
        return ShmOwnership.from_record(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o``'s fields; None once the controller no longer knows the job."""
    done = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=_CALL_TIMEOUT_S, check=False
    )
    if done.returncode != 0 or not done.stdout.strip():
        return None
    fields: dict[str, str] = {}
    for word in done.stdout.split():
        key, sep, value = word.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def sacct_job(job_id: str) -> tuple[str, str] | None:
    """(state, ExitCode) from accounting, or None where the cluster keeps none."""
    if shutil.which("sacct") is None:
        return None
    done = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
        capture_output=True,
        text=True,
        timeout=_CALL_TIMEOUT_S,
        check=False,
    )
    line = done.stdout.strip().splitlines()[:1] if done.returncode == 0 else []
    if not line or "|" not in line[0]:
        return None
    state, _, code = line[0].partition("|")
    return state.split()[0], code


def sbatch_argv(settings: SlurmSettings, name: str, log: Path, script: Path, *, gpus: int) -> list[str]:
    """``sbatch`` for one job (a trial's server, a sweep worker): one task, ``gpus`` GPUs (none: no ``--gres``), the
    settings' partition, account, time and extra options, its output to ``log``."""
    argv = ["sbatch", "--parsable", "--job-name", name, "--output", str(log), "--no-requeue", "--ntasks=1"]
    argv += [f"--gres=gpu:{gpus}"] if gpus else []
    argv += ["--export=ALL"]
    argv += [
        f"--{key}={value}"
        for key, value in (("partition", settings.partition), ("account", settings.account), ("time", settings.time))
        if value
    ]
    return [*argv, *settings.extra_args, str(script)]


class SlurmLauncher:
    """Submits each server as one batch job on ``settings``' partition/account/time."""

    name = "slurm"

    def __init__(self, settings: SlurmSettings | None = None, *, watchdog_grace_s: float = KEEPER_GRACE_S) -> None:
        self.settings = settings or SlurmSettings()
        self.watchdog_grace_s = watchdog_grace_s

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> SlurmLauncher:
        """From the study's ``[launcher.slurm]`` table (validated by ``config.sections.SlurmSection``)."""
        given = dict(settings)
        given["extra_args"] = tuple(given.get("extra_args") or ())
        return cls(SlurmSettings(**given))

    def device_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """The fallback selection the script applies when Slurm bound no GPUs itself (see the module's doc)."""
        if not gpus:
            return {}
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in gpus)}

    def sbatch_argv(self, spec: LaunchSpec, name: str, script: Path) -> list[str]:
        return sbatch_argv(self.settings, name, spec.log_path, script, gpus=len(spec.gpus or ()))

    def memory_reader(self, gpus: tuple[int, ...], local: ReaderFactory) -> MemoryReader:
        """This host's reader: a single-node cluster's jobs run on this host (a job on another node would need a
        reader there; multi-node clusters are not handled yet: docs/engines-and-launchers.md, Slurm)."""
        return local(gpus)

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> SlurmJob:
        sbatch = shutil.which("sbatch")
        if sbatch is None or shutil.which("scancel") is None or shutil.which("scontrol") is None:
            raise ServerError(
                "Slurm's sbatch/scancel/scontrol not found (install Slurm's client commands, or use "
                "another [engine] launcher)"
            )
        if not port_is_free(spec.host, spec.port):
            raise ServerError(f"port {spec.host}:{spec.port} is busy (stop what holds it or pick another port)")
        launch_id = secrets.token_hex(6)
        name = spec.name or f"autotune-{launch_id}"
        run_dir = Path(spec.run_dir or Path(spec.log_path).parent)
        run_dir.mkdir(parents=True, exist_ok=True)
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        script = run_dir / f"{name}.sbatch"
        script.write_text(job_script(spec, self.device_env(spec.gpus)))
        env = {k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"}  # device selection is ours
        job = SlurmJob(spec, name, gpu_reader=gpu_reader, launch_id=launch_id)
        job.baseline_mib = memory_baseline(gpu_reader, spec.gpus)  # no GPU: nothing of the job's to wait for
        job.watch_shm(run_dir)  # before the job exists: only what appears after can be its
        try:
            done = subprocess.run(
                self.sbatch_argv(spec, name, script),
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=_CALL_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"sbatch did not return within {_CALL_TIMEOUT_S:g} s (is slurmctld up?)") from exc
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            job.shm_record.unlink(missing_ok=True)
            raise ServerError(f"sbatch failed (exit {done.returncode}): {last}")
        job.job_id = done.stdout.strip().split(";")[0]
        if not spec.detach:
            try:
                job.keep(self.watchdog_grace_s)
            except BaseException:
                job.cancel("KILL")
                raise
        return job

    def attach(self, record: ServerRecord) -> SlurmJob:
        """The job ``record`` names, if the controller's job of that id still carries the recorded name (a job id
        the cluster handed out again is someone else's: then not alive, and never cancelled)."""
        job = SlurmJob(record.detached_spec(), str(record.name or ""), launch_id=record.launch_id)
        job.shm = read_shm_record(job.shm_record)
        fields = scontrol_job(str(record.job_id)) if record.job_id else None
        if record.job_id and (fields is None or fields.get("JobName") == record.name):
            job.job_id = str(record.job_id)
        else:
            job.exit_code, job.reason = GONE, f"Slurm job {record.job_id} is not the recorded one"
        return job


class SlurmJob(Kept, LogFile):
    """One batch job: state and exit code from ``scontrol``/``sacct``, log from its ``--output`` file."""

    pid: int | None = None  # sbatch returns at once: no local process stands for the server

    def __init__(
        self, spec: LaunchSpec, name: str, *, gpu_reader: MemoryReader | None = None, launch_id: str | None = None
    ):
        self.spec, self.name, self.gpu_reader = spec, name, gpu_reader
        self.launch_id = launch_id or name
        self.shm: ShmOwnership | None = None  # the node's /dev/shm before the job (this host's)
        self.removed_shm: list[str] = []
        self.unattributed_shm: list[str] = []  # new SGLang-like files someone else still holds: left, listed
        self.node: str | None = None
        self.port, self.log_path = spec.port, Path(spec.log_path)
        self._connect = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host
        self._scheme = url_scheme(spec.argv)  # https for a server started with a certificate
        self.base_url = f"{self._scheme}://{self._connect}:{spec.port}"
        self.job_id = ""
        self.exit_code: int | None = None
        self.teardown_error: str | None = None
        self.reason: str | None = None  # why the job ended, in Slurm's words (state, reason, exit code)
        self.cancelled = False  # ended CANCELLED by someone else than our stop(): not the config's fault
        self._stopping = False  # our stop() is cancelling it
        self.baseline_mib: float | None = None
        self._keeper: Keeper | None = None
        self._alive_at: tuple[float, bool] | None = None  # (when, answer) of the last ``alive`` read

    def record(self) -> ServerRecord:
        return ServerRecord.of("slurm", self.spec, self.launch_id, job_id=self.job_id, name=self.name)

    # -- the job's state -----------------------------------------------------------------------------------
    def state(self) -> str | None:
        """Slurm's job state now (``RUNNING``, ``COMPLETED``, …); None once nobody knows the job."""
        fields = scontrol_job(self.job_id)
        if fields is not None:
            self._note(fields.get("JobState", ""), fields.get("ExitCode", ""), fields.get("Reason", ""))
            self._follow_node(fields.get("NodeList", ""))
            return fields.get("JobState") or None
        acct = sacct_job(self.job_id)
        if acct is not None:
            self._note(acct[0], acct[1], "")
            return acct[0]
        return None

    def _note(self, state: str, code: str, why: str) -> None:
        if state and state not in ACTIVE and state != "COMPLETING" and self.exit_code is None:
            self.exit_code = exit_code(code) if code else GONE
            if state == "CANCELLED" and self.exit_code == 0:
                self.exit_code = CANCELLED_CODE
            self.reason = f"Slurm job {self.job_id} {state} (ExitCode {code or '?'}" + (
                f", {why})" if why and why != "None" else ")"
            )
            if state == "CANCELLED" and not self._stopping:
                self.cancelled = True
                self.reason = f"Slurm job {self.job_id} CANCELLED from outside autotune (scancel or preemption)"

    def _follow_node(self, nodes: str) -> None:
        """A job on another node is reached at that node's address (single-node: the spec's host)."""
        if nodes and nodes != "(null)" and "," not in nodes and "[" not in nodes:
            self.node = nodes
            local = socket.gethostname().split(".")[0]
            host = self._connect if nodes == local else nodes
            self.base_url = f"{self._scheme}://{host}:{self.port}"

    @property
    def alive(self) -> bool:
        """Pending or running. Read at most once per ``ALIVE_TTL_S``: the replay asks from its event loop, and each
        answer is an RPC to the controller that would stall the measured window."""
        if not self.job_id:
            return False
        now = time.monotonic()
        if self._alive_at is None or now - self._alive_at[0] >= ALIVE_TTL_S or self.exit_code is not None:
            self._alive_at = (now, self.exit_code is None and self.state() in ACTIVE)
        return self._alive_at[1]

    def poll(self) -> int | None:
        """The exit code once the job has ended; a job COMPLETING (ended, its processes being reaped) is waited
        for, so that ``alive`` False always comes with a code."""
        if self.exit_code is None and self.job_id:
            state = self.state()
            deadline = time.monotonic() + COMPLETING_WAIT_S
            while state == "COMPLETING" and time.monotonic() < deadline:
                time.sleep(0.1)
                state = self.state()
            if state is None and self.exit_code is None:
                self.exit_code, self.reason = GONE, f"Slurm job {self.job_id} no longer known to the controller"
        return self.exit_code

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        """Return once ``/health`` answers 200 while the job is pending or running; a job that ends ends the wait."""
        wait_healthy(
            lambda: self.base_url, timeout_s, ended=self.poll, tail=self.log_tail, stop_event=stop_event, poll_s=0.2
        )

    # -- stop ----------------------------------------------------------------------------------------------
    def cancel(self, signal_name: str) -> None:
        subprocess.run(
            ["scancel", "--full", f"--signal={signal_name}", self.job_id],
            capture_output=True,
            timeout=_CALL_TIMEOUT_S,
            check=False,
        )
        if signal_name == "KILL":
            subprocess.run(["scancel", self.job_id], capture_output=True, timeout=_CALL_TIMEOUT_S, check=False)

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """SIGTERM (grace), then SIGKILL; released once the job has left the queue, the port is free and the GPU
        memory is back (``stopping.stop_and_release``). A job that already ended is only released."""
        if not self.job_id:
            return None
        seen: list[
            str | None
        ] = []  # the state read last (before our own cancel: a job cancelled from outside stays so)

        def running() -> bool:
            seen[:] = [self.state()]
            return seen[0] in ACTIVE

        def terminate() -> None:
            self._stopping = True
            if seen and seen[0] == "PENDING":
                self.cancel("KILL")  # never started: nothing to drain
            else:  # the batch step's main process only: the server the job script exec'd
                subprocess.run(
                    ["scancel", "--batch", "--signal=TERM", self.job_id],
                    capture_output=True,
                    timeout=_CALL_TIMEOUT_S,
                    check=False,
                )

        def kill() -> None:
            self._stopping = True
            if self.state() in ACTIVE:
                self.cancel("KILL")

        def gone() -> bool:
            state = self.state()
            return state not in ACTIVE and state != "COMPLETING"

        steps = StopSteps(
            what=f"Slurm job {self.job_id}",
            running=running,
            terminate=terminate,
            kill=kill,
            gone=gone,
            clean_files=self._clean_shm,
            poll_s=0.1,
        )
        release = Release(
            port=self.port,
            port_free=lambda: port_is_free(self.spec.host, self.port),
            reader=self.gpu_reader,
            baseline_mib=self.baseline_mib,
        )
        problems = stop_and_release(steps, release, grace_s=grace_s, release_timeout_s=release_timeout_s)
        self.poll()
        self._stand_down()
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    # -- /dev/shm on the job's node ------------------------------------------------------------------------
    @property
    def shm_record(self) -> Path:
        return Path(self.spec.run_dir or self.log_path.parent) / f"{self.name}.shm.json"

    def watch_shm(self, run_dir: Path) -> None:
        """List the directory before the job starts, and keep the listing for a later ``attach`` (a fleet's)."""
        directory = Path(self.spec.shm_dir) if self.spec.shm_dir is not None else SHM_DIR
        self.shm = ShmOwnership(directory, snapshot(directory), launch_ports(self.spec.port, self.spec.argv))
        record = {"shm_dir": str(directory), "shm_before": sorted(self.shm.before), "shm_ports": sorted(self.shm.ports)}
        run_dir.mkdir(parents=True, exist_ok=True)
        self.shm_record.write_text(json.dumps(record))

    def _clean_shm(self) -> None:
        """The job is gone: its files on this host go, the rest is listed (in the job's log too)."""
        shm, local = self.shm, socket.gethostname().split(".")[0]
        if shm is None or (self.node is not None and self.node != local):
            return  # a job on another node: its /dev/shm is not this host's
        self.removed_shm, self.unattributed_shm = clean_after_job(shm)
        self.shm_record.unlink(missing_ok=True)
        removed = ", ".join(self.removed_shm)
        lines = [f"removed {len(self.removed_shm)} file(s) of Slurm job {self.job_id}: {removed}"]
        if self.unattributed_shm:
            lines.append(
                f"left {len(self.unattributed_shm)} new file(s) other processes hold (not provably the "
                f"job's): {', '.join(self.unattributed_shm)}"
            )
            log.warning("%s: %s", shm.directory, lines[-1])
        if self.removed_shm or self.unattributed_shm:
            with contextlib.suppress(OSError), open(self.log_path, "a") as fh:
                fh.writelines(f"[autotune] {shm.directory}: {line}\n" for line in lines)

    # -- the keeper ----------------------------------------------------------------------------------------
    def keep(self, grace_s: float) -> None:
        """Start the keeper: from now on the harness's death cancels the job."""
        run_dir = Path(self.spec.run_dir or self.log_path.parent)
        self._keeper = Keeper(
            [str(shutil.which("scancel")), "--full", self.job_id],
            log_path=self.log_path,
            note=f"[autotune keeper] harness gone; cancelled Slurm job {self.job_id} (scancel --full)",
            grace_s=grace_s,
            record=run_dir / f"slurm-{self.job_id}.json",
        )

    def __enter__(self) -> SlurmJob:
        return self


def _conforms(job: SlurmJob, launcher: SlurmLauncher) -> tuple[ServerHandle, Launcher]:
    """Never called: mypy holds ``SlurmJob`` to ``ServerHandle`` and ``SlurmLauncher`` to ``Launcher``."""
    return job, launcher
