"""A quick sweep → report → apply on the simulator for a quantized checkpoint and a MoE hybrid (issue 45): the
planner's figures for these models reach the simulated server, the study, the report and the fleet's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inprocess import run_cli
from tinystudy import write_tiny_study

from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model

MODELS = Path(__file__).parent.parent / "examples" / "models"


@pytest.mark.slow
@pytest.mark.parametrize("model, gpu", [("qwen3.6-27b-fp8", "h100"), ("qwen3.5-35b-a3b", "h200")])
def test_a_quick_sweep_report_and_apply(tmp_path, monkeypatch, capsys, model, gpu):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    path = write_tiny_study(tmp_path, name="m", trials=2, top_k=1, model=str(MODELS / model), sim_gpu=gpu)
    done = run_cli(capsys, "sweep", "--config", str(path), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["baseline"]["output_tok_s"] > 0
    trials = run_cli(capsys, "trials", "--config", str(path), "--json")
    rows = [r for r in json.loads(trials.stdout) if r["status"] == "ok"]
    assert rows
    profile, device = load_model(MODELS / model), load_gpu(gpu)
    for row in rows:  # the simulated server allocated what the planner predicts for this model on this GPU
        expected = plan(
            profile,
            device,
            {k: v for k, v in row["params"].items() if v is not None}
            | {
                "speculative_algorithm": "EAGLE",
                "speculative_eagle_topk": 1,
                "speculative_num_steps": 3,
                "speculative_num_draft_tokens": 4,
                "stream_interval": 8,
            },
        )
        assert (row["kv_tokens"], row["max_running_requests"]) == (expected.kv_tokens, expected.max_running_requests)
    report = run_cli(capsys, "report", "--config", str(path), "--out", str(tmp_path / "m.html"))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "m.html").stat().st_size > 10_000
    # Two trials may not beat the baseline, nor reach the stress phase: deploy the searched trial named.
    best = max(rows[1:] or rows, key=lambda r: r["output_tok_s"] or 0)
    applied = run_cli(
        capsys,
        "apply",
        "--config",
        str(path),
        "--out",
        str(tmp_path / "deploy"),
        "--gpus",
        "0",
        "--trial",
        str(best["number"]),
        "--allow-unstressed",
    )
    assert applied.returncode == 0, applied.stderr
    fleet = (tmp_path / "deploy" / "fleet.toml").read_text()
    assert model in fleet and f'sim_gpu = "{gpu}"' in fleet
