"""A rolling restart under a job's load, with and without SGLang's router in front of the fleet.

Starts N simulated servers (``autotune fleet up``; with ``--router``, sglang-router too), drives a closed loop of
``--concurrency`` requests (``closed_loop.py``: through the router's one URL, or round-robin over the servers as a
job without a router does), runs ``autotune apply --rolling`` to another config after ``--before-s`` and keeps the
load ``--after-s`` longer. Prints, for each mode: failed requests, completions per 10 s before, during and after
the rollout, and the lowest 10 s bucket during the rollout as a share of the mean before, beside the target
(N-1)/N less the spread measured before the rollout (the relative range of the buckets before it).

The servers are the simulator (``autotune.sim``): its step times, restarts and HTTP behaviour stand for SGLang's
only as far as the simulator is true; the router is the real ``sglang-router``. On a small host the canary and a
starting server compete with the surviving servers for CPU, which shows in the during-buckets: the canary's client
load is held to ``--canary-concurrency`` (what its check needs).

    python benchmarks/rollout_under_load.py                 # both modes, 3 servers, 64 in flight
    python benchmarks/rollout_under_load.py --modes router --servers 3 --before-s 30 --after-s 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.deploy.fleet import Fleet, FleetServer, load_fleet, write_fleet  # noqa: E402
from autotune.deploy.fleetfile import RouterSection  # noqa: E402
from autotune.deploy.sglang_yaml import deployed_config, split_config, yaml_text  # noqa: E402
from autotune.launch.process import free_port  # noqa: E402
from autotune.sglang.memory import plan  # noqa: E402
from autotune.sglang.profiles import load_gpu, load_model  # noqa: E402

OLD = {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 120}
NEW = {
    "speculative_algorithm": "EAGLE",
    "max_mamba_cache_size": 200,
    "mem_fraction_static": 0.93,
    "max_running_requests": 64,
}
BUCKET_S = 10.0


def buckets(ends: list[float], t0: float, t1: float, width: float = BUCKET_S) -> list[int]:
    """Completions per ``width`` seconds from ``t0``, whole buckets up to ``t1`` only."""
    counts = [0] * int((t1 - t0) // width)
    for end in ends:
        i = int((end - t0) // width)
        if 0 <= i < len(counts):
            counts[i] += 1
    return counts


def phases(records: list[dict[str, Any]], t0: float, start: float, end: float, t1: float) -> dict[str, Any]:
    """The figures of one run: buckets before (whole ones ending by ``start``, after a 10 s ramp), during
    (``start`` … ``end``, a partial last one scaled up), after; the lowest during-bucket over the mean before; the
    target."""
    ok_ends = [r["end"] for r in records if r["ok"]]
    warm = t0 + BUCKET_S  # the loop's first 10 s ramp up: not part of "before"
    before = buckets(ok_ends, start - BUCKET_S * int(max(0.0, start - warm) // BUCKET_S), start)
    during = buckets(ok_ends, start, end + BUCKET_S)  # the bucket holding the rollout's end counts as during
    after = buckets(ok_ends, start + BUCKET_S * len(during), t1)
    base = mean(before) if before else 0.0
    spread = (max(before) - min(before)) / base if base else 0.0
    return {
        "failed": sum(not r["ok"] for r in records),
        "requests": len(records),
        "before": before,
        "during": during,
        "after": after,
        "rollout_s": round(end - start, 1),
        "lowest_share": round(min(during) / base, 3) if during and base else None,
        "spread_before": round(spread, 3),
    }


def setup(directory: Path, servers: int, routed: bool) -> Path:
    """A fleet file of ``servers`` simulated servers on OLD (with --enable-metrics, as apply writes it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "old.yaml").write_text(yaml_text(split_config(deployed_config(OLD))[0]))
    members = [
        FleetServer(
            name=f"s{i}", gpus=[i], port=free_port(), config="old.yaml", log=f"logs/s{i}.log", pid=f"run/s{i}.pid"
        )
        for i in range(servers)
    ]
    section = RouterSection(router=routed, port=free_port(), metrics_port=free_port())
    return write_fleet(
        Fleet(engine="sim", model="qwen3.6-27b", sim_gpu="b200", servers=members, router=section),
        directory / "fleet.toml",
    )


