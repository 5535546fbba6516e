"""One winner for every reader (in-process: stored confirmations, no server): a confirmation that crowned none is
what the report's headline says, with the confirmed estimates and no trial named winner; every stress phase a
confirmation launch ran is recorded where ``apply`` reads it, winner or not, so ``apply --trial N`` deploys a
trial that survived one without ``--allow-unstressed``; ``provenance.json`` carries the trial's confirmation
runs and its confirmed estimate, the figure the sweep's summary prints."""

from __future__ import annotations

import json
from types import SimpleNamespace

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.deploy.apply import load_winner
from autotune.report.page import build, figures_for, render
from autotune.results import Capacity, GpuPeaks, Metrics, Percentiles, StressResult, TrialResult
from autotune.search.confirm import decide
from autotune.search.confirm.record import Confirmation, ConfirmationRun
from autotune.search.confirm.stress import stress_winner
from autotune.search.views.worstcase import worst_case_block

BASE = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "max_mamba_cache_size": 80,
}
WIDER = {**BASE, "max_mamba_cache_size": 120, "max_running_requests": 24}
CFG = SimpleNamespace(study=SimpleNamespace(seed=0, resolution=0.02))
SETTINGS = {
    "study": {"confirm_top_k": 2},
    "engine": {"kind": "sim", "model": "qwen3.6-27b", "sim_gpu": "b200"},
    "workload": {"prompts": "prompts.jsonl", "sample_size": 20, "max_tokens": 256},
}
SURVIVED = StressResult(
    survived=True, ended="peak reached", peak_used_gib=171.0, total_gib=179.1, retractions=1, reached_peak=True
)


def _result(config, tok_s, *, stress=None) -> TrialResult:
    metrics = Metrics(
        output_tok_s=tok_s, request_s=1.0, ttft_ms=Percentiles(), itl_ms=Percentiles(), e2e_ms=Percentiles()
    )
    return TrialResult(
        status="ok",
        config=dict(config),
        engine="sim",
        metrics=metrics,
        capacity=Capacity(max_running_requests=24, kv_tokens=798_000, mamba_slots=120),
        gpu=GpuPeaks(peak_used_gib=170.0, total_gib=179.1, headroom_gib=9.1),
        stress=stress,
    )


def _study(url: str, launches: dict[int, tuple[float, ...]], search: dict[int, float]) -> optuna.Study:
    """Baseline 0 and trial 1, confirmed over ``launches`` (trial → tok/s per launch); each one's last launch ran
    the stress phase and survived it, as ``stages.stressed_in`` runs it in the second stage."""
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.set_user_attr("autotune", SETTINGS)
    for number, (config, role) in enumerate(((BASE, "baseline"), (WIDER, "search"))):
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE,
                value=search[number],
                user_attrs={"result": _result(config, search[number]).to_dict(), "role": role},
            )
        )
    configs = {0: BASE, 1: WIDER}
    runs = [
        {
            "trial": n,
            "repeat": k,
            "result": _result(configs[n], tok, stress=(SURVIVED if k == len(launches[n]) - 1 else None)).to_dict(),
        }
        for k in range(3)
        for n in (1, 0)
        for tok in [launches[n][k]]
    ]
    order = [1, 0]
    study.set_user_attr(
        "confirmation",
        {
            "runs": runs,
            "order": order,
            "n_trials": 2,
            "complete": True,
            **decide([ConfirmationRun.from_dict(r) for r in runs], order, 0, resolution=0.02).to_dict(),
        },
    )
    return study


