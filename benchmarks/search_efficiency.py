"""How fast each search strategy finds the best config, on the simulator's in-process evaluator.

For each case (a study file's space on one model and GPU) the ground truth is the exhaustive grid's optimum;
each strategy then runs at equal trial budgets over several seeds, and the table reports the best true tok/s
it found (as % of the optimum), the trials and modelled GPU-hours it took to reach 98 % of it, the GPU time
lost to OOM launches and the share of launches that OOMed. Writes ``results/search_efficiency.md`` (rendered by
``search_table.py``) and ``results/search_efficiency.html`` (``search_figure.py``); this module draws the cases and
their truths and runs them.

The simulator the strategies launch on is a *hidden truth*: per case and workload it departs from the planner's
model by a seeded draw (free memory after load, activation and CUDA-graph memory, decode speed, draft acceptance,
natural output length; ``draw_truth``), written in the table. The study, its planner and its prior never see it.

Every tok/s is scored per GPU the server spans, as the tool ranks trials (``search.objective``'s
``gpus_spanned``): the 80B case's TP-2 servers count half their tok/s, so its rows and optimum are per GPU.

Usage: ``python benchmarks/search_efficiency.py [--quick] [--seeds N] [--budgets 10,20] [--cases a,b]
[--workloads a,b] [--jobs N] [--no-truth] [--proposals]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibration  # noqa: E402
from equal_cost import equal_cost_runs  # noqa: E402
from ground_truth import ground_truth  # noqa: E402
from search_figure import figure  # noqa: E402
from search_table import markdown  # noqa: E402
from steady_truth import SteadyRates, steady_optimum  # noqa: E402
from strategies import PROPOSALS, STRATEGIES, Case, Launch, Launches, Oracle, Truth, simulate  # noqa: E402

from autotune.config import StudyConfig, load_config  # noqa: E402
from autotune.errors import ConfigError  # noqa: E402
from autotune.harness.engines.sim import sim_workload  # noqa: E402
from autotune.prompts import PromptSample  # noqa: E402
from autotune.results import TrialResult  # noqa: E402
from autotune.search.objective import gpus_spanned  # noqa: E402
from autotune.search.space import config_diff, key_of  # noqa: E402
from autotune.sim.truth import Deviation  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
CASES = {  # name: (study file, model profile override, fixed flags added)
    "qwen3.6-27b-b200": ("studies/qwen3.6-27b-b200.toml", None, {}),
    "qwen3.6-27b-h200": ("studies/qwen3.6-27b-h200.toml", None, {}),
    # 148 GiB of bf16 weights do not fit one H200: the 80B model runs tensor-parallel on two.
    "qwen3-next-80b-a3b-h200": ("studies/qwen3.6-27b-h200.toml", "qwen3-next-80b-a3b", {"tp_size": 2}),
    # A MoE hybrid (the planner's active-expert streaming) and a quantized checkpoint (bytes per FP8 weight), each
    # from its shipped study: these two are not in the default run (``--cases`` names them).
    "qwen3.5-35b-a3b-h200": ("studies/qwen3.5-35b-a3b-h200.toml", None, {}),
    "qwen3.6-27b-fp8-h100": ("studies/qwen3.6-27b-fp8-h100.toml", None, {}),
}
DEFAULT_CASES = ("qwen3.6-27b-b200", "qwen3.6-27b-h200", "qwen3-next-80b-a3b-h200")


# Workloads: (prompt lengths in tokens, max_tokens, the hidden natural output mean's range as a share of max_tokens).
# "seed" is the study's own prompt file (≈ 270 tokens in, ≈ 2,500 out); the others are generated.
WORKLOADS = {
    "seed": (None, 4096, (0.55, 0.67)),  # ≈ 2,250–2,750 tokens out
    "long-prompt": (("lognormal", 6000, 3000, 7800), 384, (0.6, 0.95)),  # ≈ 6,000 in, ≈ 230–365 out
    "mixed": (("loguniform", 100, 100, 6000), 2048, (0.2, 0.95)),  # 100–6,000 in, anywhere from 0.2 to 0.95
}
TRUTH_SEED = 12  # the draw of hidden deviations; a new value is a new truth, never tuned to the search
DEVIATION_RANGES = {
    "free_gib": (-3.0, 3.0),
    "activation_scale": (0.7, 1.3),
    "graph_scale": (0.7, 1.3),
    "decode_efficiency": (0.85, 1.15),
    "acceptance_delta": (-0.1, 0.1),
}
# The levers' own speed multiples (sim/truth.py), drawn from a stream of their own so the draws above stay as they
# were: --enable-unified-memory's translation and compaction, --speculative-adaptive's swaps and EMA lag.
LEVER_RANGES = {"unified_efficiency": (0.9, 1.05), "adaptive_efficiency": (0.9, 1.05)}


def _stable(text: str) -> int:
    return zlib.crc32(text.encode())


def draw_truth(case: str, workload: str, *, hidden: bool = True, seed: int = TRUTH_SEED) -> Truth:
    """The hidden truth of one case and workload: a seeded draw, the same in every run and process (``seed``:
    ``--truth-seed``, another draw to check that nothing is tuned to the committed one)."""
    lo, hi = WORKLOADS[workload][2]
    rng = np.random.default_rng([_stable(case), _stable(workload), seed])
    u = {k: float(rng.uniform(a, b)) for k, (a, b) in DEVIATION_RANGES.items()}
    share = float(rng.uniform(lo, hi))
    output_mean = share * WORKLOADS[workload][1]
    if not hidden:
        return Truth(output_mean=output_mean)
    levers = np.random.default_rng([_stable(case), _stable(workload), seed, _stable("levers")])
    v = {k: round(float(levers.uniform(a, b)), 3) for k, (a, b) in LEVER_RANGES.items()}
    return Truth(
        deviation=Deviation(
            free_gib=round(u["free_gib"], 3),
            activation_scale=round(u["activation_scale"], 3),
            graph_scale=round(u["graph_scale"], 3),
            decode_efficiency=round(u["decode_efficiency"], 3),
            **v,
        ),
        acceptance=round(0.825 + u["acceptance_delta"], 3),
        output_mean=round(output_mean, 1),
    )


def workload_prompts(name: str, n: int = 400) -> Path | None:
    """The generated prompt file of a workload (deterministic; cached under results/, git-ignored)."""
    spec = WORKLOADS[name][0]
    if spec is None:
        return None
    kind, mean, low, high = spec
    path = RESULTS / f"prompts-{name}.cache.json"
    rng = np.random.default_rng([_stable(name), 7])
    if kind == "lognormal":
        tokens = np.clip(rng.lognormal(np.log(mean) - 0.02, 0.2, n), low, high)
    else:
        tokens = np.exp(rng.uniform(np.log(low), np.log(high), n))
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    rows = []
    for i, k in enumerate(tokens.astype(int)):
        text = f"[{name} {i}] " + words * (int(k) * 4 // len(words) + 1)
        rows.append(json.dumps({"prompt": text[: int(k) * 4]}))
    content = "\n".join(rows) + "\n"
    if not path.exists() or path.read_text(encoding="utf-8") != content:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    return path


def check_unit(name: str, workload: str) -> None:
    """ConfigError for a case or workload this benchmark does not know."""
    if name not in CASES:
        raise ConfigError(f"unknown case {name!r}", key="--cases", fix=f"use one of {', '.join(CASES)}")
    if workload not in WORKLOADS:
        raise ConfigError(f"unknown workload {workload!r}", key="--workloads", fix=f"use one of {', '.join(WORKLOADS)}")


def make_case(
    name: str,
    workload: str = "seed",
    *,
    hidden: bool = True,
    window: tuple[float, float] | None = None,
    truth_seed: int = TRUTH_SEED,
) -> Case:
    """A case × workload on its hidden truth; ``window`` (warm-up, measured seconds) overrides the study's."""
    check_unit(name, workload)
    path, model, extra = CASES[name]
    cfg = load_config(ROOT / path, name=name)
    if model or extra:
        eng = cfg.engine.model_copy(
            update={
                "model": model or cfg.engine.model,
                "profile": model or cfg.engine.profile,
                "fixed": {**cfg.engine.fixed, **extra},
            }
        )
        cfg = cfg.model_copy(update={"engine": eng})
    prompts = workload_prompts(workload)
    update: dict[str, Any] = {"prompts": prompts, "max_tokens": WORKLOADS[workload][1]} if prompts is not None else {}
    if window is not None:
        update.update(warmup_s=window[0], measure_s=window[1])
    if update:
        cfg = cfg.model_copy(update={"workload": cfg.workload.model_copy(update=update)})
    label = name if workload == "seed" else f"{name}/{workload}"
    return case_from_config(label, cfg, truth=draw_truth(name, workload, hidden=hidden, seed=truth_seed))


