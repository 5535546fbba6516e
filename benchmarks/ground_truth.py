"""The ground truth: the exhaustive grid's optimum over a study's space, cached per case and inputs.

Exact shortcuts keep 700k-config grids to a minute or two: within one setting of every other flag the memory
fraction only grows the KV pool, so only the highest fraction that starts is kept; and configs whose plans give
the scheduler the same limits are simulated once, at the largest KV pool among them. Both rest on one
assumption (more KV never lowers throughput), checked against brute force by the tests; the benchmark raises the
optimum if a strategy ever finds better.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from optuna.distributions import CategoricalDistribution, IntDistribution
from strategies import Case, Oracle, Outcome

import autotune
from autotune.search.space import Feasibility, config_diff, key_of

METHOD = 3  # bump when the method changes, to invalidate cached optima (3: the top configs kept)
MEMORY_KNOB = "mem_fraction_static"
TOP_KEPT = 100  # the best configs by window score, kept for the steady-state optimum (``steady_truth``)


def grid_values(param: Any) -> list[Any]:
    """Every value of a parameter on its declared grid (a float range needs a step to have one)."""
    dist = param.distribution
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution):
        return list(range(dist.low, dist.high + 1, dist.step or 1))
    if not dist.step:
        raise ValueError(f"{param.name} is a continuous range: give it a step to grid it")
    n = round((dist.high - dist.low) / dist.step)
    return [round(dist.low + i * dist.step, 6) for i in range(n + 1)]


def _families(params: list[Any], values: dict[str, Any]):
    """Every combination of the parameters, honouring conditions (an inactive parameter is left out)."""
    if not params:
        yield dict(values)
        return
    head, rest = params[0], params[1:]
    if not head.active(values):
        yield from _families(rest, values)
        return
    for value in grid_values(head):
        values[head.name] = value
        yield from _families(rest, values)
    values.pop(head.name, None)


def signature(mp: Any) -> tuple:
    """What the simulated scheduler and speed model read from a plan, with the KV pool size left out.

    The Mamba slot count and ratio only feed gauges (the running cap already holds them), so configs that
    differ only there behave identically.
    """
    from autotune.sim.scheduler import SchedulerLimits

    limits = dataclasses.replace(SchedulerLimits.from_plan(mp), kv_tokens=1, mamba_slots=None, ratio=1)
    x = mp.extra
    return (limits, x.get("kv_cell_bytes"), x.get("mamba_slot_bytes"), x.get("tp_size"))


def _plan_families(
    case: Case, model_name: str, gpu_name: str, fractions: list[Any], families: list[dict[str, Any]]
) -> list[tuple[tuple, int, dict[str, Any]]]:
    """(signature, KV tokens, config) of each family's highest memory fraction that starts (none if none)."""
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model
    from autotune.sim.truth import deviate

    model, gpu, space, out = load_model(model_name), load_gpu(gpu_name), case.space, []
    for values in families:
        for fraction in fractions:
            config = space.complete(values if fraction is None else {**values, MEMORY_KNOB: fraction})
            mp = deviate(plan(model, gpu, config, _inert=False), model, case.truth.deviation)  # on the truth
            if mp.fits:
                out.append((signature(mp), mp.kv_tokens, config))
                break
            if mp.failure == "bad_args" or not mp.gib.activations:
                break  # it failed sizing the pools (or parsing): a smaller fraction fails the same way
    return out


def _outcomes(case: Case, configs: list[dict[str, Any]]) -> list[Outcome]:
    oracle = Oracle(case, noise_cv=0.0)
    return [oracle.outcome(c) for c in configs]


def _chunks(items: list[Any], n: int) -> list[list[Any]]:
    size = max(1, math.ceil(len(items) / n))
    return [items[i : i + size] for i in range(0, len(items), size)]


