"""Warm start (``autotune sweep --from``) against a cold study, on the simulator's hidden truths.

Each pair is an earlier study and the re-tune that starts from it:

- **another GPU**: the 27B seed case on a B200 → the same model on an H200 (each case's own hidden truth);
- **another version**: the B200 case under another hidden truth (``--truth-seed``: other free memory, activation and
  graph memory, decode speed, acceptance, output length: what a new SGLang release moves) → the committed truth.

Per seed, the earlier study is ``ours`` (``strategies._sweep``: the shipped Sweep, confirmation and stress) on the
source; the cold re-tune is ``ours`` on the target; the warm one is ``ours`` on the target started from the earlier
study's record, built by the code ``sweep --from`` runs (``search.views.origin.warm_record``: its winner and top 3
translated and fitted to the target's space, its planner corrections scaled by the GPUs' memory). The earlier
study's own GPU time is not counted (it was spent already). Both re-tunes run the same seed, budget and noise.

Scored against the target's steady-state optimum (``steady_truth``): the launches and GPU-hours until the best
*measured* config so far runs at ≥ 97 % of it at steady state (search launches in order; a planner skip is no
launch and costs nothing), and the steady rate of the config each pipeline names after its confirmation. All are
simulator figures: they say how the search uses a prior on the simulator's hidden truths, not what a real GPU does.

Usage: ``python benchmarks/warm_start.py [--seeds N] [--budget N] [--pairs a,b]``; writes
``results/warm_start.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ground_truth import ground_truth  # noqa: E402
from search_efficiency import LAUNCH_CV, RESULTS, TRUTH_SEED, make_case, noise_cv, pick_config  # noqa: E402
from search_table import med_iqr  # noqa: E402
from steady_truth import SteadyRates, steady_optimum  # noqa: E402
from strategies import OOM, Launch, Oracle, _sweep  # noqa: E402

from autotune.search.views.origin import warm_record  # noqa: E402
from autotune.sglang.flags import FlagTable  # noqa: E402

TARGET = 0.97
NEAR = 0.95  # the main table's easier bar (``search_table.NEAR``), where 97 % is out of every study's reach
OTHER_TRUTH = 7  # the "another version" source's truth draw (the committed table's second truth)
PAIRS = {  # name: ((source case, its truth seed), (target case, its truth seed))
    "another GPU": (("qwen3.6-27b-b200", TRUTH_SEED), ("qwen3.6-27b-h200", TRUTH_SEED)),
    "another version": (("qwen3.6-27b-b200", OTHER_TRUTH), ("qwen3.6-27b-b200", TRUTH_SEED)),
}


def reach(run: list[Launch], rate, optimum: float, target: float = TARGET) -> tuple[float, float]:
    """(launches, GPU-hours) until the best measured config so far runs at ≥ ``target`` × ``optimum`` at steady
    state; inf when it never does."""
    spent, launched, pick, seen = 0.0, 0, None, -float("inf")
    for x in run:
        spent += x.cost_s
        launched += x.launched
        if x.status == "ok" and x.observed > seen:
            pick, seen = x.config, x.observed
        if pick is not None and rate(pick) >= target * optimum:
            return float(launched), spent / 3600
    return float("inf"), float("inf")


def score(run: Any, rate, optimum: float) -> dict[str, Any]:
    launches, gpu_h = reach(run, rate, optimum)
    launches95, gpu_h95 = reach(run, rate, optimum, NEAR)
    named = pick_config(run)
    total_s = sum(x.cost_s for x in run) + run.confirm_cost_s + run.stress_cost_s
    return {
        "launches97": launches,
        "gpu_h97": gpu_h,
        "launches95": launches95,
        "gpu_h95": gpu_h95,
        "pct": 100 * rate(named) / optimum if named else 0.0,
        "launches": sum(x.launched for x in run) + run.confirm_launches + run.stress_launches,
        "gpu_h": total_s / 3600,
        "ooms": sum(x.status in OOM for x in run),
    }


def run_pair(name: str, seeds: int, budget: int, say) -> dict[str, Any]:
    (src_name, src_truth), (dst_name, dst_truth) = PAIRS[name]
    src, dst = make_case(src_name, truth_seed=src_truth), make_case(dst_name, truth_seed=dst_truth)
    src_oracle = Oracle(src, noise_cv=noise_cv(src), launch_cv=LAUNCH_CV)
    oracle = Oracle(dst, noise_cv=noise_cv(dst), launch_cv=LAUNCH_CV)
    truth = ground_truth(dst, oracle, cache_dir=RESULTS, say=say)
    oracle.asked.clear()
    rates = SteadyRates(dst, RESULTS)
    rows: dict[str, list[dict[str, Any]]] = {"cold": [], "--from": []}
    runs: list[Any] = []
    notes: list[list[str]] = []
    for seed in range(seeds):
        earlier = _sweep(src, src_oracle, budget, seed)
        record, lines = warm_record(
            earlier.study,
            "in memory",
            dst.cfg,
            table=FlagTable.bundled(),
            version="0.5.23 (simulated)",
            name=f"{src_name}@{src_truth}",
        )
        notes.append(lines)
        cold, warm = _sweep(dst, oracle, budget, seed), _sweep(dst, oracle, budget, seed, warm=record)
        runs += [cold, warm]
        rows["cold"].append(cold)
        rows["--from"].append(warm)
        say(f"  {name}: seed {seed} done")
    ranked = [config for _, config in truth.get("top", [])] or [truth["config"]]
    steady = steady_optimum(rates, ranked, [c for r in runs if (c := pick_config(r)) is not None], lambda c: 1)
    rates.save()
    optimum = steady["tok_s"]
    scored = {k: [score(r, rates.rate, optimum) for r in rs] for k, rs in rows.items()}
    return {
        "name": name,
        "source": f"{src_name} (truth {src_truth})",
        "target": f"{dst_name} (truth {dst_truth})",
        "optimum": optimum,
        "baseline": rates.rate(dst.baseline),
        "scored": scored,
        "notes": notes,
    }


def _cell(values: list[float], fmt: str, budget: int | None = None) -> str:
    """Median [IQR] over seeds (``search_table.med_iqr``: a seed that never reached counts as censored), and how
    many seeds reached it when some did not."""
    reached = sum(v != float("inf") for v in values)
    tail = f" ({reached}/{len(values)} reached)" if reached < len(values) else ""
    return med_iqr(values, fmt, budget) + tail


def _seeds(values: list[float], fmt: str) -> str:
    return ", ".join("never" if v == float("inf") else format(v, fmt) for v in values)


def markdown(results: list[dict[str, Any]], *, seeds: int, budget: int, seconds: float, command: str) -> str:
    lines = [
        "# Warm start (`autotune sweep --from`) against a cold study, on the simulator",
        "",
        f"Generated by `{command}` ({seeds} seeds, {budget} launches per study; {seconds / 60:.1f} min). "
        "**Simulator figures**: every launch runs on the simulator's hidden truth of the target case "
        "(`benchmarks/search_efficiency.py`'s draw), scored against the target's steady-state optimum "
        '(`steady_truth.py`). Cells: median [IQR] over seeds. "to 97 %": search launches and their GPU-hours '
        "until the best measured config so far runs at ≥ 97 % of that optimum at steady state (a seed that "
        'never did counts as censored: ">budget"/never; the cell says how many seeds reached it); "to 95 %": '
        'the main table\'s easier bar. "% of opt.": the config the pipeline names after its confirmation. '
        "Totals count the confirmation and stress launches; the earlier study's own GPU time is not counted "
        "(it was spent already).",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['name']}: {res['source']} → {res['target']}",
            "",
            f"Steady-state optimum {res['optimum']:,.0f} tok/s per GPU (baseline {res['baseline']:,.0f}).",
            "",
            "| start | launches to 97 % | GPU-h to 97 % | launches to 95 % | GPU-h to 95 % | % of opt. named | "
            "launches in all | GPU-h in all | OOM launches |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for start, stats in res["scored"].items():
            col = lambda key, stats=stats: [float(s[key]) for s in stats]  # noqa: E731
            lines.append(
                f"| {start} | {_cell(col('launches97'), '.0f', budget)} | {_cell(col('gpu_h97'), '.2f')} | "
                f"{_cell(col('launches95'), '.0f', budget)} | {_cell(col('gpu_h95'), '.2f')} | "
                f"{med_iqr(col('pct'), '.1f')} | {med_iqr(col('launches'), '.0f')} | "
                f"{med_iqr(col('gpu_h'), '.2f')} | {sum(s['ooms'] for s in stats)} |"
            )
        lines += ["", "Per seed, launches to 97 % / to 95 %:", ""]
        for start, stats in res["scored"].items():
            lines.append(
                f"- {start}: {_seeds([s['launches97'] for s in stats], '.0f')} / "
                f"{_seeds([s['launches95'] for s in stats], '.0f')}"
            )
        lines += ["", "What `--from` carried (seed 0):", "", *[f"- {line}" for line in res["notes"][0]], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0" and argv is None:  # as search_efficiency: TPE's order is hashed
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of: {', '.join(PAIRS)}")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.pairs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        print(f"Error: --pairs: unknown pair {unknown[0]!r} (use {', '.join(PAIRS)})", file=sys.stderr)
        return 1
    started = time.monotonic()

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results = [run_pair(n, args.seeds, args.budget, say) for n in names]
    command = (
        "python benchmarks/warm_start.py"
        + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
        + (f" --budget {args.budget}" if args.budget != 20 else "")
        + (f" --pairs '{args.pairs}'" if names != list(PAIRS) else "")
    )
    text = markdown(results, seeds=args.seeds, budget=args.budget, seconds=time.monotonic() - started, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warm_start.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
