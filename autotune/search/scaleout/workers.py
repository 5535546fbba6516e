"""Scale out: one study, one worker process per GPU group, on one node or many, through Optuna's shared storage; the
supervisor forwards Ctrl-C and removes what a dead worker left. docs/study-file.md ("Several GPUs", "Servers over
several GPUs").
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import optuna

from autotune.config import StudyConfig
from autotune.config.pool import check_pool, study_spans
from autotune.errors import ConfigError, StudyError
from autotune.launch.gpulocks import hold_sweep_gpus
from autotune.launch.groups import group_label, worker_groups
from autotune.launch.process import cleanup_orphans
from autotune.search.objective import make_sampler, open_study
from autotune.search.scaleout.slurm_workers import SlurmWorkers, start_slurm_workers
from autotune.search.signals import on_sigint
from autotune.search.study import Prepared, Sweep

Echo = Callable[[str], None]


def on_gpu(cfg: StudyConfig, gpu: int, port: int | None) -> StudyConfig:
    """The study config pinned to one GPU and port (the config is frozen: a copy); a server spanning N GPUs
    counts up from it."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"gpu": gpu, "gpus": None, "port": port})})


def on_gpus(cfg: StudyConfig, gpus: Sequence[int], port: int | None, *, key: str = "--gpus") -> StudyConfig:
    """The study config on the pool ``gpus`` (``[engine] gpus``) and port; a pool too small for the study is a
    ConfigError naming ``key``."""
    pinned = cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"gpu": gpus[0], "gpus": list(gpus), "port": port})}
    )
    check_pool(pinned, tuple(gpus), file=str(cfg.path) if cfg.path else None, key=key)
    return pinned


def with_launcher(cfg: StudyConfig, launcher: str | None) -> StudyConfig:
    """The study config with ``[engine] launcher`` overridden (``--launcher``; None keeps the file's)."""
    if launcher is None or launcher == cfg.engine.launcher:
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"launcher": launcher})})


def gpu_run_dir(cfg: StudyConfig, gpu: int | str) -> Path:
    """Pid files of the servers one worker starts (named by its GPU or group): its orphan cleanup touches only these."""
    return cfg.work_dir / "runs" / f"gpu-{gpu}"


def worker_name(cfg: StudyConfig, shared: int | None) -> str:
    """How a worker is named in its run dir and progress lines: its group (``0,1``), or its slot in a shared pool."""
    if shared is not None:
        return f"worker{shared}"
    return group_label(cfg.engine.pool or (cfg.engine.gpu,))


# --- the worker ------------------------------------------------------------------------------------------
class WorkerSweep(Sweep):
    """A sweep on ``cfg.engine.gpu`` or the group ``cfg.engine.gpus`` that shares its study with other workers
    (``shared``: its slot among workers sharing that pool)."""

    def __init__(self, cfg: StudyConfig, *, shared: int | None = None, **kwargs: Any):
        super().__init__(cfg, shared=shared, run_dir=gpu_run_dir(cfg, worker_name(cfg, shared)), **kwargs)

    def prepare(self) -> Prepared:
        ready = super().prepare()
        # Workers seeded alike would propose the same random start-up configs at the same moment.
        salt = len(self.study.get_trials(deepcopy=False)) + 7919 * (os.getpid() % 100_003)
        self.study.sampler = make_sampler(self.cfg, salt=salt)
        return ready


def run_worker(
    cfg: StudyConfig,
    *,
    progress: Any = None,
    stop_event: threading.Event | None = None,
    runner: Any = None,
    shared: int | None = None,
) -> optuna.Study:
    """One worker's search (no confirmation: the supervisor's caller runs that once, after all workers)."""
    sweep = WorkerSweep(cfg, runner=runner, progress=progress, stop_event=stop_event, shared=shared)
    try:
        study = sweep.run()
        if sweep.stop.is_set():
            raise KeyboardInterrupt
        return study
    finally:
        sweep.close()


