"""Read a running SGLang server without touching its state (GETs of its info endpoints and, when given, its startup
log), so ``autotune inspect`` is safe against a production fleet; a failure is one ``ProbeFailure`` line.
docs/contracts.md (``inspect/``).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from autotune import redaction
from autotune.harness.gpu import NvmlReader
from autotune.sglang.endpoints import MemoryUsage, ModelInfo

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})

# /server_info fields the diagnosis cannot do without; an SGLang whose /server_info lacks one is reported as such.
REQUIRED_STATE = ("effective_max_running_requests_per_dp",)
REQUIRED_TOP = ("max_total_num_tokens",)


class InternalState(TypedDict, total=False):
    """``/server_info`` ``internal_states[0]``, the scheduler's runtime state (SGLang 0.5.23
    ``srt/managers/scheduler.py`` ``get_internal_state``): the keys inspect reads. The keys are SGLang's; only
    ``REQUIRED_STATE`` is checked to be there, every other one is read with ``.get``."""

    effective_max_running_requests_per_dp: int
    max_mamba_cache_size: int | None
    memory_usage: MemoryUsage | None
    avg_spec_accept_length: float | None
    last_gen_throughput: float | None
    device: str | None


class ServerInfo(TypedDict, total=False):
    """``/server_info`` (SGLang 0.5.23 ``srt/entrypoints/http_server.py``): the resolved server args at the top
    level (every ``ServerArgs`` field by dest name; the ones inspect names are listed) and the runtime state in
    ``internal_states``. ``fetch_server_info`` checks ``model_path``, ``REQUIRED_TOP`` and ``REQUIRED_STATE``."""

    model_path: str
    version: str | None
    max_total_num_tokens: int
    internal_states: list[InternalState]
    launch_command: str | None
    device: str | None
    base_gpu_id: int | None
    context_length: int | None
    max_req_input_len: int | None


@dataclass(frozen=True, kw_only=True)
class StartupPools:
    """The pool lines of a server's startup log (the latest startup when the log holds several), GiB."""

    path: str
    mamba_slots: int | None = None  # ``max_mamba_cache_size`` of the ``Mamba Cache is allocated`` line
    mamba_gib: dict[str, float] = field(default_factory=dict)  # conv_state, ssm_state, intermediate_* → GiB
    kv_gib: float | None = None  # K + V of every ``KV Cache is allocated`` line of that startup (target + draft)
    kv_tokens: int | None = None  # ``max_total_num_tokens=`` of the capacity line

    @property
    def mamba_states_gib(self) -> float | None:
        parts = [self.mamba_gib[k] for k in ("conv_state", "ssm_state") if k in self.mamba_gib]
        return sum(parts) if parts else None

    @property
    def spec_intermediates_gib(self) -> float | None:
        if self.mamba_slots is None:
            return None
        # SGLang prints the intermediate buffers only under speculative decoding: absent means none.
        return sum(v for k, v in self.mamba_gib.items() if k.startswith("intermediate"))


@dataclass(frozen=True)
class GpuMemory:
    """The device's memory as read for one server (GiB used and in all), and the reader that said so."""

    used_gib: float
    total_gib: float
    source: str  # "simulated GPU (/sim/gpu)" or "NVML GPU <index>"


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What one server said, raw: the JSON bodies, the parsed Prometheus gauges, and its startup log's pools."""

    url: str
    server_info: ServerInfo
    model_info: ModelInfo | None = None
    metrics: dict[str, float] | None = None  # sglang:<name> → value summed over label sets (one per rank)
    metrics_note: str | None = None  # why there are no metrics
    gpu: GpuMemory | None = None
    log: StartupPools | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return (urlsplit(self.url).hostname or "") in LOCAL_HOSTS


@dataclass(frozen=True, kw_only=True)
class ProbeFailure:
    """A server that could not be inspected, and the one line that says why."""

    url: str
    kind: str  # unreachable | not_sglang | missing_field | http_error
    message: str


_MAMBA_LINE = re.compile(r"Mamba Cache is allocated\. max_mamba_cache_size: (\d+),(.*)")
_MAMBA_PART = re.compile(r"(\w+) size: ([\d.]+)\s*GB")
_KV_LINE = re.compile(r"KV Cache is allocated\. .*?#tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB")
_CAPACITY_LINE = re.compile(r"max_total_num_tokens=(\d+), chunked_prefill_size=")
_STARTUP_BEGINS = ("Memory baseline taken", "server_args={", "server_args=ServerArgs(")


