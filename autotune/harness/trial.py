"""One trial: validate → start → ready → capacity → replay under a GPU monitor → stop → classify, then the caller's
follow-up steps in the same launch. A failure is data (a ``TrialResult`` with the log line that decided it), the
server is always stopped before returning, and a window that did not measure the server is measured once more, then
refused. docs/contracts.md (``harness/trial.py``), docs/engines-and-launchers.md ("A measurement the host could not
make is refused").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.config.context import misfit_reason
from autotune.errors import ConfigError, ServerError
from autotune.harness.engines import logparse
from autotune.harness.engines.base import Engine, GpuReader, group_reader, launch_gpus
from autotune.harness.fidelity import FidelityProbe
from autotune.harness.files import writing
from autotune.harness.gpu import GpuMonitor
from autotune.harness.outcome import STUDY_OPTIONS, dominated, no_tokens, rejection_line, rejections
from autotune.harness.serverinfo import flush_cache, server_info, server_stream_interval, sim_pace
from autotune.harness.setup import NO_HOOKS, PhaseCallback, TrialHooks, TrialSetup, server_group
from autotune.harness.steps import AfterWindow, Launch, ProbeStep
from autotune.harness.workload import (
    ReplayProgress,
    ReplayRecords,
    SimPace,
    metrics_from_records,
    repeated_prompt_share,
    replay,
    window_drift,
)
from autotune.launch import Launcher, LaunchSpec, PortTaken, ServerExited, ServerHandle, ServerStartTimeout
from autotune.launch.process import cleanup_orphans, free_port
from autotune.launch.registry import make_launcher
from autotune.progress import PhaseInfo
from autotune.results import (
    PORT_TAKEN,
    TOO_SLOW,
    UNTRUSTED_STATUSES,
    Capacity,
    FailureKind,
    GpuPeaks,
    MeasurementVerdict,
    Metrics,
    Outcome,
    Placement,
    Status,
    TrialResult,
)
from autotune.sglang.envs import env_strings

DEFAULT_CONCURRENCY = 64  # when the server did not report its effective max running requests
LAG_LIMIT = 0.02  # the sim server's wall clock may trail its modelled clock by this share of the window
CLIENT_BUSY_LIMIT = 0.95  # the replay's event-loop thread running or runnable this share of the window: client-bound
REMEASURE_STREAM_INTERVAL = 16  # tokens per SSE chunk for the re-measure (at least 4 × the trial's own)


def auto_concurrency(capacity: Capacity | None) -> int:
    """2 × the effective max running requests: enough queued work that the server's batch stays full."""
    if capacity is None or not capacity.max_running_requests:
        return DEFAULT_CONCURRENCY
    return 2 * capacity.max_running_requests


def _diagnose(engine: Engine, log_text: str, exit_code: int | None) -> tuple[FailureKind | None, str | None]:
    kind = logparse.classify(log_text, exit_code)
    line = logparse.failure_line(log_text, exit_code) if kind else None
    if kind and not line and exit_code is not None:
        line = f"server exited with code {exit_code}"
    return kind, line


def _write(result: TrialResult, trial_dir: Path) -> TrialResult:
    path = trial_dir / "result.json"
    with writing(path, partial=True):
        path.write_text(json.dumps(result.to_dict(), indent=2, default=str))
    return result


