"""SGLang 0.5.23's log lines, word for word, so one log parser serves the real server and the simulator.

Formats follow the recorded logs of a real server (timestamps ``[YYYY-mm-dd HH:MM:SS]``, GiB printed as "GB").
Only the first line of a multi-line record (a traceback) carries a timestamp, as in SGLang.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from autotune.sglang.adaptive import AdaptiveSpec

if TYPE_CHECKING:
    from autotune.sglang.endpoints import StartupTime

READY = "The server is fired up and ready to roll!"
SIGQUIT = "Received sigquit from a child process. It usually means the child failed."
CAPTURE_SOLUTIONS = (
    "Possible solutions:",
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
    "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)",
    "3. disable decode CUDA graph by --cuda-graph-backend-decode=disabled.",
)
_POOL_FRAMES = (
    (
        "site-packages/sglang/srt/managers/scheduler.py",
        6362,
        "run_scheduler_process",
        "scheduler = Scheduler(server_args, port_args)",
    ),
    ("site-packages/sglang/srt/managers/scheduler.py", 1137, "init_model_worker", "self.init_memory_pools()"),
    (
        "site-packages/sglang/srt/model_executor/model_runner.py",
        982,
        "alloc_memory_pool",
        "result = self.kv_cache_configurator.configure(",
    ),
    (
        "site-packages/sglang/srt/mem_cache/kv_cache_configurator.py",
        3182,
        "_resolve_memory_pool_config",
        "available_bytes = self._profile_available_bytes(pre_model_load_memory)",
    ),
)
_GRAPH_FRAMES = (
    (
        "site-packages/sglang/srt/managers/scheduler.py",
        6362,
        "run_scheduler_process",
        "scheduler = Scheduler(server_args, port_args)",
    ),
    (
        "site-packages/sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py",
        771,
        "init_cuda_graphs",
        "self.graph_runner = DecodeCudaGraphRunner(self)",
    ),
    ("site-packages/sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", 597, "__init__", "raise Exception("),
)
_RUNTIME_FRAMES = (
    ("site-packages/sglang/srt/managers/scheduler.py", 6370, "run_scheduler_process", "scheduler.event_loop_overlap()"),
    (
        "site-packages/sglang/srt/managers/scheduler.py",
        1532,
        "event_loop_overlap",
        "batch_result = self.run_batch(batch)",
    ),
    ("site-packages/sglang/srt/model_executor/model_runner.py", 2310, "forward_extend", "return self.model.forward("),
)

_DEVICE_FRAMES = (
    (
        "site-packages/sglang/srt/managers/scheduler.py",
        6362,
        "run_scheduler_process",
        "scheduler = Scheduler(server_args, port_args)",
    ),
    ("site-packages/sglang/srt/managers/scheduler.py", 552, "__init__", "self.init_model_worker()"),
    ("site-packages/sglang/srt/managers/tp_worker.py", 247, "__init__", "self._model_runner = ModelRunner("),
    (
        "site-packages/sglang/srt/model_executor/model_runner.py",
        383,
        "__init__",
        "min_per_gpu_memory = self.init_torch_distributed()",
    ),
    (
        "site-packages/sglang/srt/model_executor/model_runner.py",
        791,
        "init_torch_distributed",
        "torch.get_device_module(self.device).set_device(self.gpu_id)",
    ),
    ("site-packages/torch/cuda/__init__.py", 567, "set_device", "torch._C._cuda_setDevice(device)"),
)
INVALID_ORDINAL = "RuntimeError: CUDA error: invalid device ordinal"
TORCH_CUDA_HINTS = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
)


class Log:
    """Timestamped lines on one stream (the harness captures stdout and stderr together)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, message: str, *, rank: str = "") -> None:
        """One record; ``rank`` is a scheduler's prefix (``TP1``), printed inside the brackets as SGLang does."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S") + (f" {rank}" if rank else "")
        self.stream.write(f"[{stamp}] {message}\n")
        self.stream.flush()

    def lines(self, messages: Iterable[str], *, rank: str = "") -> None:
        for message in messages:
            self(message, rank=rank)


def gb(value: float) -> str:
    return f"{value:.2f}"


def server_args_line(server_args: dict[str, Any]) -> str:
    return f"server_args={server_args!r}"


def baseline(usage_gib: float) -> str:
    return f"Memory baseline taken. mem usage={gb(usage_gib)} GB"


def load_begin(avail_gib: float) -> str:
    return f"Load weight begin. avail mem={gb(avail_gib)} GB"


def load_end(elapsed_s: float, model_class: str, avail_gib: float, usage_gib: float) -> str:
    return (
        f"Load weight end. elapsed={elapsed_s:.2f} s, type={model_class}, avail mem={gb(avail_gib)} GB, "
        f"mem usage={gb(usage_gib)} GB."
    )


def mamba_cap(running: int, slots: int, ratio: int) -> str:
    return (
        f"max_running_requests is capped to {running} by the mamba state cache (max_mamba_cache_size={slots}, "
        f"{ratio} state slots per request). To raise it: increase --mamba-full-memory-ratio or "
        "--max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype bfloat16."
    )


def mamba_pool(slots: int, conv_gib: float, ssm_gib: float, inter_ssm: float | None, inter_conv: float | None) -> str:
    line = (
        f"Mamba Cache is allocated. max_mamba_cache_size: {slots}, conv_state size: {gb(conv_gib)}GB, "
        f"ssm_state size: {gb(ssm_gib)}GB "
    )
    if inter_ssm is not None:
        line += (
            f"intermediate_ssm_state_cache size: {gb(inter_ssm)}GB "
            f"intermediate_conv_window_cache size: {gb(inter_conv or 0.0)}GB"
        )
    return line


def kv_pool(dtype: str, tokens: int, k_gib: float, v_gib: float) -> str:
    return f"KV Cache is allocated. dtype: {dtype}, #tokens: {tokens}, K size: {gb(k_gib)} GB, V size: {gb(v_gib)} GB"


def unified_pool(total_bytes: int) -> str:
    """``--enable-unified-memory``'s buffer (``UnifiedKVPool.__init__``, unified_memory_pool.py L567-575)."""
    return (
        f"[unified-memory-pool] UnifiedKVPool allocated: total_bytes={total_bytes / 2**30:.2f} GB "
        f"(={total_bytes} B), 2 sub-pool(s)"
    )


