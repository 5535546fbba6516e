"""One probed server in autotune's words: the resolved args, the runtime capacity and the operator's flags.

``/server_info`` mixes resolved startup args (top level) with runtime overrides (``internal_states[0]``);
this module reads each figure from the place SGLang 0.5.23 actually puts it (FACTS §3).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from autotune.diagnosis_probe import Probe

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
    state: dict[str, Any]  # internal_states[0]
    launch_command: str | None
    effective_mrr: int
    mamba_slots: int | None
    kv_tokens: int
    context_len: int | None
    accept_length: float | None
    last_gen_throughput: float | None
    memory: dict[str, float | None]  # weights / kv / graphs / startup_available, GiB as SGLang reports them
    metrics: dict[str, float] | None
    metrics_note: str | None
    gpu: dict[str, Any] | None
    notes: list[str]
    simulated: bool

    @classmethod
    def from_probe(cls, p: Probe) -> ServerState:
        info, model_info = p.server_info, p.model_info or {}
        state = info["internal_states"][0]
        args = {k: v for k, v in info.items() if k != "internal_states"}
        usage = state.get("memory_usage") or {}
        graphs = usage.get("graph")
        graph_gib = (
            sum(as_num(v) or 0.0 for v in graphs.values()) if isinstance(graphs, dict) else as_num(graphs)
        )
        metrics = p.metrics or {}
        context = as_int(args.get("context_length")) or as_int(metrics.get("sglang:context_len"))
        if context is None and args.get("max_req_input_len") is not None:
            context = int(args["max_req_input_len"]) + 6  # SGLang: min(context_len − 1, kv − 1) − 5
        return cls(
            url=p.url,
            version=info.get("version"),
            model_path=model_info.get("model_path") or info.get("model_path"),
            architectures=list(model_info.get("architectures") or []),
            args=args,
            state=state,
            launch_command=info.get("launch_command"),
            effective_mrr=int(state["effective_max_running_requests_per_dp"]),
            mamba_slots=as_int(state.get("max_mamba_cache_size")),
            kv_tokens=int(info["max_total_num_tokens"]),
            context_len=context,
            accept_length=as_num(state.get("avg_spec_accept_length")),
            last_gen_throughput=as_num(state.get("last_gen_throughput")),
            memory={
                "weights": as_num(usage.get("weight")),
                "kv": as_num(usage.get("kvcache")),
                "graphs": graph_gib,
                "startup_available": as_num(usage.get("startup_available")),
            },
            metrics=p.metrics,
            metrics_note=p.metrics_note,
            gpu=p.gpu,
            notes=list(p.notes),
            simulated=bool(p.gpu and str(p.gpu.get("source", "")).startswith("simulated")),
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


def flags_from_command(command: str) -> dict[str, Any] | None:
    """SGLang's ``launch_command`` → dest-keyed flags (placement flags dropped), or None when unparseable."""
    from autotune.errors import ConfigError
    from autotune.flags import FlagTable

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
    return {k: v for k, v in out.items() if k not in _PLACEMENT}