def measurement_verdict(records: ReplayRecords) -> tuple[Status | None, str | None, MeasurementVerdict]:
    """(status, reason, figures) for a replay's trustworthiness: ``invalid_measurement`` when the simulated
    server lagged its model by more than ``LAG_LIMIT`` (sim only: ``sim_pace`` in /server_info), ``client_bound``
    when the replay's event-loop thread was saturated; (None, None, figures) when the window measured the server."""
    settling = records.settling
    figures = MeasurementVerdict(
        client_busy=records.client_busy,
        repeated_prompts=repeated_prompt_share(records),
        window_drift=window_drift(records),
        settled=settling.settled if settling else None,
        settling=settling.to_dict() if settling is not None else None,
    )
    probes = [p for p in records.probes if isinstance(p, SimPace)]
    if len(probes) == 2:
        modelled, lag = probes[1].modelled_s - probes[0].modelled_s, probes[1].lag_s - probes[0].lag_s
        share = lag / modelled if modelled > 0 else 0.0
        figures = dataclasses.replace(figures, sim_lag=round(share, 4))
        if share > LAG_LIMIT:
            return (
                "invalid_measurement",
                f"the simulated server's wall clock trailed its modelled clock by {share:.1%} over the window "
                f"(limit {LAG_LIMIT:.0%}): the host's CPU could not pace this config, so the tok/s would be "
                f"the CPU's, not the modelled GPU's",
                figures,
            )
    busy = records.client_busy
    if busy is not None and busy >= CLIENT_BUSY_LIMIT:
        return (
            "client_bound",
            f"the replay client's event loop was busy or waiting for a CPU {busy:.0%} of the window (limit "
            f"{CLIENT_BUSY_LIMIT:.0%}): the tok/s would be the client's, not the server's",
            figures,
        )
    return None, None, figures


def run_trial(
    setup: TrialSetup,
    config: Mapping[str, Any],
    *,
    trial_dir: Path,
    probe: FidelityProbe | None = None,
    hooks: TrialHooks = NO_HOOKS,
    after: Sequence[AfterWindow] = (),
) -> TrialResult:
    """Run one server config end to end; never raises for a trial outcome (bad input still raises). An untrusted
    window (see the module docstring) is measured once more with batched SSE chunks before it is recorded.
    ``setup``: engine, workload and place (``harness.setup``); ``probe``: the fidelity probe (``harness.fidelity``)
    to run in the same launch after a trusted window; ``hooks``: phases to the caller, its stop event; ``after``: the
    follow-up steps to run in the same launch after the window (and the probe), in order."""
    trial_dir = Path(trial_dir)
    setup = setup.resolved()
    assert setup.sample is not None
    # a prompt over the model's context raises here, before any file or launch; over the config's: bad_args
    misfit = misfit_reason(setup.engine.model_path, config, setup.sample, setup.workload.max_tokens)
    result = _run_once(setup, config, trial_dir=trial_dir, probe=probe, hooks=hooks, misfit=misfit, after=after)
    if result.status not in UNTRUSTED_STATUSES or hooks.stopped:
        return result
    first = result
    for name in ("server.log", "records.jsonl", "result.json"):  # keep the first attempt beside the second
        path = trial_dir / name
        if path.exists():
            with writing(path):
                path.replace(trial_dir / name.replace(".", ".first.", 1))
    interval = max(REMEASURE_STREAM_INTERVAL, 4 * int(config.get("stream_interval") or 1))
    # the display says why the trial runs again
    hooks.phase(
        f"re-measuring with --stream-interval {interval} ({first.status})",
        {"reason": first.reason, "stream_interval": interval},
    )
    result = _run_once(
        setup,
        {**config, "stream_interval": interval},
        trial_dir=trial_dir,
        probe=probe,
        hooks=hooks,
        misfit=misfit,
        after=after,
    )
    first_figures = first.measurement.to_dict() if first.measurement else {}
    measurement = dataclasses.replace(
        result.measurement or MeasurementVerdict(),
        stream_interval=interval,
        first={"status": first.status, "reason": first.reason, **first_figures},
    )
    reason = result.reason
    if result.status in UNTRUSTED_STATUSES:
        reason = f"{result.reason}; also after re-measuring with --stream-interval {interval}"
    # ``config`` stays the trial's own: the stream interval only batches SSE chunks and is recorded here.
    result = dataclasses.replace(result, config=dict(first.config), measurement=measurement, reason=reason)
    return _write(result, trial_dir)


