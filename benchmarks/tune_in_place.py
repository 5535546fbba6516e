"""Tune in place under a job's load: a study on one borrowed server of a running fleet, then the winner rolled out.

Three simulated servers behind sglang-router (``autotune fleet up``, with its keeper), a closed loop of
``--concurrency`` requests through the router for the whole run (``closed_loop.py``). After ``--before-s``:
``autotune sweep --borrow s1 --trials N`` (a small study on the simulated engine, its confirmation included) runs to
its summary and gives s1 back; then ``autotune apply --rolling`` rolls the study's winner (else its best trial) out
to all three. Printed: failed requests, completions per 10 s before, during the lease, after the return and after
the rollout; the lowest 10 s bucket during the lease against (N-1)/N of the mean before; the time from the study's
end to the server back in the router.

The servers are the simulator (``autotune.sim``): its startup and step times stand for SGLang's only as far as the
simulator is true; the router is the real ``sglang-router``.

    python benchmarks/tune_in_place.py
    python benchmarks/tune_in_place.py --trials 3 --concurrency 48
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rollout_under_load import autotune, buckets, routed_load, setup  # noqa: E402

from autotune.deploy.fleetlog import FleetLog  # noqa: E402

STUDY = """
[study]
name = "inplace"
trials = {trials}
seed = 0
confirm_top_k = 1
confirm_repeats = 1
confirm_windows = 1

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"

[engine.fixed]
speculative_algorithm = "EAGLE"
enable_metrics = true

[space]
max_mamba_cache_size = {{ type = "int", low = 80, high = 240, step = 40 }}
mem_fraction_static = {{ type = "float", low = 0.86, high = 0.92, step = 0.02 }}

[workload]
prompts = "prompts.jsonl"
sample_size = 32
max_tokens = 128
warmup_s = 2
measure_s = 6

[baseline]
flags = {{ max_mamba_cache_size = 120 }}
"""


def event_time(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["time"]).timestamp()


def lowest_share(during: list[int], before: list[int]) -> str:
    return f"{min(during) / mean(before):.2f}" if during and before else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--before-s", type=float, default=30.0)
    parser.add_argument("--after-s", type=float, default=20.0)
    args = parser.parse_args()
    n = args.servers
    print(
        f"{n} simulated servers (qwen3.6-27b on a simulated B200) behind sglang-router, closed loop of "
        f"{args.concurrency} in flight, {args.max_tokens} tokens each; sweep --borrow s1 --trials {args.trials}, "
        f"then apply --rolling; host: {os.cpu_count()} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tune-in-place-") as tmp:
        directory = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOTUNE_SIM_DEVICE_DIR": str(directory / "devices")}
        path = setup(directory, n, True)
        study = directory / "inplace.toml"
        study.write_text(STUDY.format(trials=args.trials))
        (directory / "prompts.jsonl").write_text(
            "".join(json.dumps({"prompt": f"Explain topic {i} in detail. " * 4}) + "\n" for i in range(64))
        )
        load = None
        try:
            out = directory / "load.jsonl"
            fleet, load = routed_load(path, env, concurrency=args.concurrency, max_tokens=args.max_tokens, out=out)
            t0 = time.time()
            time.sleep(args.before_s)
            swept = autotune("sweep", "--config", str(study), "--borrow", "s1", "--fleet", str(path), env=env)
            summary = swept.stdout.strip().splitlines()
            events = FleetLog.of(fleet).events()
            lent = next(e for e in events if e["event"] == "lent")
            back = next(e for e in events if e["event"] == "returned")
            time.sleep(args.after_s / 2)
            rolled_at = time.time()
            # the canary replays the study's own workload (its concurrency), so its tok/s compares with the study's
            rolled = autotune(
                "apply",
                "--config",
                str(study),
                "--fleet",
                str(path),
                "--rolling",
                "--grace",
                "10",
                "--startup-timeout",
                "120",
                env=env,
            )
            rolled_end = time.time()
            time.sleep(args.after_s)
            t1 = time.time()
            load.send_signal(signal.SIGTERM)
            load.wait(timeout=180)
            records = [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
        finally:
            if load is not None and load.poll() is None:
                load.kill()
            autotune("fleet", "down", "--fleet", str(path), "--grace", "5", env=env)
        ends = [r["end"] for r in records if r["ok"]]
        out_at, in_at = event_time(lent), event_time(back)
        before = buckets(ends, t0 + 10.0, out_at)
        during = buckets(ends, out_at, in_at)
        after_return = buckets(ends, in_at, rolled_at)
        after_rollout = buckets(ends, rolled_end, t1)
        print(f"failed requests: {sum(not r['ok'] for r in records)} of {len(records)}")
        print(f"sweep (rc {swept.returncode}): " + " | ".join(line.strip() for line in summary[-8:]))
        print(f"lease: {lent['line']}; {back['line']}")
        print(f"from the study's end to s1 back in the router: {back['return_s']} s")
        said = (rolled.stderr if rolled.returncode else rolled.stdout).strip().splitlines() or ["(no output)"]
        print(f"rollout (rc {rolled.returncode}, {rolled_end - rolled_at:.0f} s): {said[-1]}")
        print(
            f"completions per 10 s  before {before}  during the lease {during}  after the return {after_return}  "
            f"after the rollout {after_rollout}"
        )
        print(
            f"lowest 10 s bucket during the lease: {lowest_share(during, before)} of the mean before "
            f"(target (N-1)/N = {(n - 1) / n:.2f})"
        )


if __name__ == "__main__":
    main()