def read_startup_log(path: str | Path) -> StartupPools:
    """The pool lines of the latest startup in a server log, read line by line (a log may be gigabytes).

    OSError when the file cannot be read; a log without pool lines gives empty fields, not a guess."""
    mamba: tuple[int, dict[str, float]] | None = None
    kv: list[float] = []
    tokens: int | None = None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if any(marker in line for marker in _STARTUP_BEGINS):
                mamba, kv, tokens = None, [], None  # a log appended across restarts: only the latest counts
            elif m := _MAMBA_LINE.search(line):
                mamba = (int(m[1]), {k: float(v) for k, v in _MAMBA_PART.findall(m[2])})
            elif m := _KV_LINE.search(line):
                kv.append(float(m[2]) + float(m[3]))
            elif m := _CAPACITY_LINE.search(line):
                tokens = int(m[1])
    return StartupPools(
        path=str(path),
        mamba_slots=mamba[0] if mamba else None,
        mamba_gib=mamba[1] if mamba else {},
        kv_gib=round(sum(kv), 4) if kv else None,
        kv_tokens=tokens,
    )


def normalise_url(url: str) -> str:
    """``host:port`` → ``http://host:port``; no trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = f"http://{url}"
    return url.rstrip("/")


_FRACTIONS = ("_usage", "_rate", "_ratio", "accept_length")


def _samples(text: str) -> Iterator[tuple[str, float]]:
    """(sample name, value) of every sample, by ``prometheus_client``'s parser; a malformed exposition is read
    line by line so that one bad line costs only itself."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        families = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                families += text_string_to_metric_families(line + "\n")
    for family in families:
        for sample in family.samples:
            yield sample.name, sample.value


def parse_prometheus(text: str) -> dict[str, float]:
    """Gauges and counters of a Prometheus text exposition, one value per name across label sets.

    Counts add up across label sets (DP workers, graph phases); fractions (``*_usage``, ``*_rate``, accept
    lengths) are averaged. Histogram series (``_bucket``/``_sum``/``_count``) are skipped: inspect reads levels.
    """
    out: dict[str, float] = {}
    seen: dict[str, int] = {}
    for name, value in _samples(text):
        if name.endswith(("_bucket", "_sum", "_count")) or math.isnan(value):
            continue
        out[name] = out.get(name, 0.0) + value
        seen[name] = seen.get(name, 0) + 1
    for name, count in seen.items():
        if count > 1 and name.endswith(_FRACTIONS):
            out[name] /= count
    return out


def _json(response: httpx.Response) -> Any:
    if "json" not in response.headers.get("content-type", "json"):
        raise ValueError(f"content-type {response.headers.get('content-type')}")
    return response.json()


def _describe(response: httpx.Response) -> str:
    kind = response.headers.get("content-type", "no content-type").split(";")[0]
    return f"HTTP {response.status_code} ({kind})"


def fetch_server_info(client: httpx.Client, url: str) -> ServerInfo | ProbeFailure:
    """``/server_info`` or the line saying why this is not an inspectable SGLang server."""
    try:
        response = client.get(f"{url}/server_info")
    except httpx.HTTPError as exc:
        reason = type(exc).__name__
        return ProbeFailure(
            url=url,
            kind="unreachable",
            message=f"{url}: unreachable ({reason}: {exc or 'no answer'}); is the server running?",
        )
    if response.status_code == 404:
        return ProbeFailure(
            url=url,
            kind="not_sglang",
            message=f"{url}: not an SGLang server (GET /server_info → {_describe(response)})",
        )
    if response.status_code != 200:
        return ProbeFailure(
            url=url,
            kind="http_error",
            message=f"{url}: GET /server_info → {_describe(response)}; is the server still starting?",
        )
    try:
        info = redaction.scrub(_json(response))  # it echoes the server's --api-key
    except ValueError:
        return ProbeFailure(
            url=url,
            kind="not_sglang",
            message=f"{url}: not an SGLang server (GET /server_info → {_describe(response)}, not JSON)",
        )
    if not isinstance(info, dict) or "model_path" not in info:
        return ProbeFailure(
            url=url,
            kind="not_sglang",
            message=f"{url}: not an SGLang server (/server_info JSON has no model_path)",
        )
    missing = [key for key in REQUIRED_TOP if info.get(key) is None]
    states = info.get("internal_states")
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        missing.append("internal_states[0]")
    else:
        missing += [f"internal_states[0].{key}" for key in REQUIRED_STATE if states[0].get(key) is None]
    if missing:
        version = info.get("version", "unknown")
        return ProbeFailure(
            url=url,
            kind="missing_field",
            message=f"{url}: SGLang {version}'s /server_info lacks {', '.join(missing)}; "
            "inspect reads SGLang 0.5.23's fields (upgrade the server or read its startup log)",
        )
    return cast(ServerInfo, info)  # the keys inspect cannot do without are there; the others are read with .get