def adaptive_init(adaptive: AdaptiveSpec) -> str:
    """``AdaptiveSpeculativeParams.__init__`` (adaptive_spec_params.py L296-303): the first slot's steps."""
    first = min(adaptive.table)
    cands = list(adaptive.table[first].candidates)
    return f"AdaptiveSpeculativeParams initialized: steps={adaptive.slot_initial(first)}, candidate_steps={cands}"


def pool_end(avail_gib: float) -> str:
    return f"Memory pool end. avail mem={gb(avail_gib)} GB"


def capture_begin(name: str, detail: str, avail_gib: float) -> str:
    return f"Capture {name} CUDA graph begin. {detail}, avail mem={gb(avail_gib)} GB"


def capture_end(name: str, bs: Sequence[int] | None, elapsed_s: float, usage_gib: float, avail_gib: float) -> str:
    head = f"bs={list(bs)}, " if bs is not None else ""
    return (
        f"Capture {name} CUDA graph end. {head}elapsed={elapsed_s:.2f} s, mem usage={gb(usage_gib)} GB, "
        f"avail mem={gb(avail_gib)} GB."
    )


def capacity(*, tokens: int, chunked: int, max_prefill: int, running: int, context_len: int, avail_gib: float) -> str:
    return (
        f"max_total_num_tokens={tokens}, chunked_prefill_size={chunked}, max_prefill_tokens={max_prefill}, "
        f"max_running_requests={running}, context_len={context_len}, available_gpu_mem={gb(avail_gib)} GB"
    )


def startup_timings(startup: StartupTime) -> str:
    graphs = ", ".join(f"{k}={v:.2f}" for k, v in startup["cuda_graph"].items())
    return (
        f"Engine startup timings (s): load_weight={startup['load_weight']:.2f}, "
        f"kv_cache_allocation={startup['kv_cache_allocation']:.2f}, "
        f"scheduler_e2e={startup['scheduler_e2e']:.2f}, cuda_graph={{{graphs}}}, "
        f"tokenizer_e2e={startup['tokenizer_e2e']:.2f}"
    )


_CLASS = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")


def error_class(message: str) -> str:
    """The Python exception SGLang raises with this message (what a traceback's last line starts with)."""
    if message.startswith("Loaded weights leave no GPU memory"):
        return "ValueError"
    if message.startswith("Capture cuda graph failed"):
        return "Exception"
    if message.startswith("CUDA out of memory"):
        return "torch.OutOfMemoryError"
    return "RuntimeError"


def error_line(message: str) -> str:
    """``Class: message``, keeping a class the message already names."""
    return message if _CLASS.match(message) else f"{error_class(message)}: {message}"


