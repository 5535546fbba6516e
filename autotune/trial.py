"""One trial: validate → start → ready → capacity → replay under a GPU monitor → stop → classify.

A failure is data: OOMs, crashes, timeouts and bad flags all come back as a ``TrialResult`` with the log
line that decided them, and the server is always stopped (port free, GPU memory released) before returning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from autotune.engines import logparse
from autotune.engines.base import Engine
from autotune.errors import ConfigError, ServerError
from autotune.gpu import GpuMonitor
from autotune.results import Capacity, TrialResult
from autotune.server import ServerExited, ServerProcess, ServerStartTimeout, cleanup_orphans, free_port
from autotune.workload import PromptSample, WorkloadSpec, metrics_from_records, replay

DEFAULT_CONCURRENCY = 64  # when the server did not report its effective max running requests
PhaseCallback = Callable[[str, dict], None]


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    startup_s: float = 900.0
    teardown_s: float = 60.0
    grace_s: float = 10.0
    request_s: float = 600.0


def _server_info(base_url: str) -> dict[str, Any] | None:
    try:
        resp = httpx.get(f"{base_url}/server_info", timeout=10.0, trust_env=False)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _flush_cache(base_url: str) -> None:
    try:
        httpx.post(f"{base_url}/flush_cache", timeout=10.0, trust_env=False)
    except httpx.HTTPError:
        pass  # only the accept-length fallback loses precision


def auto_concurrency(capacity: Capacity | None) -> int:
    """2 × the effective max running requests: enough queued work that the server's batch stays full."""
    if capacity is None or not capacity.max_running_requests:
        return DEFAULT_CONCURRENCY
    return 2 * capacity.max_running_requests


def _diagnose(engine: Engine, log_text: str, exit_code: int | None) -> tuple[str | None, str | None]:
    kind = engine.classify(log_text, exit_code)
    line = engine.failure_line(log_text, exit_code) if kind else None
    if kind and not line and exit_code is not None:
        line = f"server exited with code {exit_code}"
    return kind, line


def _write(result: TrialResult, trial_dir: Path) -> TrialResult:
    (trial_dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2, default=str))
    return result


def run_trial(
    engine: Engine,
    config: Mapping[str, Any],
    workload: WorkloadSpec,
    *,
    trial_dir: Path,
    gpu_index: int | None = 0,
    port: int | None = None,
    timeouts: Timeouts = Timeouts(),
    on_phase: PhaseCallback | None = None,
    stop_event: threading.Event | None = None,
    run_dir: Path | None = None,
    sample: PromptSample | None = None,
    shm_dir: Path | None = None,
) -> TrialResult:
    """Run one server config end to end; never raises for a trial outcome (bad input still raises)."""
    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    log_path = trial_dir / "server.log"
    phase = on_phase or (lambda name, info: None)
    base: dict[str, Any] = dict(
        engine=engine.name, gpu_index=gpu_index, trial_dir=str(trial_dir), log_path=str(log_path)
    )
    sample = sample or PromptSample.load(workload.prompts, workload.sample_size, workload.seed)
    try:
        checked = engine.check(config)
    except ConfigError as exc:
        return _write(TrialResult(status="bad_args", config=dict(config), reason=str(exc), **base), trial_dir)
    config = dict(checked) if isinstance(checked, Mapping) else dict(config)
    preflight = getattr(engine, "preflight", None)
    if preflight is not None:
        preflight()  # an engine that cannot launch at all is an error of the setup, not a trial outcome
    run_dir = Path(run_dir) if run_dir is not None else Path.cwd() / "runs"
    cleanup_orphans(run_dir)
    log_path.unlink(missing_ok=True)  # a rerun into the same directory must not classify an old log
    port = port or free_port()
    reader = engine.gpu_reader(gpu_index)
    server = ServerProcess(
        engine.argv(config, port=port), port=port, env=engine.env(gpu_index=gpu_index), gpu_index=gpu_index,
        log_path=log_path, gpu_reader=reader, run_dir=run_dir, shm_dir=shm_dir or getattr(engine, "shm_dir", None),
    )
    durations: dict[str, float] = {}
    fields: dict[str, Any] = {}
    try:
        phase("starting", {"port": port, "argv": server.argv})
        t0 = time.monotonic()
        try:
            server.start()
            server.wait_ready(timeouts.startup_s, stop_event=stop_event)
        except ServerExited as exc:
            kind, line = _diagnose(engine, server.log_text(), exc.exit_code)
            fields.update(status=kind or "crash", reason=line or str(exc), exit_code=exc.exit_code, log_tail=exc.log_tail)
        except ServerStartTimeout as exc:
            interrupted = stop_event is not None and stop_event.is_set()
            fields.update(
                status="interrupted" if interrupted else "timeout",
                reason="interrupted while starting" if interrupted else str(exc), log_tail=exc.log_tail,
            )
        except ServerError as exc:
            fields.update(status="crash", reason=str(exc))
        durations["startup"] = round(time.monotonic() - t0, 3)
        if not fields:
            fields.update(_measure(engine, server, workload, sample, trial_dir, durations, phase, stop_event, timeouts))
    finally:
        phase("stopping", {})
        t1 = time.monotonic()
        exit_code = server.stop(grace_s=timeouts.grace_s, release_timeout_s=timeouts.teardown_s)
        durations["teardown"] = round(time.monotonic() - t1, 3)
        reader.close()
    fields.setdefault("exit_code", exit_code)
    if server.teardown_error:
        fields["reason"] = "; ".join(filter(None, [fields.get("reason"), f"teardown: {server.teardown_error}"]))
    result = TrialResult(config=config, durations_s=durations, **base, **fields)
    return _write(result, trial_dir)