def _optional_json(client: httpx.Client, url: str, path: str) -> dict[str, Any] | None:
    try:
        response = client.get(f"{url}{path}")
        if response.status_code != 200:
            return None
        body = _json(response)
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _metrics(client: httpx.Client, url: str) -> tuple[dict[str, float] | None, str | None]:
    try:
        response = client.get(f"{url}/metrics")
    except httpx.HTTPError as exc:
        return None, f"/metrics unreadable ({type(exc).__name__})"
    if response.status_code == 404:
        return None, "metrics disabled: no live pool usage (restart with --enable-metrics to see it)"
    if response.status_code != 200:
        return None, f"/metrics → {_describe(response)}"
    gauges = parse_prometheus(response.text)
    if not any(name.startswith("sglang:") for name in gauges):
        return None, "/metrics has no sglang: series"
    return gauges, None


def _sim_gpu(client: httpx.Client, url: str) -> GpuMemory | None:
    # The simulated server's device reading; a real SGLang answers 404 and NVML stands in when local.
    body = _optional_json(client, url, "/sim/gpu")
    if not body:
        return None
    used = body.get("used_gib", _mib(body.get("used_mib")))
    total = body.get("total_gib", _mib(body.get("total_mib")))
    if used is None or total is None:
        return None
    return GpuMemory(float(used), float(total), "simulated GPU (/sim/gpu)")


def _mib(value: Any) -> float | None:
    return None if value is None else float(value) / 1024.0


def _nvml_gpu(index: int) -> GpuMemory | None:
    """The device's memory through NVML, or None: NVML is optional here, never a reason to fail."""
    try:
        reader = NvmlReader(index)
        try:
            reading = reader.read()
        finally:
            reader.close()
    except Exception:  # noqa: BLE001 - no driver, no library, no device: inspect simply reports without it
        return None
    if reading.used_gib is None or reading.total_gib is None:
        return None
    return GpuMemory(reading.used_gib, reading.total_gib, f"NVML GPU {index}")


def probe(
    url: str, *, client: httpx.Client, use_nvml: bool = True, log: StartupPools | None = None
) -> Probe | ProbeFailure:
    """Everything inspect reads from one server, GET only. ``/server_info`` answering is the liveness check.
    ``log``: the pools of the server's startup log (``read_startup_log``), when the caller has it."""
    url = normalise_url(url)
    info = fetch_server_info(client, url)
    if isinstance(info, ProbeFailure):
        return info
    notes: list[str] = []
    # SGLang's keys, read with .get: a server that lacks one has None there
    model_info = cast("ModelInfo | None", _optional_json(client, url, "/model_info"))
    if model_info is None:
        notes.append("/model_info unreadable: model inferred from /server_info model_path")
    metrics, metrics_note = _metrics(client, url)
    gpu = _sim_gpu(client, url)
    local = (urlsplit(url).hostname or "") in LOCAL_HOSTS
    if gpu is None and server_device(info) == "cpu":
        # SGLang's CPU backend: its pools live in host RAM. NVML would describe some GPU it does not use.
        notes.append("CPU server (device cpu): its pools live in host RAM, so there is no GPU memory reading")
        return Probe(
            url=url,
            server_info=info,
            model_info=model_info,
            metrics=metrics,
            metrics_note=metrics_note,
            gpu=None,
            log=log,
            notes=notes,
        )
    if gpu is None and local and use_nvml:
        # base_gpu_id is the server's first device as SGLang numbers it; with CUDA_VISIBLE_DEVICES set the
        # physical index may differ, which the note below owns up to.
        gpu = _nvml_gpu(int(info.get("base_gpu_id") or 0))
        if gpu is not None:
            notes.append(f"GPU memory read from {gpu.source} (assumes the server's CUDA_VISIBLE_DEVICES is unset)")
    if gpu is None:
        notes.append(
            "no GPU memory reading (server not local or NVML unavailable): idle memory is the planner's estimate"
        )
    return Probe(
        url=url,
        server_info=info,
        model_info=model_info,
        metrics=metrics,
        metrics_note=metrics_note,
        gpu=gpu,
        log=log,
        notes=notes,
    )


def server_device(info: ServerInfo) -> str:
    """The device SGLang runs on (``device`` in ``/server_info``; unset means CUDA)."""
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    return str(info.get("device") or state.get("device") or "cuda").lower()
