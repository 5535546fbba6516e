"""``autotune inspect``: what a running SGLang server allocated, which limit caps it, and what it uses.

The seed's diagnosis in one pass — "KV 2-3 % used, 27 GB idle, capped at 16 by Mamba slots" — computed from
the server's own ``/server_info`` and ``/metrics`` (``diagnosis_probe``), then handed to the planner for the
next step (``diagnosis_suggest``). Read-only by construction: the probe only GETs info endpoints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from autotune import tls
from autotune.errors import AutotuneError
from autotune.inspect.probe import Probe, ProbeFailure, StartupPools, probe, read_startup_log
from autotune.inspect.state import ServerState, as_int
from autotune.inspect.suggest import Advice, advise
from autotune.sglang.args import mamba_slots_per_request
from autotune.sglang.parallel import requests_per_dp
from autotune.sglang.profiles import load_gpu, load_model


class InspectError(AutotuneError):
    """Inspect cannot do what was asked: no server could be inspected, or no sweep file can be based on one."""


@dataclass(frozen=True, kw_only=True)
class Limit:
    """One cap on ``max_running_requests`` (SGLang 0.5.23 ``srt/mem_cache/kv_cache_configurator.py``,
    ``resolve_max_num_reqs``): its name, value and where it comes from."""

    name: str  # mamba | kv | spec_default | explicit | est
    value: int
    why: str


@dataclass(frozen=True, kw_only=True)
class CapacityExplanation:
    effective: int  # the server's effective max running requests per DP worker
    binding: str | None  # the limit equal to ``effective`` (None: the server's figure is unexplained)
    limits: list[Limit]
    mamba_slots: int | None
    ratio: int | None  # Mamba slots per running request
    strategy: str | None
    kv_tokens: int
    sentence: str


@dataclass(frozen=True, kw_only=True)
class PoolUsage:
    """Live load from ``/metrics`` (None where the server does not export it)."""

    running: int | None = None
    queued: int | None = None
    retracted: int | None = None
    kv_used_pct: float | None = None
    kv_used_tokens: int | None = None
    mamba_used_pct: float | None = None
    mamba_used_slots: int | None = None
    running_pct: float | None = None  # running ÷ effective max running requests
    gen_throughput: float | None = None


def mamba_ratio(args: dict[str, Any], *, skip_decode_lock: bool = False) -> tuple[int | None, str | None]:
    """Mamba slots per running request (``sglang.args.mamba_slots_per_request``) from the resolved strategy, and the
    strategy's words; ``skip_decode_lock``: under SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1."""
    if args.get("disable_radix_cache"):
        return 1, "radix cache disabled"
    strategy = args.get("mamba_radix_cache_strategy")
    if strategy not in ("extra_buffer", "extra_buffer_lazy", "no_buffer"):
        return None, strategy
    overlap = not args.get("disable_overlap_schedule")
    words = (
        ("extra_buffer + overlap" if overlap else "extra_buffer, no overlap")
        if strategy == "extra_buffer"
        else strategy
    )
    return mamba_slots_per_request(strategy, overlap=overlap, radix_off=False, skip_decode_lock=skip_decode_lock), words


