"""``autotune.results``: the typed records a trial stores, read back from what older versions stored."""

from __future__ import annotations

import json

from autotune.results import (
    DevicePeak,
    FidelityFigures,
    MeasurementVerdict,
    Rejections,
    ServerProgress,
    StressResult,
    TrialResult,
    Window,
)

# A result as a study stored it before its blocks were typed records (keys as they were written then), with a key
# no version of this reader knows (a later version's): it must still read, the unknown key ignored.
STORED = {
    "status": "ok",
    "config": {"max_running_requests": 32, "chunked_prefill_size": 4096},
    "engine": "sim",
    "metrics": {"output_tok_s": 5000.0, "request_s": 2.0, "ttft_ms": {"p50": 10.0}, "itl_ms": {}, "e2e_ms": {}},
    "durations_s": {"startup": 120.0, "measure": 30.0},
    "measurement": {"client_busy": 0.1, "stream_interval": 1, "settled": True},
    "fidelity": {
        "role": "probe",
        "prompts": 16,
        "tokens": 256,
        "duration_s": 3.2,
        "changes": [],
        "prefix_match_mean": 101.5,
        "prefix_match_min": 12,
        "exact_share": 0.5,
        "mean_abs_logprob_delta": 0.0125,
        "scored_tokens": 900,
        "first_difference": [None, 12],
        "outputs_differ": True,
        "unexpected": True,
        "differs": [{"flag": "chunked_prefill_size", "value": 4096, "reference": None}],
        "reference": {"path": "trials/reference/reference.json", "sha256": "ab12", "trial": 0},
    },
    "windows": [
        {
            "index": 2,
            "status": "ok",
            "output_tok_s": 5100.0,
            "tok_s_per_gpu": 5100.0,
            "output_tokens": 9000,
            "window_s": 30.0,
            "settled": True,
            "first_pass": 2,
            "last_pass": 2,
            "reason": None,
            "measurement": {"client_busy": 0.1},
        }
    ],
    "stress": {
        "survived": True,
        "ended": "peak reached",
        "peak_used_gib": 171.0,
        "total_gib": 179.1,
        "retractions": 2,
        "reached_peak": True,
    },
    "a_later_field": {"ignored": True},
}


def test_a_result_stored_before_the_typed_records_reads_into_them():
    result = TrialResult.from_dict(json.loads(json.dumps(STORED)))  # as Optuna hands it back: plain JSON
    fid = result.fidelity
    assert isinstance(fid, FidelityFigures) and fid.probed and fid.unexpected is True
    assert (fid.prefix_match_mean, fid.exact_share, fid.tokens) == (101.5, 0.5, 256)
    assert fid.first_difference == (None, 12) and fid.differs[0]["flag"] == "chunked_prefill_size"
    assert fid.reference is not None and fid.reference["sha256"] == "ab12"
    assert result.windows == (
        Window(
            index=2,
            status="ok",
            output_tok_s=5100.0,
            tok_s_per_gpu=5100.0,
            output_tokens=9000,
            window_s=30.0,
            settled=True,
            first_pass=2,
            last_pass=2,
            measurement={"client_busy": 0.1},
        ),
    )
    assert isinstance(result.stress, StressResult) and result.stress.survived and result.stress.retractions == 2
    assert result.stress.failure is None  # a field the stored record lacked: its default
    assert result.measurement == MeasurementVerdict(client_busy=0.1, stream_interval=1, settled=True)


def test_the_stored_keys_are_the_keys_read_back_and_unchanged():
    result = TrialResult.from_dict(STORED)
    stored = json.loads(json.dumps(result.to_dict()))
    assert stored["fidelity"] == STORED["fidelity"]  # the probe's figures stored as the probe wrote them
    assert stored["windows"] == STORED["windows"] and stored["measurement"] == STORED["measurement"]
    assert {k: stored["stress"][k] for k in STORED["stress"]} == STORED["stress"]
    assert "a_later_field" not in stored
    assert TrialResult.from_dict(stored) == result


def test_a_result_without_the_optional_blocks_reads_as_none():
    result = TrialResult.from_dict({"status": "crash", "config": {}, "fidelity": None, "windows": None})
    assert (result.fidelity, result.windows, result.stress, result.measurement) == (None, None, None, None)
    assert TrialResult.from_dict({"status": "ok", "config": {}, "windows": []}).windows == ()
    stored = result.to_dict()
    assert stored["fidelity"] is None and stored["windows"] is None and stored["stress"] is None


# Blocks a study stored as plain dicts before they were typed: refusals, the server's progress in a window that
# delivered nothing (stored empty when nothing moved), and each GPU's peak of a server over several GPUs.
STORED_BLOCKS = {
    "status": "too_slow",
    "config": {},
    "engine": "sim",
    "measurement": {
        "progress": {"prefill_batches": 2, "prefill_tokens": 4096},
        "held_streams": 4,
        "rejected": {"count": 3, "of": 5, "kinds": {"HTTP 400": 2, "HTTP 413": 1}, "first": "HTTP 400: x"},
    },
    "gpu": {
        "peak_used_gib": 170.0,
        "total_gib": 179.1,
        "headroom_gib": 9.1,
        "mean_util_pct": None,
        "peak_power_w": None,
        "samples": 3,
        "per_gpu": [
            {"index": 0, "peak_used_gib": 160.0, "total_gib": 179.1, "headroom_gib": 19.1},
            {"index": 1, "peak_used_gib": 170.0, "total_gib": 179.1, "headroom_gib": 9.1},
        ],
    },
}


def test_stored_refusals_progress_and_per_gpu_peaks_read_into_records_and_store_the_same_keys():
    result = TrialResult.from_dict(json.loads(json.dumps(STORED_BLOCKS)))
    m, gpu = result.measurement, result.gpu
    assert isinstance(m.rejected, Rejections) and (m.rejected.count, m.rejected.of) == (3, 5)
    assert m.rejected.kinds == {"HTTP 400": 2, "HTTP 413": 1} and m.rejected.first == "HTTP 400: x"
    assert m.progress == ServerProgress(prefill_batches=2, prefill_tokens=4096) and m.progress
    assert gpu.per_gpu == (
        DevicePeak(index=0, peak_used_gib=160.0, total_gib=179.1, headroom_gib=19.1),
        DevicePeak(index=1, peak_used_gib=170.0, total_gib=179.1, headroom_gib=9.1),
    )
    stored = json.loads(json.dumps(result.to_dict()))
    assert stored["measurement"] == STORED_BLOCKS["measurement"] and stored["gpu"] == STORED_BLOCKS["gpu"]
    assert TrialResult.from_dict(stored) == result
    nothing_moved = MeasurementVerdict.from_dict({"progress": {}})
    assert nothing_moved.progress == ServerProgress() and not nothing_moved.progress
    assert nothing_moved.to_dict() == {"progress": {}}  # stored empty, as before: not dropped
