"""SGLang 0.5.23's own log phrases → failure kind, the deciding line, and what the server allocated.

Both engines use this module: the simulator prints SGLang's lines, so one parser serves a real server and a
simulated one. Phrases are SGLang's exact wording (its scheduler, pool configurator and CUDA-graph runners);
matching on them rather than on exit codes is what separates "config does not fit" from "server broke".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from autotune.results import Capacity, FailureKind

READY_LINE = "The server is fired up and ready to roll!"

# Argument parsing/resolution failed before any scheduler started (argparse exits 2, a resolve hook exits 1).
_BAD_ARGS = (
    "error: unrecognized arguments",
    "error: ambiguous option",
    "error: argument",
    "error: the following arguments are required",
)
# Static allocation at startup does not fit: SGLang refuses the config.
_STARTUP_OOM = (
    "Not enough memory. Please try to increase --mem-fraction-static",
    "Loaded weights leave no GPU memory",
    "Not enough GPU memory for hybrid",
    "too small to serve any requests",
    "cannot hold even one request",
    "Capture cuda graph failed",
    "Capture prefill CUDA graph failed",
    "Fail when using backend: breakable",
)
# A CUDA allocation failed; before "fired up" it is a startup OOM, after it a runtime OOM.
_CUDA_OOM = ("CUDA out of memory", "torch.OutOfMemoryError", "Triton Error [CUDA]: out of memory")
# The KV/request pools ran dry while serving (fatal only when the scheduler dies on it).
_RUNTIME_OOM = (
    "Prefill out of memory",
    "Decode out of memory",
    "alloc_req_slots runs out of memory",
)
# A scheduler could not open its device: the GPU group is smaller than the ranks need (or a GPU is gone). The
# launch's fault, not the config's, so it is a crash and never a verdict on the config.
_NO_DEVICE = ("CUDA error: invalid device ordinal", "CUDA error: no CUDA-capable device is detected")
_HANG = ("watchdog timeout",)
_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:]+(?:\s+[^\]]*)?\]\s*")
_EXCEPTION = re.compile(r"^(?:[\w.]+(?:Error|Exception)|KeyboardInterrupt)(?::|$)")
_SCHEDULER_STARTED = ("Memory baseline taken", "Load weight begin", "Scheduler hit an exception")


def _clean(line: str) -> str:
    return _PREFIX.sub("", line.strip())


def _split(log_text: str) -> tuple[list[str], list[str]]:
    """Lines before and after the readiness line (after is empty while starting)."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if READY_LINE in line:
            return lines[: i + 1], lines[i + 1 :]
    return lines, []


def _find(lines: list[str], phrases: tuple[str, ...]) -> str | None:
    """The most explicit line holding one of ``phrases``: an exception line if one matches, else the first."""
    hits = [line for line in lines if any(p in line for p in phrases)]
    if not hits:
        return None
    for line in hits:
        if _EXCEPTION.match(_clean(line)):
            return _clean(line)
    return _clean(hits[0])


def _last_exception(lines: list[str]) -> str | None:
    for line in reversed(lines):
        cleaned = _clean(line)
        if _EXCEPTION.match(cleaned):
            return cleaned
    return None


def diagnose(log_text: str, exit_code: int | None) -> tuple[FailureKind | None, str | None]:
    """(failure kind, deciding line) for a server log; (None, None) when the log shows no failure.

    ``exit_code`` is the launcher's (None while alive; negative for a signal, as Popen reports it).
    """
    before, after = _split(log_text)
    started = any(p in line for line in before for p in _SCHEDULER_STARTED)
    if not after:
        line = _find(before, _BAD_ARGS)
        if line is not None or exit_code == 2:
            return "bad_args", line or _last_exception(before) or "argument parsing failed (exit 2)"
    line = _find(before, _NO_DEVICE)
    if line is not None:
        return "crash", line
    line = _find(before, _STARTUP_OOM) or _find(before, _CUDA_OOM)
    if line is not None:
        return "startup_oom", line
    line = _find(after, _CUDA_OOM) or _find(after, _RUNTIME_OOM)
    if line is not None:
        return "runtime_oom", line
    line = _find(before + after, _HANG)
    if line is not None:
        return "timeout", line
    if exit_code is None:
        return None, None
    if exit_code == 1 and not started and not after:
        # A resolve hook raised in the main process before any scheduler existed.
        return "bad_args", _last_exception(before) or "argument resolution failed (exit 1)"
    if exit_code == 0 and not after and not started:
        return "crash", "server exited before it was ready"
    if exit_code == 0:
        return None, None
    return "crash", _last_exception(before + after) or f"server exited with code {exit_code}"


def classify(log_text: str, exit_code: int | None) -> FailureKind | None:
    return diagnose(log_text, exit_code)[0]


def failure_line(log_text: str, exit_code: int | None = None) -> str | None:
    return diagnose(log_text, exit_code)[1]