def explain_capacity(s: ServerState) -> CapacityExplanation:
    """Which of SGLang's caps produced the server's effective ``max_running_requests``."""
    ratio, strategy = mamba_ratio(s.args)
    limits: list[Limit] = []
    if s.mamba_slots is not None and ratio:
        limits.append(
            Limit(
                name="mamba",
                value=s.mamba_slots // ratio,
                why=f"{s.mamba_slots:,} Mamba slots ÷ {ratio} per request ({strategy})",
            )
        )
    requested = as_int(s.args.get("max_running_requests"))
    per_dp = requests_per_dp(requested, s.args) if requested is not None else None
    explicit = "max_running_requests" in s.user_flags()
    if per_dp is not None:
        if s.spec and requested == 48 and not explicit:
            limits.append(
                Limit(
                    name="spec_default",
                    value=per_dp,
                    why="SGLang's default of 48 under speculative decoding",
                )
            )
        else:
            limits.append(Limit(name="explicit", value=per_dp, why=f"--max-running-requests {requested}"))
    elif s.context_len:
        est = min(max(int(s.kv_tokens / s.context_len * 512), 2048), 4096)
        limits.append(Limit(name="est", value=est, why=f"SGLang's estimate from {s.kv_tokens:,} tokens ÷ context"))
    limits.append(Limit(name="kv", value=s.kv_tokens // 2, why=f"{s.kv_tokens:,} KV tokens ÷ 2"))
    # SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1 (an environment switch /server_info does not show) lowers the ratio by one
    # in the extra-buffer strategies (kv_cache_configurator.py L3066-3069)
    skipped = mamba_ratio(s.args, skip_decode_lock=True)[0]
    if (
        s.mamba_slots is not None
        and ratio
        and skipped
        and skipped != ratio
        and s.mamba_slots // ratio != s.effective_mrr == s.mamba_slots // skipped
    ):
        limits.insert(
            0,
            Limit(
                name="mamba",
                value=s.mamba_slots // skipped,
                why=f"{s.mamba_slots:,} Mamba slots ÷ {skipped} per request ({strategy}, "
                "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1)",
            ),
        )
    matching = [limit for limit in limits if limit.value == s.effective_mrr]
    binding = matching[0].name if matching else None
    if matching:
        also = f" (also {', '.join(m.name for m in matching[1:])})" if len(matching) > 1 else ""
        words = _LIMIT_WORDS[matching[0].name]
        sentence = f"capped at {s.effective_mrr} running requests by {words}: {matching[0].why}{also}"
    else:
        sentence = (
            f"{s.effective_mrr} running requests, matching none of the known caps "
            f"({'; '.join(f'{lim.name} {lim.value}' for lim in limits)}): the strategy or an env override differs"
        )
    if explicit and per_dp is not None and per_dp > s.effective_mrr:  # what users ask SGLang for
        sentence = f"asked for {per_dp} running, got {s.effective_mrr}: {sentence}"
    return CapacityExplanation(
        effective=s.effective_mrr,
        binding=binding,
        limits=limits,
        mamba_slots=s.mamba_slots,
        ratio=ratio,
        strategy=strategy,
        kv_tokens=s.kv_tokens,
        sentence=sentence,
    )


_LIMIT_WORDS = {
    "mamba": "the Mamba slots",
    "kv": "the KV cache",
    "spec_default": "the speculative default",
    "explicit": "--max-running-requests",
    "est": "SGLang's estimate",
}


def pool_usage(s: ServerState) -> PoolUsage | None:
    """Live pool usage from SGLang's gauges; None when metrics are off."""
    m = s.metrics
    if not m:
        return None
    running = as_int(m.get("sglang:num_running_reqs"))
    kv_pct = m.get("sglang:full_token_usage", m.get("sglang:token_usage"))
    kv_used = as_int(m.get("sglang:kv_used_tokens", m.get("sglang:num_used_tokens")))
    if kv_pct is None and kv_used is not None:
        kv_pct = kv_used / max(s.kv_tokens, 1)
    return PoolUsage(
        running=running,
        queued=as_int(m.get("sglang:num_queue_reqs")),
        retracted=as_int(m.get("sglang:num_retracted_reqs")),
        kv_used_pct=None if kv_pct is None else 100.0 * kv_pct,
        kv_used_tokens=kv_used,
        mamba_used_pct=None if m.get("sglang:mamba_usage") is None else 100.0 * m["sglang:mamba_usage"],
        mamba_used_slots=as_int(m.get("sglang:mamba_used_tokens")),
        running_pct=None if running is None else 100.0 * running / max(s.effective_mrr, 1),
        gen_throughput=m.get("sglang:gen_throughput"),
    )


@dataclass(frozen=True, kw_only=True)
class ServerDiagnosis:
    url: str
    state: ServerState
    capacity: CapacityExplanation
    usage: PoolUsage | None
    memory: dict[str, dict[str, float | None]]  # pool → {server, planner} GiB
    headline: str
    advice: Advice | None = None  # planner reproduction, suggestions, inert flags
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        s = self.state
        return {
            "url": self.url,
            "version": s.version,
            "model_path": s.model_path,
            "architectures": s.architectures,
            "headline": self.headline,
            "capacity": asdict(self.capacity),
            "usage": asdict(self.usage) if self.usage else None,
            "memory_gib": self.memory,
            "device": s.device,
            "gpu": asdict(s.gpu) if s.gpu else None,
            "accept_length": s.accept_length,
            "last_gen_throughput": s.last_gen_throughput,
            "config": s.user_flags(),
            "advice": asdict(self.advice) if self.advice is not None else None,
            "notes": self.notes,
        }


@dataclass(frozen=True, kw_only=True)
class Inspection:
    """A fleet's diagnosis: one entry per server that answered, one line per server that did not."""

    servers: list[ServerDiagnosis]
    failures: list[ProbeFailure]
    differences: list[str]

    @property
    def ok(self) -> bool:
        return bool(self.servers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "servers": [d.to_dict() for d in self.servers],
            "failures": [asdict(f) for f in self.failures],
            "differences": self.differences,
        }


def memory_split(s: ServerState, plan_gib: dict[str, float] | None) -> dict[str, dict[str, float | None]]:
    """Where the device's memory went: the server's own figures next to the planner's for the same config."""
    p = plan_gib or {}
    m = s.memory
    free = None
    if s.gpu:
        free = max(0.0, s.gpu.total_gib - s.gpu.used_gib)
    # SGLang's memory_usage.kvcache is the KV pool only (K + V); the Mamba pools are separate and come from the
    # startup log (or whatever the server states). A pool nobody reported stays None: "unknown", not a guess.
    kv, mamba = m["kv"], m.get("mamba_total")
    pools = None if kv is None or mamba is None else kv + mamba
    rows = {
        "weights": {"server": m["weights"], "planner": p.get("weights")},
        "pools": {"server": pools, "planner": _sum(p, "kv", "mamba_total")},
        "kv": {"server": m["kv"], "planner": p.get("kv")},
        "mamba_states": {"server": m.get("mamba_states"), "planner": _sum(p, "mamba_ssm", "mamba_conv")},
        "spec_intermediates": {
            "server": m.get("spec_intermediates"),
            "planner": _sum(p, "intermediate_ssm", "intermediate_conv"),
        },
        "graphs": {"server": m["graphs"], "planner": p.get("graphs")},
        "free": {"server": free, "planner": p.get("headroom")},
    }
    if s.gpu:
        rows["gpu_used"] = {"server": s.gpu.used_gib, "planner": None}
        rows["gpu_total"] = {"server": s.gpu.total_gib, "planner": p.get("total")}
    return rows


def _sum(d: dict[str, float], *keys: str) -> float | None:
    values = [d[k] for k in keys if d.get(k) is not None]
    return sum(values) if values else None


def headline(cap: CapacityExplanation, usage: PoolUsage | None, memory: dict[str, dict[str, float | None]]) -> str:
    """The seed's one-line diagnosis."""
    parts = [cap.sentence]
    if usage and usage.kv_used_pct is not None:
        parts.append(f"KV {usage.kv_used_pct:.1f} % used")
    if usage and usage.running is not None:
        parts.append(f"{usage.running} running, {usage.queued or 0} queued")
    free = memory["free"]["server"]
    if free is not None:
        parts.append(f"{free:.1f} GiB of GPU memory idle")
    elif memory["free"]["planner"] is not None:
        parts.append(f"~{memory['free']['planner']:.1f} GiB headroom (planner)")
    return "; ".join(parts)


def diagnose(p: Probe, *, model: str | None = None, gpu: str | None = None) -> ServerDiagnosis:
    """One server: capacity explanation, pool usage, memory split, and the planner's advice when it can."""
    state = ServerState.from_probe(p)
    cap = explain_capacity(state)
    usage = pool_usage(state)
    advice = advise(state, cap, model=model, gpu=gpu)
    memory = memory_split(state, advice.plan_gib if advice else None)
    notes = list(state.notes) + list(state.memory_notes)
    if state.metrics_note:
        notes.append(state.metrics_note)
    notes += advice.notes if advice else []
    return ServerDiagnosis(
        url=state.url,
        state=state,
        capacity=cap,
        usage=usage,
        memory=memory,
        headline=headline(cap, usage, memory),
        advice=advice,
        notes=notes,
    )


def fleet_differences(diagnoses: Sequence[ServerDiagnosis]) -> list[str]:
    """Servers whose config or capacity differs from the rest (the majority, or each other when there is none)."""
    if len(diagnoses) < 2:
        return []
    rows: list[dict[str, Any]] = []
    for d in diagnoses:
        facts = {
            "version": d.state.version,
            "model": d.state.model_path,
            "max running requests": d.capacity.effective,
            "Mamba slots": d.capacity.mamba_slots,
            "KV tokens": d.capacity.kv_tokens,
        }
        facts.update({f"--{k.replace('_', '-')}": v for k, v in d.state.user_flags().items()})
        rows.append(facts)
    keys = list(dict.fromkeys(key for facts in rows for key in facts))
    n = len(diagnoses)
    lines: list[str] = []
    for key in keys:
        values = [facts.get(key) for facts in rows]
        counts = Counter(repr(v) for v in values)
        if len(counts) == 1:
            continue
        common, count = counts.most_common(1)[0]
        if count * 2 > n:
            for d, v in zip(diagnoses, values, strict=True):
                if repr(v) != common:
                    lines.append(f"{d.url}: {key} = {_show(v)} (the others: {common if common != 'None' else 'unset'})")
        else:
            shown = ", ".join(f"{d.url} {_show(v)}" for d, v in zip(diagnoses, values, strict=True))
            lines.append(f"servers differ on {key}: {shown}")
    return lines


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def inspect_servers(
    urls: Sequence[str],
    *,
    model: str | None = None,
    gpu: str | None = None,
    timeout_s: float = 5.0,
    transport: httpx.BaseTransport | None = None,
    use_nvml: bool = True,
    logs: Sequence[str | Path | None] = (),
) -> Inspection:
    """Diagnose every URL; a server that cannot be inspected is one line in ``failures``, never an exception.
    ``logs[i]`` is the startup log of ``urls[i]`` (optional): the only place SGLang states its Mamba pools' size."""
    # A bad --model/--gpu/--log is the caller's mistake: say so before touching any server.
    if model:
        load_model(model)
    if gpu:
        load_gpu(gpu)
    if len(logs) > len(urls):
        raise InspectError(
            f"{len(logs)} startup logs for {len(urls)} server(s): give at most one --log per URL, "
            "in the order of the URLs"
        )
    pools: list[StartupPools | None] = []
    for path in logs:
        try:
            pools.append(read_startup_log(path) if path else None)
        except OSError as exc:
            raise InspectError(f"{path}: cannot read the startup log ({exc.strerror or exc})") from None
    pools += [None] * (len(urls) - len(pools))
    diagnoses: list[ServerDiagnosis] = []
    failures: list[ProbeFailure] = []
    with httpx.Client(timeout=timeout_s, transport=transport, follow_redirects=False, **tls.secured()) as client:
        for url, log in zip(urls, pools, strict=True):
            result = probe(url, client=client, use_nvml=use_nvml, log=log)
            if isinstance(result, ProbeFailure):
                failures.append(result)
                continue
            try:
                diagnoses.append(diagnose(result, model=model, gpu=gpu))
            except (KeyError, TypeError, ValueError) as exc:  # a field of the wrong shape: this server only
                failures.append(
                    ProbeFailure(
                        url=result.url,
                        kind="malformed",
                        message=f"{result.url}: /server_info has a malformed field ({exc!r})",
                    )
                )
    return Inspection(servers=diagnoses, failures=failures, differences=fleet_differences(diagnoses))
