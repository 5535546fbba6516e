"""Does the radix cache win where prompts share a long prefix, and lose where they do not? Measured, not assumed.

Runs two studies with the same space (``studies/qwen3.6-27b-b200.toml``, the seed's workload, and
``studies/qwen3.6-27b-b200-shared-prefix.toml``) on the simulator's virtual clock (``simulated_runner`` below:
the same scheduler as the paced server, seconds instead of minutes), then reports each study's winner and its
flag slice over ``disable_radix_cache``: the best tok/s with the cache on and with it off. The simulator's prefix
reuse is a model of SGLang's radix cache (``autotune/sim/radix.py``); the figures are claims about SGLang only as far
as that model is. Usage: ``python benchmarks/radix_trade.py [--trials 40]``; writes ``results/radix_trade.md``.

``--levers`` answers another question on the same two studies: do the Mamba-slot and Mamba-state levers of SGLang
0.5.23 (the decode-lock switch ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK``, ``--mamba-track-interval``,
``--mamba-max-states-per-path``) change the winner? Each study runs without them (its file less any of them),
then with them (``LEVERS`` added as ``LEVER_VARIANTS`` says), per ``--seeds``; each crowned config is re-measured on
fresh seeds, and the winner
found without them is re-measured with the decode-lock switch set (the slots re-derived). Writes
``results/radix_trade_levers.md``. ``--tree``: the shared-prefix study's radix-on configs at fixed running caps,
with the track interval and the per-path cap varied one at a time (``results/radix_trade_tree.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.config import StudyConfig, load_config  # noqa: E402
from autotune.results import TrialResult  # noqa: E402
from autotune.search.runner import Runner, predict  # noqa: E402
from autotune.search.space import Space  # noqa: E402
from autotune.search.study import run_study  # noqa: E402

STUDIES = {
    "seed workload": "studies/qwen3.6-27b-b200.toml",
    "shared prefix": "studies/qwen3.6-27b-b200-shared-prefix.toml",
}


def simulated_runner(cfg: StudyConfig) -> Runner:
    """A runner on the simulator's virtual clock, seeded per trial (a repeat of a trial gets fresh noise)."""
    calls: dict[int, int] = {}

    def run(config: dict, number: int):
        calls[number] = calls.get(number, 0) + 1
        return predict(cfg, config, seed=(cfg.study.seed * 100_003 + number) * 101 + calls[number])

    return run