_NUM = r"(-?[\d.]+)"
_CAPACITY_LINE = re.compile(
    r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
    r"max_running_requests=(\d+), context_len=(\d+), available_(?:gpu|cpu)_mem=" + _NUM + " GB"
)
_MAMBA_LINE = re.compile(
    r"Mamba Cache is allocated\. max_mamba_cache_size: (\d+), conv_state size: " + _NUM + r"\s*GB, "
    r"ssm_state size: " + _NUM + r"\s*GB(?:,?\s*intermediate_ssm_state_cache size: " + _NUM + r"\s*GB)?"
    r"(?:,?\s*intermediate_conv_window_cache size: " + _NUM + r"\s*GB)?"
)
_KV_LINE = re.compile(r"KV Cache is allocated\. .*?#tokens: (\d+), K size: " + _NUM + r" GB, V size: " + _NUM + " GB")
_WEIGHT_LINE = re.compile(r"Load weight end\..*?mem usage=" + _NUM + " GB")
_GRAPH_LINE = re.compile(r"Capture .*CUDA graph end\..*?mem usage=" + _NUM + " GB")
_MFS = re.compile(r"mem_fraction_static['\"]?[=:]\s*" + _NUM)
# SGLang 0.5.23's warnings when a pool lowers the running cap (``kv_cache_configurator.py`` L3141, L3167)
_MAMBA_CAP = re.compile(r"max_running_requests is capped to \d+ by the mamba state cache")
_KV_CAP = re.compile(r"max_running_requests was reduced from the requested \d+ to \d+")


def _sum(values: list[float]) -> float | None:
    return round(sum(values), 4) if values else None


def _f(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _i(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def capacity(log_text: str, server_info: Mapping[str, Any] | None = None) -> Capacity:
    """What the server allocated. ``/server_info`` ``internal_states[0]`` (runtime overrides) wins over the log."""
    logged = _logged(log_text)
    if not server_info:
        return logged
    reported = _reported(server_info)
    return dataclasses.replace(
        logged,
        **{
            f.name: getattr(reported, f.name)
            for f in dataclasses.fields(reported)
            if getattr(reported, f.name) is not None
        },
    )


def _logged(log_text: str) -> Capacity:
    """What the startup log says the server allocated."""
    line, mamba, mfs = _CAPACITY_LINE.search(log_text), _MAMBA_LINE.search(log_text), _MFS.search(log_text)
    return Capacity(
        kv_tokens=int(line[1]) if line else None,
        chunked_prefill_size=int(line[2]) if line else None,
        max_running_requests=int(line[4]) if line else None,
        context_len=int(line[5]) if line else None,
        available_gib=float(line[6]) if line else None,
        mamba_slots=int(mamba[1]) if mamba else None,
        mamba_gib=round(sum(float(x) for x in mamba.groups()[1:] if x is not None), 4) if mamba else None,
        kv_gib=_sum([float(m[2]) + float(m[3]) for m in _KV_LINE.finditer(log_text)]),
        weights_gib=_sum([float(m[1]) for m in _WEIGHT_LINE.finditer(log_text)]),
        graphs_gib=_sum([float(m[1]) for m in _GRAPH_LINE.finditer(log_text)]),
        mem_fraction_static=float(mfs[1]) if mfs else None,
        bound_by="mamba" if _MAMBA_CAP.search(log_text) else "kv" if _KV_CAP.search(log_text) else None,
    )


def _reported(info: Mapping[str, Any]) -> Capacity:
    """What ``/server_info`` reports (None where it does not say)."""
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states[0], Mapping) else {}
    usage = state.get("memory_usage") or {}
    usage = usage if isinstance(usage, Mapping) else {}
    graphs = usage.get("graph")
    kv_tokens = _i(info.get("max_total_num_tokens"))
    return Capacity(
        max_running_requests=_i(state.get("effective_max_running_requests_per_dp")),
        mamba_slots=_i(state.get("max_mamba_cache_size")),
        kv_tokens=kv_tokens if kv_tokens is not None else _i(usage.get("token_capacity")),
        mem_fraction_static=_f(state.get("mem_fraction_static", info.get("mem_fraction_static"))),
        chunked_prefill_size=_i(state.get("chunked_prefill_size", info.get("chunked_prefill_size"))),
        context_len=_i(info.get("context_length") or state.get("context_length")),
        weights_gib=_f(usage.get("weight")),
        kv_gib=_f(usage.get("kvcache")),
        available_gib=_f(usage.get("startup_available")),
        graphs_gib=round(sum(_f(v) or 0.0 for v in graphs.values()), 4) if isinstance(graphs, Mapping) else None,
    )


def startup_seconds(server_info: Mapping[str, Any] | None) -> float | None:
    """The server-reported startup time (load + pools + graphs), the cost a real restart pays."""
    if not server_info:
        return None
    times = server_info.get("startup_time")
    if not isinstance(times, Mapping):
        states = server_info.get("internal_states") or [{}]
        times = states[0].get("startup_time") if isinstance(states[0], Mapping) else None
    if not isinstance(times, Mapping):
        return _f(times)
    for key in ("tokenizer_e2e", "scheduler_e2e"):
        if _f(times.get(key)) is not None:
            return _f(times.get(key))
    parts = [_f(times.get(k)) or 0.0 for k in ("load_weight", "kv_cache_allocation")]
    graphs = times.get("cuda_graph")
    if isinstance(graphs, Mapping):
        parts += [_f(v) or 0.0 for v in graphs.values()]
    return round(sum(parts), 3) or None


def spec_accept_length(server_info: Mapping[str, Any] | None) -> float | None:
    if not server_info:
        return None
    states = server_info.get("internal_states") or [{}]
    state = states[0] if isinstance(states[0], Mapping) else {}
    return _f(state.get("avg_spec_accept_length"))
