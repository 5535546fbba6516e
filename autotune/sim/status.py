"""What one sim server planned and holds, and the reports built from it: ``/server_info``, ``/model_info``,
``/metrics``, resolved ``server_args``, and the simulated GPU's record of its memory."""

from __future__ import annotations

import bisect
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from autotune.sglang import parallel
from autotune.sglang.endpoints import MemoryUsage, ModelInfo, StartupTime
from autotune.sim import args as sim_args
from autotune.sim import device, logs
from autotune.sim.limits import largest_graph_bs

__all__ = ["GRAPH_PHASES", "VERSION", "ServerStatus"]

VERSION = "0.5.23"

# SGLang 0.5.23's bucket bounds for its prompt/generation token-length histograms (as its /metrics prints them).
TOKEN_BUCKETS = (
    100,
    300,
    500,
    700,
    1000,
    1500,
    2000,
    3000,
    4000,
    5000,
    6000,
    7000,
    8000,
    9000,
    10000,
    12500,
    15000,
    17500,
    20000,
    22500,
    25000,
    27500,
    30000,
    35000,
    40000,
    60000,
    80000,
    100000,
    200000,
    300000,
    400000,
    600000,
    800000,
    1000000,
    1100000,
)
TOKEN_HISTOGRAMS = ("prompt_tokens_histogram", "generation_tokens_histogram")

GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")


def launch_factor(sim: sim_args.SimOptions) -> float:
    """This start's own speed, ``exp(launch_cv · z)`` with ``z`` drawn fresh (``--sim-launch-cv``): what a real
    relaunch varies (CUDA-graph capture, allocator layout), which the study's seed must not fix. 1 at CV 0. A stated
    figure, not a measured one; the in-process evaluator (``sim.evaluate``) has no launches and never draws it."""
    cv = sim.launch_cv
    return math.exp(cv * random.gauss(0.0, 1.0)) if cv > 0 else 1.0


def _startup_times(value: Any, spec: bool) -> StartupTime:
    """The modelled real startup split like SGLang's ``startup_time`` (the simulator itself starts in ~1 s)."""
    if isinstance(value, dict) and "load_weight" in value:
        scheduler = float(value.get("scheduler_e2e", 0.0))
        return StartupTime(
            load_weight=float(value.get("load_weight", 0.0)),
            kv_cache_allocation=float(value.get("kv_cache_allocation", 0.0)),
            scheduler_e2e=scheduler,
            cuda_graph={p: float((value.get("cuda_graph") or {}).get(p, 0.0)) for p in GRAPH_PHASES},
            tokenizer_e2e=float(value.get("tokenizer_e2e", scheduler)),
        )
    total = float(value or 0.0)
    load, kv = 0.55 * total, 0.03 * total
    graphs = total - load - kv
    shares = (
        {"prefill": 0.3, "target_verify": 0.4, "draft_decode": 0.2, "draft_extend": 0.1}
        if spec
        else {"prefill": 0.4, "decode": 0.6}
    )
    return StartupTime(
        load_weight=load,
        kv_cache_allocation=kv,
        scheduler_e2e=total,
        cuda_graph={p: graphs * shares.get(p, 0.0) for p in GRAPH_PHASES},
        tokenizer_e2e=total + 1.0,
    )


def _group(server_args: dict[str, Any]) -> tuple[tuple[int, ...], parallel.Rank | None]:
    """The GPUs the server's schedulers open (``CUDA_VISIBLE_DEVICES`` entries at their device ordinals) and the
    first scheduler whose ordinal is past the visible list (it fails at startup; None when all fit). On SGLang's
    CPU backend (``--device cpu``): the host's memory, shared by every server on the host."""
    if str(server_args.get("device") or "").lower() == "cpu":
        return (device.HOST,), None
    ranks = parallel.ranks(server_args)
    visible = device.visible_indices(need=max(r.gpu_id for r in ranks) + 1)
    missing = next((r for r in ranks if r.gpu_id >= len(visible)), None)
    gpus = tuple(dict.fromkeys(visible[r.gpu_id] for r in ranks if r.gpu_id < len(visible)))
    return gpus or visible[:1], missing