def case_from_config(name: str, cfg: StudyConfig, truth: Truth | None = None) -> Case:
    """A case for a loaded study: its workload as the in-process evaluator replays it."""
    wl = cfg.workload
    sample = PromptSample.load(wl.prompts, wl.sample_size, wl.seed)
    workload = sim_workload(wl, [row.as_text() for row in sample.rows])
    return Case(name, cfg, workload, int(cfg.engine.fixed.get("tp_size") or 1), truth or Truth())


# The confirmation's launch term (what a relaunch adds: graph capture, allocator layout), drawn once per launch. A
# stated figure, not a measurement: the simulator draws the same per-run factor in every launch of a study, so it
# has no launch term of its own to measure; 1 % is the order of a real server's restart-to-restart spread. The window
# term is each config's own, from its simulated window (``strategies.Oracle``). ``--single-noise``: the one-term
# model (``noise_cv`` per launch) the table used before.
LAUNCH_CV = 0.01
SENSITIVITY = 3.0  # the sensitivity row runs ours again with the launch term this many times the stated one


def noise_cv(case: Case, repeats: int = 8) -> float:
    """Run-to-run spread of the hand-tuned config (the sim's noise and per-seed requests): the noise model."""
    config = {**case.cfg.engine.fixed, **(case.cfg.enqueue[0].flags if case.cfg.enqueue else case.cfg.baseline.flags)}
    noise = float(case.cfg.engine.sim_options.get("noise", 0.0))
    values = [simulate(case, config, seed=s, noise=noise).output_tok_s for s in range(1, repeats + 1)]
    return float(np.std(values, ddof=1) / np.mean(values)) if np.mean(values) else 0.0


