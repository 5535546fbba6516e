"""Prompt sample loading, the streaming replay client (against a fake SSE server), and window metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from autotune.errors import WorkloadError
from autotune.harness.workload import (
    CUT,
    PromptSample,
    ReplayProgress,
    ReplayRecords,
    RequestRecord,
    WorkloadSpec,
    metrics_from_records,
    repeated_prompt_share,
    replay,
)
from autotune.prompts import PromptRow

pytestmark = pytest.mark.timeout(60)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
PROMPT_TOKENS = 7  # what the fake server reports for every prompt, as SGLang does in meta_info / usage


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- prompt sample -----------------------------------------------------------------------------------------
def test_sample_is_seeded_and_identical_across_loads(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": f"p{i}"} for i in range(50)] + [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}],
    )
    a, b = PromptSample.load(path, 20, seed=3), PromptSample.load(path, 20, seed=3)
    assert a.rows == b.rows and len(a) == 20
    assert PromptSample.load(path, 20, seed=4).rows != a.rows
    whole = PromptSample.load(path, 1000, seed=0)
    assert len(whole) == 51
    chat = next(r for r in whole.rows if r.messages)
    assert chat.max_tokens == 7
    assert chat.as_text() == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"text": "x"}', "neither"),
        ('["x"]', "JSON list, not an object"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": 5}', '"prompt" must be a string'),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, line, match):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, line])
    with pytest.raises(WorkloadError, match=match) as info:
        PromptSample.load(path, 5)
    assert str(info.value).startswith(f"{path}:2: ")


def test_missing_file_and_bad_spec(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        PromptSample.load(tmp_path / "none.jsonl", 5)
    with pytest.raises(ValueError, match="endpoint"):  # the study's record: a file names the key, measure the option
        WorkloadSpec(prompts=tmp_path, endpoint="grpc")
    with pytest.raises(ValueError, match="repeats"):
        WorkloadSpec(prompts=tmp_path, repeats="twice")


def test_shipped_example_sample_is_valid_and_mixed():
    sample = PromptSample.load(EXAMPLES, 10_000)
    assert 300 <= len(sample) <= 600
    assert any(r.messages for r in sample.rows) and any(r.prompt for r in sample.rows)
    lengths = [len(r.as_text()) / 4 for r in sample.rows]  # ~4 characters per token
    assert min(lengths) >= 60 and max(lengths) <= 800
    assert EXAMPLES.stat().st_size < 1_000_000


# -- fake SSE server ---------------------------------------------------------------------------------------
class FakeSSE:
    """SGLang-shaped streams: ``per_chunk`` tokens every ``dt`` s; counts clients that went away."""

    def __init__(self, per_chunk: int = 3, dt: float = 0.01, accept: float = 2.5):
        self.per_chunk, self.dt, self.accept = per_chunk, dt, accept
        self.disconnects = 0
        self.requests: list[dict] = []

    def app(self) -> Starlette:
        async def generate(request: Request):
            body = await request.json()
            self.requests.append(body)
            if body.get("text") == "bad":
                return JSONResponse({"error": "bad request"}, status_code=400)
            n = body["sampling_params"]["max_new_tokens"]
            return StreamingResponse(self._native(n), media_type="text/event-stream")

        async def openai(request: Request):
            body = await request.json()
            self.requests.append(body)
            return StreamingResponse(self._openai(body["max_tokens"]), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/generate", generate, methods=["POST"]),
                Route("/v1/completions", openai, methods=["POST"]),
                Route("/v1/chat/completions", openai, methods=["POST"]),
            ]
        )

    async def _native(self, n: int):
        done = 0
        try:
            while done < n:
                await asyncio.sleep(self.dt)
                done = min(n, done + self.per_chunk)
                meta = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": done, "finish_reason": None}
                if done == n:
                    meta.update(finish_reason={"type": "length", "length": n}, spec_accept_length=self.accept)
                yield f"data: {json.dumps({'text': 'x' * done, 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise

    async def _openai(self, n: int):
        done = 0
        try:
            while done < n:
                await asyncio.sleep(self.dt)
                done = min(n, done + self.per_chunk)
                choice = {
                    "index": 0,
                    "text": "y",
                    "delta": {"content": "y"},
                    "finish_reason": "length" if done == n else None,
                }
                usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": done}
                yield f"data: {json.dumps({'choices': [choice], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise


@pytest.fixture
def sse_server():
    fake = FakeSSE()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def _sample(tmp_path, rows) -> PromptSample:
    return PromptSample.load(write_jsonl(tmp_path / "p.jsonl", rows), 100)


def test_replay_counts_server_tokens_and_closes_streams(tmp_path, sse_server):
    fake, url = sse_server
    sample = _sample(
        tmp_path, [{"prompt": "a"}, {"prompt": "b", "max_tokens": 9}, {"messages": [{"role": "user", "content": "c"}]}]
    )
    ticks: list[ReplayProgress] = []
    records = asyncio.run(
        replay(
            url,
            sample,
            concurrency=4,
            max_tokens=30,
            warmup_s=0.3,
            measure_s=1.0,
            on_progress=ticks.append,
            progress_interval_s=0.1,
        )
    )
    assert {t.phase for t in ticks} == {"warmup", "measuring"} and {t.window for t in ticks} == {1}
    finished = [r for r in records.requests if r.finish_reason == "length"]
    assert finished and all(r.tokens in (9, 30) for r in finished)  # server counts, capped by the row's max_tokens
    assert all(r.prompt_tokens == PROMPT_TOKENS for r in finished)  # the server's count, for the edge starts
    assert all(n in (3, 0) or n == 30 % 3 or n == 9 % 3 for r in finished for _, n in r.chunks)
    cut = [r for r in records.requests if r.finish_reason == CUT]
    assert 1 <= len(cut) <= 4 and all(r.error is None for r in cut)
    m = metrics_from_records(records)
    assert m.errors == 0 and m.completed > 0 and m.output_tokens > 0
    assert m.accept_length == pytest.approx(2.5)
    assert m.output_tok_s == pytest.approx(m.output_tokens / 1.0)
    assert m.ttft_ms.p50 is not None and m.itl_ms.p50 is not None
    assert fake.requests[0]["stream"] is True and fake.requests[0]["sampling_params"]["ignore_eos"] is False


def test_window_end_closes_every_open_stream(tmp_path, sse_server):
    fake, url = sse_server
    records = asyncio.run(
        replay(
            url, _sample(tmp_path, [{"prompt": "a"}]), concurrency=4, max_tokens=100_000, warmup_s=0.1, measure_s=0.4
        )
    )
    assert len(records.requests) == 4 and all(r.finish_reason == CUT for r in records.requests)
    deadline = time.monotonic() + 5
    while fake.disconnects < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.disconnects == 4  # the server saw every client go away (SGLang aborts those requests)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_replay_openai_endpoints_use_usage_counts(tmp_path, sse_server, endpoint):
    fake, url = sse_server
    sample = _sample(tmp_path, [{"prompt": "a"}, {"messages": [{"role": "user", "content": "c"}]}])
    records = asyncio.run(
        replay(
            url, sample, concurrency=2, max_tokens=12, warmup_s=0.0, measure_s=1.0, endpoint=endpoint, ignore_eos=True
        )
    )
    done = [r for r in records.requests if r.finish_reason == "length"]
    assert done and all(r.tokens == 12 for r in done)
    assert all(r.prompt_tokens == PROMPT_TOKENS for r in done)
    body = fake.requests[0]
    assert body["ignore_eos"] is True and body["stream_options"]["continuous_usage_stats"] is True
    assert ("messages" in body) == (endpoint == "chat")


def test_pass_marker_leads_the_prompt_on_later_walks():
    text_row, chat_row = (
        PromptRow(1, prompt="alpha"),
        PromptRow(2, messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "beta"})),
    )
    assert text_row.as_text(0) == "alpha" and text_row.as_text(2) == "[pass 2]\nalpha"
    assert chat_row.as_text(1).startswith("[pass 1]\n<|im_start|>system\nbe brief")
    assert chat_row.as_messages(0)[0]["content"] == "be brief"
    assert (
        chat_row.as_messages(3)[0]["content"] == "[pass 3]\nbe brief"
        and chat_row.as_messages(3)[1]["content"] == "beta"
    )
    assert chat_row.messages[0]["content"] == "be brief"  # the row itself is untouched
    parts = PromptRow(3, messages=({"role": "user", "content": [{"type": "text", "text": "gamma"}]},))
    assert parts.as_messages(1)[0]["content"] == [
        {"type": "text", "text": "[pass 1]\n"},
        {"type": "text", "text": "gamma"},
    ]


@pytest.mark.parametrize("endpoint", ["generate", "completions", "chat"])
def test_fresh_replay_marks_each_walk_and_verbatim_resends(tmp_path, sse_server, endpoint):
    """The sample comes round many times in the window; a fresh replay sends each later walk's prompts with that
    walk's marker (nothing cached on an earlier walk matches past it), a verbatim one re-sends the text."""
    fake, url = sse_server
    sample = _sample(
        tmp_path,
        [
            {"prompt": "alpha"},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "beta"}]},
        ],
    )
    rows = {row.line: row for row in sample.rows}
    key = {"generate": "text", "completions": "prompt"}.get(endpoint)

    def body_prompt(prompt: object) -> str:
        return prompt if isinstance(prompt, str) else json.dumps(prompt)

    def replayed(mode: str, measure_s: float = 0.6) -> tuple[list[str], list[str], ReplayRecords]:
        """What went out, what the records say should have, and the records."""
        fake.requests.clear()
        records = asyncio.run(
            replay(
                url,
                sample,
                concurrency=2,
                max_tokens=3,
                warmup_s=0.2,
                measure_s=measure_s,
                endpoint=endpoint,
                repeats=mode,
            )
        )
        time.sleep(0.3)  # a body the client sent just before closing may still be read by the server
        sent = [body_prompt(b[key] if key else b["messages"]) for b in fake.requests]
        expected = [
            body_prompt(rows[r.row].as_text(r.pass_no) if key else rows[r.row].as_messages(r.pass_no))
            for r in records.requests
        ]
        return sent, expected, records

    sent, expected, records = replayed("fresh")
    assert len(sent) >= 6 and max(r.pass_no for r in records.requests) >= 2  # three walks at least
    assert len(set(sent)) == len(sent)  # no prompt text went out twice
    assert set(sent) <= set(expected) and len(expected) - len(sent) <= 2  # a request cut at the end never left
    assert [r.pass_no for r in records.requests][:4] == [0, 0, 1, 1]
    assert repeated_prompt_share(records) == 0.0
    sent, expected, records = replayed("verbatim", measure_s=2.0)  # the share needs > 4 requests in the window
    assert len(set(sent)) == 2 and set(sent) == set(expected) and {r.pass_no for r in records.requests} == {0}
    lo, hi = records.window
    in_window = sum(lo <= r.sent < hi for r in records.requests)
    assert repeated_prompt_share(records) >= 1 - 2 / max(in_window, 1)  # all but each prompt's first sending repeat it
    with pytest.raises(WorkloadError, match="repeats"):
        asyncio.run(replay(url, sample, concurrency=1, max_tokens=3, warmup_s=0, measure_s=0.1, repeats="twice"))