def capture_failure_text(oom: str) -> str:
    """A failed decode-graph capture: the torch OOM wrapped with SGLang's advice, one suggestion per line."""
    head = oom.split(" Possible solutions:")[0].split("\nPossible solutions:")[0]
    if "Capture cuda graph failed" not in head:
        head = f"Capture cuda graph failed: {head if _CLASS.match(head) else 'torch.OutOfMemoryError: ' + head}"
    return "\n".join((head, *CAPTURE_SOLUTIONS))


def scheduler_exception(message: str, *, phase: str) -> list[str]:
    """``Scheduler hit an exception:`` + a traceback ending in ``message``, as one multi-line record."""
    frames = {"graph": _GRAPH_FRAMES, "runtime": _RUNTIME_FRAMES}.get(phase, _POOL_FRAMES)
    body = ["Scheduler hit an exception: Traceback (most recent call last):"]
    for path, line, func, code in frames:
        body += [f'  File "{path}", line {line}, in {func}', f"    {code}"]
    body.append(error_line(message))
    return ["\n".join(body) + "\n"]


def invalid_device_ordinal() -> list[str]:
    """A scheduler whose ``gpu_id`` is past the visible devices: torch's error from ``set_device`` in
    ``ModelRunner.init_torch_distributed``, the first CUDA call of a rank."""
    body = ["Scheduler hit an exception: Traceback (most recent call last):"]
    for path, line, func, code in _DEVICE_FRAMES:
        body += [f'  File "{path}", line {line}, in {func}', f"    {code}"]
    body += [INVALID_ORDINAL, *TORCH_CUDA_HINTS]
    return ["\n".join(body) + "\n"]


def runtime_oom(new_tokens: int, alloc_gib: float) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {alloc_gib:.2f} GiB. The activations of a "
        f"{new_tokens}-token prefill batch do not fit in the memory left outside the static pools."
    )


def prefill_line(
    *,
    new_seq: int,
    new_token: int,
    kv_usage: float,
    mamba_usage: float,
    hybrid: bool,
    running: int,
    queue: int,
    pending: int,
    graph: bool,
    throughput: float,
    cached_token: int = 0,
) -> str:
    if hybrid:
        usage = f"full token usage: {kv_usage:.2f}, mamba usage: {mamba_usage:.2f}"
    else:
        usage = f"token usage: {kv_usage:.2f}"
    return (
        f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: {cached_token}, {usage}, "
        f"#running-req: {running}, #queue-req: {queue}, #pending-token: {pending}, cuda graph: {graph}, "
        f"input throughput (token/s): {throughput:.2f}"
    )


def decode_line(
    *,
    running: int,
    kv_used: int,
    kv_usage: float,
    mamba_num: int,
    mamba_usage: float,
    hybrid: bool,
    spec: bool,
    accept_len: float,
    accept_rate: float,
    graph: bool,
    throughput: float,
    queue: int,
) -> str:
    if hybrid:
        pools = (
            f"#full token: {kv_used}, full token usage: {kv_usage:.2f}, mamba num: {mamba_num}, "
            f"mamba usage: {mamba_usage:.2f}"
        )
    else:
        pools = f"#token: {kv_used}, token usage: {kv_usage:.2f}"
    spec_part = f"accept len: {accept_len:.2f}, accept rate: {accept_rate:.2f}, " if spec else ""
    return (
        f"Decode batch, #running-req: {running}, {pools}, {spec_part}cuda graph: {graph}, "
        f"gen throughput (token/s): {throughput:.2f}, #queue-req: {queue}"
    )


def retract_line(retracted: int, gained: int, mamba_gained: int | None, old: float, new: float) -> str:
    mamba = f", #mamba_num_gained: {mamba_gained}" if mamba_gained is not None else ""
    return (
        f"KV cache pool is full. Retract requests. #retracted_reqs: {retracted}, #new_tokens_gained: {gained}"
        f"{mamba}, #new_token_ratio: {old:.4f} -> {new:.4f}"
    )


def pace_line(modelled_s: float, lag_s: float) -> str:
    """The simulator's own line (not SGLang's): how far its wall clock fell behind its modelled clock."""
    share = lag_s / modelled_s if modelled_s > 0 else 0.0
    return (
        f"[sim] pacing: {modelled_s:.2f} modelled s, wall clock {lag_s:+.3f} s behind ({share:.1%} lag); "
        f"over 2 % the harness refuses the measurement"
    )


