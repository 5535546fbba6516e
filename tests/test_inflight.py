"""What the job's client must send (``deploy.inflight``): the in-flight requests per server and fleet, on
recorded trials (two windows of one config on the simulated B200, cap 40, replayed at 36 and at 80 in flight)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.deploy.apply import load_winner
from autotune.deploy.inflight import ClientAdvice, client_advice, poisson_quantile, read_advice
from autotune.results import TrialResult
from autotune.search.views.settings import StudySettings

RECORDED = Path(__file__).resolve().parent / "data" / "inflight"
WARNING = "warning: the study's client was the binding limit"


def recorded(concurrency: int) -> TrialResult:
    return TrialResult.from_dict(json.loads((RECORDED / f"sim-b200-cap40-concurrency{concurrency}.json").read_text()))


def load_winner_like(result: TrialResult, *, config: dict | None = None) -> SimpleNamespace:
    """What ``client_advice`` reads of a winner, for a trial outside any study."""
    return SimpleNamespace(trial=1, result=result, config=config or result.config, settings=StudySettings())


def study_with_winner(tmp_path: Path, winner: TrialResult) -> str:
    """A stored study whose confirmed winner (trial 1) is ``winner``; the baseline runs the seed's 80 slots."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.set_user_attr(
        "autotune",
        {
            "engine": {"kind": "sim", "model": "qwen3.6-27b", "sim_gpu": "b200"},
            "workload": {"prompts": "prompts.jsonl", "sample_size": 100},
        },
    )
    baseline = TrialResult.from_dict({**winner.to_dict(), "config": {**winner.config, "max_mamba_cache_size": 80}})
    for res, role in ((baseline, "baseline"), (winner, "search")):
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE,
                value=res.output_tok_s or 0.0,
                user_attrs={"result": res.to_dict(), "role": role},
            )
        )
    study.set_user_attr(
        "confirmation",
        {
            "runs": [],
            "winner_trial": 1,
            "baseline_trial": 0,
            "complete": True,
            "gain": 0.1,
            "ci_low": 0.05,
            "ci_high": 0.15,
            "note": "",
        },
    )
    return storage


def test_poisson_quantile_by_hand():
    assert poisson_quantile(0.0) == 0
    assert poisson_quantile(0.5) == 4  # P(N ≤ 3) = 0.99825, P(N ≤ 4) = 0.99983
    assert poisson_quantile(2.0) == 8  # P(N ≤ 7) = 0.99890, P(N ≤ 8) = 0.99976
    assert poisson_quantile(10_000.0) == 10_309  # the normal approximation: 10,000 + 3.09 × 100


def test_recorded_window_that_filled_the_cap():
    """λ 1.2/s; refill 2 × 34.672 ms × 3.2145 tokens per chunk = 0.2229 s; Poisson(0.2675) covers 99.9 % at 3."""
    result = recorded(80)
    advice = client_advice(load_winner_like(result), servers=7)
    assert (advice.running_cap, advice.queue, advice.per_server, advice.fleet) == (40, 3, 43, 301)
    assert advice.refill_s == pytest.approx(0.2229, abs=1e-4) and advice.completions_s == 1.2
    assert advice.measured_concurrency == 80 and not advice.binding
    assert advice.measured_generating == pytest.approx(result.metrics.output_tok_s * 0.010666, abs=0.01)
    assert advice.measured_generating == pytest.approx(40, abs=0.2)  # the cap was full at 80 in flight


def test_dp_workers_each_run_the_reported_cap():
    result = recorded(80)
    advice = client_advice(load_winner_like(result, config={**result.config, "dp_size": 2}), servers=1)
    assert advice.running_cap == 80 and advice.per_server == 83
    assert advice.binding is False  # 80 in flight, the two workers' 80: full, not bound


@pytest.mark.parametrize("concurrency, binding", [(36, True), (80, False)])
def test_apply_prints_and_writes_the_same_figures(tmp_path, concurrency, binding):
    storage = study_with_winner(tmp_path, recorded(concurrency))
    out = tmp_path / "deploy"
    res = CliRunner().invoke(
        cli, ["apply", "--storage", storage, "--out", str(out), "--gpus", "0-1", "--allow-unstressed"]
    )
    assert res.exit_code == 0, res.output

    written = json.loads((out / "client.json").read_text())
    assert json.loads((out / "provenance.json").read_text())["client"] == written
    advice = read_advice(out)  # what client.json holds, read back as apply reads it
    assert isinstance(advice, ClientAdvice)
    # the same figures, with the fleet's router said (its URL, or what it would give: deploy.router.advise)
    assert replace(advice, router_url=None, router_note=None) == client_advice(load_winner(storage), servers=2)
    assert (advice.running_cap, advice.per_server, advice.fleet) == (40, 43, 86)
    assert advice.binding is binding and advice.measured_concurrency == concurrency
    for line in written["lines"]:
        assert line in res.output.splitlines()
        assert f"# {line}" in (out / "launch_fleet.sh").read_text().splitlines()
    assert "keep 43 requests in flight per server (running cap 40 + queue 3), 86 across the 2 servers" in res.output
    assert (WARNING in res.output) is binding
    if binding:
        warning = next(line for line in res.output.splitlines() if line.startswith(WARNING))
        assert "kept 36 requests in flight, below the winner's running cap of 40" in warning
        assert "raise [workload] concurrency to at least 43" in warning


def test_a_yaml_deployed_as_is_has_no_window_to_size_the_queue(tmp_path):
    storage = study_with_winner(tmp_path, recorded(80))
    runner = CliRunner()
    assert (
        runner.invoke(
            cli, ["apply", "--storage", storage, "--out", str(tmp_path / "a"), "--gpus", "0", "--allow-unstressed"]
        ).exit_code
        == 0
    )
    res = runner.invoke(
        cli,
        [
            "apply",
            "--config",
            str(tmp_path / "a" / "sglang.yaml"),
            "--out",
            str(tmp_path / "b"),
            "--gpus",
            "0",
            "--allow-unstressed",
        ],
    )
    assert res.exit_code == 0, res.output
    advice = json.loads((tmp_path / "b" / "client.json").read_text())
    assert advice["per_server"] is None and advice["running_cap"] == 40
    assert "keep more than 40 running requests per server in flight" in res.output
