"""Scale out: one study, one worker process per GPU, on one node or many, through Optuna's shared storage.

``run_workers`` starts ``python -m autotune.search.workers --gpu i …`` per GPU and supervises them: each worker is a
normal sweep pinned to its GPU (its own port, ``CUDA_VISIBLE_DEVICES``, run dir and GPU lock) that asks the
shared study for trials until finished + running trials reach the target. Ctrl-C is forwarded (each worker
stops its server and records the trial as interrupted); a second Ctrl-C kills them. A worker that dies
mid-trial leaves a RUNNING trial that another worker fails and retries once (``storage.dead_running``); its
orphan server is removed when its GPU next starts, and by the supervisor when the workers end.

Every GPU runs the baseline once, so tok/s can be compared across devices (``search.gpus``).

When the study's launcher is ``slurm``, each worker is a Slurm job instead (``search.slurm_workers``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import click
import optuna

from autotune.config import StudyConfig, load_config
from autotune.errors import AutotuneError, ConfigError, StudyError
from autotune.harness.engines import ENGINES
from autotune.launch import LAUNCHERS
from autotune.launch.process import cleanup_orphans
from autotune.progress import PlainProgress
from autotune.search.objective import make_sampler
from autotune.search.slurm_workers import SlurmWorkers, start_slurm_workers
from autotune.search.storage import open_study
from autotune.search.study import Sweep

Echo = Callable[[str], None]


def parse_gpus(text: str) -> list[int]:
    """``"0,1,2,3"`` → ``[0, 1, 2, 3]``; duplicates or non-numbers are a ConfigError."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"cannot read GPU list {text!r}", key="--gpus", fix="write GPU indices like 0,1,2,3")
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"GPU list {text!r} repeats a GPU", key="--gpus",
                          fix="name each GPU once: two workers on one GPU would skew both")
    return gpus


def on_gpu(cfg: StudyConfig, gpu: int, port: int | None) -> StudyConfig:
    """The study config pinned to one GPU and port (the config is frozen: a copy)."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"gpu": gpu, "port": port})})


def with_launcher(cfg: StudyConfig, launcher: str | None) -> StudyConfig:
    """The study config with ``[engine] launcher`` overridden (``--launcher``; None keeps the file's)."""
    if launcher is None or launcher == cfg.engine.launcher:
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"launcher": launcher})})


def gpu_run_dir(cfg: StudyConfig, gpu: int) -> Path:
    """Pid files of the servers one GPU's worker starts: orphan cleanup on that GPU touches only these."""
    return cfg.work_dir / "runs" / f"gpu-{gpu}"