def prometheus_modes(name: str, kind: str, values: dict[str, float], *, labels: dict[str, str]) -> str:
    """One SGLang metric split by a ``mode`` label (``prefill_effective_tokens_total{mode="device_hit"}``)."""
    out = [f"# HELP sglang:{name} {name.replace('_', ' ')}.", f"# TYPE sglang:{name} {kind}"]
    for mode, value in values.items():
        lab = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "mode": mode}.items()))
        out.append(f"sglang:{name}{{{lab}}} {float(value)}")
    return "\n".join(out) + "\n"


def kill_tree(pid: int, *, include_parent: bool) -> str:
    return f"kill_process_tree called: parent_pid={pid}, include_parent={include_parent}, pid={pid}"


def sigterm() -> str:
    return "SIGTERM received. signum=None frame=None. Draining requests and shutting down..."


def graceful(remaining: Sequence[str]) -> str:
    return (
        f"Gracefully exiting... Remaining number of requests {len(remaining)}. "
        f"Remaining requests remaining_rids={list(remaining)}."
    )


def prometheus(
    gauges: dict[str, float],
    counters: dict[str, float],
    summaries: dict[str, tuple[float, float]],
    *,
    labels: dict[str, str],
) -> str:
    """``/metrics`` text with SGLang's metric names (``sglang:`` prefix) and labels."""
    lab = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    out: list[str] = []
    for name, value in gauges.items():
        out += [
            f"# HELP sglang:{name} {name.replace('_', ' ')}.",
            f"# TYPE sglang:{name} gauge",
            f"sglang:{name}{lab} {float(value or 0.0)}",
        ]
    for name, value in counters.items():
        out += [
            f"# HELP sglang:{name} {name.replace('_', ' ')}.",
            f"# TYPE sglang:{name} counter",
            f"sglang:{name}{lab} {float(value or 0.0)}",
        ]
    for name, (total, count) in summaries.items():
        out += [
            f"# HELP sglang:{name} {name.replace('_', ' ')}.",
            f"# TYPE sglang:{name} histogram",
            f'sglang:{name}_bucket{lab[:-1]},le="+Inf"}} {float(count)}',
            f"sglang:{name}_sum{lab} {float(total)}",
            f"sglang:{name}_count{lab} {float(count)}",
        ]
    return "\n".join(out) + "\n"


def prometheus_histogram(
    name: str, bounds: tuple[float, ...], counts: list[int], total: float, *, labels: dict[str, str]
) -> str:
    """One SGLang histogram (``sglang:<name>``): cumulative ``_bucket`` series for ``bounds`` and ``+Inf``,
    then ``_sum`` and ``_count``. ``counts[i]`` is the observations in bucket i (``counts[-1]``: above the last
    bound), not yet cumulative."""
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    out = [
        f"# HELP sglang:{name} {name.replace('_', ' ')}.",
        f"# TYPE sglang:{name} histogram",
        f"sglang:{name}_sum{{{lab}}} {float(total)}",
    ]
    running = 0
    for bound, count in zip((*map(repr, map(float, bounds)), "+Inf"), counts, strict=True):
        running += count
        out.append(f'sglang:{name}_bucket{{{lab},le="{bound}"}} {float(running)}')
    out.append(f"sglang:{name}_count{{{lab}}} {float(running)}")
    return "\n".join(out) + "\n"


KV_DTYPES = {"fp8_e5m2": "torch.float8_e5m2", "fp8_e4m3": "torch.float8_e4m3fn", "float16": "torch.float16"}


def decode_bs(max_bs: int) -> list[int]:
    """SGLang's decode capture sizes up to ``max_bs`` (the effective request pool is added as its own bucket)."""
    sizes = [b for b in (*range(1, 17), *range(18, 33, 2), *range(40, 1025, 8)) if b <= max_bs]
    return sizes + ([max_bs] if max_bs > 0 and max_bs not in sizes else [])


def prefill_tokens(chunked: int) -> list[int]:
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(5120, 32769, 1024),
    ]
    return [t for t in sizes if t <= max(chunked, 4)]