def test_failed_requests_are_counted_not_dropped(tmp_path, sse_server):
    _, url = sse_server
    sample = _sample(tmp_path, [{"prompt": "bad"}, {"prompt": "fine"}])
    records = asyncio.run(replay(url, sample, concurrency=2, max_tokens=6, warmup_s=0.0, measure_s=1.0))
    errors = [r for r in records.requests if r.error]
    assert errors and all(r.error.startswith("HTTP 400") for r in errors)
    assert metrics_from_records(records).errors == len(errors)


def test_replay_stops_early_when_asked(tmp_path, sse_server):
    _, url = sse_server
    t0 = time.monotonic()
    records = asyncio.run(
        replay(
            url,
            _sample(tmp_path, [{"prompt": "a"}]),
            concurrency=2,
            max_tokens=1000,
            warmup_s=5,
            measure_s=30,
            should_stop=lambda: "server exited" if time.monotonic() - t0 > 0.3 else None,
        )
    )
    assert records.stopped_early == "server exited"
    assert time.monotonic() - t0 < 5


def test_replay_against_a_dead_port_records_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    records = asyncio.run(
        replay(
            f"http://127.0.0.1:{port}",
            _sample(tmp_path, [{"prompt": "a"}]),
            concurrency=2,
            max_tokens=5,
            warmup_s=0,
            measure_s=0.3,
        )
    )
    assert sum(1 for r in records.requests if r.error) >= 2
    assert all(r.error or r.finish_reason == CUT for r in records.requests)  # a connect still pending at the end is cut
    assert len(records.requests) < 40  # errors back off instead of spinning