# --- the worker ------------------------------------------------------------------------------------------
class WorkerSweep(Sweep):
    """A sweep pinned to ``cfg.engine.gpu`` that shares its study with other workers."""

    def __init__(self, cfg: StudyConfig, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        if hasattr(self.runner, "run_dir"):
            self.runner.run_dir = gpu_run_dir(cfg, cfg.engine.gpu)

    def prepare(self) -> None:
        super().prepare()
        # Workers seeded alike would propose the same random start-up configs at the same moment.
        salt = len(self.study.get_trials(deepcopy=False)) + 7919 * (os.getpid() % 100_003)
        self.study.sampler = make_sampler(self.cfg, salt=salt)


def run_worker(cfg: StudyConfig, *, progress: Any = None, stop_event: threading.Event | None = None,
               runner: Any = None) -> optuna.Study:
    """One worker's search (no confirmation: the supervisor's caller runs that once, after all workers)."""
    sweep = WorkerSweep(cfg, runner=runner, progress=progress, stop_event=stop_event)
    try:
        study = sweep.run()
        if sweep.stop.is_set():
            raise KeyboardInterrupt
        return study
    finally:
        sweep.close()


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpu", required=True, type=click.IntRange(min=0))
@click.option("--port", type=click.IntRange(1, 65535))
@click.option("--storage")
@click.option("--study", "study_name")
@click.option("--trials", type=click.IntRange(min=1))
@click.option("--engine", type=click.Choice(sorted(ENGINES)))
@click.option("--launcher", type=click.Choice(sorted(LAUNCHERS)))
def worker(config_path: Path, gpu: int, port: int | None, storage: str | None, study_name: str | None,
           trials: int | None, engine: str | None, launcher: str | None) -> None:
    """One GPU's worker: sweep the shared study on this GPU until it has its trials (started by run_workers)."""
    cfg = load_config(config_path, name=study_name, storage=storage, trials=trials, engine=engine)
    cfg = with_launcher(cfg, launcher)
    run_worker(on_gpu(cfg, gpu, port), progress=PlainProgress(sys.stdout))


def main(argv: Sequence[str] | None = None) -> None:
    try:
        worker.main(args=list(argv) if argv is not None else None, prog_name="autotune.search.workers",
                    standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AutotuneError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (KeyboardInterrupt, click.exceptions.Abort):
        sys.exit(130)
    sys.exit(0)


# --- the supervisor --------------------------------------------------------------------------------------
@dataclass
class Workers:
    """Worker processes of one node, started by ``start_workers``; ``wait`` supervises them."""

    cfg: StudyConfig
    procs: dict[int, subprocess.Popen[str]] = field(default_factory=dict)
    echo: Echo = print
    interrupted: bool = False
    _relays: list[threading.Thread] = field(default_factory=list)

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
        with _forward_sigint(self):
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
        for gpu in self.procs:
            for pid in cleanup_orphans(gpu_run_dir(self.cfg, gpu)):
                self.echo(f"gpu{gpu}: stopped orphan server pid {pid} left by its worker")


@contextlib.contextmanager
def _forward_sigint(workers: Workers) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: workers.interrupt())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def worker_argv(cfg: StudyConfig, gpu: int, port: int | None, *, launcher: str | None = None) -> list[str]:
    """The worker's command line: the study file plus every override already resolved into ``cfg``
    (``launcher``: where its servers run, when not the study's own)."""
    assert cfg.path is not None, "a worker needs the study file"
    argv = [sys.executable, "-m", "autotune.search.workers", "--config", str(cfg.path), "--gpu", str(gpu),
            "--storage", cfg.storage_url, "--study", cfg.name, "--trials", str(cfg.study.trials),
            "--engine", cfg.engine.kind, "--launcher", launcher or cfg.engine.launcher]
    return argv + (["--port", str(port)] if port else [])


def _relay(stream: IO[str], prefix: str, echo: Echo) -> None:
    for line in iter(stream.readline, ""):
        echo(f"{prefix}{line.rstrip()}")
    stream.close()


def start_workers(cfg: StudyConfig, gpus: Sequence[int], *, echo: Echo = print,
                  env: dict[str, str] | None = None) -> Workers:
    """Check the storage, create the study, then start one worker per GPU (ports ``engine.port + k`` when a
    port is configured, else each trial picks a free one). Nothing starts if the storage is unusable."""
    open_study(cfg)  # StorageError / StudyError here, before any process or server starts
    workers = Workers(cfg=cfg, echo=echo)
    for k, gpu in enumerate(gpus):
        port = cfg.engine.port + k if cfg.engine.port else None
        proc = subprocess.Popen(worker_argv(cfg, gpu, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})},
                                start_new_session=True)  # Ctrl-C reaches workers through us, once
        workers.procs[gpu] = proc
        relay = threading.Thread(target=_relay, args=(proc.stdout, f"gpu{gpu} | ", echo), daemon=True)
        relay.start()
        workers._relays.append(relay)
    return workers


def start_workers_on_slurm(cfg: StudyConfig, gpus: Sequence[int], *, echo: Echo = print,
                           env: dict[str, str] | None = None) -> SlurmWorkers:
    """Check the storage, create the study, then ``sbatch`` one worker job per GPU (``search.slurm_workers``);
    inside its allocation each worker's servers run with the ``local`` launcher."""
    open_study(cfg)
    argvs = {gpu: worker_argv(cfg, gpu, cfg.engine.port + k if cfg.engine.port else None, launcher="local")
             for k, gpu in enumerate(gpus)}
    return start_slurm_workers(cfg, argvs, echo=echo, env=env)


def run_workers(cfg: StudyConfig, gpus: Sequence[int], *, echo: Echo = print) -> dict[int, int]:
    """Search ``cfg``'s study with one worker per GPU until it has its trials; returns each worker's exit code.
    On ``[engine] launcher = "slurm"`` each worker is a Slurm job. Raises KeyboardInterrupt after a forwarded
    Ctrl-C, StudyError when every worker failed."""
    if cfg.engine.launcher == "slurm":
        workers: Workers | SlurmWorkers = start_workers_on_slurm(cfg, gpus, echo=echo)
    else:
        workers = start_workers(cfg, gpus, echo=echo)
    codes = workers.wait()
    if workers.interrupted:
        raise KeyboardInterrupt
    failed = {g: c for g, c in codes.items() if c != 0}
    if failed and len(failed) == len(codes):
        raise StudyError(f"every worker failed (exit codes {failed}); see the lines above for why")
    for gpu, code in failed.items():
        echo(f"gpu{gpu}: worker exited with code {code}; the other workers finished its trials")
    return codes


if __name__ == "__main__":
    main()
