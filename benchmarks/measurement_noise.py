"""How long must the measurement window be? The same config measured N times through the real harness.

Each launch is one ``run_trial`` on the simulated server with ``--sim-noise`` on, measured over the longest
window; the shorter windows are the same launch's first seconds after warm-up. Two series: *same seed* (every
launch replays identical requests, as greedy decoding does: what varies is step jitter and the harness's own
timing, the noise a longer window averages away) and *new seed* (each launch draws new output lengths and
acceptance, as sampled decoding would: workload variance, which no window removes). The coefficient of
variation (CV) of steady-state tok/s per window says which window separates two configs 2 % apart: the
difference of two measurements spreads by √2 × CV, so CV ≤ 0.7 % resolves 2 % at 95 %. The in-process
evaluator, out to long windows, shows whether a short window is also *biased* (a 2,500-token completion lives
for tens of seconds, so a short window sees only the start of a batch's life). Writes
``results/measurement_noise.md``.

Usage: ``python benchmarks/measurement_noise.py [--quick] [--repeats 10] [--windows 2,5,10,20] [--long 60,300]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autotune.config import load_config
from autotune.errors import AutotuneError
from autotune.harness.engines import make_engine
from autotune.harness.engines.sim import sim_workload
from autotune.harness.setup import TrialSetup
from autotune.harness.trial import run_trial
from autotune.harness.workload import (
    PromptSample,
    ReplayRecords,
    RequestRecord,
    WorkloadSpec,
    metrics_from_records,
)
from autotune.sim import evaluate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
STUDY = ROOT / "studies" / "qwen3.6-27b-b200.toml"
RESOLVE_CV = 0.7  # % : two measurements 2 % apart are told apart at 95 % (1.96 × √2 × 0.7 % ≈ 2 %)


def window_rates(trial_dir: Path, warmup_s: float, windows: list[float], concurrency: int) -> dict[float, float]:
    """Steady-state tok/s over [warm-up, warm-up + w] for each w, from the trial's per-request records."""
    rows = [
        json.loads(line)
        for line in (trial_dir / "records.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    requests = [RequestRecord(**{**row, "chunks": [tuple(c) for c in row["chunks"]]}) for row in rows]
    records = ReplayRecords(
        requests=requests, window=(warmup_s, warmup_s + max(windows)), concurrency=concurrency, endpoint="generate"
    )
    return {w: metrics_from_records(records, window=(warmup_s, warmup_s + w)).output_tok_s for w in windows}


def harness_runs(
    config: dict[str, Any],
    *,
    cfg: Any,
    repeats: int,
    windows: list[float],
    noise: float,
    workdir: Path,
    say,
    failures: list[str] | None = None,
    new_seed: bool = True,
) -> list[dict[float, float]]:
    """Per launch, tok/s per window. A launch that fails is listed in ``failures`` (a failure is data) and the
    others still count; fewer than two good launches is an error."""
    failures = [] if failures is None else failures
    wl = cfg.workload
    spec = WorkloadSpec(**{**wl.model_dump(), "measure_s": max(windows)})
    sample = PromptSample.load(wl.prompts, wl.sample_size, wl.seed)
    out = []
    for k in range(repeats):
        engine = make_engine(
            "sim",
            model_path=cfg.engine.profile or cfg.engine.model,
            sim_gpu=cfg.engine.sim_gpu,
            sim_options={"noise": noise, "seed": k + 1 if new_seed else 1, "startup_s": 0.2, "release_s": 0},
        )
        started = time.monotonic()
        trial_dir = workdir / f"{'new' if new_seed else 'same'}-seed-{k}"
        setup = TrialSetup(engine=engine, workload=spec, sample=sample, gpu_index=0, run_dir=workdir / "runs")
        result = run_trial(setup, config, trial_dir=trial_dir)
        if not result.ok or result.metrics is None:
            failures.append(f"launch {k + 1} ended {result.status}: {result.reason}")
            say(f"  repeat {k + 1}/{repeats}: {failures[-1]}")
            continue
        out.append(window_rates(trial_dir, wl.warmup_s, windows, result.metrics.concurrency))
        say(
            f"  repeat {k + 1}/{repeats}: {result.metrics.output_tok_s:,.0f} tok/s over {max(windows):g} s "
            f"({time.monotonic() - started:.0f} s)"
        )
    if len(out) < 2:
        raise AutotuneError(f"only {len(out)} of {repeats} launches measured: {'; '.join(failures)}")
    return out


def evaluator_runs(
    config: dict[str, Any], *, cfg: Any, repeats: int, windows: list[float], noise: float
) -> dict[float, list[float]]:
    wl = cfg.workload
    prompts = [row.as_text() for row in PromptSample.load(wl.prompts, wl.sample_size, wl.seed).rows]
    out: dict[float, list[float]] = {}
    for w in windows:
        work = dataclasses.replace(sim_workload(wl, prompts), measure_s=w)
        out[w] = [
            evaluate(
                config, work, model=cfg.engine.profile, gpu=cfg.engine.sim_gpu, seed=k + 1, noise=noise
            ).output_tok_s
            for k in range(repeats)
        ]
    return out


def cv_pct(values: list[float]) -> float:
    return float(100 * np.std(values, ddof=1) / np.mean(values)) if len(values) > 1 and np.mean(values) else 0.0


def report(
    config: dict[str, Any],
    harness: dict[str, list[dict[float, float]]],
    virtual: dict[float, list[float]],
    *,
    windows: list[float],
    warmup_s: float,
    noise: float,
    default_s: float,
    seconds: float,
    failures: Sequence[str] = (),
) -> str:
    """``harness``: {"same seed": runs, "new seed": runs}, each run {window: tok/s}."""
    same, new = harness["same seed"], harness["new seed"]
    lines = [
        "# Measurement noise vs window length",
        "",
        f"Generated by `python benchmarks/measurement_noise.py` in {seconds / 60:.1f} min: the hand-tuned "
        f"Qwen3.6-27B config on the simulated B200 (`--sim-noise {noise:g}`) launched through `run_trial`, "
        f"{len(same)} times replaying the same requests (same `--sim-seed`) and {len(new)} times with a new "
        f"seed each; {warmup_s:g} s warm-up; each window is the start of the same launch's measurement. "
        f"Config: `{config}`.",
        "",
        *([f"Failed launches, left out: {'; '.join(failures)}.", ""] if failures else []),
        "| window (s) | same seed: mean tok/s | same seed: CV % | new seed: mean tok/s | new seed: CV % | "
        "evaluator, new seed: CV % |",
        "|---|---|---|---|---|---|",
    ]
    cvs = {}
    for w in windows:
        a, b = [run[w] for run in same], [run[w] for run in new]
        cvs[w] = cv_pct(a)
        lines.append(
            f"| {w:g} | {np.mean(a):,.0f} | {cvs[w]:.2f} | {np.mean(b):,.0f} | {cv_pct(b):.2f} | "
            f"{cv_pct(virtual[w]):.2f} |"
        )
    longest = max(virtual)
    ref = float(np.mean(virtual[longest]))
    lines += [
        "",
        f"The evaluator alone (new seed per run), out to long windows: is a short window *biased*, not "
        f"just noisy? Bias is the mean against the {longest:g} s window's.",
        "",
        "| window (s) | evaluator mean tok/s | evaluator CV % | bias vs longest % |",
        "|---|---|---|---|",
    ]
    for w in sorted(virtual):
        mean = float(np.mean(virtual[w]))
        lines.append(f"| {w:g} | {mean:,.0f} | {cv_pct(virtual[w]):.2f} | {100 * (mean / ref - 1):+.1f} |")
    enough = next((w for w in windows if cvs[w] <= RESOLVE_CV), None)
    lines += [
        "",
        f"Two measurements 2 % apart are separated at 95 % when CV ≤ {RESOLVE_CV} %. With the same "
        "requests, "
        + (
            f"the shortest window that meets it here is **{enough:g} s**"
            if enough is not None
            else f"no window up to {max(windows):g} s meets it here"
        )
        + f"; the study default (`measure_s`) is {default_s:g} s. The new-seed CV is the workload's own "
        "variance (different output lengths and acceptance): a longer window does not remove it, a larger "
        "prompt sample does. Confirmation re-measures the top configs interleaved, so the search window "
        "only has to rank, not to certify, a winner.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--windows", default="2,5,10,20")
    ap.add_argument("--long", default="60,300", help="extra windows for the in-process evaluator only (bias)")
    ap.add_argument("--quick", action="store_true", help="3 launches per series, windows 2 and 5 s (1–2 min)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    repeats, windows_text = (min(args.repeats, 3), "2,5") if args.quick else (args.repeats, args.windows)
    try:
        windows = sorted({float(w) for w in windows_text.split(",")})
        long = sorted({float(w) for w in args.long.split(",") if w.strip()} - set(windows))
        if repeats < 2 or windows[0] <= 0 or (long and long[0] <= 0):
            raise ValueError
    except ValueError:
        print(
            f"Error: need --repeats ≥ 2 and positive --windows/--long, got {repeats}, {windows_text!r}, {args.long!r}",
            file=sys.stderr,
        )
        return 1
    try:
        cfg = load_config(STUDY)
    except AutotuneError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    config = {**cfg.engine.fixed, **cfg.enqueue[0].flags}
    noise = float(cfg.engine.sim_options.get("noise", 0.02)) or 0.02
    started = time.monotonic()

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="autotune-noise-") as tmp:
        os.environ.setdefault("AUTOTUNE_SIM_DEVICE_DIR", str(Path(tmp) / "devices"))
        failures: list[str] = []
        try:
            harness = {
                label: harness_runs(
                    config,
                    cfg=cfg,
                    repeats=repeats,
                    windows=windows,
                    noise=noise,
                    workdir=Path(tmp),
                    say=say,
                    failures=failures,
                    new_seed=new_seed,
                )
                for label, new_seed in (("same seed", False), ("new seed", True))
            }
        except AutotuneError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            return 1
    virtual = evaluator_runs(config, cfg=cfg, repeats=repeats, windows=windows + long, noise=noise)
    text = report(
        config,
        harness,
        virtual,
        windows=windows,
        warmup_s=cfg.workload.warmup_s,
        noise=noise,
        default_s=cfg.workload.measure_s,
        seconds=time.monotonic() - started,
        failures=failures,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "measurement_noise.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