def pick_config(launches: list[Launch]) -> dict[str, Any] | None:
    """The config a strategy's pipeline names: ours' confirmed winner, else its best *measured* launch."""
    if getattr(launches, "named", None) is not None:
        return getattr(launches, "named_config", None)
    best, seen = None, -float("inf")
    for x in launches:
        if x.status == "ok" and x.observed > seen:
            best, seen = x.config, x.observed
    return best


# --- per GPU, as the tool scores ----------------------------------------------------------------------------
def gpus_of(config: dict[str, Any] | None) -> int:
    """The GPUs a server with ``config`` spans, counted by the function the study's objective divides by."""
    return gpus_spanned(TrialResult(status="ok", config=dict(config or {})))


def per_gpu_launches(launches: list[Launch]) -> list[Launch]:
    """A strategy's launches with every tok/s (observed, true, the named config's) per GPU its server spans."""
    out = Launches(
        dataclasses.replace(x, observed=x.observed / gpus_of(x.config), true=x.true / gpus_of(x.config))
        for x in launches
    )
    for name in (
        "named_config",
        "confirm_launches",
        "confirm_cost_s",
        "confirm_note",
        "stress_launches",
        "stress_cost_s",
        "confirm",
        "trial_configs",
        "search_stop",
        "pruned",
    ):
        setattr(out, name, getattr(launches, name, getattr(Launches, name)))
    named = getattr(launches, "named", None)
    out.named = None if named is None else named / gpus_of(out.named_config)
    return out


