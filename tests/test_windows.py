"""More windows in the same launch (``harness.windows``): fresh pass markers per window, one server for all."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_workload import FakeSSE, sse_server, write_jsonl  # noqa: F401  (the fixture is used by name)

from autotune.config import Timeouts
from autotune.harness.steps import Launch
from autotune.harness.windows import WindowsStep, passes_sent
from autotune.harness.workload import PromptSample, ReplayRecords, WorkloadSpec, replay

pytestmark = pytest.mark.timeout(60)


class Server:
    """The running server as a follow-up step sees it: one base URL, alive throughout."""

    def __init__(self, url: str):
        self.base_url, self.alive = url, True


def _launch(tmp_path: Path, spec: WorkloadSpec, sample: PromptSample, phases: list[str]) -> Launch:
    return Launch(engine=None, workload=spec, sample=sample, trial_dir=tmp_path,  # type: ignore[arg-type]
                  timeouts=Timeouts(), phase=lambda name, info: phases.append(name), stop_event=None)


def _sent_text(body: dict) -> str:
    return body.get("text") or json.dumps(body.get("messages"))


def test_each_window_sends_its_own_pass_markers_in_the_one_launch(tmp_path, sse_server):  # noqa: F811
    fake, url = sse_server
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "alpha"}, {"prompt": "beta"}, {"prompt": "gamma"}])
    sample = PromptSample.load(prompts, 3)
    spec = WorkloadSpec(prompts=prompts, concurrency=2, max_tokens=6, warmup_s=0.1, measure_s=0.4,
                        warmup_max_s=0.1, measure_max_s=0.4)
    # the launch's first window, as run_trial leaves it: its records in records.jsonl
    first = asyncio.run(replay(url, sample, concurrency=2, max_tokens=6, warmup_s=0.1, measure_s=0.4))
    first.write_jsonl(tmp_path / "records.jsonl")
    first_last = max(r.pass_no for r in first.requests)
    assert first_last >= 1 and passes_sent(tmp_path / "records.jsonl") == first_last  # one pass or more: load-free
    phases: list[str] = []
    fields = WindowsStep(count=2, span=2)(Server(url), _launch(tmp_path, spec, sample, phases), {"status": "ok"})

    windows = list(fields.windows or ())
    assert [w.index for w in windows] == [2, 3] and phases == ["window 2 of 3", "window 3 of 3"]
    assert all(w.ok and w.output_tok_s > 0 for w in windows)
    assert all(w.tok_s_per_gpu == pytest.approx(w.output_tok_s / 2) for w in windows)
    assert windows[0].first_pass == first_last + 1 and windows[1].first_pass == windows[0].last_pass + 1
    # the records say so too: no pass number is used by two windows of the launch
    passes = [{r.pass_no for r in ReplayRecords.read_jsonl(tmp_path / name)}
              for name in ("records.jsonl", "records-window-2.jsonl", "records-window-3.jsonl")]
    assert not (passes[0] & passes[1]) and not (passes[1] & passes[2]) and not (passes[0] & passes[2])
    assert min(passes[1]) == first_last + 1  # the second window's first walk is marked too
    # and what the one server received: no prompt text twice in the launch (nothing an earlier window cached)
    sent = [_sent_text(b) for b in fake.requests]
    assert len(sent) == len(set(sent)) and any(s.startswith(f"[pass {first_last + 1}]\n") for s in sent)
    assert all(w.settled is not None and w.measurement["settling"]["tok_s"] for w in windows)


def test_no_windows_after_a_failed_window():
    step = WindowsStep(count=2)
    assert not step.runs_after({"status": "runtime_oom"}, Server("http://127.0.0.1:1"))
    assert not WindowsStep(count=0).runs_after({"status": "ok"}, Server("http://127.0.0.1:1"))
