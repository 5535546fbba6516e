"""Scale-out: wall time of one simulated study with 1, 2 and 4 workers (one per simulated GPU).

Writes ``results/scale_out.md``. Each run is a fresh study in a temporary directory: ``--trials`` trials (default 24) of the simulated engine with
short windows, searched by ``run_workers`` exactly as ``autotune sweep --gpus`` does (worker processes, real
sim servers, the shared storage). Prints wall time, speed-up over one worker, trials per minute and the
device-to-device spread of the per-GPU baselines. Target: near-linear (≥ 3.2× at 4 workers) where the
host has a core per worker; the sim servers and replay clients need CPU, so a smaller host caps the speed-up.

    python benchmarks/scale_out.py [--workers 1,2,4] [--trials 24] [--measure-s 1] [--storage sqlite|journal|URL]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
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


def run_once(workers: int, *, trials: int, measure_s: float, storage: str) -> dict:
    from autotune.config import load_config
    from autotune.study import open_study
    from autotune.workers import gpu_spread, run_workers

    with tempfile.TemporaryDirectory(prefix="autotune-scale-") as tmp:
        base = Path(tmp)
        os.environ["AUTOTUNE_SIM_DEVICE_DIR"] = str(base / "devices")
        (base / "prompts.jsonl").write_text(
            "".join(json.dumps({"prompt": f"Explain topic {i} in detail. " * 4}) + "\n" for i in range(16)))
        path = base / "scale-out.toml"
        path.write_text(STUDY.format(trials=trials, measure_s=measure_s))
        name = f"scale-out-{workers}w-{int(time.time())}"
        cfg = load_config(path, name=name, storage=storage_url(storage, base, workers))
        lines: list[str] = []
        started = time.monotonic()
        codes = run_workers(cfg, list(range(workers)), echo=lines.append)
        wall = time.monotonic() - started
        if any(codes.values()):
            sys.exit(f"a worker failed ({codes}):\n" + "\n".join(lines[-30:]))
        study = open_study(cfg, create=False)
        done = [t for t in study.get_trials() if t.state.is_finished()]
        return {"workers": workers, "wall_s": wall, "trials": len(done), "spread": gpu_spread(study)}


def main() -> None:
    from autotune.storage import redact

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4", help="worker counts to time (comma-separated)")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--measure-s", type=float, default=1.0)
    parser.add_argument("--storage", default="sqlite", help="sqlite, journal, or a database URL")
    args = parser.parse_args()
    os.environ.setdefault("AUTOTUNE_HEARTBEAT_S", "2")
    counts = [int(n) for n in args.workers.split(",")]
    header = f"{'workers':>8} {'wall s':>8} {'speed-up':>9} {'trials/min':>11} {'baseline spread':>16}"
    lines = [f"scale-out: {args.trials}-trial simulated study, {args.measure_s:g} s windows, storage "
             f"{redact(args.storage)}, {os.cpu_count()} CPU cores; speed-up vs {counts[0]} worker(s)", header]
    print("\n".join(lines), flush=True)
    first = None
    for n in counts:
        r = run_once(n, trials=args.trials, measure_s=args.measure_s, storage=args.storage)
        first = first or r["wall_s"]
        spread = "n/a" if r["spread"] is None else f"{r['spread']:.1%}"
        row = (f"{n:>8} {r['wall_s']:>8.1f} {first / r['wall_s']:>8.2f}× {r['trials'] / r['wall_s'] * 60:>11.1f} "
               f"{spread:>16}")
        lines.append(row)
        print(row, flush=True)
    out = Path(__file__).resolve().parent / "results" / "scale_out.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("```\n" + "\n".join(lines) + "\n```\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