def _run_once(
    setup: TrialSetup,
    config: Mapping[str, Any],
    *,
    trial_dir: Path,
    probe: FidelityProbe | None,
    hooks: TrialHooks,
    misfit: str | None,
    after: Sequence[AfterWindow] = (),
) -> TrialResult:
    """One launch of a resolved ``setup``; never raises for a trial outcome (bad input, a prompt over the model's
    context and a full disk still raise: ``WorkloadError``, ``DiskError``, after the server is stopped)."""
    engine, workload = setup.engine, setup.workload
    with writing(trial_dir):
        trial_dir.mkdir(parents=True, exist_ok=True)
    log_path = trial_dir / "server.log"
    group = launch_gpus(engine, server_group(setup, config))
    base = Placement(
        engine=engine.name,
        device=engine.device,
        gpu_index=group[0] if group else setup.gpu_index,
        gpus=list(group) or None,
        trial_dir=str(trial_dir),
        log_path=str(log_path),
    )
    assert setup.sample is not None
    try:
        checked = engine.check(config)
    except ConfigError as exc:
        return _write(TrialResult(status="bad_args", config=dict(config), reason=str(exc), **base), trial_dir)
    config = dict(checked) if isinstance(checked, Mapping) else dict(config)
    if misfit is not None:  # a prompt over this config's --context-length: nothing to launch
        return _write(TrialResult(status="bad_args", config=config, reason=misfit, **base), trial_dir)
    spec, reader = _spec(setup, config, group, log_path=log_path)
    # A step that files windows of the first window's closed loop (``WindowsStep.later_windows``) lengthens it.
    loop = 1 + sum(int(getattr(step, "later_windows", 0)) for step in after)
    launch = Launch(
        engine=engine,
        workload=workload,
        trial_dir=trial_dir,
        timeouts=setup.timeouts,
        sample=setup.sample,
        phase=hooks.phase,
        stop_event=hooks.stop_event,
        reader=reader,
        windows=loop,
    )
    server: ServerHandle | None = None
    try:
        server, fields = _start(make_launcher(setup.launcher), spec, launch)
        if server is not None and not fields:
            fields.update(_measure(server, launch))
            steps = [*([ProbeStep(probe)] if probe is not None else []), *after]
            for step in steps:
                if not step.runs_after(fields, server):
                    break
                fields.update(step(server, launch, fields).fields())
    finally:
        exit_code = _stop(server, launch) if server is not None else None
        reader.close()
    fields.setdefault("exit_code", exit_code)
    if server is not None and server.teardown_error:
        fields["reason"] = "; ".join(filter(None, [fields.get("reason"), f"teardown: {server.teardown_error}"]))
    result = TrialResult(config=config, durations_s=launch.durations, **base, **fields)
    return _write(result, trial_dir)


def _spec(
    setup: TrialSetup, config: Mapping[str, Any], group: tuple[int, ...], *, log_path: Path
) -> tuple[LaunchSpec, GpuReader]:
    """The server to start on ``group`` and its devices' reader (the launcher's: it knows where the server runs):
    the engine can launch, orphans of earlier runs are gone, no old log remains."""
    engine = setup.engine
    engine.preflight()  # an engine that cannot launch at all is an error of the setup, not a trial outcome
    run_dir = Path(setup.run_dir) if setup.run_dir is not None else Path.cwd() / "runs"
    cleanup_orphans(run_dir)
    with writing(log_path):
        log_path.unlink(missing_ok=True)  # a rerun into the same directory must not classify an old log
    port = setup.port or free_port()
    launcher = make_launcher(setup.launcher)
    # The engine's kind of reader (NVML, the simulated GPU, host memory) of the group: the launcher's to place.
    reader = launcher.memory_reader(group, lambda gpus: group_reader(engine, gpus or _no_gpu(setup)))
    return LaunchSpec(
        argv=engine.argv(config, port=port),
        port=port,
        env={**engine.env(), **env_strings(config)},
        gpus=group,
        log_path=log_path,
        run_dir=run_dir,
        shm_dir=setup.shm_dir or engine.shm_dir,
    ), reader