# --- the run --------------------------------------------------------------------------------------------------
def run_case(
    case: Case,
    *,
    seeds: int,
    budgets: list[int],
    say,
    cache_dir: Path = RESULTS,
    proposals: bool = False,
    only: list[str] | None = None,
    launch_cv: float | None = LAUNCH_CV,
) -> dict[str, Any]:
    started = time.monotonic()
    cv = noise_cv(case)
    oracle = Oracle(case, noise_cv=cv, launch_cv=launch_cv)
    truth = ground_truth(case, oracle, cache_dir=cache_dir, say=say)
    oracle.asked.clear()  # the grid's configs, when it was not cached, are not the strategies'
    runs: dict[tuple[str, int], list[list[Launch]]] = {}
    chosen = {**STRATEGIES, **(PROPOSALS if proposals else {})}
    if only:
        chosen = {name: chosen[name] for name in only}
    for name, strategy in chosen.items():
        for budget in budgets:
            runs[name, budget] = [per_gpu_launches(strategy(case, oracle, budget, seed)) for seed in range(seeds)]
        say(f"  {case.name}: {name} done ({time.monotonic() - started:.0f} s)")
    top = max(budgets)
    sensitivity = None
    if launch_cv is not None and "ours" in chosen:  # the stated launch term is a guess: ours again at 3× it
        loud = Oracle(case, noise_cv=cv, launch_cv=SENSITIVITY * launch_cv)
        loud.memo = oracle.memo  # the same configs, evaluated once
        sensitivity = {
            "launch_cv": loud.launch_cv,
            "factor": SENSITIVITY,
            "runs": [per_gpu_launches(STRATEGIES["ours"](case, loud, top, seed)) for seed in range(seeds)],
        }
        say(f"  {case.name}: ours at {SENSITIVITY:g}× the launch CV done ({time.monotonic() - started:.0f} s)")
    equal = equal_cost_runs(case, oracle, chosen, runs, budgets, seeds, per_gpu_launches) if "ours" in chosen else {}
    if equal:
        say(f"  {case.name}: rivals at equal GPU-hours done ({time.monotonic() - started:.0f} s)")
    steady, checks = _steady(
        case,
        oracle,
        truth,
        [*runs.values(), *equal.values(), *([sensitivity["runs"]] if sensitivity else [])],
        runs.get(("ours", top), []),
        cache_dir,
    )
    say(f"  {case.name}: steady state, {steady['evaluated']} configs evaluated ({time.monotonic() - started:.0f} s)")
    optimum = truth["tok_s"] / gpus_of(truth["config"])  # per GPU, as every launch above
    found = max((x.true for rs in runs.values() for r in rs for x in r), default=0.0)
    if found > optimum:  # the grid's KV shortcut missed a config (see ground_truth.py): keep the honest maximum
        say(f"  {case.name}: a strategy found {found:,.0f} tok/s > grid optimum {optimum:,.0f}; using it")
        optimum = found
    return {
        "case": case,
        "name": case.name,
        "truth": truth,
        "hidden": case.truth.to_dict(),
        "optimum": optimum,
        "baseline_per_gpu": truth["baseline_tok_s"] / gpus_of(case.baseline),
        "gpus": gpus_of(truth["config"]),
        "noise_cv": cv,
        "launch_cv": launch_cv,
        "window_cv": _median_window_cv(oracle),
        "runs": runs,
        "names": list(chosen),
        "steady": steady,
        "sensitivity": sensitivity,
        "equal": equal,
        "calibration": checks,
    }


