"""Scale out on Slurm: each worker of ``run_workers`` is its own batch job, one GPU group per allocation, whose
trials' servers start inside it with the ``local`` launcher; Ctrl-C becomes ``scancel --signal=INT``.
docs/engines-and-launchers.md ("Sweep workers as Slurm jobs").
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autotune.config import StudyConfig
from autotune.errors import StudyError
from autotune.launch.slurm import ACTIVE, GONE, SlurmSettings, exit_code, sacct_job, sbatch_argv, scontrol_job
from autotune.search.signals import on_sigint

Echo = Callable[[str], None]
POLL_S = 0.5
_CALL_TIMEOUT_S = 30.0


def worker_script(argv: Sequence[str]) -> str:
    """The worker's batch script: one ``exec`` line, every word quoted by ``shlex``."""
    return f"#!/bin/bash\n# written by autotune: one study worker, its argv quoted by shlex\nexec {shlex.join(argv)}\n"


def _indices(text: str) -> list[int]:
    """``0-1,3`` (Slurm's IDX lists, ``CUDA_VISIBLE_DEVICES``) → ``[0, 1, 3]``."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def allocation_gpus(env: dict[str, str] | None = None) -> tuple[int, ...]:
    """The GPUs of the Slurm allocation this process runs in: ``CUDA_VISIBLE_DEVICES`` where Slurm's GPU plugin
    sets it, else ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``, else the ``IDX`` list of ``scontrol show job -d``, else
    the first ``SLURM_GPUS_ON_NODE``. A StudyError when the job holds no GPU."""
    env = dict(os.environ if env is None else env)
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(key, "")
        if re.fullmatch(r"[0-9,\-]+", value or ""):
            return tuple(_indices(value))
    job = env.get("SLURM_JOB_ID")
    if job:
        done = subprocess.run(
            ["scontrol", "show", "job", "-d", job], capture_output=True, text=True, timeout=_CALL_TIMEOUT_S, check=False
        )
        found = re.search(r"GRES=gpu[^(\s]*\(IDX:([0-9,\-]+)\)", done.stdout)
        if found:
            return tuple(_indices(found.group(1)))
    count = env.get("SLURM_GPUS_ON_NODE", "")
    if count.isdigit() and int(count) > 0:
        return tuple(range(int(count)))
    raise StudyError("this Slurm job holds no GPU (no CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS or gres in scontrol)")


@dataclass
class WorkerJob:
    """One worker's batch job and its log, relayed line by line while it grows (``gpu``: the worker's key)."""

    gpu: int
    job_id: str
    log: Path
    prefix: str = ""
    code: int | None = None
    _offset: int = 0
    _partial: str = ""

    def relay(self, echo: Echo) -> None:
        try:
            with self.log.open(errors="replace") as fh:
                fh.seek(self._offset)
                text = fh.read()
                self._offset = fh.tell()
        except OSError:
            return  # pending: no log yet
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            echo(f"{self.prefix or f'gpu{self.gpu}'} | {line.rstrip()}")

    def finished(self) -> bool:
        """True once the job has left the queue; ``code`` then holds its exit code (``GONE`` when unknown)."""
        if self.code is not None:
            return True
        fields = scontrol_job(self.job_id)
        if fields is not None:
            state, code = fields.get("JobState", ""), fields.get("ExitCode", "")
        else:
            state, code = sacct_job(self.job_id) or ("", "")
        if state in ACTIVE or state == "COMPLETING":
            return False
        self.code = exit_code(code) if code else GONE
        return True


@dataclass
class SlurmWorkers:
    """The worker jobs of one study, started by ``start_slurm_workers``; ``wait`` supervises them."""

    jobs: list[WorkerJob] = field(default_factory=list)
    echo: Echo = print
    interrupted: bool = False

    def scancel(self, *args: str) -> None:
        ids = [job.job_id for job in self.jobs if job.code is None]
        if ids:
            subprocess.run(["scancel", *args, *ids], capture_output=True, timeout=_CALL_TIMEOUT_S, check=False)

    def interrupt(self) -> None:
        """First call: SIGINT to every worker (each stops its server cleanly). Second: cancel the jobs."""
        if self.interrupted:
            self.scancel("--full", "--signal=KILL")
            self.scancel()
        else:
            self.scancel("--full", "--signal=INT")
        self.interrupted = True

    def wait(self, timeout_s: float | None = None) -> dict[int, int]:
        """Wait for every job, relaying its log and forwarding Ctrl-C. Returns each GPU's worker exit code."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            with on_sigint(self.interrupt):  # Ctrl-C stops the workers
                while not all([job.finished() for job in self.jobs]):  # a list: every job polled each round
                    for job in self.jobs:
                        job.relay(self.echo)
                    if deadline is not None and time.monotonic() > deadline:
                        self.interrupted = True
                        self.interrupt()  # a stuck worker must not outlive its supervisor
                        deadline = None
                    time.sleep(POLL_S)
        except BaseException:
            self.interrupted = True
            self.interrupt()  # the supervisor dies: its jobs go with it
            raise
        for job in self.jobs:
            job.relay(self.echo)
        return {job.gpu: int(job.code if job.code is not None else GONE) for job in self.jobs}


def start_slurm_workers(
    cfg: StudyConfig,
    argvs: dict[int, tuple[list[str], int]],
    *,
    echo: Echo = print,
    env: dict[str, str] | None = None,
    names: dict[int, str] | None = None,
) -> SlurmWorkers:
    """``sbatch`` one job per worker: its argv and the GPUs it asks for, keyed by the worker's first GPU (or slot;
    ``names`` are their progress prefixes, ``gpu0,1`` or ``worker1``). Scripts and logs under
    ``work_dir/runs/workers``. A failed ``sbatch`` cancels the jobs already submitted and raises ``StudyError``."""
    settings = _settings(cfg)
    folder = cfg.work_dir / "runs" / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    workers = SlurmWorkers(echo=echo)
    for key, (argv, gpus) in argvs.items():
        prefix = (names or {}).get(key, f"gpu{key}")
        stem = re.sub(r"^(gpu|worker)", r"\1-", prefix).replace(",", "-")  # gpu-0, gpu-0-1, worker-2
        name = f"autotune-worker-{cfg.name}-{prefix.replace(',', '-')}"
        script, log = folder / f"{stem}.sbatch", folder / f"{stem}.log"
        script.write_text(worker_script(argv))
        log.unlink(missing_ok=True)  # the relay reads this run's lines only
        done = subprocess.run(
            sbatch_argv(settings, name, log, script, gpus=gpus),
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=_CALL_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            workers.scancel()
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise StudyError(f"sbatch of the {prefix} worker failed (exit {done.returncode}): {last}")
        job = WorkerJob(gpu=key, job_id=done.stdout.strip().split(";")[0], log=log, prefix=prefix)
        workers.jobs.append(job)
        echo(f"{prefix}: worker is Slurm job {job.job_id} asking for {gpus} GPU{'s' if gpus > 1 else ''} (log {log})")
    return workers


def _settings(cfg: StudyConfig) -> SlurmSettings:
    """``[launcher.slurm]`` as given (defaults the launcher's), its extra sbatch arguments a tuple."""
    given = dict(cfg.launcher.settings("slurm"))
    given["extra_args"] = tuple(given.get("extra_args") or ())
    return SlurmSettings(**given)