@dataclass(frozen=True)
class LiveStats:
    """The scheduler's live counters and the radix cache's figures, under the names /metrics reads them by."""

    num_running: int = 0
    num_queue: int = 0
    kv_used: int = 0
    mamba_used: int = 0
    retractions: int = 0
    new_token_ratio: float = 0.0
    last_gen_throughput: float = 0.0
    spec_verify_ct: int = 0
    generation_tokens: int = 0
    avg_spec_accept_length: float = 0.0
    cache_hit_rate: float = 0.0  # cached ÷ (cached + computed) prompt tokens
    cached_tokens: int = 0
    input_tokens: int = 0
    kv_evictable: int = 0
    mamba_evictable: int = 0


class ServerStatus:
    """What one sim server planned and holds: startup lines, ``/server_info``, ``/metrics``, the device record."""

    def __init__(
        self,
        *,
        args: sim_args.SimArgs,
        model: Any,
        gpu: Any,
        plan: Any,
        scheduler: Any,
        gpus: tuple[int, ...],
        free_gib: float,
        pid: int,
        missing: parallel.Rank | None = None,
        device_total_mib: float | None = None,
    ):
        self.args, self.model, self.gpu, self.plan, self.scheduler = args, model, gpu, plan, scheduler
        # The device's whole memory (the host's on the CPU backend, where ``gpu`` is sized to what was free)
        self.device_total_mib = float(gpu.memory_mib if device_total_mib is None else device_total_mib)
        # Every GPU of the server's group holds the planner's per-GPU figures (TP and PP ranks alike).
        self.gpus, self.free_gib, self.pid = gpus, free_gib, pid
        self.gpu_index = gpus[0]
        self.missing = missing  # the first scheduler whose device ordinal CUDA_VISIBLE_DEVICES does not show
        self.device_dir = args.sim.device_dir
        sim, x = args.sim, plan.extra
        self.server_args = args.server_args
        self.host = str(self.server_args.get("host") or "127.0.0.1")
        port = self.server_args.get("port")
        self.port = 30000 if port is None else int(port)  # 0: the OS picks; the "Uvicorn running" line says which
        self.seed, self.acceptance = sim.seed, sim.acceptance
        self.output_mean, self.output_dist = float(sim.output_mean), sim.output_dist
        self.spec = bool(x.get("spec"))
        self.draft_tokens = int(x.get("draft_tokens") or 1) if self.spec else 1
        self.context_len = int(x.get("context_len") or model.context_len)
        self.served_model_name = str(self.server_args.get("served_model_name") or args.flags["model_path"])
        self.startup_time = _startup_times(x.get("startup_s"), self.spec)
        self.started_at = time.time()
        tp = int(self.server_args.get("tp_size") or 1)
        # The plan's target share on this rank (a pipeline stage holds only its layers).
        self.target_gib = float(x.get("target_weights_gib") or model.weights_gib(with_draft=False, tp=tp))
        self.draft_gib = max(0.0, float(plan.gib.weights) - self.target_gib)
        self.pre_gib = float(x.get("pre_gib", free_gib))
        g = plan.gib
        self.pools_gib = float(g.weights + float(x.get("workspace_gib") or 0.0) + g.kv + g.mamba_total)
        self.context_mib = float(getattr(gpu, "cuda_context_gib", 0.5)) * 1024
        self.weights_mib = self.context_mib + float(g.weights) * 1024
        self.pools_mib = self.context_mib + self.pools_gib * 1024
        self.static_mib = float(x.get("static_gib") or 0.0) * 1024 or self.pools_mib + (g.backend + g.graphs) * 1024
        # Free once the pools, the attention backend's buffers and the graphs are in place ("available_gpu_mem").
        self.startup_available_gib = self.pre_gib - self.pools_gib - g.backend - g.graphs
        # Activations as torch's caching allocator holds them: the largest forward so far stays reserved (NVML sees
        # it), starting with the prefill graph captured at startup; a prefill batch of t tokens takes t × the plan's
        # per-token figure (the plan's ``activations`` are one full chunk's, deviated where the truth says so).
        chunk = int(x.get("chunked_prefill_size") or 0) or int(x.get("prefill_graph_tokens") or 0)
        self.act_mib_per_token = float(g.activations) * 1024 / chunk if chunk > 0 else 0.0
        self.act_high_mib = self.act_mib_per_token * int(x.get("prefill_graph_tokens") or 0)
        self.counters = dict.fromkeys(
            (
                "num_requests_total",
                "prompt_tokens_total",
                "generation_tokens_total",
                "num_aborted_requests_total",
                "e2e_sum",
                "e2e_count",
                "ttft_sum",
                "ttft_count",
            ),
            0.0,
        )
        # per-bucket counts (the last one above every bound) and the sum, observed when a request ends
        self.histograms = {name: ([0] * (len(TOKEN_BUCKETS) + 1), [0.0]) for name in TOKEN_HISTOGRAMS}

    @classmethod
    def create(cls, args: sim_args.SimArgs, *, pid: int) -> ServerStatus:
        from autotune.sglang.memory import plan as make_plan
        from autotune.sglang.profiles import load_gpu, load_model
        from autotune.sim.requests import check_request_params
        from autotune.sim.scheduler import Scheduler
        from autotune.sim.truth import Deviation, deviate

        sim = args.sim
        check_request_params(acceptance_mean=sim.acceptance, output_mean=sim.output_mean, output_dist=sim.output_dist)
        model = load_model(args.flags["model_path"])
        gpu = load_gpu(sim.gpu, memory_mib=sim.gpu_memory_mib)
        gpus, missing = _group(args.server_args)
        # The fullest GPU of the group decides (SGLang takes the minimum free memory over its TP group).
        others = max(device.others_used_mib(index, pid, sim.device_dir) for index in gpus)
        device_total_mib = float(gpu.memory_mib)
        if gpus == (device.HOST,):  # the CPU backend: --mem-fraction-static is a share of the RAM free at its start
            gpu = load_gpu(sim.gpu, memory_mib=max(1024, int(device_total_mib - others)))
            others = 0.0
        # SGLang sizes from the memory free after its own CUDA context: what the others leave, minus ours.
        free_gib = max(0.0, (gpu.memory_mib - others) / 1024 - float(getattr(gpu, "cuda_context_gib", 0.5)))
        # SGLang reads its SGLANG_* switches from its own environment at start (the decode-lock switch moves the cap).
        env = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}
        plan = make_plan(model, gpu, args.flags, free_gib=free_gib, env=env)
        deviation = Deviation.from_sim(sim)
        plan = deviate(plan, model, deviation)  # the machine as it is, not as planned (identity by default)
        sched = None
        if plan.failure in (None, "runtime_oom"):
            # The same constructor ``evaluate()`` uses, so paced and virtual runs agree.
            sched = Scheduler.from_plan(
                plan,
                model,
                gpu,
                noise=sim.noise,
                seed=sim.seed,
                efficiency=deviation.efficiency(plan.extra) * launch_factor(sim),
            )
        return cls(
            args=args,
            model=model,
            gpu=gpu,
            plan=plan,
            scheduler=sched,
            gpus=gpus,
            free_gib=free_gib,
            pid=pid,
            missing=missing,
            device_total_mib=device_total_mib,
        )

    # -- device ---------------------------------------------------------------------------------------------
    def register_device(self) -> None:
        """Register on every GPU of the group: each scheduler rank opens a CUDA context on its own device."""
        release_s = 0.0 if self.gpus == (device.HOST,) else self.args.sim.release_s  # host RAM: back at exit
        for index in self.gpus:
            device.register(
                index,
                pid=self.pid,
                gpu_name=self.gpu.name,
                total_mib=self.device_total_mib,
                used_mib=self.context_mib,
                release_s=release_s,
                directory=self.device_dir,
            )

    def release_device(self) -> None:
        """A clean exit: every GPU of the group starts freeing this server's memory."""
        for index in self.gpus:
            device.mark_exited(index, self.pid, directory=self.device_dir)

    def note_prefill(self, new_tokens: int) -> None:
        """A prefill batch of ``new_tokens`` ran: its activations join the allocator's high-water mark."""
        self.act_high_mib = max(self.act_high_mib, new_tokens * self.act_mib_per_token)

    def report_device(self, *, busy: bool, prefill: bool = False, held_mib: float | None = None) -> None:
        act = self.act_high_mib if busy else 0.0
        used = held_mib if held_mib is not None else self.static_mib + act
        for index in self.gpus:  # TP ranks run in lockstep: each GPU holds and works the same
            try:
                device.update(
                    index, self.pid, used_mib=used, util_pct=100.0 if busy else 0.0, directory=self.device_dir
                )
            except OSError:
                pass  # the registry folder is gone (a test cleaned up): serving goes on

    def device_reading(self) -> device.GroupReading:
        """``/sim/gpu``: the first GPU's reading at the top level (as before), every GPU of the group in ``devices``."""
        readings = []
        for index in self.gpus:
            r = device.read(index, self.device_dir)
            readings.append(
                device.GpuReading(
                    index=index,
                    used_mib=r.used_mib,
                    total_mib=r.total_mib,
                    free_mib=r.free_mib,
                    util_pct=r.util_pct,
                    processes=r.processes,
                )
            )
        return device.GroupReading(**readings[0], devices=readings)

    # -- reports --------------------------------------------------------------------------------------------
    def resolved_args(self) -> dict[str, Any]:
        """``server_args`` after SGLang's resolution: the values the planner decided, as SGLang would print them."""
        out = dict(self.server_args)
        x = self.plan.extra
        out["mem_fraction_static"] = self.plan.mem_fraction_static
        out["tokenizer_path"] = out.get("tokenizer_path") or out.get("model_path")
        out["served_model_name"] = self.served_model_name
        for key, name in (
            ("chunked_prefill_size", "chunked_prefill_size"),
            ("page_size", "page_size"),
            ("strategy", "mamba_radix_cache_strategy"),
        ):
            if x.get(key) is not None:
                out[name] = x[key]
        if x.get("strategy") == "no_buffer":
            out["disable_overlap_schedule"] = True
        if self.spec:  # NEXTN resolves to EAGLE; steps/topk/draft tokens as the planner resolved them
            out["speculative_algorithm"] = x.get("spec_algorithm") or out.get("speculative_algorithm")
            out["speculative_num_draft_tokens"] = self.draft_tokens
            out["speculative_num_steps"] = x.get("spec_steps") or out.get("speculative_num_steps")
            out["speculative_eagle_topk"] = x.get("spec_topk") or out.get("speculative_eagle_topk")
            out["max_running_requests"] = out.get("max_running_requests") or 48
        return out

    def _stats(self) -> LiveStats:
        """The scheduler's live counters and the radix cache's figures (zeros before the scheduler exists)."""
        if self.scheduler is None:
            return LiveStats()
        st, cache = self.scheduler.stats, self.scheduler.cache
        hits, computed = st.cached_tokens_total, st.input_tokens_total
        return LiveStats(
            num_running=st.num_running,
            num_queue=st.num_queue,
            kv_used=self.scheduler.kv_used_tokens(),
            mamba_used=st.mamba_used,
            retractions=st.retractions,
            new_token_ratio=st.new_token_ratio,
            last_gen_throughput=st.last_gen_throughput,
            spec_verify_ct=st.spec_verify_ct,
            generation_tokens=st.generation_tokens_total,
            avg_spec_accept_length=st.avg_spec_accept_length or 0.0,
            cache_hit_rate=hits / (hits + computed) if hits + computed else 0.0,
            cached_tokens=hits,
            input_tokens=computed,
            kv_evictable=cache.evictable_tokens if cache is not None else 0,
            mamba_evictable=cache.evictable_states if cache is not None else 0,
        )

    def flush(self) -> None:
        """``/flush_cache``: the spec counters restart (SGLang's reset_metrics) and the radix cache empties."""
        if self.scheduler is not None:
            self.scheduler.stats.reset_spec()
            if self.scheduler.cache is not None:
                self.scheduler.cache.reset()

    def memory_usage(self) -> MemoryUsage:
        g = self.plan.gib
        cg = self.startup_time["cuda_graph"]
        total_cg = sum(cg.values()) or 1.0
        return MemoryUsage(
            weight=round(g.weights, 3),
            kvcache=round(g.kv, 3),  # KV only, like SGLang (no Mamba)
            startup_available=round(self.startup_available_gib, 3),
            token_capacity=self.plan.kv_tokens,
            token_capacity_swa=None,
            graph={p: round(g.graphs * cg[p] / total_cg, 3) for p in GRAPH_PHASES},
        )

    def server_info(self, *, ready: bool) -> dict[str, Any]:
        resolved = self.resolved_args()
        snap = self._stats()
        startup = dict(self.startup_time)
        internal = {
            **resolved,
            "world_size": int(resolved.get("tp_size") or 1) * int(resolved.get("pp_size") or 1),
            "max_mamba_cache_size": self.plan.max_mamba_cache_size,
            "effective_max_running_requests_per_dp": self.plan.max_running_requests,
            "last_gen_throughput": float(snap.last_gen_throughput or 0.0),
            "memory_usage": self.memory_usage(),
            "decode_cuda_graph_bs": logs.decode_bs(largest_graph_bs(self.plan.extra.get("decode_graph_bs"))),
            "step_time_dict": None,
            "startup_time": {k: v for k, v in startup.items() if k != "tokenizer_e2e"},
        }
        if self.spec:
            internal["avg_spec_accept_length"] = snap.avg_spec_accept_length
        kv = self.plan.kv_tokens
        return {
            **resolved,
            "launch_command": self.args.launch_command,
            "status": "ready" if ready else "starting",
            "max_total_num_tokens": kv,
            "max_req_input_len": min(self.context_len - 1, kv - 1) - 5,
            "startup_time": startup,
            "kv_events": None,
            "internal_states": [internal],
            "version": VERSION,
            "frontend": "python",
        }

    def model_info(self) -> ModelInfo:
        m, sa = self.model, self.server_args
        return ModelInfo(
            model_path=sa.get("model_path"),
            served_model_name=self.served_model_name,
            tokenizer_path=sa.get("tokenizer_path") or sa.get("model_path"),
            is_generation=True,
            preferred_sampling_params=None,
            weight_version="default",
            load_format=sa.get("load_format"),
            reasoning_parser=sa.get("reasoning_parser"),
            tool_call_parser=sa.get("tool_call_parser"),
            disaggregation_mode="null",
            has_image_understanding=bool(getattr(m, "multimodal", False)),
            has_audio_understanding=False,
            model_type=m.model_type,
            architectures=[m.architecture],
        )

    def on_request(self, prompt_tokens: int) -> None:
        self.counters["num_requests_total"] += 1
        self.counters["prompt_tokens_total"] += prompt_tokens

    def on_done(
        self, tokens: int, *, finished: bool, e2e_s: float, ttft_s: float | None, prompt_tokens: int | None = None
    ) -> None:
        c = self.counters
        if prompt_tokens is not None:  # like SGLang, both length histograms observe a request when it ends
            for name, value in zip(TOKEN_HISTOGRAMS, (prompt_tokens, tokens), strict=True):
                counts, total = self.histograms[name]
                counts[bisect.bisect_left(TOKEN_BUCKETS, value)] += 1
                total[0] += value
        c["generation_tokens_total"] += tokens
        if not finished:
            c["num_aborted_requests_total"] += 1
        c["e2e_sum"] += e2e_s
        c["e2e_count"] += 1
        if ttft_s is not None:
            c["ttft_sum"] += ttft_s
            c["ttft_count"] += 1

    def metrics_text(self) -> str:
        snap, g, c = self._stats(), self.plan.gib, self.counters
        kv_used = float(snap.kv_used)
        kv_usage = kv_used / max(1, self.plan.kv_tokens)
        mamba_used = float(snap.mamba_used)
        mamba_usage = mamba_used / self.plan.max_mamba_cache_size if self.plan.max_mamba_cache_size else 0.0
        gauges = {
            "num_running_reqs": snap.num_running,
            "num_queue_reqs": snap.num_queue,
            "gen_throughput": snap.last_gen_throughput,
            "cache_hit_rate": snap.cache_hit_rate,
            "kv_evictable_tokens": snap.kv_evictable,
            "mamba_evictable_tokens": snap.mamba_evictable,
            "token_usage": max(kv_usage, mamba_usage),
            "full_token_usage": kv_usage,
            "mamba_usage": mamba_usage,
            "num_used_tokens": kv_used,
            "kv_used_tokens": kv_used,
            "kv_available_tokens": self.plan.kv_tokens - kv_used,
            "mamba_used_tokens": mamba_used,
            "mamba_available_tokens": (self.plan.max_mamba_cache_size or 0) - mamba_used,
            "num_retracted_reqs": snap.retractions,
            "new_token_ratio": snap.new_token_ratio,
            "max_total_num_tokens": self.plan.kv_tokens,
            "context_len": self.context_len,
            "page_size": self.plan.extra.get("page_size", 1),
            "weight_memory_usage_gb": g.weights,
            "kv_cache_memory_usage_gb": g.kv,
            "graph_memory_usage_gb": g.graphs,
            "startup_available_gpu_memory_gb": self.startup_available_gib,
            "startup_time_seconds": self.startup_time["scheduler_e2e"],
            "startup_cuda_graph_time_seconds": sum(self.startup_time["cuda_graph"].values()),
            "weight_load_duration_seconds": self.startup_time["load_weight"],
        }
        if self.spec:
            accept = snap.avg_spec_accept_length
            gauges.update(
                spec_accept_length=accept,
                spec_accept_rate=(accept - 1) / (self.draft_tokens - 1) if accept else 0.0,
                spec_num_steps=self.draft_tokens - 1,
                spec_num_draft_tokens=self.draft_tokens,
            )
        counters = {
            k: c[k]
            for k in (
                "num_requests_total",
                "prompt_tokens_total",
                "generation_tokens_total",
                "num_aborted_requests_total",
            )
        }
        counters["spec_verify_calls_total"] = snap.spec_verify_ct
        counters["num_retracted_requests_total"] = snap.retractions
        summaries = {
            "e2e_request_latency_seconds": (c["e2e_sum"], c["e2e_count"]),
            "time_to_first_token_seconds": (c["ttft_sum"], c["ttft_count"]),
        }
        text = logs.prometheus(
            gauges,
            counters,
            summaries,
            labels={
                "engine_type": "unified",
                "model_name": self.served_model_name,
                "moe_ep_rank": "0",
                "pp_rank": "0",
                "tp_rank": "0",
            },
        )
        hist_labels = {"engine_type": "unified", "model_name": self.served_model_name}
        modes = {
            "engine_type": "unified",
            "model_name": self.served_model_name,
            "moe_ep_rank": "0",
            "pp_rank": "0",
            "tp_rank": "0",
        }
        hits, computed = snap.cached_tokens, snap.input_tokens
        text += logs.prometheus_modes(
            "prefill_effective_tokens_total",
            "counter",
            {"input": computed, "device_hit": hits, "host_hit": 0, "storage_hit": 0},
            labels=modes,
        )
        text += logs.prometheus_modes(
            "realtime_tokens_total",
            "counter",
            {"prefill_compute": computed, "prefill_cache": hits, "decode": snap.generation_tokens},
            labels=modes,
        )
        return text + "".join(
            logs.prometheus_histogram(name, TOKEN_BUCKETS, counts, total[0], labels=hist_labels)
            for name, (counts, total) in self.histograms.items()
        )
