"""The ``slurm`` launcher: a server as a Slurm batch job (``sbatch``), stopped with ``scancel``.

- **The job script** is the one place a shell line exists: written to the run dir from the engine's argv with
  ``shlex.join``, ending in ``exec`` so the server *is* the batch step and receives Slurm's signals itself.
- **Environment.** ``--export=ALL`` with the spec's env placed in ``sbatch``'s own environment (not spelled on
  ``--export=ALL,K=V``, whose commas would split ``CUDA_VISIBLE_DEVICES=0,1``; nor written to the script, where
  a token would sit on disk).
- **GPUs.** ``--gres=gpu:N``. When Slurm binds GPUs it sets ``SLURM_JOB_GPUS`` and ``CUDA_VISIBLE_DEVICES`` and
  those win; when it does not (a GRES without device files, as on the CI's single-node cluster), the script
  selects the spec's GPUs itself, as the local launcher would.
- **State and exit code.** ``scontrol show job`` (finished jobs stay visible for the cluster's ``MinJobAge``);
  once the controller has forgotten the job, ``sacct`` when accounting exists, else ``GONE``. Slurm's
  ``ExitCode=a:b`` becomes ``-b`` when a signal ended it (as ``Popen`` reports), else ``a``; a CANCELLED job
  Slurm recorded as ``0:0`` reads ``-15``. ``reason`` holds the state and Slurm's reason for the trial's record.
- **Cancelled from outside.** A job that ends CANCELLED without our ``stop()`` having cancelled it (an operator's
  ``scancel``, a preemption) is no fault of the config: ``cancelled`` is True, and the trial records it as
  interrupted (the study runs it again) instead of a crash.
- **Address.** The server's ``/health`` is polled at the spec's host while the job runs on this host; on another
  node (``NodeList`` in ``scontrol``), at that node's name: such a server must listen on ``0.0.0.0``.
- **Stop.** ``scancel --full --signal=TERM`` (SGLang drains), ``--signal=KILL`` after the grace; released once
  the job has left the queue, the port is free and the GPU memory is back.
- **Never outliving the harness.** A non-detached job has a keeper: a tiny local process that ``scancel``s the
  job when SIGTERMed, watched by the local launcher's watchdog (``launch/watchdog.py``). A detached (fleet) job has
  none; ``release`` forgets it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from autotune.errors import ServerError
from autotune.launch.base import (
    LOG_TAIL_LINES,
    Launcher,
    LaunchSpec,
    MemoryReader,
    ReaderFactory,
    ServerExited,
    ServerHandle,
    ServerStartTimeout,
    log_tail,
    port_is_free,
)
from autotune.launch.memory import used_mib, wait_released
from autotune.launch.watchdog import Watchdog

GONE = -1  # the exit code of a job the controller forgot before its code was read (and no accounting)
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "REQUEUED")
CANCELLED_CODE = -15  # a cancelled job Slurm recorded as 0:0 (scancel signals SIGTERM first): never a clean exit
ALIVE_TTL_S = 0.5
COMPLETING_WAIT_S = 15.0  # longer than the cluster's KillWait: the job's final state follows
_CALL_TIMEOUT_S = 30.0
KEEPER_GRACE_S = 10.0
# The keeper: on SIGTERM, scancel the job from a session of its own (so the watchdog's SIGKILL of the keeper's group
# cannot cut it short), note it in the server's log, exit. argv: scancel, job id, log path.
KEEPER = """
import os, signal, subprocess, sys
scancel, job, log = sys.argv[1:4]
def gone(*_):
    subprocess.run([scancel, "--full", job], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, start_new_session=True, timeout=60, check=False)
    with open(log, "a") as fh:
        fh.write(f"[autotune keeper] harness gone; cancelled Slurm job {job}\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, gone)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("keeping", flush=True)
while True:
    signal.pause()
"""


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


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o``'s fields; None once the controller no longer knows the job."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          timeout=_CALL_TIMEOUT_S, check=False)
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
    done = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], capture_output=True,
                          text=True, timeout=_CALL_TIMEOUT_S, check=False)
    line = done.stdout.strip().splitlines()[:1] if done.returncode == 0 else []
    if not line or "|" not in line[0]:
        return None
    state, _, code = line[0].partition("|")
    return state.split()[0], code


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
        s = self.settings
        argv = ["sbatch", "--parsable", "--job-name", name, "--output", str(spec.log_path), "--no-requeue",
                "--ntasks=1", "--export=ALL"]
        if spec.gpus:
            argv.append(f"--gres=gpu:{len(spec.gpus)}")
        argv += [f"--{key}={value}" for key, value in
                 (("partition", s.partition), ("account", s.account), ("time", s.time)) if value]
        return [*argv, *s.extra_args, str(script)]

    def memory_reader(self, gpus: tuple[int, ...], local: ReaderFactory) -> MemoryReader:
        """This host's reader: a single-node cluster's jobs run on this host (a job on another node would need a
        reader there; multi-node clusters are not handled yet: docs/engines-and-launchers.md, Slurm)."""
        return local(gpus)

    def start(self, spec: LaunchSpec, *, gpu_reader: MemoryReader | None = None) -> SlurmJob:
        sbatch = shutil.which("sbatch")
        if sbatch is None or shutil.which("scancel") is None or shutil.which("scontrol") is None:
            raise ServerError("Slurm's sbatch/scancel/scontrol not found (install Slurm's client commands, or use "
                              "another [engine] launcher)")
        if not port_is_free(spec.host, spec.port):
            raise ServerError(f"port {spec.host}:{spec.port} is busy (stop what holds it or pick another port)")
        name = spec.name or f"autotune-{secrets.token_hex(6)}"
        run_dir = Path(spec.run_dir or Path(spec.log_path).parent)
        run_dir.mkdir(parents=True, exist_ok=True)
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        script = run_dir / f"{name}.sbatch"
        script.write_text(job_script(spec, self.device_env(spec.gpus)))
        env = {k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"}  # device selection is ours
        job = SlurmJob(spec, name, gpu_reader=gpu_reader)
        job.baseline_mib = used_mib(gpu_reader) if gpu_reader is not None else None
        try:
            done = subprocess.run(self.sbatch_argv(spec, name, script), env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=_CALL_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"sbatch did not return within {_CALL_TIMEOUT_S:g} s (is slurmctld up?)") from exc
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ServerError(f"sbatch failed (exit {done.returncode}): {last}")
        job.job_id = done.stdout.strip().split(";")[0]
        if not spec.detach:
            try:
                job.keep(self.watchdog_grace_s)
            except BaseException:
                job.cancel("KILL")
                raise
        return job


class SlurmJob:
    """One batch job: state and exit code from ``scontrol``/``sacct``, log from its ``--output`` file."""

    pid: int | None = None  # sbatch returns at once: no local process stands for the server

    def __init__(self, spec: LaunchSpec, name: str, *, gpu_reader: MemoryReader | None = None):
        self.spec, self.name, self.gpu_reader = spec, name, gpu_reader
        self.port, self.log_path = spec.port, Path(spec.log_path)
        self._connect = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host
        self.base_url = f"http://{self._connect}:{spec.port}"
        self.job_id = ""
        self.exit_code: int | None = None
        self.teardown_error: str | None = None
        self.reason: str | None = None  # why the job ended, in Slurm's words (state, reason, exit code)
        self.cancelled = False  # ended CANCELLED by someone else than our stop(): not the config's fault
        self._stopping = False  # our stop() is cancelling it
        self.baseline_mib: float | None = None
        self._keeper: subprocess.Popen[bytes] | None = None
        self._watchdog: Watchdog | None = None
        self._alive_at: tuple[float, bool] | None = None  # (when, answer) of the last ``alive`` read

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
                f", {why})" if why and why != "None" else ")")
            if state == "CANCELLED" and not self._stopping:
                self.cancelled = True
                self.reason = f"Slurm job {self.job_id} CANCELLED from outside autotune (scancel or preemption)"

    def _follow_node(self, nodes: str) -> None:
        """A job on another node is reached at that node's address (single-node: the spec's host)."""
        if nodes and nodes != "(null)" and "," not in nodes and "[" not in nodes:
            local = socket.gethostname().split(".")[0]
            host = self._connect if nodes == local else nodes
            self.base_url = f"http://{host}:{self.port}"

    @property
    def alive(self) -> bool:
        """Pending or running. Read at most once per ``ALIVE_TTL_S``: the replay asks from its event loop, and each
        answer is an RPC to the controller that would stall the measured window."""
        now = time.monotonic()
        if self._alive_at is None or now - self._alive_at[0] >= ALIVE_TTL_S or self.exit_code is not None:
            self._alive_at = (now, self.exit_code is None and self.state() in ACTIVE)
        return self._alive_at[1]

    def poll(self) -> int | None:
        """The exit code once the job has ended; a job COMPLETING (ended, its processes being reaped) is waited
        for, so that ``alive`` False always comes with a code."""
        if self.exit_code is None:
            state = self.state()
            deadline = time.monotonic() + COMPLETING_WAIT_S
            while state == "COMPLETING" and time.monotonic() < deadline:
                time.sleep(0.1)
                state = self.state()
            if state is None and self.exit_code is None:
                self.exit_code, self.reason = GONE, f"Slurm job {self.job_id} no longer known to the controller"
        return self.exit_code

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def wait_ready(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> None:
        """Return once ``/health`` answers 200 while the job is pending or running; a job that ends ends the wait."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if self.poll() is not None:
                    raise ServerExited(self.exit_code, self.log_tail())
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # pending, or not listening yet
                if (stop_event is not None and stop_event.is_set()) or time.monotonic() >= deadline:
                    raise ServerStartTimeout(timeout_s, self.log_tail())
                time.sleep(0.2)

    # -- stop ----------------------------------------------------------------------------------------------
    def cancel(self, signal_name: str) -> None:
        subprocess.run(["scancel", "--full", f"--signal={signal_name}", self.job_id], capture_output=True,
                       timeout=_CALL_TIMEOUT_S, check=False)
        if signal_name == "KILL":
            subprocess.run(["scancel", self.job_id], capture_output=True, timeout=_CALL_TIMEOUT_S, check=False)

    def _wait_state(self, timeout_s: float, *, queued: bool) -> bool:
        """Wait until the job is no longer active (``queued=False``: also not COMPLETING); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state not in ACTIVE and (queued or state != "COMPLETING"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def stop(self, grace_s: float = 10.0, release_timeout_s: float = 30.0) -> int | None:
        """SIGTERM (grace), then SIGKILL; released once the job has left the queue, the port is free and the GPU
        memory is back. A job that already ended is only released."""
        if not self.job_id:
            return None
        problems: list[str] = []
        state = self.state()  # read before our own cancel: a job already cancelled from outside stays so
        self._stopping = True
        if state in ACTIVE:
            if state == "PENDING":
                self.cancel("KILL")  # never started: nothing to drain
            else:
                self.cancel("TERM")
                if not self._wait_state(grace_s, queued=True):
                    self.cancel("KILL")
        deadline = time.monotonic() + release_timeout_s
        if not self._wait_state(release_timeout_s, queued=False):
            self.cancel("KILL")
            problems.append(f"Slurm job {self.job_id} still in the queue after {release_timeout_s:g} s")
        self.poll()
        while not port_is_free(self.spec.host, self.port):
            if time.monotonic() >= deadline:
                problems.append(f"port {self.port} still busy after {release_timeout_s:g} s")
                break
            time.sleep(0.05)
        if self.gpu_reader is not None:
            left = max(0.0, deadline - time.monotonic())
            if not wait_released(self.gpu_reader, self.baseline_mib, left):
                problems.append(f"GPU memory not released within {release_timeout_s:g} s")
        self._stand_down()
        self.teardown_error = "; ".join(problems) or None
        return self.exit_code

    # -- the keeper ----------------------------------------------------------------------------------------
    def keep(self, grace_s: float) -> None:
        """Start the keeper and its watchdog: from now on the harness's death cancels the job."""
        watchdog = Watchdog(grace_s=grace_s)
        try:
            keeper = subprocess.Popen(
                [sys.executable, "-c", KEEPER, str(shutil.which("scancel")), self.job_id, str(self.log_path)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                close_fds=True,
            )
            assert keeper.stdout is not None
            keeper.stdout.readline()  # its SIGTERM handler is in place
            keeper.stdout.close()
        except BaseException:
            watchdog.stand_down()
            raise
        self._keeper, self._watchdog = keeper, watchdog
        run_dir = Path(self.spec.run_dir or self.log_path.parent)
        watchdog.watch(keeper.pid, run_dir / f"slurm-{self.job_id}.json")  # no record: nothing on the host to clean

    def _stand_down(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stand_down()
            self._watchdog = None
        if self._keeper is not None:
            self._keeper.kill()
            self._keeper.wait(timeout=10)
            self._keeper = None

    def release(self) -> None:
        """Leave the job running (a fleet's): a detached spec has no keeper; any other stops being kept."""
        self._stand_down()

    def __enter__(self) -> SlurmJob:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.spec.detach:
            self.stop()


def _conforms(job: SlurmJob, launcher: SlurmLauncher) -> tuple[ServerHandle, Launcher]:
    """Never called: mypy holds ``SlurmJob`` to ``ServerHandle`` and ``SlurmLauncher`` to ``Launcher``."""
    return job, launcher