# --- the supervisor --------------------------------------------------------------------------------------
@dataclass
class Workers:
    """Worker processes of one node, started by ``start_workers``; ``wait`` supervises them."""

    cfg: StudyConfig
    procs: dict[int, subprocess.Popen[str]] = field(default_factory=dict)  # by the worker's first GPU (or slot)
    names: dict[int, str] = field(default_factory=dict)  # each worker's run-dir name: its group, or its slot
    echo: Echo = print
    interrupted: bool = False
    _relays: list[threading.Thread] = field(default_factory=list)
    _pool_locks: list[Any] = field(default_factory=list)  # a shared pool's sweep locks, held while its workers run

    def interrupt(self) -> None:
        """First call: SIGINT to every worker (each stops its server cleanly). Second: SIGKILL them."""
        sig = signal.SIGKILL if self.interrupted else signal.SIGINT
        self.interrupted = True
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if sig == signal.SIGKILL:
                        os.killpg(proc.pid, sig)  # the worker leads its own group (start_new_session)
                    else:
                        proc.send_signal(sig)

    def wait(self, timeout_s: float | None = None) -> dict[int, int]:
        """Wait for every worker, forwarding Ctrl-C; then remove what dead workers left. Returns exit codes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with on_sigint(self.interrupt):  # Ctrl-C stops the workers
            while [p for p in self.procs.values() if p.poll() is None]:  # poll all: reaps the dead at once
                if deadline is not None and time.monotonic() > deadline:
                    self.interrupted = True
                    self.interrupt()  # SIGKILL: a stuck worker must not outlive its supervisor
                    break
                time.sleep(0.1)
        for proc in self.procs.values():
            proc.wait()
        for relay in self._relays:
            relay.join(timeout=5)
        self.cleanup()
        return {gpu: proc.returncode for gpu, proc in self.procs.items()}

    def cleanup(self) -> None:
        for key in self.procs:
            name = self.names.get(key, str(key))
            for pid in cleanup_orphans(gpu_run_dir(self.cfg, name)):
                self.echo(f"{_prefix(name)}: stopped orphan server pid {pid} left by its worker")
        for fh in self._pool_locks:
            fh.close()
        self._pool_locks = []


def worker_argv(
    cfg: StudyConfig,
    gpu: int | Sequence[int] | None,
    port: int | None,
    *,
    launcher: str | None = None,
    shared: int | None = None,
) -> list[str]:
    """The worker's command line: the study file plus every override already resolved into ``cfg``
    (``gpu``: one GPU, a group, or None for the GPUs of its Slurm allocation; ``launcher``: where its servers
    run, when not the study's own; ``shared``: its slot among workers sharing the pool ``gpu``)."""
    assert cfg.path is not None, "a worker needs the study file"
    if gpu is None:
        where = ["--slurm-gpus"]
    elif isinstance(gpu, int):
        where = ["--gpu", str(gpu)]
    else:
        where = ["--gpus", group_label(gpu)] + (["--shared", str(shared)] if shared is not None else [])
    argv = [
        sys.executable,
        "-m",
        "autotune",
        "worker",
        "--config",
        str(cfg.path),
        *where,
        "--storage",
        cfg.storage_url,
        "--study",
        cfg.name,
        "--trials",
        str(cfg.study.trials),
        "--engine",
        cfg.engine.kind,
        "--launcher",
        launcher or cfg.engine.launcher,
    ]
    return argv + (["--port", str(port)] if port else [])


def _prefix(name: str) -> str:
    return name if name.startswith("worker") else f"gpu{name}"


@dataclass(frozen=True)
class WorkerPlan:
    """One worker to start: its key (first GPU, or slot), run-dir name, GPUs and slot in a shared pool."""

    key: int
    name: str
    gpus: tuple[int, ...]
    shared: int | None

    def argv_gpu(self) -> int | tuple[int, ...]:
        """One GPU as ``--gpu`` (the form older workers take), a group or pool as ``--gpus``."""
        return self.gpus[0] if len(self.gpus) == 1 and self.shared is None else self.gpus


def plan_workers(cfg: StudyConfig, gpus: Sequence[int]) -> list[WorkerPlan]:
    """The workers of ``gpus`` for this study (``launch.groups.worker_groups``); a pool too small is a ConfigError."""
    check_pool(cfg, tuple(gpus), file=str(cfg.path) if cfg.path else None, key="--gpus")
    groups, shared = worker_groups(gpus, study_spans(cfg))
    if shared:
        return [WorkerPlan(k, f"worker{k}", tuple(g), k) for k, g in enumerate(groups)]
    return [WorkerPlan(g[0], group_label(g), tuple(g), None) for g in groups]


def _relay(stream: IO[str], prefix: str, echo: Echo) -> None:
    for line in iter(stream.readline, ""):
        echo(f"{prefix}{line.rstrip()}")
    stream.close()


def start_workers(
    cfg: StudyConfig, gpus: Sequence[int], *, echo: Echo = print, env: dict[str, str] | None = None
) -> Workers:
    """Check the pool and the storage, create the study, then start one worker per group (``plan_workers``;
    ports ``engine.port + k`` when a port is configured, else each trial picks a free one). Nothing starts if
    the storage is unusable or another sweep of the study holds one of these GPUs."""
    plans = plan_workers(cfg, gpus)  # ConfigError before anything starts
    open_study(cfg)  # StorageError / StudyError here, before any process or server starts
    workers = Workers(cfg=cfg, echo=echo)
    idle = [g for g in gpus if not any(g in p.gpus for p in plans)]
    if idle:  # a pool that does not divide into the servers' groups
        echo(
            f"note: {'GPU' if len(idle) == 1 else 'GPUs'} {group_label(idle)} left idle: the study's servers span "
            f"{len(plans[0].gpus)} GPUs each and take aligned groups"
        )
    if plans and plans[0].shared is not None:  # the shared pool's GPUs are this supervisor's to hold
        workers._pool_locks = hold_sweep_gpus(cfg, [str(g) for g in gpus])
    for k, plan in enumerate(plans):
        port = cfg.engine.port + k if cfg.engine.port else None
        argv = worker_argv(cfg, plan.argv_gpu(), port, shared=plan.shared)
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # Ctrl-C reaches workers through us, once
        workers.procs[plan.key], workers.names[plan.key] = proc, plan.name
        relay = threading.Thread(target=_relay, args=(proc.stdout, f"{_prefix(plan.name)} | ", echo), daemon=True)
        relay.start()
        workers._relays.append(relay)
    return workers


def start_workers_on_slurm(
    cfg: StudyConfig,
    gpus: Sequence[int] | None,
    *,
    echo: Echo = print,
    env: dict[str, str] | None = None,
    count: int | None = None,
) -> SlurmWorkers:
    """Check the storage, create the study, then ``sbatch`` the worker jobs (``slurm_workers``): one per
    group of ``gpus`` (``plan_workers``), or ``count`` jobs that each ask Slurm for a group of the study's size
    (``--gres=gpu:<size>``) and run on the GPUs of their allocation. Inside its allocation each worker's servers
    run with the ``local`` launcher."""
    port = cfg.engine.port
    if gpus is None:
        size = max(study_spans(cfg))  # a job holds the largest server's GPUs, so every config of the space fits
        open_study(cfg)
        argvs = {
            k: (worker_argv(cfg, None, port + k if port else None, launcher="local"), size) for k in range(count or 1)
        }
        return start_slurm_workers(cfg, argvs, echo=echo, env=env, names={k: f"worker{k}" for k in argvs})
    plans = plan_workers(cfg, gpus)
    open_study(cfg)
    argvs = {
        p.key: (
            worker_argv(cfg, p.argv_gpu(), port + k if port else None, launcher="local", shared=p.shared),
            len(p.gpus) if p.shared is None else 1,
        )
        for k, p in enumerate(plans)
    }
    return start_slurm_workers(cfg, argvs, echo=echo, env=env, names={p.key: _prefix(p.name) for p in plans})


def run_workers(
    cfg: StudyConfig, gpus: Sequence[int] | None, *, echo: Echo = print, count: int | None = None
) -> dict[int, int]:
    """Search ``cfg``'s study with one worker per GPU group until it has its trials; returns each worker's exit
    code (by its first GPU, or its slot). On ``[engine] launcher = "slurm"`` each worker is a Slurm job
    (``count`` jobs on GPUs Slurm allocates when ``gpus`` is None). Raises KeyboardInterrupt after a forwarded
    Ctrl-C, StudyError when every worker failed."""
    if cfg.engine.launcher == "slurm":
        workers: Workers | SlurmWorkers = start_workers_on_slurm(cfg, gpus, echo=echo, count=count)
    else:
        if gpus is None:
            raise ConfigError(
                "--workers needs the slurm launcher",
                key="--workers",
                fix="add --launcher slurm, or give --gpus 0-3 to run workers on this node",
            )
        workers = start_workers(cfg, gpus, echo=echo)
    codes = workers.wait()
    if workers.interrupted:
        raise KeyboardInterrupt
    failed = {g: c for g, c in codes.items() if c != 0}
    if failed and len(failed) == len(codes):
        raise StudyError(f"every worker failed (exit codes {failed}); see the lines above for why")
    names = getattr(workers, "names", {})
    for key, code in failed.items():
        echo(
            f"{_prefix(names.get(key, str(key)))}: worker exited with code {code}; the other workers finished its "
            "trials"
        )
    return codes
