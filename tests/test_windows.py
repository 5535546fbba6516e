"""More windows in the same launch (``harness.windows``): windows 2.. continue the first window's closed loop, so
the warm-up is paid once; fresh pass markers never repeat in the launch; an early stop in a later window reports."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from test_workload import FakeSSE, sse_server, write_jsonl  # noqa: F401  (the fixture is used by name)

from autotune.config import Timeouts
from autotune.harness.steps import Launch
from autotune.harness.windows import WindowsStep
from autotune.harness.workload import CUT, PromptSample, ReplayRecords, WorkloadSpec, replay

pytestmark = pytest.mark.timeout(60)
WARMUP_S, MEASURE_S = 0.4, 0.4
# Streams of three lengths (the fake server sends 3 tokens per 10 ms: 90 tokens take 0.3 s, the rows' own caps
# 0.24 and 0.18 s), none a divisor of the window: the two streams do not finish in step on a window's edge, so one
# is in flight across it even when a loaded host sends the next request late, and each window still sends some.
MAX_TOKENS = 90


class Server:
    """The running server as a follow-up step sees it: one base URL, alive throughout."""

    def __init__(self, url: str):
        self.base_url, self.alive = url, True


def _launch(tmp_path: Path, sample: PromptSample, phases: list[str], later: list[ReplayRecords]) -> Launch:
    spec = WorkloadSpec(
        prompts=tmp_path / "p.jsonl", concurrency=2, max_tokens=MAX_TOKENS, warmup_s=WARMUP_S, measure_s=MEASURE_S
    )
    return Launch(
        engine=None,
        workload=spec,
        sample=sample,
        trial_dir=tmp_path,  # type: ignore[arg-type]
        timeouts=Timeouts(),
        phase=lambda name, info: phases.append(name),
        stop_event=None,
        windows=3,
        later=later,
    )


def _sample(tmp_path: Path) -> PromptSample:
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "alpha"}, {"prompt": "beta", "max_tokens": 72}, {"prompt": "gamma", "max_tokens": 54}],
    )
    return PromptSample.load(prompts, 3)


def _loop(url: str, sample: PromptSample, **kw) -> ReplayRecords:
    """Three windows of one closed loop: a warm-up and window of fixed lengths, then two windows of the same."""
    return asyncio.run(
        replay(
            url, sample, concurrency=2, max_tokens=MAX_TOKENS, warmup_s=WARMUP_S, measure_s=MEASURE_S, windows=3, **kw
        )
    )


def _sent_text(body: dict) -> str:
    return body.get("text") or json.dumps(body.get("messages"))


def test_later_windows_continue_the_loop_without_a_warmup_of_their_own(tmp_path, sse_server):  # noqa: F811
    fake, url = sse_server
    first = _loop(url, _sample(tmp_path))
    windows = [first, *first.later]
    assert len(windows) == 3 and all(w.settling is not None and w.stopped_early is None for w in windows)
    # each window opens where the one before closed: one warm-up (the first's), then three windows back to back
    assert first.settling.warmup_slices * first.settling.slice_s == pytest.approx(WARMUP_S)
    for before, after in zip(windows, windows[1:], strict=False):
        assert after.window[0] == pytest.approx(before.window[1])
        assert after.settling.warmup_slices == before.settling.warmup_slices + before.settling.window_slices
        assert after.window[1] - after.window[0] == pytest.approx(MEASURE_S)
    assert windows[-1].window[1] == pytest.approx(WARMUP_S + 3 * MEASURE_S)
    # streams stay in flight across a boundary: a request sent in one window sends tokens in the next
    for before, after in zip(windows, windows[1:], strict=False):
        edge = after.window[0]
        crossing = [r for r in after.requests if r.sent < edge and any(t >= edge for t, _ in r.chunks)]
        assert crossing and all(r in before.requests for r in crossing)
    # only the loop's end closes streams: nothing was cut at an inner boundary, and nothing is left open
    cut = [r for w in windows for r in w.requests if r.finish_reason == CUT]
    assert all(r.ended is not None for w in windows for r in w.requests)
    assert cut and all(r.ended >= windows[-1].window[1] for r in cut)
    # each window's figures are its own: every window measured tokens, and a window holds only what it saw
    assert all(sum(n for r in w.requests for t, n in r.chunks if w.window[0] <= t < w.window[1]) for w in windows)
    assert all(r.ended >= w.window[0] for w in first.later for r in w.requests)
    # a fresh loop never sends a prompt twice: one request per (row, pass), and so the server saw each text once
    keys = {(r.row, r.pass_no): r.sent for w in windows for r in w.requests}
    assert len(keys) == len({id(r) for w in windows for r in w.requests})
    sent = [_sent_text(b) for b in fake.requests]
    assert len(sent) == len(set(sent)) and any(s.startswith("[pass 1]\n") for s in sent)


def test_the_step_files_the_loops_later_windows(tmp_path, sse_server):  # noqa: F811
    _, url = sse_server
    sample = _sample(tmp_path)
    first = _loop(url, sample)
    phases: list[str] = []
    fields = WindowsStep(count=2, span=2)(Server(url), _launch(tmp_path, sample, phases, first.later), {"status": "ok"})
    windows = list(fields.windows or ())
    assert [w.index for w in windows] == [2, 3] and phases == []  # the loop showed them as it reached them
    assert all(w.ok and w.output_tok_s > 0 for w in windows)
    assert all(w.tok_s_per_gpu == pytest.approx(w.output_tok_s / 2) for w in windows)
    assert all(w.window_s == pytest.approx(MEASURE_S) for w in windows)
    first_sent = max(r.pass_no for r in first.requests)
    assert windows[0].first_pass >= first_sent and windows[1].first_pass >= windows[0].last_pass
    assert all(w.settled is not None and w.measurement["settling"]["tok_s"] for w in windows)
    assert WindowsStep(count=2).later_windows == 2 and WindowsStep(count=0).later_windows == 0


def test_an_interruption_in_window_two_ends_the_loop_and_reports(tmp_path, sse_server):  # noqa: F811
    fake, url = sse_server
    sample = _sample(tmp_path)
    stop = threading.Event()
    first = _loop(
        url,
        sample,
        progress_interval_s=0.05,
        on_progress=lambda tick: stop.set() if tick.window == 2 else None,
        should_stop=lambda: "interrupted" if stop.is_set() else None,
    )
    assert first.settling is not None and first.stopped_early is None  # the first window measured in full
    (second,) = first.later
    assert second.stopped_early == "interrupted" and second.settling is None
    assert all(r.ended is not None for r in second.requests)  # its streams were closed too
    phases: list[str] = []
    fields = WindowsStep(count=2)(Server(url), _launch(tmp_path, sample, phases, first.later), {"status": "ok"})
    assert fields.status == "interrupted" and fields.windows == ()


def test_an_untrusted_first_window_ends_the_loop(tmp_path, sse_server):  # noqa: F811
    _, url = sse_server
    seen: list[ReplayRecords] = []
    first = _loop(url, _sample(tmp_path), go_on=lambda records: seen.append(records) or False)
    assert seen == [first] and first.later == [] and first.settling is not None


def test_no_windows_after_a_failed_window():
    step = WindowsStep(count=2)
    assert not step.runs_after({"status": "runtime_oom"}, Server("http://127.0.0.1:1"))
    assert not WindowsStep(count=0).runs_after({"status": "ok"}, Server("http://127.0.0.1:1"))
