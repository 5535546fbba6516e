"""A job's client in miniature: a closed loop of N requests in flight, each replaced as soon as it ends, sent to
one URL (the fleet's router) or round-robin over the servers' URLs (what a job without a router does).

Requests rotate over SGLang's ``/generate`` and OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streamed
and not, so the one-URL client is the job's real client shape. One JSON line per finished request (start, end,
endpoint, ok, status or error) goes to ``--out`` as it ends; SIGTERM (or ``--seconds``) stops issuing new requests and
lets those in flight finish. A slot whose request failed pauses half a second before the next (a client that
retried at once would count thousands of failures per second against a stopped server). Used by
``rollout_under_load.py`` and the router tests.

    python benchmarks/closed_loop.py --url http://127.0.0.1:30003 --concurrency 64 --out load.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx

FAILED_PAUSE_S = 0.5  # a slot whose request failed waits this long before its next one, as a job's client backs off
KINDS = [
    ("generate", False),
    ("generate", True),
    ("completions", False),
    ("completions", True),
    ("chat", False),
    ("chat", True),
]


def request(kind: str, stream: bool, i: int, max_tokens: int, model: str) -> tuple[str, dict[str, Any]]:
    prompt = f"Write item {i} of a numbered list about GPUs."
    if kind == "generate":
        return "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens}, "stream": stream}
    if kind == "completions":
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return "/v1/chat/completions", {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def answered(kind: str, stream: bool, text: str) -> bool:
    """The body holds generated text in the endpoint's own shape (a stream: at least one data chunk)."""
    if stream:
        chunks = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
        return any(c and c != "[DONE]" for c in chunks)
    try:
        body = json.loads(text)
    except ValueError:
        return False
    if kind == "generate":
        return bool(body.get("text"))
    choice = (body.get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("message") or {}).get("content"))


async def one(client: httpx.AsyncClient, url: str, slot: int, i: int, max_tokens: int, model: str) -> dict[str, Any]:
    kind, stream = KINDS[(slot + i) % len(KINDS)]
    path, body = request(kind, stream, i, max_tokens, model)
    start = time.time()
    record: dict[str, Any] = {"start": start, "endpoint": f"{path}{' stream' if stream else ''}", "url": url}
    try:
        async with client.stream("POST", url + path, json=body) as response:
            text = (await response.aread()).decode(errors="replace")
        record.update(status=response.status_code, ok=response.status_code == 200 and answered(kind, stream, text))
        if not record["ok"]:
            record["error"] = text[:200]
    except httpx.HTTPError as exc:
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    record["end"] = time.time()
    return record


async def run(
    urls: list[str],
    *,
    concurrency: int,
    out: Path,
    max_tokens: int = 32,
    seconds: float | None = None,
    model: str = "qwen3.6-27b",
    signals: bool = False,
) -> list[dict[str, Any]]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        loop.add_signal_handler(sig, stop.set)
    if seconds is not None:
        loop.call_later(seconds, stop.set)
    records: list[dict[str, Any]] = []
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    with open(out, "w") as fh:
        async with httpx.AsyncClient(timeout=120.0, trust_env=False, limits=limits) as client:

            async def slot(n: int) -> None:
                while not stop.is_set():
                    i = next(counter)
                    record = await one(client, urls[i % len(urls)], n, i, max_tokens, model)
                    records.append(record)
                    fh.write(json.dumps(record) + "\n")
                    fh.flush()
                    if not record["ok"]:
                        await asyncio.sleep(FAILED_PAUSE_S)

            await asyncio.gather(*(slot(n) for n in range(concurrency)))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="the router's URL, or each server's")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = asyncio.run(
        run(
            args.url,
            concurrency=args.concurrency,
            out=args.out,
            max_tokens=args.max_tokens,
            seconds=args.seconds,
            signals=True,
        )
    )
    failed = sum(not r["ok"] for r in records)
    print(f"{len(records)} requests, {failed} failed")


if __name__ == "__main__":
    main()