def _steady(
    case: Case,
    oracle: Oracle,
    truth: dict[str, Any],
    groups: list[list[Launches]],
    ours: list[Launches],
    cache_dir: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The steady-state optimum over the grid's top and every pick; each run's ``steady`` (its pick's steady rate
    per GPU); ours' claims checked against it (``calibration``). The rates are memoised on disk."""
    rates = SteadyRates(case, cache_dir)

    def rate(config: dict[str, Any]) -> float:
        return rates.rate(config) / gpus_of(config)

    every = [r for group in groups for r in group]
    ranked = [config for _, config in truth.get("top", [])] or [truth["config"]]
    steady = steady_optimum(rates, ranked, [c for r in every if (c := pick_config(r)) is not None], gpus_of)
    for r in every:
        c = pick_config(r)
        r.steady = rate(c) if c is not None else 0.0
    checks = [calibration.check(r, rate) for r in ours]
    # The same claims against the noise-free rates of the confirmation's own windows (each contender's warm-up,
    # ``confirm.warmup``): what the intervals measure, so a shortfall here is the interval's statistics and one only
    # against the steady state is the windows' bias.
    steady["window_checks"] = [calibration.check(r, _confirm_rate(oracle, r)) for r in ours]
    window_best = rate(truth["config"])
    steady.update(
        window_optimum_pct=100 * window_best / steady["tok_s"] if steady["tok_s"] else 0.0,
        window_optimum_drift=oracle.outcome(truth["config"]).drift,
        baseline_tok_s=rate(case.baseline),
        best_diff=config_diff(steady["config"] or case.baseline, case.baseline),
    )
    rates.save()
    steady["evaluated"] = rates.evaluated
    return steady, checks


def _confirm_rate(oracle: Oracle, run: Launches):
    """A config's noise-free rate per GPU in ``run``'s confirmation windows (the warm-up it gave that config)."""
    warm = {int(n): w for n, w in ((getattr(run, "confirm", None) or {}).get("warmup_s") or {}).items()}
    by_key = {key_of(c): warm.get(n) for n, c in (getattr(run, "trial_configs", None) or {}).items()}
    return lambda c: oracle.outcome(c, by_key.get(key_of(c))).tok_s / gpus_of(c)


def _median_window_cv(oracle: Oracle) -> float:
    """The median window term over the configs the strategies measured cleanly (not the grid's: it may be cached)."""
    cvs = [o.window_cv for key, o in oracle.memo.items() if key in oracle.asked and o.status == "ok"]
    return float(statistics.median(cvs)) if cvs else 0.0


def _unit(
    args: tuple[
        str, str, bool, int, list[int], bool, str, list[str] | None, tuple[float, float] | None, float | None, int
    ],
) -> dict[str, Any]:
    """One case × workload in a worker process (the result without the case object)."""
    name, workload, hidden, seeds, budgets, proposals, cache, only, window, launch_cv, truth_seed = args

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    case = make_case(name, workload, hidden=hidden, window=window, truth_seed=truth_seed)
    result = run_case(
        case,
        seeds=seeds,
        budgets=budgets,
        say=say,
        cache_dir=Path(cache),
        proposals=proposals,
        only=only,
        launch_cv=launch_cv,
    )
    result.pop("case")
    return result


def _pin_hash_seed(argv: list[str] | None) -> None:
    """Re-run under PYTHONHASHSEED=0: Optuna's grouped multivariate TPE walks sets of parameter names, whose order
    follows the per-process string hash, so an unpinned run proposes different configs from the same seeds."""
    if os.environ.get("PYTHONHASHSEED") == "0" or argv is not None:
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})


def _window(text: str) -> tuple[float, float] | None:
    """``--window WARMUP,MEASURE``: None when not given; ValueError unless warm-up ≥ 0 and window > 0."""
    if not text:
        return None
    warmup, measure = (float(x) for x in text.split(","))
    if warmup < 0 or measure <= 0:
        raise ValueError(text)
    return warmup, measure


