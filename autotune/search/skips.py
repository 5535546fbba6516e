"""Why the planner skipped a config, in the tool's own words beside SGLang's.

SGLang's startup message names the symptom, and sometimes a fix that cannot work: 800 Mamba slots at
``--mem-fraction-static 0.94`` fail with "Raise --mem-fraction-static above 0.346", while the cause is the Mamba
pool. The skip's reason keeps SGLang's line (the correction reads figures from it) and adds which pool took the
memory, from the plan's own sizes.
"""

from __future__ import annotations

from autotune.sglang.memory import MemoryPlan

POOLS = {"mamba_total": "the Mamba state", "kv": "the KV cache", "activations": "activations", "graphs": "CUDA graphs"}
FIXES = {
    "mamba_total": "fewer Mamba slots (--max-mamba-cache-size) or a bfloat16 state (--mamba-ssm-dtype)",
    "kv": "a smaller --max-total-tokens",
    "activations": "a smaller --chunked-prefill-size",
    "graphs": "a smaller --cuda-graph-max-bs-decode",
}


def pool_cause(plan: MemoryPlan) -> str | None:
    """ "the Mamba state of 800 slots (142.7 GiB) and the weights (56.6 GiB) need more than the 167.9 GiB …" for a
    plan that does not fit; None when the plan's sizes cannot say (a failure before the pools were sized)."""
    pools = {key: float(getattr(plan.gib, key) or 0.0) for key in POOLS}
    key = max(pools, key=lambda k: pools[k])
    if plan.fits or pools[key] <= 0:
        return None
    weights = float(plan.gib.weights or 0.0)
    pre = plan.extra.get("pre_gib")
    fraction = plan.mem_fraction_static
    what = POOLS[key]
    if key == "mamba_total" and plan.max_mamba_cache_size:
        what += f" of {plan.max_mamba_cache_size} slots"
    text = f"{what} ({pools[key]:.1f} GiB) and the weights ({weights:.1f} GiB)"
    if pre and fraction:
        budget = float(pre) * float(fraction)
        if pools[key] + weights > budget:
            return (
                f"{text} need more than the {budget:.1f} GiB --mem-fraction-static {fraction:g} reserves: "
                f"{FIXES[key]} makes room, not another fraction"
            )
    return f"{text} took the memory"


def skip_reason(plan: MemoryPlan) -> str:
    """SGLang's message for a skipped config, then the tool's account of it."""
    said = plan.message or f"planner: {plan.failure}"
    cause = pool_cause(plan)
    return f"{said} (autotune: {cause})" if cause else said