class _Quiet:
    """A progress sink that prints nothing (the table at the end is the output)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def run(path: str, trials: int, storage_dir: Path) -> dict:
    cfg = load_config(ROOT / path, trials=trials, storage=f"sqlite:///{storage_dir / Path(path).stem}.db")
    study = run_study(cfg, runner=simulated_runner(cfg), progress=_Quiet())
    best: dict[bool, tuple[float, int]] = {}
    for trial in study.get_trials(deepcopy=False):
        result = TrialResult.of(trial)
        if result is None or not result.ok or result.metrics is None:
            continue
        off = bool(result.config.get("disable_radix_cache"))
        tok = result.metrics.output_tok_s
        if tok > best.get(off, (0.0, -1))[0]:
            best[off] = (tok, trial.number)
    crowned = (study.user_attrs.get("confirmation") or {}).get("winner_trial")
    config = next((TrialResult.of(t).config for t in study.get_trials(deepcopy=False) if t.number == crowned), None)
    if config is None:  # no confirmation stage: the best measured trial
        off = max(best, key=lambda k: best[k][0])
        crowned, config = best[off][1], {"disable_radix_cache": off}
    return {
        "on": best.get(False),
        "off": best.get(True),
        "crowned": crowned,
        "winner_radix": "off" if config.get("disable_radix_cache") else "on",
    }


SWITCH = "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK"
TREE = ("mamba_track_interval", "mamba_max_states_per_path")
ALL_LEVERS = (f"env:{SWITCH}", *TREE)
# How a variant searches each lever (the committed studies search the switch this way; the shared-prefix one was
# measured with the tree levers too, results/radix_trade_levers.md, and does not search them).
LEVERS = {
    f"env:{SWITCH}": {"choices": [False, True], "when": "not disable_radix_cache"},
    "mamba_track_interval": {"choices": [128, 256, 1024], "when": "not disable_radix_cache"},
    "mamba_max_states_per_path": {"choices": ["unset", 2, 8], "when": "not disable_radix_cache"},
}
# (study, variant label, the levers it searches)
LEVER_VARIANTS = [
    ("seed workload", "without", ()),
    ("seed workload", "+ decode lock", (f"env:{SWITCH}",)),
    ("shared prefix", "without", ()),
    ("shared prefix", "+ decode lock", (f"env:{SWITCH}",)),
    ("shared prefix", "+ decode lock, track interval, cap", ALL_LEVERS),
]
REMEASURE_SEEDS = range(1, 6)
SIM_NOTE = (
    "Simulator figures (virtual clock): a claim about SGLang 0.5.23 only as far as the planner's slot rule and "
    "the simulator's radix cache are true (docs/sglang-memory.md §1)."
)


def variant_file(path: str, keep: tuple[str, ...], directory: Path, label: str, seed: int) -> Path:
    """The study file searching exactly the levers in ``keep`` (as ``LEVERS``), prompts made absolute."""
    raw = tomllib.loads((ROOT / path).read_text(encoding="utf-8"))
    space = raw["space"]
    env = space.pop("env", {})
    derived = space.pop("derived", None)
    for lever in ALL_LEVERS:
        if lever.startswith("env:"):
            env.pop(lever[4:], None)
        else:
            space.pop(lever, None)
    for lever in keep:
        if lever.startswith("env:"):
            env[lever[4:]] = LEVERS[lever]
        else:
            space[lever] = LEVERS[lever]
    if env:
        space["env"] = env
    if derived is not None:
        space["derived"] = derived
    raw["study"]["seed"] = seed
    raw["workload"]["prompts"] = str(((ROOT / path).parent / raw["workload"]["prompts"]).resolve())
    out = directory / f"{Path(path).stem}-{label.replace(' ', '').replace(',', '_')}-{seed}.toml"
    out.write_text(tomli_w.dumps(raw), encoding="utf-8")
    return out


def remeasure(cfg: StudyConfig, config: dict) -> float:
    """Mean tok/s of ``config`` over fresh seeds (0 when it fails)."""
    values = []
    for seed in REMEASURE_SEEDS:
        result = predict(cfg, config, seed=10_000 + seed)
        values.append(result.metrics.output_tok_s if result and result.ok and result.metrics else 0.0)
    return statistics.fmean(values)


def with_switch(cfg: StudyConfig, config: dict) -> dict:
    """``config`` with the decode-lock switch set and its derived flags (the Mamba slots) derived again."""
    out = {**config, f"env:{SWITCH}": True}
    return Space.from_config(cfg).complete(out)


def lever_row(study: str, label: str, keep: tuple[str, ...], trials: int, seed: int, tmp: Path) -> str:
    path = variant_file(STUDIES[study], keep, tmp, label, seed)
    cfg = load_config(path, trials=trials, storage=f"sqlite:///{tmp / path.stem}.db")
    study_obj = run_study(cfg, runner=simulated_runner(cfg), progress=_Quiet())
    results = {t.number: TrialResult.of(t) for t in study_obj.get_trials(deepcopy=False)}
    measured = {n: r.metrics.output_tok_s for n, r in results.items() if r and r.ok and r.metrics}
    crowned = (study_obj.user_attrs.get("confirmation") or {}).get("winner_trial")
    if crowned is None and measured:  # no confirmation stage: the best measured trial, as ``run`` reads it
        crowned = max(measured, key=lambda n: measured[n])
    result = results.get(crowned) if crowned is not None else None
    if result is None:
        return f"| {study} | {label} | {seed} | — (no winner) | — | — |"
    config = result.config
    shown = {k: config.get(k) for k in ("disable_radix_cache", "max_running_requests", *ALL_LEVERS) if k in config}
    mean = remeasure(cfg, config)
    flipped = (
        ""
        if config.get("disable_radix_cache") or config.get(f"env:{SWITCH}")
        else f"{remeasure(cfg, with_switch(cfg, config)):,.0f}"
    )
    return f"| {study} | {label} | {seed} | #{crowned}: {shown} | {mean:,.0f} | {flipped or '—'} |"


def levers(trials: int, seeds: int) -> None:
    lines = [
        "| study | space | study seed | crowned trial: its radix cache, running cap and levers | "
        "crowned tok/s (5 fresh seeds) | the same + decode lock |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            for study, label, keep in LEVER_VARIANTS:
                lines.append(lever_row(study, label, keep, trials, seed, Path(tmp)))
                print(lines[-1], flush=True)
    text = (
        f"# Mamba levers: do they change the winner? (simulator, {trials} trials per study)\n\n"
        f"`python benchmarks/radix_trade.py --levers --trials {trials} --seeds {seeds}`\n\n{SIM_NOTE}\n\n"
        + "\n".join(lines)
        + "\n"
    )
    (ROOT / "benchmarks" / "results" / "radix_trade_levers.md").write_text(text)
    print(text)


TREE_VARIANTS = {
    "default": {},
    "track interval 64": {"mamba_track_interval": 64},
    "track interval 2048": {"mamba_track_interval": 2048},
    "cap 1": {"mamba_max_states_per_path": 1},
    "cap 8": {"mamba_max_states_per_path": 8},
}


def tree() -> None:
    """Tok/s (mean of two seeds) of radix-on configs of the shared-prefix study with each tree-lever variant."""
    cfg = load_config(ROOT / STUDIES["shared prefix"])
    space = Space.from_config(cfg)
    lines = ["| running cap | " + " | ".join(TREE_VARIANTS) + " |", "|---|" + "---|" * len(TREE_VARIANTS)]
    for mrr in (32, 48, 64, 80):
        base = space.complete(
            {
                **cfg.engine.fixed,
                "mem_fraction_static": 0.93,
                "speculative_num_steps": 3,
                "mamba_radix_cache_strategy": "extra_buffer_lazy",
                "max_running_requests": mrr,
            }
        )
        cells = []
        for extra in TREE_VARIANTS.values():
            runs = [predict(cfg, {**base, **extra}, seed=seed) for seed in (1, 2)]
            cells.append(statistics.fmean(r.metrics.output_tok_s if r and r.ok and r.metrics else 0.0 for r in runs))
        lines.append(f"| {mrr} | " + " | ".join(f"{v:,.0f}" for v in cells) + " |")
        print(lines[-1], flush=True)
    text = (
        "# Track interval and per-path cap on the shared-prefix workload (simulator)\n\n"
        "`python benchmarks/radix_trade.py --tree`: `extra_buffer_lazy`, mem_fraction_static 0.93, EAGLE 3/1/4, "
        "the slots derived from the running cap; output tok/s, mean of two seeds.\n\n"
        f"{SIM_NOTE}\n\n" + "\n".join(lines) + "\n"
    )
    (ROOT / "benchmarks" / "results" / "radix_trade_tree.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--levers", action="store_true", help="with and without the Mamba levers (see above)")
    parser.add_argument("--seeds", type=int, default=1, help="--levers: study seeds per variant")
    parser.add_argument("--tree", action="store_true", help="the track interval and the per-path cap (see above)")
    opts = parser.parse_args()
    if opts.tree:
        tree()
        return
    if opts.levers:
        levers(opts.trials, opts.seeds)
        return
    lines = [
        "| workload | best tok/s, radix on (trial) | best tok/s, radix off (trial) | crowned trial: radix cache |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in STUDIES.items():
            out = run(path, opts.trials, Path(tmp))
            cell = lambda v: f"{v[0]:,.0f} (#{v[1]})" if v else "—"  # noqa: E731
            lines.append(
                f"| {label} | {cell(out['on'])} | {cell(out['off'])} | #{out['crowned']}: {out['winner_radix']} |"
            )
            print(lines[-1], flush=True)
    text = (
        f"# Radix cache trade (simulator, {opts.trials} trials per study)\n\n"
        f"`python benchmarks/radix_trade.py --trials {opts.trials}`\n\n" + "\n".join(lines) + "\n"
    )
    (ROOT / "benchmarks" / "results" / "radix_trade.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