def main(argv: list[str] | None = None) -> int:
    _pin_hash_seed(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budgets", default="10,20")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="3 seeds, budgets 10,20, the seed case and workload only")
    ap.add_argument("--no-truth", action="store_true", help="turn the hidden deviations off (the planner is exact)")
    ap.add_argument(
        "--truth-seed",
        type=int,
        default=TRUTH_SEED,
        help=f"draw the hidden truth with another seed (default {TRUTH_SEED}, the committed table's)",
    )
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="case × workload units in parallel")
    ap.add_argument("--proposals", action="store_true", help="add rows for proposed study-loop/space changes")
    ap.add_argument("--strategies", default="", help="only these rows (comma-separated names; default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write the table and figure")
    ap.add_argument(
        "--cache",
        type=Path,
        default=RESULTS,
        help="where the ground truth and steady rates are memoised (default: beside the tables)",
    )
    ap.add_argument("--no-figure", action="store_true")
    ap.add_argument("--launch-cv", type=float, default=LAUNCH_CV, help="the stated launch term (default 0.01)")
    ap.add_argument("--single-noise", action="store_true", help="one noise term per launch (the table before windows)")
    ap.add_argument(
        "--window",
        default="",
        metavar="WARMUP,MEASURE",
        help="every trial's warm-up and window in seconds, instead of the study's (e.g. 90,30)",
    )
    args = ap.parse_args(argv)
    try:
        window = _window(args.window)
    except ValueError:
        print(
            f"Error: --window must be WARMUP,MEASURE in seconds (warm-up ≥ 0, window > 0), got {args.window!r}",
            file=sys.stderr,
        )
        return 1
    seeds, budgets, names, workloads = args.seeds, args.budgets, args.cases.split(","), args.workloads.split(",")
    if args.quick:
        seeds, budgets, names, workloads = min(seeds, 3), "10,20", ["qwen3.6-27b-b200"], ["seed"]
    try:
        budget_list = sorted({int(b) for b in budgets.split(",")})
        units = [(n.strip(), w.strip()) for n in names for w in workloads]
        for n, w in units:
            check_unit(n, w)
        only = [x.strip() for x in args.strategies.split(",") if x.strip()] or None
        known = {**STRATEGIES, **(PROPOSALS if args.proposals else {})}
        for x in only or []:
            if x not in known:
                raise ConfigError(
                    f"unknown strategy {x!r}",
                    key="--strategies",
                    fix=f"use names from {', '.join(known)} (proposals need --proposals)",
                )
    except ValueError:
        print(f"Error: --budgets must be comma-separated integers, got {budgets!r}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    launch_cv = None if args.single_noise else args.launch_cv
    jobs = [
        (
            n,
            w,
            not args.no_truth,
            seeds,
            budget_list,
            args.proposals,
            str(args.cache),
            only,
            window,
            launch_cv,
            args.truth_seed,
        )
        for n, w in units
    ]
    if args.jobs > 1 and len(jobs) > 1:
        # Results come back in submission order: the table does not depend on which worker finished first.
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_unit, jobs))
    else:
        results = [_unit(job) for job in jobs]
    command = (
        "python benchmarks/search_efficiency.py"
        + (" --quick" if args.quick else "")
        + (f" --seeds {args.seeds}" if args.seeds != 10 and not args.quick else "")
        + (" --no-truth" if args.no_truth else "")
        + (f" --window {args.window}" if window else "")
        + (
            " --single-noise"
            if args.single_noise
            else f" --launch-cv {args.launch_cv:g}"
            if args.launch_cv != LAUNCH_CV
            else ""
        )
        + (f" --truth-seed {args.truth_seed}" if args.truth_seed != TRUTH_SEED else "")
        + (f" --strategies {args.strategies}" if args.strategies else "")
        + (f" --cases {args.cases}" if args.cases != ",".join(DEFAULT_CASES) and not args.quick else "")
        + (f" --workloads {args.workloads}" if args.workloads != ",".join(WORKLOADS) and not args.quick else "")
        + (f" --budgets {args.budgets}" if args.budgets != "10,20" and not args.quick else "")
        + (" --proposals" if args.proposals else "")
    )
    text = markdown(
        results,
        seeds=seeds,
        budgets=budget_list,
        seconds=time.monotonic() - started,
        hidden=not args.no_truth,
        command=command,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search_efficiency.md").write_text(text + "\n", encoding="utf-8")
    if not args.no_figure:
        figure(results, budget_list, args.out / "search_efficiency.html")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
