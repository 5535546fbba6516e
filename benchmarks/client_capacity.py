"""How much the harness itself costs: the replay client's absorbed token rate, and per-trial overhead.

1. Client capacity: the replay client on one core against a local SSE server that streams SGLang-shaped
   ``/generate`` chunks as fast as the socket takes them (server in another process). Target ≥ 50k tokens/s.
2. Harness overhead: wall time of ``run_trial`` on the simulator beyond server startup + warm-up + window
   (flag check, capacity read, teardown, release waits). Target ≤ 2 s.

MTP speculative decoding streams ~3 tokens per chunk (one chunk per verify step), so the 3-token figure is
the one that matters for this workload. On a busy machine the absorbed rate is capped by the server's share
of the CPU; tokens per client CPU-second is the client's own ceiling.

Run: ``python benchmarks/client_capacity.py [--seconds 3] [--trials 3]``. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _sse_body(max_tokens: int, per_chunk: int) -> bytes:
    """The whole chunked-encoded SSE body of one request (cumulative completion_tokens, like SGLang)."""
    parts, done = [], 0
    while done < max_tokens:
        done = min(max_tokens, done + per_chunk)
        finish = {"type": "length", "length": max_tokens} if done == max_tokens else None
        event = json.dumps({"text": "", "meta_info": {"completion_tokens": done, "finish_reason": finish}})
        parts.append(f"data: {event}\n\n".encode())
    parts.append(b"data: [DONE]\n\n")
    out = []
    for part in parts:
        out.append(f"{len(part):x}\r\n".encode() + part + b"\r\n")
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def _serve(sock: socket.socket, per_chunk: int) -> None:
    """A minimal HTTP/1.1 keep-alive server: answers every POST with a precomputed SSE stream."""
    os.sched_setaffinity(0, {os.cpu_count() - 1})
    cache: dict[int, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = json.loads(await reader.readexactly(length))
                n = body["sampling_params"]["max_new_tokens"]
                if n not in cache:
                    cache[n] = _sse_body(n, per_chunk)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                writer.write(cache[n])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def client_capacity(seconds: float, per_chunk: int, concurrency: int = 32) -> tuple[float, float, float]:
    """(tokens/s absorbed, client CPU share of one core, tokens per client CPU-second)."""
    from autotune.harness.workload import PromptSample, metrics_from_records, replay

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    proc = multiprocessing.get_context("fork").Process(target=_serve, args=(sock, per_chunk), daemon=True)
    proc.start()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(64)))
        sample = PromptSample.load(path, 64)
        os.sched_setaffinity(0, {0})  # the client gets one core
        cpu0 = time.process_time()
        records = asyncio.run(
            replay(
                f"http://127.0.0.1:{port}",
                sample,
                concurrency=concurrency,
                max_tokens=2048,
                warmup_s=0.5,
                measure_s=seconds,
            )
        )
        cpu = time.process_time() - cpu0
        os.sched_setaffinity(0, set(range(os.cpu_count())))
    proc.terminate()
    proc.join(5)
    sock.close()
    m = metrics_from_records(records)
    total = sum(r.tokens for r in records.requests)
    return m.output_tok_s, cpu / (seconds + 0.5), total / cpu if cpu else 0.0


def harness_overhead(trials: int) -> list[tuple[float, dict]]:
    from autotune.harness.engines import make_engine
    from autotune.harness.setup import TrialSetup
    from autotune.harness.trial import run_trial
    from autotune.harness.workload import WorkloadSpec

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AUTOTUNE_SIM_DEVICE_DIR"] = str(Path(tmp) / "devices")
        engine = make_engine("sim", model_path="qwen3.6-27b", sim_options={"startup_s": 0.3, "release_s": 0.3})
        spec = WorkloadSpec(
            prompts=REPO / "examples" / "prompts.jsonl", sample_size=100, warmup_s=1.0, measure_s=2.0, max_tokens=1024
        )
        for i in range(trials):
            t0 = time.monotonic()
            setup = TrialSetup(engine=engine, workload=spec, gpu_index=0, run_dir=Path(tmp) / "runs")
            result = run_trial(setup, {"max_running_requests": 16}, trial_dir=Path(tmp) / f"t{i}")
            wall = time.monotonic() - t0
            d = result.durations_s
            overhead = wall - d.get("startup", 0) - d.get("warmup", 0) - d.get("measure", 0)
            out.append((overhead, {"status": result.status, "wall_s": round(wall, 2), **d}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    print("replay client capacity (one core, local SSE server, 32 streams):")
    for per_chunk in (1, 3):
        tok_s, cpu_share, per_cpu_s = client_capacity(args.seconds, per_chunk)
        print(
            f"  {per_chunk} token(s)/chunk: {tok_s:,.0f} tokens/s absorbed ({tok_s / per_chunk:,.0f} chunks/s) using "
            f"{cpu_share:.0%} of one core; {per_cpu_s:,.0f} tokens per client CPU-second "
            f"(= the rate one saturated core absorbs; target >= 50,000 tokens/s)"
        )
    print("harness overhead per trial (beyond startup + warm-up + window; sim, 1 s + 2 s windows):")
    for overhead, detail in harness_overhead(args.trials):
        print(f"  {overhead:.2f} s  {detail}  (target <= 2 s)")


if __name__ == "__main__":
    main()
