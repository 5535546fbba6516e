"""One probed server in autotune's words: the resolved args, the runtime capacity and the operator's flags.

``/server_info`` mixes resolved startup args (top level) with runtime overrides (``internal_states[0]``);
this module reads each figure from the place SGLang 0.5.23 actually puts it (``srt/entrypoints/http_server.py``:
``/server_info`` and its ``internal_states``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import ConfigError
from autotune.inspect.probe import GpuMemory, InternalState, Probe, StartupPools, server_device
from autotune.redaction import secret_name
from autotune.sglang.endpoints import MemoryUsage
from autotune.sglang.flags import FlagTable

# Flags that say where the server runs, not how it is configured: left out of the config a sweep would tune.
_PLACEMENT = frozenset({"model_path", "tokenizer_path", "host", "port", "served_model_name", "base_gpu_id"})
# When /server_info has no launch_command, these resolved args are what the planner needs to replay the config.
_PLANNER_ARGS = (
    "mem_fraction_static",
    "max_running_requests",
    "max_total_tokens",
    "max_mamba_cache_size",
    "mamba_full_memory_ratio",
    "mamba_ssm_dtype",
    "mamba_radix_cache_strategy",
    "disable_radix_cache",
    "disable_overlap_schedule",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "chunked_prefill_size",
    "context_length",
    "kv_cache_dtype",
    "tp_size",
    "dp_size",
    "attn_dp_size",
    "page_size",
    "cuda_graph_max_bs_decode",
    "enable_metrics",
)


def as_num(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def as_int(value: Any) -> int | None:
    number = as_num(value)
    return None if number is None else int(number)


@dataclass(frozen=True, kw_only=True)
class ServerState:
    """The fields of one probe that the diagnosis reads, in autotune's words."""

    url: str
    version: str | None
    model_path: str | None
    architectures: list[str]
    args: dict[str, Any]  # top-level resolved args
    state: InternalState  # internal_states[0]
    launch_command: str | None
    effective_mrr: int
    mamba_slots: int | None
    kv_tokens: int
    context_len: int | None
    accept_length: float | None
    last_gen_throughput: float | None
    # GiB as SGLang reports them: weights, kv (the KV pool only), graphs, startup_available, and the Mamba pools
    # (mamba_states, spec_intermediates, mamba_total) when the startup log or the server states them, else None.
    memory: dict[str, float | None]
    memory_notes: list[str] = field(default_factory=list)  # where the Mamba figures came from, or why unknown
    device: str = "cuda"  # or "cpu": SGLang's CPU backend, pools in host RAM
    metrics: dict[str, float] | None
    metrics_note: str | None
    gpu: GpuMemory | None
    notes: list[str]
    simulated: bool

    @classmethod
    def from_probe(cls, p: Probe) -> ServerState:
        info, model_info = p.server_info, p.model_info or {}
        state = info["internal_states"][0]
        args = {k: v for k, v in info.items() if k != "internal_states"}
        usage = state.get("memory_usage")  # absent or null: no figure from it
        graphs = usage.get("graph") if usage else None
        graph_gib = sum(as_num(v) or 0.0 for v in graphs.values()) if isinstance(graphs, dict) else as_num(graphs)
        metrics = p.metrics or {}
        mamba_slots = as_int(state.get("max_mamba_cache_size"))
        kv_tokens = int(info["max_total_num_tokens"])
        kv_gib = as_num(usage.get("kvcache")) if usage else None
        if kv_gib is None:
            kv_gib = as_num(metrics.get("sglang:kv_cache_memory_usage_gb"))
        mamba, memory_notes = mamba_memory(usage, metrics, p.log, mamba_slots=mamba_slots, kv_tokens=kv_tokens)
        context = as_int(args.get("context_length")) or as_int(metrics.get("sglang:context_len"))
        if context is None and (max_input := info.get("max_req_input_len")) is not None:
            context = int(max_input) + 6  # SGLang: min(context_len − 1, kv − 1) − 5
        return cls(
            url=p.url,
            version=info.get("version"),
            model_path=model_info.get("model_path") or info.get("model_path"),
            architectures=list(model_info.get("architectures") or []),
            args=args,
            state=state,
            launch_command=info.get("launch_command"),
            effective_mrr=int(state["effective_max_running_requests_per_dp"]),
            mamba_slots=mamba_slots,
            kv_tokens=kv_tokens,
            context_len=context,
            accept_length=as_num(state.get("avg_spec_accept_length")),
            last_gen_throughput=as_num(state.get("last_gen_throughput")),
            memory={
                "weights": as_num(usage.get("weight")) if usage else None,
                "kv": kv_gib,
                "graphs": graph_gib,
                "startup_available": as_num(usage.get("startup_available")) if usage else None,
                **mamba,
            },
            memory_notes=memory_notes,
            device=server_device(info),
            metrics=p.metrics,
            metrics_note=p.metrics_note,
            gpu=p.gpu,
            notes=list(p.notes),
            simulated=bool(p.gpu and p.gpu.source.startswith("simulated")),
        )

    @property
    def spec(self) -> bool:
        return bool(self.args.get("speculative_algorithm"))

    def user_flags(self) -> dict[str, Any]:
        """The config as the operator gave it (dest-keyed): parsed from ``launch_command``, else the resolved args."""
        if self.launch_command:
            flags = flags_from_command(self.launch_command)
            if flags is not None:
                return flags
        return self._resolved_flags()

    def _resolved_flags(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for dest in _PLANNER_ARGS:
            value = self.args.get(dest)
            if value is None or value is False:
                continue
            if dest == "max_running_requests" and self.spec and value == 48:
                continue  # SGLang's speculative default, not a choice
            if dest == "mamba_full_memory_ratio" and value == 0.9:
                continue
            if dest in ("tp_size", "dp_size", "attn_dp_size", "page_size") and value == 1:
                continue
            if dest == "kv_cache_dtype" and value == "auto":
                continue
            out[dest] = value
        return out


def mamba_memory(
    usage: MemoryUsage | None,
    metrics: dict[str, float],
    log: StartupPools | None,
    *,
    mamba_slots: int | None,
    kv_tokens: int,
) -> tuple[dict[str, float | None], list[str]]:
    """The Mamba pools' GiB (states, speculative intermediates, total) and where they came from.

    SGLang 0.5.23's ``memory_usage.kvcache`` is the KV pool alone (K + V); the Mamba pools are reported only by the
    startup log's ``Mamba Cache is allocated`` line. A log that describes another startup (its slot or token
    count differs from the server's) is not used; what nothing states stays None ("unknown"), never a guess.
    """
    unknown: dict[str, float | None] = {"mamba_states": None, "spec_intermediates": None, "mamba_total": None}
    if mamba_slots is None:  # not a hybrid model: no Mamba pool at all
        return {"mamba_states": 0.0, "spec_intermediates": 0.0, "mamba_total": 0.0}, []
    if log is not None and log.mamba_slots is not None:
        mismatch = []
        if log.mamba_slots != mamba_slots:
            mismatch.append(f"{log.mamba_slots:,} Mamba slots there, {mamba_slots:,} here")
        if log.kv_tokens is not None and log.kv_tokens != kv_tokens:
            mismatch.append(f"{log.kv_tokens:,} KV tokens there, {kv_tokens:,} here")
        if not mismatch:
            states, spec = log.mamba_states_gib, log.spec_intermediates_gib
            total = None if states is None or spec is None else states + spec
            return (
                {"mamba_states": states, "spec_intermediates": spec, "mamba_total": total},
                [f"Mamba pools from the startup log {log.path} (`Mamba Cache is allocated`)"],
            )
        note = f"the startup log {log.path} describes another startup ({'; '.join(mismatch)}), so it is not used"
    elif log is not None:
        note = f"the startup log {log.path} has no `Mamba Cache is allocated` line"
    else:
        note = (
            "/server_info memory_usage.kvcache is the KV pool only (pass --log with the server's startup log "
            "to read its `Mamba Cache is allocated` line)"
        )
    # What the server states itself: a memory_usage or /metrics figure named for the Mamba pool, if any.
    stated = [v for k, v in (usage or {}).items() if "mamba" in k.lower() and as_num(v) is not None]
    stated_metrics = [v for k, v in metrics.items() if k.startswith("sglang:mamba") and k.endswith("_gb")]
    if stated or stated_metrics:
        total = sum(as_num(v) or 0.0 for v in stated) if stated else sum(stated_metrics)
        source = "/server_info memory_usage" if stated else "/metrics"
        return {**unknown, "mamba_total": total}, [f"Mamba pools' total from {source}; their split is unknown: {note}"]
    return unknown, [f"Mamba pool size unknown: {note}"]


def flags_from_command(command: str) -> dict[str, Any] | None:
    """SGLang's ``launch_command`` → dest-keyed flags (placement flags dropped), or None when unparseable."""
    table = FlagTable.bundled()
    tokens = shlex.split(command)
    while tokens and not tokens[0].startswith("--"):
        tokens.pop(0)  # "python -m sglang.launch_server" or "sglang serve" before the flags
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            return None
        name, _, inline = token.partition("=")
        if name.startswith("--sim-"):  # the simulator's own knobs (its device, its pace), not SGLang flags
            if not inline and i < len(tokens) and not tokens[i].startswith("--"):
                i += 1
            continue
        try:
            spec = table.lookup(name)
        except ConfigError:
            return None
        if spec.store_true:
            out[spec.dest] = True
            continue
        if spec.boolean_optional:
            out[spec.dest] = not name.startswith("--no-")
            continue
        values: list[str] = [inline] if inline else []
        while i < len(tokens) and not tokens[i].startswith("--") and (not values or spec.is_list):
            values.append(tokens[i])
            i += 1
        raw: Any = values if spec.is_list else (values[0] if values else None)
        try:
            out[spec.dest] = table.coerce(spec.dest, raw)
        except ConfigError:
            out[spec.dest] = raw
    if "config" in out:
        return None  # the flags live in a YAML file this side cannot read: the resolved args say more
    # Credentials (--api-key, --admin-api-key, --ssl-keyfile-password) are not configuration, and inspect's
    # tables, JSON and sweep files must never repeat them.
    return {k: v for k, v in out.items() if k not in _PLACEMENT and not secret_name(k)}