def _measure(engine, server, workload, sample, trial_dir, durations, phase, stop_event, timeouts) -> dict[str, Any]:
    """Capacity, then the replay; classifies a server that died or an interruption while measuring."""
    info = _server_info(server.base_url)
    capacity = engine.capacity(server.log_text(), info)
    out: dict[str, Any] = {"capacity": capacity, "modelled_startup_s": logparse.startup_seconds(info)}
    concurrency = workload.concurrency or auto_concurrency(capacity)
    seen: set[str] = {"warmup"}  # announced below, with the server's pid

    def progress(info: dict) -> None:
        if info["phase"] not in seen or info["phase"] == "measuring":
            seen.add(info["phase"])
            phase(info["phase"], info)

    def should_stop() -> str | None:
        if stop_event is not None and stop_event.is_set():
            return "interrupted"
        return None if server.alive else "server exited"

    _flush_cache(server.base_url)  # idle now: restart the server's spec counters so they cover this replay only
    phase("warmup", {"concurrency": concurrency, "pid": server.pid})
    monitor = GpuMonitor(server.gpu_reader) if server.gpu_reader is not None else None
    t0 = time.monotonic()
    if monitor is not None:
        monitor.__enter__()
    try:
        records = asyncio.run(
            replay(
                server.base_url, sample, concurrency=concurrency, max_tokens=workload.max_tokens,
                warmup_s=workload.warmup_s, measure_s=workload.measure_s, endpoint=workload.endpoint,
                ignore_eos=workload.ignore_eos, on_progress=progress, should_stop=should_stop,
                request_timeout_s=timeouts.request_s,
            )
        )
    finally:
        if monitor is not None:
            monitor.__exit__(None, None, None)
    elapsed = time.monotonic() - t0
    durations["warmup"] = round(min(elapsed, workload.warmup_s), 3)
    durations["measure"] = round(max(0.0, elapsed - workload.warmup_s), 3)
    records.write_jsonl(trial_dir / "records.jsonl")
    if monitor is not None:
        out["gpu"] = monitor.peaks()
    if records.stopped_early == "interrupted":
        return {**out, "status": "interrupted", "reason": "interrupted while measuring"}
    if records.stopped_early == "server exited" or not server.alive:
        code = server.poll()
        kind, line = _diagnose(engine, server.log_text(), code)
        return {
            **out, "status": kind if kind in ("runtime_oom", "crash", "timeout") else "crash",
            "reason": line or f"server exited with code {code} while measuring",
            "exit_code": code, "log_tail": server.log_tail(),
        }
    metrics = metrics_from_records(records)
    if metrics.accept_length is None:
        # No request finished inside the window (long outputs, short window): the server's own counter,
        # reset before the replay, covers warm-up + window.
        accept = logparse.spec_accept_length(_server_info(server.base_url))
        if accept:
            metrics = dataclasses.replace(metrics, accept_length=round(accept, 4))
    out["metrics"] = metrics
    kind, line = _diagnose(engine, server.log_text(), None)
    if kind == "runtime_oom":
        return {**out, "status": "runtime_oom", "reason": line, "log_tail": server.log_tail()}
    if metrics.output_tokens == 0:
        first_error = next((r.error for r in records.requests if r.error), None)
        return {**out, "status": "crash", "reason": f"no tokens arrived in the measured window ({first_error or 'no error'})"}
    return {**out, "status": "ok"}