# -- metrics on exact records ------------------------------------------------------------------------------
def test_metrics_count_only_the_window():
    a = RequestRecord(
        row=1, sent=0.0, chunks=[(0.5, 3), (1.5, 3), (2.5, 3)], finish_reason="length", ended=2.5, accept_length=3.0
    )
    b = RequestRecord(
        row=2, sent=1.0, chunks=[(1.2, 2), (1.4, 2)], finish_reason="length", ended=1.4, accept_length=2.0
    )
    c = RequestRecord(row=3, sent=1.8, chunks=[(2.9, 4), (3.5, 4)], finish_reason=CUT, ended=3.5)
    d = RequestRecord(row=4, sent=1.1, error="HTTP 500: boom", ended=1.2)
    records = ReplayRecords([a, b, c, d], (1.0, 3.0), 4, "generate")
    m = metrics_from_records(records)
    assert m.output_tokens == 3 + 2 + 2 + 3 + 4  # tokens arriving in [1, 3); the ramp (0.5) and tail (3.5) excluded
    assert m.output_tok_s == pytest.approx(14 / 2.0)
    assert m.completed == 2 and m.request_s == pytest.approx(1.0)  # a and b end in the window; c was cut
    assert m.errors == 1
    assert m.ttft_ms.p50 == pytest.approx(((1.2 - 1.0) * 1000 + (2.9 - 1.8) * 1000) / 2)  # b and c start in-window
    assert m.e2e_ms.mean == pytest.approx((2500 + 400) / 2)
    assert m.accept_length == pytest.approx((3.0 * 9 + 2.0 * 4) / 13, abs=1e-3)
    assert m.itl_ms.p50 == pytest.approx(1000 / 3, rel=1e-3)  # a: 1 s gaps over 3 tokens dominate the list


def test_records_round_trip_through_jsonl(tmp_path):
    rec = RequestRecord(row=7, sent=0.123456, chunks=[(0.5, 3), (0.75, 2)], finish_reason="length", ended=0.75)
    ReplayRecords([rec], (0.0, 1.0), 1, "generate").write_jsonl(tmp_path / "r.jsonl")
    (back,) = ReplayRecords.read_jsonl(tmp_path / "r.jsonl")
    assert back.chunks == rec.chunks and back.sent == pytest.approx(0.1235) and back.tokens == 5
