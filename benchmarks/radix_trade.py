"""Does the radix cache win where prompts share a long prefix, and lose where they do not? Measured, not assumed.

Runs two studies with the same space (``studies/qwen3.6-27b-b200.toml``, the seed's workload, and
``studies/qwen3.6-27b-b200-shared-prefix.toml``) on the simulator's virtual clock (``simulated_runner`` below:
the same scheduler as the paced server, seconds instead of minutes), then reports each study's winner and its
flag slice over ``disable_radix_cache``: the best tok/s with the cache on and with it off. The simulator's prefix
reuse is a model of SGLang's radix cache (``autotune/sim/radix.py``); the figures are claims about SGLang only as far
as that model is. Usage: ``python benchmarks/radix_trade.py [--trials 40]``; writes ``results/radix_trade.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.config import StudyConfig, load_config  # noqa: E402
from autotune.results import TrialResult  # noqa: E402
from autotune.search.runner import Runner, predict  # noqa: E402
from autotune.search.study import run_study  # noqa: E402

STUDIES = {"seed workload": "studies/qwen3.6-27b-b200.toml",
           "shared prefix": "studies/qwen3.6-27b-b200-shared-prefix.toml"}


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
    return {"on": best.get(False), "off": best.get(True), "crowned": crowned,
            "winner_radix": "off" if config.get("disable_radix_cache") else "on"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    opts = parser.parse_args()
    lines = ["| workload | best tok/s, radix on (trial) | best tok/s, radix off (trial) | crowned trial: radix cache |",
             "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in STUDIES.items():
            out = run(path, opts.trials, Path(tmp))
            cell = lambda v: f"{v[0]:,.0f} (#{v[1]})" if v else "—"  # noqa: E731
            lines.append(f"| {label} | {cell(out['on'])} | {cell(out['off'])} | #{out['crowned']}: {out['winner_radix']} |")
            print(lines[-1], flush=True)
    text = (f"# Radix cache trade (simulator, {opts.trials} trials per study)\n\n"
            f"`python benchmarks/radix_trade.py --trials {opts.trials}`\n\n" + "\n".join(lines) + "\n")
    (ROOT / "benchmarks" / "results" / "radix_trade.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
