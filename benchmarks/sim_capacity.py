"""How fast the simulator can go: (a) the highest modelled tok/s one sim server paces correctly on one core,
(b) how many simulated seconds ``evaluate()`` covers per CPU second.

(a) starts ``python -m autotune.sim`` pinned to one core, replays a closed loop of streaming ``/generate``
requests from another core, and compares the tokens that arrived in the window with ``evaluate()``'s prediction
for the same prompts, concurrency and window. "Correct" = within 2 %. The ladder of configs rises in modelled
tok/s; each line also shows the server's CPU share and how late its steps went out (``/sim/pace``), so a starved
server (a loaded machine) is told apart from a slow one, and the lag the harness's detector reads (``sim_pace`` in
``/server_info``: wall clock behind the modelled clock over the replay) against its threshold
(``autotune.harness.trial.LAG_LIMIT``): the highest rate it accepts is what a trial can record on this host.
Runs in under ~3 minutes. Usage: ``python benchmarks/sim_capacity.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx  # only for the readiness poll

from autotune.harness.trial import LAG_LIMIT
from autotune.sim.evaluate import SimWorkload, _seed_prompts, evaluate

DENSE_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "head_dim": 128,
}
COUNT = re.compile(rb'"completion_tokens":(\d+)')


def _cores() -> tuple[set[int], set[int]]:
    cores = sorted(os.sched_getaffinity(0))
    return ({cores[0]}, set(cores[1:]) or {cores[0]})


def start_server(model: str, flags: list[str], devices: str, core: set[int]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": devices, "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "autotune.sim",
        "--model-path",
        model,
        "--port",
        "0",
        "--sim-startup-s",
        "0",
        "--sim-warmup-s",
        "0",
        "--sim-seed",
        "1",
        "--sim-release-s",
        "0",
        "--uvicorn-access-log-exclude-prefixes",
        "/generate",
        "/health",
        *flags,
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, core),
    )
    deadline = time.monotonic() + 30
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        if match := re.search(r"Uvicorn running on (http://[\d.]+:\d+)", line):
            url = match[1]
            break
        if time.monotonic() > deadline:
            break
    else:
        raise RuntimeError(f"sim server exited with {proc.wait()}")
    while httpx.get(f"{url}/health").status_code != 200:
        time.sleep(0.02)
    # Keep draining its output so a full pipe never blocks the server's log writes.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, url


async def replay(
    url: str, prompts: list[str], concurrency: int, max_tokens: int, warmup: float, window: float
) -> float:
    """Closed-loop streaming client on raw sockets (one connection per request), so the client is never the
    bottleneck: tokens are counted by arrival time inside the window from ``completion_tokens`` in the bytes."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    lo, hi = t0 + warmup, t0 + warmup + window
    sent = tokens = 0

    async def one(text: str) -> None:
        nonlocal tokens
        body = json.dumps({"text": text, "stream": True, "sampling_params": {"max_new_tokens": max_tokens}}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        seen, tail = 0, b""
        try:
            while data := await reader.read(1 << 16):
                counts = COUNT.findall(tail + data)
                tail = data[-40:]
                now = loop.time()
                if counts:
                    n = int(counts[-1])
                    if lo <= now <= hi:
                        tokens += n - seen
                    seen = max(seen, n)
                if now > hi:
                    return
        finally:
            writer.close()

    async def worker() -> None:
        nonlocal sent
        while loop.time() < hi:
            text = prompts[sent % len(prompts)]
            sent += 1
            await one(text)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens / window


def pacing(quick: bool) -> None:
    print("(a) pacing: HTTP-measured tok/s vs evaluate() (server pinned to one core, client on another)")
    server_core, client_core = _cores()
    os.sched_setaffinity(0, client_core)
    prompts = _seed_prompts(64, mean_tokens=200)
    # Natural output lengths (mean 400) stagger the finishes: the window sees steady decode, not the phase of
    # one synchronized generation of fixed-length requests.
    warmup, window, max_tokens, output_mean = 1.0, 3.0, 2048, 400
    with tempfile.TemporaryDirectory() as tmp:
        dense = Path(tmp) / "dense-8b"
        dense.mkdir()
        (dense / "config.json").write_text(json.dumps(DENSE_8B))
        # (label, model, planner flags, server-only flags, concurrency); --stream-interval N is SGLang's own knob
        # for sending every N tokens, which divides the chunks (and syscalls) per generated token by N.
        mtp80 = {
            "speculative_algorithm": "NEXTN",
            "max_mamba_cache_size": 400,
            "max_running_requests": 80,
            "mamba_ssm_dtype": "bfloat16",
            "disable_radix_cache": True,
        }
        points = [
            ("qwen3.6-27b MTP", "qwen3.6-27b", {"speculative_algorithm": "NEXTN"}, [], 56),
            ("qwen3.6-27b MTP R=80", "qwen3.6-27b", mtp80, [], 80),
        ]
        points += [(f"dense-8b B={c}", str(dense), {}, [], c) for c in ((64,) if quick else (32, 64, 128))]
        points += [
            (f"dense-8b B={c} si=8", str(dense), {}, ["--stream-interval", "8"], c)
            for c in ((256,) if quick else (128, 256, 512))
        ]
        # --sim-speedup F paces the model F× faster than real time: rungs above what one core can pace, to find
        # where the lag detector starts refusing.
        points += [
            (f"dense-8b B=256 si=16 x{f}", str(dense), {}, ["--stream-interval", "16", "--sim-speedup", str(f)], 256)
            for f in ((4,) if quick else (2, 4, 8))
        ]
        best = accepted = 0.0
        for label, model, flags, server_only, conc in points:
            argv = [
                x
                for k, v in flags.items()
                for x in ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v)))
            ]
            argv += server_only
            predicted = evaluate(
                flags,
                SimWorkload(
                    prompts=prompts, max_tokens=max_tokens, concurrency=conc, warmup_s=warmup, measure_s=window
                ),
                model=model,
                gpu="b200",
                seed=1,
                output_mean=output_mean,
            ).output_tok_s
            if "--sim-speedup" in server_only:
                predicted *= float(server_only[server_only.index("--sim-speedup") + 1])
            argv += ["--sim-output-mean", str(output_mean)]
            proc, url = start_server(model, argv, str(Path(tmp) / "devices"), server_core)
            try:
                before = httpx.get(f"{url}/server_info").json()["sim_pace"]
                cpu0 = _cpu(proc.pid)
                measured = asyncio.run(replay(url, prompts, conc, max_tokens, warmup, window))
                cpu = (_cpu(proc.pid) - cpu0) / (warmup + window)
                pace = httpx.get(f"{url}/server_info").json()["sim_pace"]
            finally:
                proc.kill()
                proc.wait()
            err = measured / predicted - 1 if predicted else float("nan")
            ok = abs(err) <= 0.02
            best = max(best, predicted) if ok else best
            modelled = pace["modelled_s"] - before["modelled_s"]
            lag = (pace["lag_s"] - before["lag_s"]) / modelled if modelled > 0 else 0.0
            accepted = max(accepted, predicted) if lag <= LAG_LIMIT else accepted
            print(
                f"  {label:<22} modelled {predicted:>9,.0f} tok/s  measured {measured:>9,.0f} tok/s  "
                f"error {err:+6.1%}  server CPU {cpu:4.0%} ({measured / max(cpu, 1e-9):>7,.0f} tok per CPU-s)  "
                f"step lateness mean "
                f"{1e3 * pace['late_s_sum'] / max(1, pace['steps']):5.1f} ms max {1e3 * pace['late_s_max']:6.1f} ms  "
                f"lag {lag:5.1%} ({'accepted' if lag <= LAG_LIMIT else 'REFUSED'})  {'ok' if ok else 'LAGS'}"
            )
        print(f"  highest modelled tok/s paced within 2 %: {best:,.0f}")
        print(
            f"  lag detector threshold: {LAG_LIMIT:.0%} of the window; highest modelled tok/s it accepts: "
            f"{accepted:,.0f} (a trial above it is re-measured with --stream-interval 16, then invalid_measurement)"
        )
        print(
            "  (tok per CPU-s = delivered tok/s per second of server CPU: the one-core ceiling when the server is "
            "starved by other load, as the lateness columns show)"
        )


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def evaluate_speed() -> None:
    print("(b) evaluate(): simulated seconds per CPU second (hand-tuned seed config, R=40)")
    mtp = {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
    }
    cfg = {
        **mtp,
        "max_mamba_cache_size": 200,
        "mamba_full_memory_ratio": 0.6,
        "mem_fraction_static": 0.93,
        "max_running_requests": 64,
    }
    work = SimWorkload(prompts=_seed_prompts(), max_tokens=4096, warmup_s=60, measure_s=600)
    ev = evaluate(cfg, work)
    print(
        f"  R={ev.max_running_requests}, {ev.output_tok_s:,.0f} tok/s, {ev.sim_s:,.0f} simulated s in "
        f"{ev.cpu_s:.2f} CPU s = {ev.sim_s / max(ev.cpu_s, 1e-9):,.0f} simulated s per CPU s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pacing points")
    opts = parser.parse_args()
    evaluate_speed()
    pacing(opts.quick)


if __name__ == "__main__":
    main()