def _no_gpu(setup: TrialSetup) -> tuple[int, ...]:
    """A server handed no GPU still has a reader: the CPU backend's host memory, or the simulator's device it
    picks from ``gpu_index``."""
    return () if setup.gpu_index is None else (setup.gpu_index,)


def _start(launcher: Launcher, spec: LaunchSpec, launch: Launch) -> tuple[ServerHandle | None, Outcome]:
    """Start the server and wait until it is ready: the server (None when it could not start) and no fields when
    it is ready, else the failure's fields (a trial outcome)."""
    fields: Outcome = {}
    stop_event = launch.stop_event
    launch.phase("starting", {"port": spec.port, "argv": spec.argv})
    t0 = time.monotonic()
    server: ServerHandle | None = None
    try:
        with writing(spec.log_path):  # the server's log file opens here: a full disk is a DiskError
            server = launcher.start(spec, gpu_reader=launch.reader)
        server.wait_ready(launch.timeouts.startup_s, stop_event=stop_event)
    except ServerExited as exc:
        kind, line = _diagnose(launch.engine, server.log_text() if server is not None else "", exc.exit_code)
        fields.update(
            {
                "status": kind or "crash",
                "reason": line or str(exc),
                "exit_code": exc.exit_code,
                "log_tail": exc.log_tail,
            }
        )
        fields.update(_cancelled(server) or {})
    except ServerStartTimeout as exc:
        interrupted = stop_event is not None and stop_event.is_set()
        fields.update(
            {
                "status": "interrupted" if interrupted else "timeout",
                "reason": "interrupted while starting" if interrupted else str(exc),
                "log_tail": exc.log_tail,
            }
        )
    except PortTaken as exc:
        fields.update({"status": PORT_TAKEN, "reason": str(exc), "log_tail": exc.log_tail})
    except ServerError as exc:
        fields.update({"status": "crash", "reason": str(exc)})
    except BaseException:  # an interruption or a full disk: the started server goes before it propagates
        if server is not None:
            server.stop(grace_s=launch.timeouts.grace_s, release_timeout_s=launch.timeouts.teardown_s)
        raise
    launch.durations["startup"] = round(time.monotonic() - t0, 3)
    return server, fields


def _stop(server: ServerHandle, launch: Launch) -> int | None:
    """Stop the server whatever happened (port free, GPU memory released); its exit code."""
    launch.phase("stopping", {})
    t0 = time.monotonic()
    exit_code = server.stop(grace_s=launch.timeouts.grace_s, release_timeout_s=launch.timeouts.teardown_s)
    launch.durations["teardown"] = round(time.monotonic() - t0, 3)
    return exit_code


def _measure(server: ServerHandle, launch: Launch) -> Outcome:
    """Capacity, then the replay; classifies a server that died or an interruption while measuring."""
    info = server_info(server.base_url)
    capacity = logparse.capacity(server.log_text(), info)
    cpu = launch.engine.device == "cpu"  # SGLang's CPU backend: host memory, no GPU figures
    out: Outcome = {"capacity": capacity}
    if not cpu:  # the startup model is a GPU's (weights to device, graph capture)
        out["modelled_startup_s"] = logparse.startup_seconds(info)
    concurrency = launch.workload.concurrency or auto_concurrency(capacity)
    log_start = len(server.log_text())  # the replay's log lines are the server's progress evidence
    records, peaks = _replay_window(server, launch, concurrency)
    if peaks is not None:
        out.update({"host": peaks} if cpu else {"gpu": peaks})
    ended = _ended_early(server, launch.engine, records)
    if ended is not None:
        return {**out, **ended}
    return {
        **out,
        **_window_outcome(
            server,
            launch.engine,
            records,
            info,
            server.log_text()[log_start:],
            options=(launch.workload.option("measure_s"), launch.workload.option("warmup_s")),
        ),
    }