# -- the startup sequence of one server (``st`` is the sim's ServerStatus)
# --------------------------------------------------------------------------------------
def load_lines(st: Any) -> list[str]:
    pre, t, d = st.pre_gib, st.target_gib, st.draft_gib
    times = st.startup_time
    lines = [
        baseline(st.context_mib / 1024),
        load_begin(pre),
        load_end(times["load_weight"] * (0.9 if d else 1.0), st.model.architecture, pre - t, t),
    ]
    if d:
        lines += [
            load_begin(pre - t),
            load_end(times["load_weight"] * 0.1, f"{st.model.architecture}MTP", pre - t - d, d),
        ]
    warnings = [str(w) for w in st.plan.extra.get("warnings") or []]
    k, ratio = st.plan.max_mamba_cache_size, int(st.plan.extra.get("ratio") or 1)
    if k and not any("capped to" in w for w in warnings) and st.plan.max_running_requests == k // ratio:
        requested = st.server_args.get("max_running_requests") or (48 if st.spec else 2048)
        if k // ratio < requested:
            warnings.append(mamba_cap(k // ratio, k, ratio))
    return lines + warnings


def pool_lines(st: Any) -> list[str]:
    g, plan, lines = st.plan.gib, st.plan, []
    if plan.max_mamba_cache_size:
        spec = st.spec
        lines.append(
            mamba_pool(
                plan.max_mamba_cache_size,
                g.mamba_conv,
                g.mamba_ssm,
                g.intermediate_ssm if spec else None,
                g.intermediate_conv if spec else None,
            )
        )
    dtype = KV_DTYPES.get(str(st.server_args.get("kv_cache_dtype")), "torch.bfloat16")
    draft_share = 0.0
    if st.spec and getattr(st.model, "mtp_layers", 0):
        full = st.model.kv_cell_bytes(with_draft=True)
        draft_share = st.model.draft_kv_cell_bytes / full if full else 0.0
    target_kv = g.kv * (1 - draft_share)
    lines.append(kv_pool(dtype, plan.kv_tokens, target_kv / 2, target_kv / 2))
    if draft_share:
        lines.append(kv_pool(dtype, plan.kv_tokens, g.kv * draft_share / 2, g.kv * draft_share / 2))
    if plan.extra.get("unified"):
        lines.append(unified_pool(int(plan.extra["unified"]["total_bytes"])))
    lines.append(pool_end(st.pre_gib - st.pools_gib))
    return lines


def graph_lines(st: Any, *, fail: bool) -> list[str]:
    x, g, sa = st.plan.extra, st.plan.gib, st.server_args
    avail = st.pre_gib - st.pools_gib - g.backend
    cg = st.startup_time["cuda_graph"]
    lines: list[str] = []
    prefill_on = not (
        sa.get("disable_cuda_graph")
        or sa.get("disable_prefill_cuda_graph")
        or sa.get("cuda_graph_backend_prefill") == "disabled"
    )
    chunked = int(x.get("chunked_prefill_size") or 8192)
    if prefill_on and not fail:
        use = g.graphs * 0.25
        lines += [
            capture_begin("target prefill", f"backend=breakable, num_tokens={prefill_tokens(chunked)}", avail),
            capture_end("target prefill", None, cg["prefill"], use, avail - use),
        ]
        avail -= use
    max_bs = x.get("decode_graph_bs")
    max_bs = int(max(max_bs) if isinstance(max_bs, list | tuple) and max_bs else max_bs or 0)
    if max_bs <= 0 and not fail:
        return lines
    name = "target verify" if st.spec else "target decode"
    detail = f"backend=full, num_tokens_per_req={st.draft_tokens}" if st.spec else "backend=full"
    lines.append(capture_begin(name, detail, avail))
    if fail:
        return lines
    use = g.graphs * (0.45 if st.spec else 0.75)
    lines.append(capture_end(name, decode_bs(max_bs), cg["target_verify" if st.spec else "decode"], use, avail - use))
    avail -= use
    if st.spec:
        for phase, share in (("draft decode", 0.2), ("draft extend", 0.1)):
            use = g.graphs * share
            detail = f"backend=full, num_tokens_per_req={1 if phase == 'draft decode' else st.draft_tokens}"
            lines += [
                capture_begin(phase, detail, avail),
                capture_end(phase, decode_bs(max_bs), cg[phase.replace(" ", "_")], use, avail - use),
            ]
            avail -= use
    if x.get("adaptive"):
        lines.append(adaptive_init(AdaptiveSpec.from_dict(x["adaptive"])))
    return lines


def ready_lines(st: Any) -> list[str]:
    x, plan = st.plan.extra, st.plan
    avail = st.startup_available_gib
    return [
        capacity(
            tokens=plan.kv_tokens,
            chunked=int(x.get("chunked_prefill_size") or -1),
            max_prefill=int(st.server_args.get("max_prefill_tokens") or 16384),
            running=plan.max_running_requests,
            context_len=st.context_len,
            avail_gib=avail,
        ),
        startup_timings(st.startup_time),
    ]
