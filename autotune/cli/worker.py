"""``autotune worker``: one sweep worker on its GPUs, started by ``autotune sweep --gpus``/``--workers``
(``search.scaleout.workers``), not by hand; hidden from ``autotune --help``.

Its errors take the CLI's one path (one ``Error:`` line, exit 1). A stopped worker exits 130 without a line of
its own: its supervisor forwarded the Ctrl-C and says once that the sweep was interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.harness.engines import ENGINES
from autotune.launch import LAUNCHERS
from autotune.launch.groups import group_label, parse_gpus
from autotune.progress import PlainProgress
from autotune.search.scaleout.slurm_workers import allocation_gpus
from autotune.search.scaleout.workers import on_gpu, on_gpus, run_worker, with_launcher


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpu", type=click.IntRange(min=0), help="One GPU (a server spanning N counts up from it).")
@click.option("--gpus", "group", help="This worker's GPUs (0,1), or the pool it shares with --shared.")
@click.option("--shared", type=click.IntRange(min=0), help="This worker's slot among workers sharing --gpus.")
@click.option("--slurm-gpus", is_flag=True, help="The GPUs of this Slurm allocation.")
@click.option("--port", type=click.IntRange(1, 65535))
@click.option("--storage")
@click.option("--study", "study_name")
@click.option("--trials", type=click.IntRange(min=1))
@click.option("--engine", type=click.Choice(sorted(ENGINES)))
@click.option("--launcher", type=click.Choice(sorted(LAUNCHERS)))
def worker(
    config_path: Path,
    gpu: int | None,
    group: str | None,
    shared: int | None,
    slurm_gpus: bool,
    port: int | None,
    storage: str | None,
    study_name: str | None,
    trials: int | None,
    engine: str | None,
    launcher: str | None,
) -> None:
    """One worker: sweep the shared study on its GPUs until it has its trials (started by run_workers)."""
    cfg = load_config(config_path, name=study_name, storage=storage, trials=trials, engine=engine)
    cfg = with_launcher(cfg, launcher)
    if slurm_gpus:
        gpus = allocation_gpus()
        print(f"this allocation's GPUs: {group_label(gpus)}", flush=True)
        cfg = on_gpus(cfg, gpus, port, key="--gres")
    elif group is not None:
        cfg = on_gpus(cfg, parse_gpus(group), port)
    elif gpu is not None:
        cfg = on_gpu(cfg, gpu, port)
    else:
        raise ConfigError("a worker needs its GPUs", key="--gpu", fix="pass --gpu N, --gpus 0,1 or --slurm-gpus")
    try:
        run_worker(cfg, progress=PlainProgress(sys.stdout), shared=shared)
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None  # the supervisor reports the interrupt, once