def exhaustive(case: Case, oracle: Oracle, *, jobs: int = 2) -> dict[str, Any]:
    """The grid optimum over the study's space, planner-inert flags dropped as the study drops them."""
    cfg = case.cfg
    space = case.space
    feas = Feasibility.from_config(cfg)
    contexts = cfg.given_configs()
    space = space.without(set(feas.inert_everywhere(space, contexts))) if feas else space
    memory = next((p for p in space.params if p.name == MEMORY_KNOB), None)
    fractions = sorted(grid_values(memory), reverse=True) if memory else [None]
    families = list(_families([p for p in space.params if p is not memory], dict(space.fixed)))
    groups: dict[tuple, tuple[int, dict[str, Any]]] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = pool.map(
            _plan_families,
            *zip(
                *[(case, oracle.model, oracle.gpu, fractions, chunk) for chunk in _chunks(families, 8 * jobs)],
                strict=True,
            ),
        )
        for part in parts:
            for key, kv, config in part:
                if key not in groups or kv > groups[key][0]:
                    groups[key] = (kv, config)
        configs = [config for _, config in groups.values()]
        chunks = _chunks(configs, 8 * jobs)
        for chunk, outs in zip(chunks, pool.map(_outcomes, [case] * len(chunks), chunks), strict=True):
            for config, out in zip(chunk, outs, strict=True):
                oracle.memo[key_of(config)] = out
    best_config, best = case.baseline, oracle.outcome(case.baseline).tok_s
    for config in configs:
        if oracle.outcome(config).tok_s > best:
            best_config, best = config, oracle.outcome(config).tok_s
    ranked = sorted((c for c in configs if oracle.outcome(c).tok_s > 0), key=lambda c: -oracle.outcome(c).tok_s)
    return {
        "config": best_config,
        "tok_s": best,
        "grid": len(families) * len(fractions),
        "families": len(families),
        "groups": len(groups),
        "baseline_tok_s": oracle.outcome(case.baseline).tok_s,
        "top": [[oracle.outcome(c).tok_s, c] for c in ranked[:TOP_KEPT]],
    }


def space_hash(case: Case) -> str:
    """What the optimum depends on: the study's space, fixed flags, baseline, workload, model, GPU, and the
    planner's and simulator's source (a changed speed model invalidates the cached optimum)."""
    cfg = case.cfg
    parts = {
        "space": {k: v.model_dump(mode="json") for k, v in cfg.space.items()},
        "derived": cfg.derived,
        "fixed": cfg.engine.fixed,
        "baseline": cfg.baseline.flags,
        "model": cfg.engine.profile,
        "gpu": cfg.engine.sim_gpu,
        "workload": cfg.workload.model_dump(mode="json", exclude={"prompts"}),
        "prompts": hashlib.sha256("\n".join(case.workload.prompts).encode()).hexdigest(),
        "method": METHOD,
        "truth": case.truth.to_dict(),
        "max_tokens": case.workload.max_tokens,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    package = Path(autotune.__file__).parent
    for source in sorted([*(package / "sglang").glob("*.py"), *(package / "sim").glob("*.py")]):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def cache_path(kind: str, case: Case, cache_dir: Path, suffix: str = "") -> Path:
    """``<kind>-<case>-<space_hash><suffix>.cache.json``: where a figure of the case's inputs is cached."""
    return cache_dir / f"{kind}-{case.name.replace('/', '--')}-{space_hash(case)}{suffix}.cache.json"


def read_cache(path: Path) -> Any:
    """A cached figure, or None when there is none yet."""
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def write_cache(path: Path, data: Any) -> None:
    """Write a cache file atomically: a parallel worker, or a run stopped half-way, never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str), encoding="utf-8")
    tmp.replace(path)


def ground_truth(case: Case, oracle: Oracle, *, cache_dir: Path, say) -> dict[str, Any]:
    """The exhaustive grid's optimum, cached as ``ground-truth-<case>-<hash>.cache.json`` (same inputs, same
    answer)."""
    path = cache_path("ground-truth", case, cache_dir)
    cached = read_cache(path)
    if cached is not None:
        return cached
    say(f"  {case.name}: exhaustive grid (cached afterwards in {path.name}) ...")
    started = time.monotonic()
    truth = exhaustive(case, oracle)
    truth["seconds"] = round(time.monotonic() - started, 1)
    truth["best_diff"] = config_diff(truth["config"], case.baseline)
    write_cache(path, truth)
    say(
        f"  {case.name}: optimum {truth['tok_s']:,.0f} tok/s over {truth['grid']:,} configs "
        f"({truth['groups']:,} simulated) in {truth['seconds']:.0f} s"
    )
    return truth
