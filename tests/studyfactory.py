"""Realistic synthetic Optuna studies that follow the study storage contract (docs/contracts.md).

The report reads only what a study stores, so tests build studies here instead of running a sweep: trials carry
``user_attrs["result"]`` (a ``TrialResult.to_dict()``), ``role``, ``label`` and ``constraint``; OOMs are COMPLETE
with value 0, crashes and timeouts FAIL. Memory plans use SGLang's arithmetic for Qwen3.6-27B + MTP in a compact
form (weights, pools, graphs, activations and headroom add up to the device), and throughput follows the roofline
fitted on the seed point (~2,000 tok/s at 16 running requests on a B200).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from autotune.results import Capacity, GpuPeaks, Metrics, Percentiles, TrialResult
from autotune.sglang.memory import MemoryGiB, MemoryPlan

GIB = 2**30
GPUS = {"b200": (179.06, 8.0e12), "h200": (140.4, 4.8e12)}  # nvidia-smi total GiB, HBM bytes/s
WEIGHTS_GIB = 56.58  # target 51.05 + MTP draft 5.53
SLOT_BYTES = 153_944_064  # one Mamba slot: 48 layers of conv + fp32 ssm state
CONV_SHARE = 48 * 10240 * 3 * 2 / SLOT_BYTES
KV_CELL = 68 * 1024  # target 64 KiB + draft 4 KiB per token
CONTEXT_GIB, RUNTIME_GIB = 0.5, 1.0
ALPHA = 0.825

DISTRIBUTIONS = {
    "max_mamba_cache_size": IntDistribution(40, 400, step=8),
    "mem_fraction_static": FloatDistribution(0.80, 0.97),
    "max_running_requests": IntDistribution(16, 128, step=8),
    "speculative_num_steps": IntDistribution(1, 5),
    "chunked_prefill_size": CategoricalDistribution([4096, 8192, 16384]),
}
FIXED = {
    "model_path": "Qwen/Qwen3.6-27B",
    "speculative_algorithm": "EAGLE",
    "speculative_eagle_topk": 1,
    "mamba_radix_cache_strategy": "extra_buffer",
    "context_length": 8192,
}
BASELINE = {
    "max_mamba_cache_size": 80,
    "mem_fraction_static": 0.88,
    "max_running_requests": 48,
    "speculative_num_steps": 3,
    "chunked_prefill_size": 16384,
}
HAND_TUNED = {
    "max_mamba_cache_size": 200,
    "mem_fraction_static": 0.93,
    "max_running_requests": 64,
    "speculative_num_steps": 3,
    "chunked_prefill_size": 16384,
}


def memory_plan(params: dict[str, Any], gpu: str) -> MemoryPlan:
    """SGLang's pool sizing for one config, reduced to the terms the report draws."""
    total, _ = GPUS[gpu]
    pre = total - CONTEXT_GIB
    mfs, slots = params["mem_fraction_static"], params["max_mamba_cache_size"]
    draft = params["speculative_num_steps"] + 1
    slot_gib = SLOT_BYTES / GIB
    running = min(params["max_running_requests"], slots // 5)  # extra_buffer + overlap: 5 slots per request
    states = slot_gib * (slots + 1)
    intermediates = slot_gib * (running + 1) * draft
    rest = pre * mfs - WEIGHTS_GIB - RUNTIME_GIB
    kv = rest - states - intermediates
    graphs = 0.25 + 2 / 1024 * 512 * (1 + draft / 4)
    activations = 0.5 / 1024 * params["chunked_prefill_size"]
    headroom = pre * (1 - mfs) - graphs - activations
    failure, message = None, None
    if kv <= 0:
        failure = "startup_oom"
        message = (
            f"Not enough GPU memory for hybrid (mamba/linear-attention) state cache. Computed "
            f"max_mamba_cache_size={slots}, total_rest_memory={rest:.2f} GB"
        )
        kv = 0.0
    elif headroom < 0:
        failure = "runtime_oom"
        message = "Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB."
    gib = MemoryGiB(
        weights=WEIGHTS_GIB,
        kv=kv,
        mamba_ssm=states * (1 - CONV_SHARE),
        mamba_conv=states * CONV_SHARE,
        intermediate_ssm=intermediates * (1 - CONV_SHARE),
        intermediate_conv=intermediates * CONV_SHARE,
        mamba_total=states + intermediates,
        graphs=graphs,
        activations=activations,
        headroom=headroom,
    )
    static = WEIGHTS_GIB + RUNTIME_GIB + rest
    return MemoryPlan(
        fits=failure is None,
        failure=failure,
        message=message,
        mem_fraction_static=mfs,
        max_mamba_cache_size=slots,
        max_running_requests=running,
        kv_tokens=int(kv * GIB // KV_CELL),
        inert=[],
        gib=gib,
        extra={
            "total_gib": total,
            "static_gib": static,
            "peak_gib": total - headroom,
            "ratio": 5,
            "context_gib": CONTEXT_GIB,
            "runtime_gib": RUNTIME_GIB,
        },
    )


def throughput(running: int, draft: int, gpu: str) -> tuple[float, float]:
    """(output tok/s, decode-cycle seconds) from the roofline fitted on the seed point."""
    _, bandwidth = GPUS[gpu]
    tau = (1 - ALPHA**draft) / (1 - ALPHA)
    per_request = (3 + draft) * SLOT_BYTES + 1500 * KV_CELL
    cycle = 2.5e-3 + (51.25e9 + 3.39e9 * (draft - 1) + running * per_request) / (0.46 * bandwidth)
    return running * tau / cycle, cycle


def _records(rng: np.random.Generator, cycle: float, draft: int, n: int) -> list[dict[str, Any]]:
    """Per-request records in the replay client's format: send time and (arrival, tokens) chunks."""
    tau = (1 - ALPHA**draft) / (1 - ALPHA)
    rows = []
    for i in range(n):
        sent = float(i) * 0.05
        t = sent + float(rng.lognormal(math.log(0.25 + 40 * cycle), 0.35))
        chunks = []
        for _ in range(24):
            tokens = int(rng.integers(1, draft + 1))
            chunks.append([t, tokens])
            t += float(rng.gamma(4.0, cycle / 4.0)) * tokens / tau
        rows.append(
            {
                "row": i,
                "sent": sent,
                "chunks": chunks,
                "finish_reason": "length",
                "error": None,
                "ended": t,
                "accept_length": tau,
            }
        )
    return rows


def _latencies(records: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    ttft, itl, e2e = [], [], []
    for rec in records:
        ttft.append(rec["chunks"][0][0] - rec["sent"])
        for (prev, _), (t, n) in zip(rec["chunks"], rec["chunks"][1:], strict=False):
            itl.extend([(t - prev) / n] * n)
        e2e.append(rec["ended"] - rec["sent"])
    return ttft, itl, e2e


def _percentiles(values: list[float], scale: float = 1000.0) -> Percentiles:
    arr = np.asarray(values) * scale
    return Percentiles(
        p50=float(np.percentile(arr, 50)),
        p90=float(np.percentile(arr, 90)),
        p99=float(np.percentile(arr, 99)),
        mean=float(arr.mean()),
    )


def _result(
    params: dict[str, Any],
    gpu: str,
    rng: np.random.Generator,
    trial_dir: Path | None,
    status_override: str | None = None,
) -> tuple[TrialResult, list[dict[str, Any]]]:
    plan = memory_plan(params, gpu)
    config = {**FIXED, **params}
    total, _ = GPUS[gpu]
    log_path = str(trial_dir / "server.log") if trial_dir else None
    base = {
        "config": config,
        "engine": "sim",
        "gpu_index": 0,
        "plan": plan.to_dict(),
        "trial_dir": str(trial_dir) if trial_dir else None,
        "log_path": log_path,
    }
    if status_override:
        reason = {
            "crash": "Scheduler hit an exception: RuntimeError: NCCL error in: init.cpp:1",
            "timeout": "server did not answer /health within 600 s",
        }[status_override]
        return TrialResult(status=status_override, reason=reason, exit_code=1, **base), []
    if plan.failure == "startup_oom":
        return TrialResult(status="skipped_infeasible", reason=plan.message, **base), []
    capacity = Capacity(
        max_running_requests=plan.max_running_requests,
        kv_tokens=plan.kv_tokens,
        mamba_slots=plan.max_mamba_cache_size,
        mem_fraction_static=plan.mem_fraction_static,
        context_len=8192,
        chunked_prefill_size=params["chunked_prefill_size"],
        weights_gib=plan.gib.weights,
        kv_gib=plan.gib.kv,
        mamba_gib=plan.gib.mamba_total,
        graphs_gib=plan.gib.graphs,
        available_gib=max(plan.gib.headroom, 0.0),
    )
    if plan.failure == "runtime_oom":
        peak = GpuPeaks(peak_used_gib=total - 0.2, total_gib=total, headroom_gib=0.2, samples=12)
        return TrialResult(
            status="runtime_oom", reason=plan.message, exit_code=137, capacity=capacity, gpu=peak, **base
        ), []
    draft = params["speculative_num_steps"] + 1
    tok_s, cycle = throughput(plan.max_running_requests, draft, gpu)
    tok_s *= float(rng.normal(1.0, 0.015))
    records = _records(rng, cycle, draft, 40)
    ttft, itl, e2e = _latencies(records)
    metrics = Metrics(
        output_tok_s=tok_s,
        request_s=tok_s / 2400,
        ttft_ms=_percentiles(ttft),
        itl_ms=_percentiles(itl),
        e2e_ms=_percentiles(e2e),
        accept_length=(1 - ALPHA**draft) / (1 - ALPHA),
        output_tokens=int(tok_s * 60),
        completed=40,
        window_s=60.0,
        concurrency=96,
    )
    observed = plan.extra["peak_gib"] + float(rng.normal(0.0, 0.3))
    gpu_peaks = GpuPeaks(
        peak_used_gib=observed,
        total_gib=total,
        headroom_gib=total - observed,
        mean_util_pct=93.0,
        peak_power_w=900.0,
        samples=300,
    )
    result = TrialResult(
        status="ok",
        capacity=capacity,
        metrics=metrics,
        gpu=gpu_peaks,
        durations_s={"startup": 1.2, "warmup": 5.0, "measure": 60.0, "teardown": 0.8},
        modelled_startup_s=165.0,
        **base,
    )
    return result, records


def _write_files(result: TrialResult, records: list[dict[str, Any]], with_records: bool) -> None:
    if not result.trial_dir:
        return
    trial_dir = Path(result.trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    Path(result.log_path).write_text(
        f"[server] starting\n{result.reason or 'The server is fired up and ready to roll!'}\n"
    )
    if with_records and records:
        with open(trial_dir / "records.jsonl", "w") as fh:
            for row in records:
                fh.write(json.dumps(row) + "\n")


def _add(
    study: optuna.Study, number: int, params: dict[str, Any], role: str, label: str, result: TrialResult, multi: bool
) -> None:
    attrs: dict[str, Any] = {"result": result.to_dict(), "role": role, "label": label}
    failed = result.status in ("crash", "timeout")
    tok_s = result.output_tok_s or 0.0
    if result.status != "ok" and not failed:
        attrs["constraint"] = [1.0]
    elif result.status == "ok":
        attrs["constraint"] = [0.0]
    values = None
    if not failed:
        values = [tok_s, result.metrics.itl_ms.p99 if result.metrics else 0.0] if multi else [tok_s]
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL if failed else optuna.trial.TrialState.COMPLETE,
            params=params,
            distributions=DISTRIBUTIONS,
            values=values,
            user_attrs=attrs,
        )
    )


def _sample(rng: np.random.Generator) -> dict[str, Any]:
    params = {}
    for name, dist in DISTRIBUTIONS.items():
        if isinstance(dist, CategoricalDistribution):
            params[name] = dist.choices[int(rng.integers(len(dist.choices)))]
        elif isinstance(dist, IntDistribution):
            steps = (dist.high - dist.low) // dist.step
            params[name] = dist.low + dist.step * int(rng.integers(steps + 1))
        else:
            params[name] = round(float(rng.uniform(dist.low, dist.high)), 4)
    return params


def make_study(
    *,
    n_trials: int = 40,
    seed: int = 0,
    gpu: str = "b200",
    name: str = "synthetic",
    storage: str | optuna.storages.BaseStorage | None = None,
    trials_dir: Path | None = None,
    multi_objective: bool = False,
    with_records: bool = True,
    confirm: bool = True,
    crash_every: int = 13,
) -> optuna.Study:
    """A finished study: a baseline, the hand-tuned enqueued config, then ``n_trials - 2`` sampled ones.

    Every ``crash_every``-th search trial crashes (FAIL) and the one after it times out, so failures of each
    kind are present. ``trials_dir`` (optional) receives per-trial logs and ``records.jsonl`` files.
    """
    rng = np.random.default_rng(seed)
    directions = ["maximize", "minimize"] if multi_objective else ["maximize"]
    study = optuna.create_study(study_name=name, storage=storage, directions=directions)
    # The shape of StudyConfig.to_dict().
    study.set_user_attr(
        "autotune",
        {
            "study": {"name": name, "trials": n_trials, "seed": seed},
            "engine": {"kind": "sim", "model": "qwen3.6-27b", "sim_gpu": gpu, "fixed": FIXED},
            "workload": {"prompts": "prompts.jsonl", "sample_size": 200, "concurrency": 96, "max_tokens": 4096},
            "objective": {
                "metric": "output_tok_s",
                "constraints": [],
                "second": {"metric": "p99_itl_ms", "direction": "minimize"} if multi_objective else None,
            },
        },
    )
    results: dict[int, TrialResult] = {}
    for number in range(n_trials):
        if number == 0:
            params, role, label = BASELINE, "baseline", "baseline"
        elif number == 1:
            params, role, label = HAND_TUNED, "enqueued", "hand-tuned"
        else:
            params, role, label = _sample(rng), "search", f"trial {number}"
        override = None
        if role == "search" and crash_every and number % crash_every == 0:
            override = "crash"
        elif role == "search" and crash_every and number % crash_every == 1 and number > crash_every:
            override = "timeout"
        trial_dir = trials_dir / "trials" / str(number) if trials_dir else None
        result, records = _result(params, gpu, rng, trial_dir, override)
        _write_files(result, records, with_records)
        _add(study, number, params, role, label, result, multi_objective)
        results[number] = result
    if confirm:
        _confirm(study, results, rng)
    return study


def _confirm(study: optuna.Study, results: dict[int, TrialResult], rng: np.random.Generator) -> None:
    ok = {n: r for n, r in results.items() if r.ok}
    winner = max(ok, key=lambda n: ok[n].output_tok_s or 0.0)
    runs, medians = [], {}
    for number in (winner, 0):
        values = []
        for repeat in range(3):
            base = results[number]
            tok_s = (base.output_tok_s or 0.0) * float(rng.normal(1.0, 0.01))
            metrics = Metrics.from_dict({**dataclasses.asdict(base.metrics), "output_tok_s": tok_s})
            rerun = TrialResult.from_dict({**base.to_dict(), "metrics": dataclasses.asdict(metrics)})
            runs.append({"trial": number, "repeat": repeat, "result": rerun.to_dict()})
            values.append(tok_s)
        medians[number] = float(np.median(values))
    gain = medians[winner] / medians[0]  # a ratio, as confirm.py stores it
    stats = {str(n): {"median": m, "ci": [m * 0.99, m * 1.01], "runs": 3, "failed": 0} for n, m in medians.items()}
    study.set_user_attr(
        "confirmation",
        {
            "complete": True,
            "runs": runs,
            "winner_trial": winner,
            "baseline_trial": 0,
            "gain": gain,
            "ci_low": gain * 0.98,
            "ci_high": gain * 1.02,
            "note": "winner confirmed over 3 interleaved repeats",
            "stats": stats,
            "defaults": {"output_tok_s": medians[0] * 1.2, "status": "ok", "how": "measured"},
            "stress": passed_stress(winner),
        },
    )


def passed_stress(trial: int, *, peak_gib: float = 171.3, total_gib: float = 179.1, retractions: int = 2) -> dict:
    """A confirmation's ``stress`` entry in which ``trial`` survived the stress phase (``search.confirm.stress``)."""
    result = {
        "survived": True,
        "ended": "peak reached",
        "reached_peak": True,
        "requests": 64,
        "running_cap": 40,
        "peak_used_gib": peak_gib,
        "total_gib": total_gib,
        "retractions": retractions,
        "max_tokens": 4096,
    }
    return {
        "runs": [{"trial": trial, "repeat": 3, "status": "ok", "reason": None, "result": result}],
        "demoted": [],
        "decided_trial": trial,
        "complete": True,
    }
