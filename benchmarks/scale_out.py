"""Scale-out: wall time of one simulated study with 1, 2 and 4 workers (one per simulated GPU).

Two modes, each a fresh ``--trials``-trial study (default 24) per worker count, in a temporary directory:

* ``sim``: ``run_workers`` exactly as ``autotune sweep --gpus`` runs it: worker processes, real simulated
  SGLang servers with short windows, the shared storage. Every server and replay client needs CPU, so a host
  with fewer cores than workers caps the speed-up (a real GPU does the serving; the harness needs little CPU).
* ``paced``: the same worker code (``run_worker``: GPU locks, shared storage, liveness, count-before-ask) in
  one process per worker, but each trial is the simulator's virtual-clock result held for ``--paced-s`` of
  wall time instead of a server: what the orchestration itself costs when the GPU does the work.

Prints wall time, speed-up over the first worker count, trials per minute and the spread of the per-GPU
baselines, and writes ``results/scale_out.md``. Target: near-linear, ≥ 3.2× at 4 workers.

    python benchmarks/scale_out.py [--mode both|sim|paced] [--workers 1,2,4] [--trials 24] [--measure-s 1]
                                   [--paced-s 5] [--storage sqlite|journal|URL]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

STUDY = """
[study]
name = "scale-out"
trials = {trials}
seed = 0
confirm_top_k = 0

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"
sim_options = {{ startup_s = 0.2, warmup_s = 0.1, release_s = 0.2 }}

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1
speculative_num_steps = 3
speculative_num_draft_tokens = 4

[space]
max_mamba_cache_size = {{ type = "int", low = 80, high = 320, step = 40 }}
mem_fraction_static = {{ type = "float", low = 0.84, high = 0.92, step = 0.02 }}

[workload]
prompts = "prompts.jsonl"
sample_size = 16
max_tokens = 256
warmup_s = 0.3
measure_s = {measure_s}

[baseline]
flags = {{ max_mamba_cache_size = 80 }}
"""


def storage_url(kind: str, base: Path, n: int) -> str | None:
    if kind == "sqlite":
        return None  # the study file's default: sqlite beside it
    if kind == "journal":
        return f"journal://{base / 'scale-out.log'}"
    return kind  # a database URL; each run uses its own study name, so runs never mix


@contextlib.contextmanager
def fresh_study(workers: int, *, trials: int, measure_s: float, storage: str) -> Iterator:
    """A new study file, prompts and simulated devices in a temporary directory."""
    from autotune.config import load_config

    with tempfile.TemporaryDirectory(prefix="autotune-scale-") as tmp:
        base = Path(tmp)
        os.environ["AUTOTUNE_SIM_DEVICE_DIR"] = str(base / "devices")
        (base / "prompts.jsonl").write_text(
            "".join(json.dumps({"prompt": f"Explain topic {i} in detail. " * 4}) + "\n" for i in range(16))
        )
        path = base / "scale-out.toml"
        path.write_text(STUDY.format(trials=trials, measure_s=measure_s))
        name = f"scale-out-{workers}w-{time.time_ns()}"
        yield load_config(path, name=name, storage=storage_url(storage, base, workers))


def run_sim(cfg, workers: int, paced_s: float) -> None:
    from autotune.search.scaleout.workers import run_workers

    lines: list[str] = []
    codes = run_workers(cfg, list(range(workers)), echo=lines.append)
    if any(codes.values()):
        sys.exit(f"a worker failed ({codes}):\n" + "\n".join(lines[-30:]))


def paced_worker(path: str, name: str, storage: str, gpu: int, paced_s: float, env: dict[str, str]) -> None:
    """One worker process: the real sweep loop; each trial's "GPU time" is a sleep."""
    os.environ.update(env)
    from autotune.config import load_config
    from autotune.progress import PlainProgress
    from autotune.search.runner import predict
    from autotune.search.scaleout.workers import on_gpu, run_worker

    cfg = on_gpu(load_config(path, name=name, storage=storage), gpu, None)

    def runner(config: dict, number: int):
        result = predict(cfg, config, seed=number)
        time.sleep(paced_s)
        return result

    with open(os.devnull, "w") as sink:
        run_worker(cfg, runner=runner, progress=PlainProgress(sink))


def run_paced(cfg, workers: int, paced_s: float) -> None:
    from autotune.search.objective import open_study

    open_study(cfg)
    spawn = multiprocessing.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k.startswith("AUTOTUNE_")}
    procs = [
        spawn.Process(target=paced_worker, args=(str(cfg.path), cfg.name, cfg.storage_url, g, paced_s, env))
        for g in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        sys.exit(f"a paced worker failed: exit codes {[proc.exitcode for proc in procs]}")


def time_mode(mode: str, counts: list[int], args: argparse.Namespace) -> list[str]:
    from autotune.search.objective import open_study
    from autotune.search.views.gpus import gpu_spread

    run = {"sim": run_sim, "paced": run_paced}[mode]
    what = (
        f"{args.measure_s:g} s windows, real sim servers"
        if mode == "sim"
        else f"trials held {args.paced_s:g} s each, no servers"
    )
    lines = [
        f"{mode}: {args.trials}-trial study, {what}; speed-up vs {counts[0]} worker(s)",
        f"{'workers':>8} {'wall s':>8} {'speed-up':>9} {'trials/min':>11} {'baseline spread':>16}",
    ]
    print("\n".join(lines), flush=True)
    first = None
    for n in counts:
        with fresh_study(n, trials=args.trials, measure_s=args.measure_s, storage=args.storage) as cfg:
            started = time.monotonic()
            run(cfg, n, args.paced_s)
            wall = time.monotonic() - started
            study = open_study(cfg, create=False)
            done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
            spread = gpu_spread(study)
        first = first or wall
        shown = "n/a" if spread is None else f"{spread:.1%}"
        row = f"{n:>8} {wall:>8.1f} {first / wall:>8.2f}× {done / wall * 60:>11.1f} {shown:>16}"
        lines.append(row)
        print(row, flush=True)
    return lines


def main() -> None:
    from autotune.search.storage import redact

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["both", "sim", "paced"], default="both")
    parser.add_argument("--workers", default="1,2,4", help="worker counts to time (comma-separated)")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--measure-s", type=float, default=1.0, help="sim mode: the measured window")
    parser.add_argument("--paced-s", type=float, default=5.0, help="paced mode: wall time held per trial")
    parser.add_argument("--storage", default="sqlite", help="sqlite, journal, or a database URL")
    args = parser.parse_args()
    os.environ.setdefault("AUTOTUNE_HEARTBEAT_S", "2")
    counts = [int(n) for n in args.workers.split(",")]
    lines = [f"scale-out on {os.cpu_count()} CPU cores, storage {redact(args.storage)}"]
    print(lines[0], flush=True)
    for mode in ["sim", "paced"] if args.mode == "both" else [args.mode]:
        lines += time_mode(mode, counts, args)
    out = Path(__file__).resolve().parent / "results" / "scale_out.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("```\n" + "\n".join(lines) + "\n```\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
