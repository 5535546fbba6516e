"""Failure causes named for what they are: a live server slower than the window is ``too_slow`` (with its progress
as evidence), refused requests are counted and named, and a trial's failed write is one ``DiskError`` naming the
path and the free space, raised after the server is stopped."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import psutil
import pytest

from autotune.cli.measure import MEASURE_OPTIONS
from autotune.config import Timeouts
from autotune.errors import DiskError
from autotune.harness.engines import make_engine
from autotune.harness.files import writing
from autotune.harness.outcome import no_tokens, rejections
from autotune.harness.setup import TrialSetup
from autotune.harness.trial import run_trial
from autotune.harness.workload import ReplayRecords, RequestRecord, SimPace, WorkloadSpec
from autotune.results import TOO_SLOW, ServerProgress, TrialResult

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
GPU = 5  # a simulated device index only these tests use
PREFILL = (
    "Prefill batch, #new-seq: 3, #new-token: 2048, #cached-token: 0, full token usage: 0.01, #running-req: 0, "
    "#queue-req: 5, #pending-token: 0, cuda graph: False, input throughput (token/s): 10.00\n"
)


def _requests(errors: list[str | None]) -> list[RequestRecord]:
    return [RequestRecord(row=i, sent=0.1 * i, error=e) for i, e in enumerate(errors)]


def test_refused_requests_are_counted_by_kind_and_named_when_they_dominate():
    reqs = _requests(
        [
            "HTTP 400: The input (9000 tokens) is longer than the model's context length (8192 tokens).",
            "HTTP 413: body too large",
            "HTTP 400: again",
            "ReadTimeout",
            None,
        ]
    )
    got = rejections(reqs)
    assert got is not None and got.count == 3 and got.of == 5
    assert got.kinds == {"HTTP 400": 2, "HTTP 413": 1} and got.first is not None
    assert got.first.startswith("HTTP 400: The input")
    status, reason, figures = no_tokens(reqs, PREFILL, [], window_s=1.0)
    assert status == "crash" and "the server rejected 3 of the 5 requests sent (2 × HTTP 400, 1 × HTTP 413" in reason
    assert figures.rejected == got
    # stored as the dict it replaced: the same keys, the kinds most first
    assert figures.to_dict()["rejected"] == {
        "count": 3,
        "of": 5,
        "kinds": {"HTTP 400": 2, "HTTP 413": 1},
        "first": got.first,
    }
    assert rejections(_requests([None, "ReadTimeout"])) is None  # a client-side failure is not a refusal


def test_no_token_from_a_progressing_server_is_too_slow_with_its_evidence():
    probes = [SimPace(modelled_s=1.0, lag_s=0.0), SimPace(modelled_s=1.25, lag_s=0.0)]
    status, reason, figures = no_tokens(_requests([None] * 4), "startup line\n" + PREFILL * 2, probes, window_s=0.5)
    assert status == TOO_SLOW
    assert figures.progress == ServerProgress(prefill_batches=2, prefill_tokens=4096, sim_modelled_s=0.25)
    assert figures.to_dict()["progress"] == {"prefill_batches": 2, "prefill_tokens": 4096, "sim_modelled_s": 0.25}
    assert "2 prefill batches (4,096 new tokens)" in reason and "lengthen workload.measure_s" in reason
    assert "host is too slow" in reason
    spec = WorkloadSpec(prompts=PROMPTS).named_by(MEASURE_OPTIONS)  # `autotune measure` names its own options
    _, reason, _ = no_tokens(
        _requests([None] * 4), PREFILL, [], window_s=0.5, options=(spec.option("measure_s"), spec.option("warmup_s"))
    )
    assert "lengthen --window (and --warmup)" in reason and "workload." not in reason
    status, reason, _ = no_tokens(_requests([None, "ReadTimeout"]), "", [], window_s=0.5)
    assert status == "crash" and "showed no progress (ReadTimeout)" in reason  # nothing moved: not too_slow


def test_writing_turns_disk_errnos_into_one_line_and_leaves_the_rest(tmp_path):
    for code, words in ((errno.ENOSPC, "No space left"), (errno.EDQUOT, "quota"), (errno.EROFS, "read-only")):
        with pytest.raises(DiskError) as info, writing(tmp_path / "records.jsonl"):
            raise OSError(code, os.strerror(code))
        assert str(info.value).startswith(f"cannot write {tmp_path / 'records.jsonl'}: ")
        assert words.lower() in str(info.value).lower() and " free on its disk" in str(info.value)
        assert info.value.path == str(tmp_path / "records.jsonl") and info.value.free_bytes > 0
    with pytest.raises(PermissionError), writing(tmp_path / "x"):
        raise PermissionError(errno.EACCES, "Permission denied")


def _engine(options: dict | None = None):
    return make_engine(
        "sim",
        model_path="qwen3.6-27b",
        sim_gpu="b200",
        sim_options={"startup_s": 0.2, "release_s": 0.2, "warmup_s": 0.1, **(options or {})},
    )


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    return tmp_path


@pytest.mark.timeout(90)
def test_a_slow_but_alive_server_is_too_slow_not_crash(env):
    # ~100k-token prompts prefilled in 16k chunks on a clock paced at half real time (--sim-speedup 0.5): the server
    # works through the first chunks all window long, and no token can arrive in 0.5 s.
    prompts = env / "long.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"Document {i}: " + "lorem ipsum dolor sit amet " * 15000}) + "\n" for i in range(4)
        )
    )
    # Run as `autotune measure` runs it: the reason names measure's own options, not a study file's keys.
    work = WorkloadSpec(
        prompts=prompts,
        sample_size=4,
        warmup_s=0.2,
        measure_s=0.5,
        concurrency=2,
        max_tokens=64,
    ).named_by(MEASURE_OPTIONS)
    setup = TrialSetup(
        engine=_engine({"speedup": 0.5}),
        workload=work,
        gpu_index=GPU,
        run_dir=env / "runs",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    result = run_trial(setup, {}, trial_dir=env / "t")
    assert result.status == TOO_SLOW, (result.status, result.reason)
    assert result.measurement.progress.prefill_batches >= 1 and "lengthen --window (and --warmup)" in result.reason
    assert result.metrics is None and result.output_tok_s is None and not _children()  # no "0 tok/s"
    assert TrialResult.from_dict(result.to_dict()).status == TOO_SLOW


DRAIN_S = 5.0  # closing the streams and the window's last probe: generous, so a loaded host cannot fail the test


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_server_that_never_answers_is_too_slow_at_the_cap_plus_the_drain(env):
    # --sim-stall: once ready the server accepts every request and holds its stream open, never sending a token.
    work = WorkloadSpec(
        prompts=PROMPTS,
        sample_size=8,
        warmup_s=0.3,
        measure_s=0.5,
        warmup_max_s=0.6,
        measure_max_s=1.0,
        concurrency=4,
        max_tokens=64,
    )
    setup = TrialSetup(
        engine=_engine({"stall": True}),
        workload=work,
        gpu_index=GPU,
        run_dir=env / "runs",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    result = run_trial(setup, {}, trial_dir=env / "t")
    assert result.status == TOO_SLOW, (result.status, result.reason)
    assert "held 4 of the 4 sent open without answering" in result.reason and "workload.measure_s" in result.reason
    assert result.measurement.held_streams == 4 and result.metrics is None
    replayed = result.durations_s["warmup"] + result.durations_s["measure"]
    assert replayed <= work.warmup_max_s + work.measure_max_s + DRAIN_S  # ended at its caps, not the server's pace
    assert not _children()


@pytest.mark.timeout(90)
def test_a_full_disk_mid_trial_is_a_disk_error_after_the_server_stopped(env, monkeypatch):
    def full(self, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ReplayRecords, "write_jsonl", full)
    work = WorkloadSpec(prompts=PROMPTS, sample_size=8, warmup_s=0.2, measure_s=0.3, concurrency=4, max_tokens=64)
    with pytest.raises(DiskError) as info:
        run_trial(
            TrialSetup(
                engine=_engine(),
                workload=work,
                gpu_index=GPU,
                run_dir=env / "runs",
                timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
            ),
            {},
            trial_dir=env / "t",
        )
    assert f"cannot write {env / 't' / 'records.jsonl'}: No space left on device" in str(info.value)
    assert info.value.path == str(env / "t" / "records.jsonl")
    assert not _children()  # the server did not outlive the trial
    assert (env / "t" / "server.log").exists() and not (env / "t" / "result.json").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (root only): real ENOSPC from the kernel."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.timeout(60)
def test_a_trial_folder_on_a_full_disk_is_one_disk_error_and_no_launch(env, tiny_disk):
    (tiny_disk / "filler").write_bytes(b"")
    with pytest.raises(OSError), open(tiny_disk / "filler", "wb") as fh:  # fill it to the last byte
        while True:
            fh.write(b"\0" * 4096)
            fh.flush()
    work = WorkloadSpec(prompts=PROMPTS, sample_size=8, warmup_s=0.2, measure_s=0.3, concurrency=4, max_tokens=64)
    # An unknown flag: the trial's result.json is its only write (a bad_args outcome), and it cannot be made.
    with pytest.raises(DiskError) as info:
        run_trial(
            TrialSetup(engine=_engine(), workload=work, gpu_index=GPU, run_dir=env / "runs"),
            {"no_such_flag": 1},
            trial_dir=tiny_disk / "t",
        )
    assert str(tiny_disk / "t") in str(info.value) and "No space left on device" in str(info.value)
    assert info.value.free_bytes is not None and info.value.free_bytes < 8192
    assert not _children() and not (env / "devices").exists()


def test_every_status_has_a_report_label():
    from autotune.report.data import OUTCOMES
    from autotune.results import STATUSES

    assert set(STATUSES) <= set(OUTCOMES), sorted(set(STATUSES) - set(OUTCOMES))
    assert OUTCOMES[TOO_SLOW] == ("too slow for the window", "failed")