def _replay_window(server: ServerHandle, launch: Launch, concurrency: int) -> tuple[ReplayRecords, GpuPeaks | None]:
    """Warm-up and window (and ``launch.windows`` − 1 more of the same loop, into ``launch.later``) under the GPU
    monitor (when the server has a reader); records in ``records.jsonl`` and ``records-window-<i>.jsonl``."""
    workload = launch.workload
    flush_cache(server.base_url)  # idle now: restart the server's spec counters so they cover this replay only
    launch.phase("warmup", {"concurrency": concurrency, "pid": server.pid})
    monitor = GpuMonitor(launch.reader) if launch.reader is not None else None
    t0 = time.monotonic()
    with monitor if monitor is not None else contextlib.nullcontext():
        records = asyncio.run(
            replay(
                server.base_url,
                launch.sample,
                concurrency=concurrency,
                max_tokens=workload.max_tokens,
                warmup_s=workload.warmup_s,
                measure_s=workload.measure_s,
                endpoint=workload.endpoint,
                ignore_eos=workload.ignore_eos,
                repeats=workload.repeats,
                on_progress=_progress_relay(launch.phase, launch.windows),
                should_stop=functools.partial(_should_stop, server, launch.stop_event),
                request_timeout_s=launch.timeouts.request_s,
                window_probe=functools.partial(sim_pace, server.base_url),
                rule=workload.settle_rule(),
                ramp_s=workload.ramp,
                windows=launch.windows,
                go_on=_trusted,
            )
        )
    elapsed = time.monotonic() - t0
    # The settle rule's warm-up and window (not the floors): the lengths this trial actually ran.
    warmup, end = records.settling.window if records.settling is not None else (workload.warmup_s, elapsed)
    first = end if records.later else elapsed
    launch.durations["warmup"] = round(min(elapsed, warmup), 3)
    launch.durations["measure"] = round(max(0.0, first - warmup), 3)
    if records.later:
        launch.durations["windows"] = round(max(0.0, elapsed - first), 3)
    launch.later.extend(records.later)
    for index, window in enumerate([records, *records.later], start=1):
        path = launch.trial_dir / ("records.jsonl" if index == 1 else f"records-window-{index}.jsonl")
        with writing(path, partial=True):
            window.write_jsonl(path)
    return records, monitor.peaks() if monitor is not None else None


def window_verdict(
    records: ReplayRecords,
    metrics: Metrics | None = None,
) -> tuple[str | None, str | None, MeasurementVerdict]:
    """``measurement_verdict`` for one window of a loop, which adds ``no_tokens``: a window in which no token
    arrived measured nothing. (None, None, figures): a trusted figure, the only kind a loop goes on from.
    ``metrics``: the window's, where the caller has them already."""
    status, reason, figures = measurement_verdict(records)
    if status is None and (metrics or metrics_from_records(records)).output_tokens == 0:
        return "no_tokens", "no token arrived inside the window", figures
    return status, reason, figures


def _trusted(records: ReplayRecords) -> bool:
    """Whether a window measured the server: only then does its loop go on."""
    return window_verdict(records)[0] is None


def _progress_relay(phase: PhaseCallback, windows: int = 1) -> Callable[[ReplayProgress], None]:
    """The replay's progress as phases (its fields the phase's info): each phase once (warm-up is announced with the
    pid), every measuring tick; a later window of the loop as ``window i of n``."""
    seen: set[str] = {"warmup"}

    def progress(tick: ReplayProgress) -> None:
        name = tick.phase if tick.window == 1 else f"window {tick.window} of {windows}"
        if name not in seen or name == "measuring":
            seen.add(name)
            phase(
                name,
                PhaseInfo(
                    phase=tick.phase,
                    elapsed_s=tick.elapsed_s,
                    tok_s=tick.tok_s,
                    completed=tick.completed,
                    errors=tick.errors,
                    window=tick.window,
                ),
            )

    return progress