def winner(directory: Path) -> Path:
    """NEW as an sglang.yaml with the provenance.json apply writes beside it (what the rollout verifies)."""
    directory.mkdir(parents=True, exist_ok=True)
    prompts = directory / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Write item {i} of a numbered list about GPUs."}) + "\n" for i in range(64))
    )
    p = plan(load_model("qwen3.6-27b"), load_gpu("b200"), NEW)
    capacity = {
        "max_running_requests": p.max_running_requests,
        "kv_tokens": p.kv_tokens,
        "mamba_slots": p.max_mamba_cache_size,
    }
    (directory / "sglang.yaml").write_text(yaml_text(split_config(deployed_config(NEW))[0]))
    (directory / "provenance.json").write_text(
        json.dumps(
            {
                "study": "benchmark",
                "trial": 1,
                "engine": "sim",
                "model_path": "qwen3.6-27b",
                "sim_gpu": "b200",
                "capacity": capacity,
                "config": NEW,
                "workload": {"prompts": str(prompts), "sample_size": 32, "max_tokens": 64},
            }
        )
    )
    return directory / "sglang.yaml"


def autotune(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], env=env, capture_output=True, text=True, timeout=900
    )


def routed_load(
    path: Path, env: dict[str, str], *, concurrency: int, max_tokens: int, out: Path
) -> tuple[Fleet, subprocess.Popen[bytes]]:
    """``fleet up`` on ``path`` (its router and keeper too), then a closed loop through the router's one URL
    writing to ``out``: the fleet and the loop's process (SIGTERM ends it)."""
    up = autotune("fleet", "up", "--fleet", str(path), env=env)
    if up.returncode:
        raise SystemExit(up.stderr or up.stdout)
    fleet = load_fleet(path)
    assert fleet.router is not None
    load = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "closed_loop.py"),
            "--url",
            fleet.router.url,
            "--concurrency",
            str(concurrency),
            "--max-tokens",
            str(max_tokens),
            "--out",
            str(out),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return fleet, load


def run_mode(base: Path, args: argparse.Namespace, routed: bool) -> dict[str, Any]:
    directory = base / ("router" if routed else "direct")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOTUNE_SIM_DEVICE_DIR": str(directory / "devices")}
    path = setup(directory, args.servers, routed)
    new = winner(directory / "new")
    try:
        up = autotune("fleet", "up", "--fleet", str(path), env=env)
        if up.returncode:
            raise SystemExit(up.stderr or up.stdout)
        fleet = load_fleet(path)
        urls = [fleet.router.url] if routed and fleet.router else [s.url for s in fleet.servers]
        out = directory / "load.jsonl"
        load = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "closed_loop.py"),
                *[a for u in urls for a in ("--url", u)],
                "--concurrency",
                str(args.concurrency),
                "--max-tokens",
                str(args.max_tokens),
                "--out",
                str(out),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        t0 = time.time()
        time.sleep(args.before_s)
        start = time.time()
        rolled = autotune(
            "apply",
            "--config",
            str(new),
            "--fleet",
            str(path),
            "--rolling",
            "--canary-s",
            str(args.canary_s),
            "--canary-warmup-s",
            "1",
            "--canary-concurrency",
            str(args.canary_concurrency),
            "--grace",
            "10",
            "--startup-timeout",
            "120",
            env=env,
        )
        end = time.time()
        time.sleep(args.after_s)
        t1 = time.time()
        load.send_signal(signal.SIGTERM)
        load.wait(timeout=180)
        records = [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
        figures = phases(records, t0, start, end, t1)
        figures["rollout"] = (rolled.stdout.strip().splitlines() or ["(no output)"])[-1]
        figures["rollout_ok"] = rolled.returncode == 0
        return figures
    finally:
        autotune("fleet", "down", "--fleet", str(path), "--grace", "5", env=env)


def report(mode: str, f: dict[str, Any], servers: int) -> list[str]:
    target = (servers - 1) / servers - f["spread_before"]
    share = f["lowest_share"]
    return [
        f"{mode}: {f['failed']} failed of {f['requests']} requests; rollout {f['rollout_s']} s "
        f"({'done' if f['rollout_ok'] else 'FAILED'}: {f['rollout']})",
        f"  completions per 10 s  before {f['before']}  during {f['during']}  after {f['after']}",
        f"  lowest 10 s bucket during the rollout: {share if share is not None else '-'} of the mean before "
        f"(target (N-1)/N - spread before = {(servers - 1) / servers:.2f} - {f['spread_before']:.2f} = "
        f"{target:.2f})",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=["router", "direct"], default=["router", "direct"])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--before-s", type=float, default=40.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--canary-s", type=float, default=3.0)
    parser.add_argument("--canary-concurrency", type=int, default=4)
    args = parser.parse_args()
    print(
        f"{args.servers} simulated servers (qwen3.6-27b on a simulated B200), closed loop of {args.concurrency} "
        f"in flight, {args.max_tokens} tokens each; OLD -> NEW; canary {args.canary_s} s at "
        f"{args.canary_concurrency} in flight; host: {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory(prefix="rollout-under-load-") as tmp:
        for mode in args.modes:
            for line in report(mode, run_mode(Path(tmp), args, mode == "router"), args.servers):
                print(line, flush=True)


if __name__ == "__main__":
    main()