@pytest.fixture()
def tied(tmp_path):
    """Trial 1 measured 1.6× the baseline once in the search; confirmed, it is tied with it: no winner."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = _study(url, {1: (1005.0, 995.0, 1002.0), 0: (1000.0, 1003.0, 997.0)}, {0: 1000.0, 1: 1620.0})
    assert study.user_attrs["confirmation"]["outcome"] == "baseline"
    return study, url


def test_the_report_says_no_config_beat_the_baseline_and_names_no_winner(tied, tmp_path):
    study, _ = tied
    built = build(study, base_dir=tmp_path)
    assert built.facts.winner is None and built.facts.outcome == "baseline"
    page = render(built, figures_for(built))
    assert "Winner: none. No config beat the baseline" in page and "nothing to apply" in page
    assert "winner tok/s" not in page and "trial 1 ·" not in page  # the search's 1,620 is not crowned
    confirmed = built.tables["confirmed"]
    assert list(confirmed["trial"]) == [1, 0]  # the best confirmed estimates, fastest first
    assert confirmed.loc[0, "confirmed_tok_s"] == pytest.approx(
        study.user_attrs["confirmation"]["stats"]["1"]["median"]
    )
    assert confirmed.loc[1, "vs_baseline"] == pytest.approx(1.0) and set(confirmed["launches"]) == {3}
    assert "Confirmed estimates" in page
    assert "1,620" not in page.split("Confirmed estimates")[1].split("</table>")[0]


def test_every_stress_phase_that_ran_is_recorded_winner_or_not(tied):
    study, _ = tied
    out = stress_winner(study, CFG, Confirmation.of(study), runner=SimpleNamespace())
    stored = study.user_attrs["confirmation"]
    assert out is not None and out.verdict is not None and out.verdict.outcome == "baseline"
    assert stored["stress"]["complete"] and stored["stress"]["decided_trial"] is None
    assert sorted(r["trial"] for r in stored["stress"]["runs"]) == [0, 1]
    assert all(r["in_confirmation"] and r["repeat"] == 2 for r in stored["stress"]["runs"])
    assert stored["stress"]["demoted"] == []  # recorded only: the verdict stands
    _, url = tied
    table = CliRunner().invoke(cli, ["trials", "--storage", url])
    assert table.exit_code == 0, table.output
    assert "trial 1: worst case: peak 171.0 of 179.1 GiB, 1 retraction, survived" in table.output
    assert "winner" not in table.output  # autotune trials names no winner either (a winner is "★ winner")


def test_apply_deploys_a_trial_that_survived_its_stress_phase_in_the_confirmation(tied, tmp_path):
    study, url = tied
    stress_winner(study, CFG, Confirmation.of(study), runner=SimpleNamespace())
    done = CliRunner().invoke(
        cli, ["apply", "--storage", url, "--trial", "1", "--out", str(tmp_path / "d"), "--gpus", "0"]
    )
    assert done.exit_code == 0, done.output
    meta = json.loads((tmp_path / "d" / "provenance.json").read_text())
    assert meta["trial"] == 1 and meta["confirmed"] and meta["worst_case"]["passed"]
    assert meta["output_tok_s_runs"] == [pytest.approx(v) for v in (1005.0, 995.0, 1002.0)]
    median = study.user_attrs["confirmation"]["stats"]["1"]["median"]
    assert meta["output_tok_s"] == pytest.approx(median) and meta["gain"] is None  # confirmed, but not the winner
    refused = CliRunner().invoke(cli, ["apply", "--storage", url, "--out", str(tmp_path / "e"), "--gpus", "0"])
    assert refused.exit_code == 1 and "no config beat the baseline" in str(refused.exception)


def test_a_study_stored_with_an_empty_stress_record_still_reads_its_confirmation_launches(tied):
    study, url = tied
    conf = study.user_attrs["confirmation"]
    study.set_user_attr("confirmation", {**conf, "stress": {"runs": [], "decided_trial": None, "complete": True}})
    block = worst_case_block(study.user_attrs, 0)
    assert block.passed and block.problem is None
    assert block.line == "worst case: peak 171.0 of 179.1 GiB, 1 retraction, survived"
    assert load_winner(url, trial=0).confirmed


def test_the_winners_provenance_figure_is_the_confirmed_estimate_not_its_first_launch(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    study = _study(url, {1: (1862.0, 1600.0, 1650.0), 0: (1000.0, 1003.0, 997.0)}, {0: 1000.0, 1: 1700.0})
    conf = study.user_attrs["confirmation"]
    assert conf["winner_trial"] == 1
    winner = load_winner(url)
    assert winner.confirmed and winner.tok_s == pytest.approx(conf["stats"]["1"]["median"])
    assert winner.tok_s != pytest.approx(1862.0) and len(winner.tok_s_runs) == 3
    assert winner.gain == pytest.approx(conf["gain"])