def _should_stop(server: ServerHandle, stop_event: threading.Event | None) -> str | None:
    """Why the replay must end early: an interruption, or the server exited; None to go on."""
    if stop_event is not None and stop_event.is_set():
        return "interrupted"
    return None if server.alive else "server exited"


def _ended_early(server: ServerHandle, engine: Engine, records: ReplayRecords) -> Outcome | None:
    """The outcome of a replay that did not measure its window (interrupted, or the server died); else None."""
    if records.stopped_early == "interrupted":
        return {"status": "interrupted", "reason": "interrupted while measuring"}
    if records.stopped_early == "server exited" or not server.alive:
        code = server.poll()
        cancelled = _cancelled(server)
        if cancelled is not None:
            return {**cancelled, "exit_code": code, "log_tail": server.log_tail()}
        kind, line = _diagnose(engine, server.log_text(), code)
        return {
            "status": kind if kind is not None and kind in ("runtime_oom", "crash", "timeout") else "crash",
            "reason": line or f"server exited with code {code} while measuring",
            "exit_code": code,
            "log_tail": server.log_tail(),
        }
    return None


def _cancelled(server: ServerHandle | None) -> Outcome | None:
    """An ``interrupted`` outcome for a server ended from outside (a Slurm job another user ``scancel``'d): the
    config did not fail, so the study runs it again instead of recording a crash; None for any other exit."""
    if server is None or not getattr(server, "cancelled", False):
        return None
    why = getattr(server, "reason", None)
    return {
        "status": "interrupted",
        "reason": "the server was cancelled outside the study; it runs again" + (f" ({why})" if why else ""),
    }


def _window_outcome(
    server: ServerHandle,
    engine: Engine,
    records: ReplayRecords,
    info: Mapping[str, Any] | None,
    log_since: str,
    *,
    options: tuple[str, str] = STUDY_OPTIONS,
) -> Outcome:
    """Metrics and status of a replay that ran its window; a tok/s only where the window measured the server.
    ``options``: how the command names the window and warm-up lengths (its study keys, or its own options)."""
    metrics = metrics_from_records(records)
    if metrics.accept_length is None and metrics.output_tokens:  # a server that sent nothing is not asked again
        # No request finished inside the window (long outputs, short window): the server's own counter,
        # reset before the replay, covers warm-up + window.
        accept = logparse.spec_accept_length(server_info(server.base_url))
        if accept:
            metrics = dataclasses.replace(metrics, accept_length=round(accept, 4))
    out: Outcome = {"metrics": metrics}
    kind, line = _diagnose(engine, server.log_text(), None)
    if kind == "runtime_oom":
        return {**out, "status": "runtime_oom", "reason": line, "log_tail": server.log_tail()}
    # First whether the window measured the server at all: a client (or sim pacing) that could not keep up reads
    # no tokens as surely as a slow config, and is re-measured, never called too slow.
    status, reason, figures = measurement_verdict(records)
    if metrics.output_tokens == 0 and status is None:  # refused, too slow, or idle: ``harness.outcome`` tells which
        why = no_tokens(records.requests, log_since, records.probes, window_s=metrics.window_s, options=options)
        if why[0] == TOO_SLOW:  # no figure of this config: the window measured nothing (no "0 tok/s" is shown)
            out["metrics"] = None
        return {**out, "status": why[0], "reason": why[1], "measurement": why[2]}
    rejected = rejections(records.requests)
    # An untrusted figure measured the CPU: it stays out of ``metrics`` (only here, for diagnosis).
    out["measurement"] = dataclasses.replace(
        figures,
        stream_interval=int(server_stream_interval(info) or 1),
        rejected=rejected or None,
        untrusted_tok_s=metrics.output_tok_s if status is not None else None,
    )
    if status is not None:
        return {**out, "metrics": None, "status": status, "reason": reason}
    if rejected is not None and dominated(rejected):  # a tok/s of the requests it served; the rest named
        return {**out, "status": "ok", "reason": rejection_line(rejected)}
    return {**out, "status": "ok"}
