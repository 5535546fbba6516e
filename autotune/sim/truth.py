"""Where the simulated machine departs from the planner's model: a *truth* the search cannot see.

``Deviation`` says by how much the real machine differs from the planner's modelled constants (free memory after
the pools, activation and graph memory, decode speed), and ``deviate`` turns the planner's plan into what the
simulated server actually allocates and whether it survives. None of it reaches the planner: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.results.plan import PlanDetails

if TYPE_CHECKING:
    from autotune.sim.args import SimOptions

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Deviation:
    """The simulated machine against the planner's model (identity: the planner is exact)."""

    free_gib: float = 0.0
    activation_scale: float = 1.0
    graph_scale: float = 1.0
    decode_efficiency: float = 1.0
    unified_efficiency: float = 1.0
    adaptive_efficiency: float = 1.0

    def efficiency(self, extra: PlanDetails) -> float:
        """The speed multiple for a plan (its ``extra``): ``decode_efficiency``, times the lever factors that
        apply (``unified`` and ``adaptive`` are set only where the planner accepted the lever)."""
        factor = self.decode_efficiency
        if extra.get("unified"):
            factor *= self.unified_efficiency
        if extra.get("adaptive"):
            factor *= self.adaptive_efficiency
        return factor

    @property
    def memory_is_exact(self) -> bool:
        return self.free_gib == 0.0 and self.activation_scale == 1.0 and self.graph_scale == 1.0

    @classmethod
    def from_sim(cls, sim: SimOptions) -> Deviation:
        """From a sim server's ``--sim-*`` values (``SimArgs.sim``)."""
        return cls(
            free_gib=sim.free_gib_delta,
            activation_scale=sim.activation_scale,
            graph_scale=sim.graph_scale,
            decode_efficiency=sim.decode_efficiency,
            unified_efficiency=sim.unified_efficiency,
            adaptive_efficiency=sim.adaptive_efficiency,
        )

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _reached_graphs(mp: Any) -> bool:
    """Whether the plan got past pool sizing (so graphs and activations are known): it fits, or it failed only at
    graph capture or at the first full prefill."""
    if mp.kv_tokens <= 0 or mp.max_running_requests <= 0:
        return False
    if mp.fits or mp.failure == "runtime_oom":
        return True
    return mp.failure == "startup_oom" and str(mp.message or "").startswith("Capture cuda graph failed")


def deviate(mp: Any, model: Any, dev: Deviation | None) -> Any:
    """The plan the simulated machine actually runs: same pools, deviated graph/activation memory and room."""
    if dev is None or dev.memory_is_exact or not _reached_graphs(mp):
        return mp
    g, x = mp.gib, PlanDetails(**mp.extra)
    tp = int(x.get("tp_size") or 1)
    ctx = float(x.get("cuda_context_gib") or 0.0)
    pre = float(x.get("pre_gib") or 0.0)
    planned_free = g.headroom + g.backend + g.graphs + g.activations  # free after the pools, as planned
    pools = pre - planned_free  # weights + workspace + Mamba + KV, as SGLang sized them
    free = planned_free + dev.free_gib - g.backend  # what capture finds once the attention backend is set up
    graphs = g.graphs * dev.graph_scale
    act_tok = float(model.activation_bytes(1, tp)) / GIB * dev.activation_scale
    activations = g.activations * dev.activation_scale
    bs = [int(b) for b in x.get("decode_graph_bs") or []]
    d = int(x.get("draft_tokens") or 0) if x.get("spec") else 0
    capture_tokens = int(x.get("prefill_graph_tokens") or 0) or max(bs, default=0) * (d or 1)
    capture_act = capture_tokens * act_tok
    headroom = free - graphs - activations
    failure, message = None, mp.message if mp.fits else None
    x["runtime_oom_tokens"] = None
    if graphs + capture_act > free:
        failure = "startup_oom"
        message = (
            f"Capture cuda graph failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{min(graphs + capture_act, 2.0):.2f} GiB. GPU 0 has a total capacity of "
            f"{float(x.get('total_gib') or 0.0):.2f} GiB of which {max(free, 0.0):.2f} GiB is free. "
            "Possible solutions: 1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7) 2. set "
            "--cuda-graph-max-bs-decode to a smaller value (e.g., 16) 3. disable decode CUDA graph by "
            "--cuda-graph-backend-decode=disabled."
        )
    elif activations > free - graphs:
        failure = "runtime_oom"
        free_at_run = free - graphs
        x["runtime_oom_tokens"] = max(1, int(free_at_run / act_tok)) if act_tok > 0 else 1
        message = (
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {min(activations, 2.0):.2f} GiB. "
            f"GPU 0 has a total capacity of {float(x.get('total_gib') or 0.0):.2f} GiB of which "
            f"{max(free_at_run, 0.0):.2f} GiB is free (a prefill batch needs {activations:.2f} GiB of "
            "activations)."
        )
    held = pools - dev.free_gib  # what the device shows used beyond the context once the pools are allocated
    held += g.backend
    x.update(
        {
            "static_gib": round(ctx + held + graphs, 4),
            "peak_gib": round(ctx + held + graphs + activations, 4),
            "truth": dev.to_dict(),
        }
    )
    gib = dataclasses.replace(
        g, graphs=round(graphs, 4), activations=round(activations, 4), headroom=round(headroom, 4)
    )
    return dataclasses.replace(mp, fits=failure is None, failure=failure, message=message, gib=gib, extra=x)
