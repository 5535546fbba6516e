"""The stress stage after the confirmation (a fake runner, no server): the winner is stressed, one that dies is
demoted with its reason and the next one stressed, a finished stress is never redone on resume, and ``apply``
refuses a config that never passed it unless ``--allow-unstressed`` (a study with the confirmation off
included)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import optuna
import pandas as pd
from click.testing import CliRunner

from autotune.cli import cli
from autotune.harness.stress import StressStep
from autotune.report.headline import gain
from autotune.results import Capacity, GpuPeaks, Metrics, Percentiles, StressResult, TrialResult
from autotune.search.confirm import decide
from autotune.search.confirm.record import Confirmation, ConfirmationRun
from autotune.search.confirm.stress import STRESS_MAX, stress_winner
from autotune.search.views.worstcase import worst_case_line

BASE = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "max_mamba_cache_size": 80,
}
FAST = {**BASE, "max_mamba_cache_size": 200, "mem_fraction_static": 0.95, "max_running_requests": 40}
SAFE = {**BASE, "max_mamba_cache_size": 200, "mem_fraction_static": 0.90, "max_running_requests": 40}
CFG = SimpleNamespace(study=SimpleNamespace(seed=0, resolution=0.02))
SETTINGS = {
    "study": {"confirm_top_k": 2},
    "engine": {"kind": "sim", "model": "qwen3.6-27b", "sim_gpu": "b200"},
    "workload": {"prompts": "prompts.jsonl", "sample_size": 20, "max_tokens": 256},
}


def _result(config, tok_s, *, stress=None) -> TrialResult:
    metrics = Metrics(
        output_tok_s=tok_s, request_s=1.0, ttft_ms=Percentiles(), itl_ms=Percentiles(), e2e_ms=Percentiles()
    )
    return TrialResult(
        status="ok",
        config=dict(config),
        engine="sim",
        metrics=metrics,
        capacity=Capacity(max_running_requests=40, kv_tokens=798_000, mamba_slots=200),
        gpu=GpuPeaks(peak_used_gib=170.0, total_gib=179.1, headroom_gib=9.1),
        stress=stress,
    )


def _study(url: str, *, settings=SETTINGS) -> optuna.Study:
    """Baseline 0, trial 1 (fastest, at 0.95) and trial 2 (a little slower, at 0.90), confirmed 3 launches each."""
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.set_user_attr("autotune", settings)
    for config, tok_s, role in ((BASE, 1000.0, "baseline"), (FAST, 3000.0, "search"), (SAFE, 2800.0, "search")):
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE,
                value=tok_s,
                user_attrs={"result": _result(config, tok_s).to_dict(), "role": role},
            )
        )
    return study


def _records(runs: list[dict]) -> list[ConfirmationRun]:
    return [ConfirmationRun.from_dict(r) for r in runs]


def _stress(study: optuna.Study, cfg, confirmation: dict, *, runner) -> dict | None:
    """``stress_winner`` given the stored form, its answer in the stored form."""
    out = stress_winner(study, cfg, Confirmation.from_dict(confirmation), runner=runner)
    return out.to_dict() if out is not None else None


def _confirmed(study: optuna.Study) -> dict:
    runs = [
        {"trial": n, "repeat": k, "result": _result(cfg, tok * (1 + 0.002 * (k - 1))).to_dict()}
        for k in range(3)
        for n, cfg, tok in ((1, FAST, 3000.0), (2, SAFE, 2800.0), (0, BASE, 1000.0))
    ]
    order = [1, 2, 0]
    confirmation = {
        "runs": runs,
        "order": order,
        "n_trials": 3,
        "complete": True,
        **decide(_records(runs), order, 0, resolution=0.02).to_dict(),
    }
    study.set_user_attr("confirmation", confirmation)
    return confirmation


class StressRunner:
    """A runner whose confirmation launches run the stress step's verdict from ``verdicts`` (trial → survived)."""

    def __init__(self, verdicts: dict[int, bool], *, interrupt: bool = False):
        self.verdicts, self.interrupt, self.calls = verdicts, interrupt, []

    def __call__(self, config, number):  # pragma: no cover - the stage only launches repeats
        raise AssertionError("the stress stage launches through repeat")

    def repeat(self, config, number, k, *, after=(), warmup_s=None):
        assert [type(step) for step in after] == [StressStep]  # the stress phase follows the window in-launch
        self.calls.append((number, k))
        if self.interrupt:
            return TrialResult(status="interrupted", config=config, reason="interrupted while measuring")
        survived = self.verdicts[number]
        stress = StressResult(
            survived=survived,
            ended="peak reached" if survived else "server exited",
            failure=None if survived else "runtime_oom",
            reason=None if survived else "torch.OutOfMemoryError: CUDA out of memory.",
            peak_used_gib=172.4 if survived else 179.0,
            total_gib=179.1,
            retractions=3 if survived else 0,
            reached_peak=survived,
        )
        return _result(config, 2900.0, stress=stress)


def test_a_winner_that_dies_under_stress_is_demoted_and_the_next_one_stressed(tmp_path):
    study = _study(f"sqlite:///{tmp_path / 's.db'}")
    confirmation = _confirmed(study)
    assert confirmation["winner_trial"] == 1 and confirmation["resolved"]
    runner = StressRunner({1: False, 2: True})
    out = _stress(study, CFG, confirmation, runner=runner)
    assert runner.calls == [(1, 3), (2, 3)]  # one launch each, filed after the trial's three confirmation runs
    assert out["winner_trial"] == 2 and out["stress"]["decided_trial"] == 1 and out["stress"]["complete"]
    assert [d["trial"] for d in out["stress"]["demoted"]] == [1]
    assert "trial 1 demoted: worst case: peak 179.0 of 179.1 GiB, 0 retractions, FAILED: runtime_oom" in out["note"]
    assert out["gain"] is not None and out["gain"] > 2.5  # the new winner's gain, from the same runs
    stored = study.user_attrs["confirmation"]
    assert stored["winner_trial"] == 2
    assert worst_case_line(Confirmation.from_dict(stored), 2) == (
        "worst case: peak 172.4 of 179.1 GiB, 3 retractions, survived"
    )
    again = _stress(study, CFG, stored, runner=StressRunner({}))  # resumed: nothing launched again
    assert again["winner_trial"] == 2 and len(again["stress"]["runs"]) == 2


def _stressed_in_confirmation(confirmation: dict, number: int, *, survived: bool) -> dict:
    """``confirmation`` with trial ``number``'s last confirmation launch carrying a stress phase's verdict."""
    stress = StressResult(
        survived=survived,
        ended="peak reached" if survived else "server exited",
        failure=None if survived else "runtime_oom",
        peak_used_gib=171.0 if survived else 179.0,
        total_gib=179.1,
        retractions=1,
        reached_peak=survived,
    ).to_dict()
    runs = [dict(r) for r in confirmation["runs"]]
    last = max(i for i, r in enumerate(runs) if r["trial"] == number)
    runs[last] = {**runs[last], "result": {**runs[last]["result"], "stress": stress}}
    return {**confirmation, "runs": runs}


def test_a_stress_phase_run_in_a_confirmation_launch_costs_no_launch_of_its_own(tmp_path):
    study = _study(f"sqlite:///{tmp_path / 's.db'}")
    confirmation = _stressed_in_confirmation(_confirmed(study), 1, survived=True)
    runner = StressRunner({})
    out = _stress(study, CFG, confirmation, runner=runner)
    assert runner.calls == [] and out["winner_trial"] == 1  # read from its confirmation launch, nothing launched
    (run,) = out["stress"]["runs"]
    assert run["in_confirmation"] and run["repeat"] == 2
    assert worst_case_line(Confirmation.from_dict(out), 1) == (
        "worst case: peak 171.0 of 179.1 GiB, 1 retraction, survived"
    )
    # one that died there is demoted all the same, and the next one is stressed in a launch of its own
    study2 = _study(f"sqlite:///{tmp_path / 's2.db'}")
    died = _stressed_in_confirmation(_confirmed(study2), 1, survived=False)
    runner2 = StressRunner({2: True})
    out2 = _stress(study2, CFG, died, runner=runner2)
    assert runner2.calls == [(2, 3)] and out2["winner_trial"] == 2
    assert [d["trial"] for d in out2["stress"]["demoted"]] == [1]


def test_an_interrupted_stress_resumes_and_the_attempts_are_bounded(tmp_path):
    study = _study(f"sqlite:///{tmp_path / 's.db'}")
    confirmation = _confirmed(study)
    assert _stress(study, CFG, confirmation, runner=StressRunner({}, interrupt=True)) is None
    assert study.user_attrs["confirmation"]["stress"]["runs"] == []  # nothing finished, nothing recorded
    everyone_dies = StressRunner({0: False, 1: False, 2: False})
    out = _stress(study, CFG, study.user_attrs["confirmation"], runner=everyone_dies)
    assert len(everyone_dies.calls) <= STRESS_MAX and out["stress"]["complete"]
    assert out["winner_trial"] != 1 and out["winner_trial"] != 2  # both demoted: no config beat the baseline
    assert out["outcome"] == "baseline" and out["gain"] is None


def test_apply_refuses_an_unstressed_or_failed_winner_and_accepts_it_when_told(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = _study(url)
    _stress(study, CFG, _confirmed(study), runner=StressRunner({1: False, 2: True}))
    ok = CliRunner().invoke(cli, ["apply", "--storage", url, "--out", str(tmp_path / "d1"), "--gpus", "0"])
    assert ok.exit_code == 0, ok.output
    assert "worst case: peak 172.4 of 179.1 GiB, 3 retractions, survived" in ok.output
    block = json.loads((tmp_path / "d1" / "provenance.json").read_text())["worst_case"]
    assert block["passed"] and block["problem"] is None and block["stress"]["retractions"] == 3
    table = CliRunner().invoke(cli, ["trials", "--storage", url])
    assert table.exit_code == 0, table.output
    assert "trial 2 (winner): worst case: peak 172.4 of 179.1 GiB, 3 retractions, survived" in table.output
    assert "trial 1: worst case: peak 179.0 of 179.1 GiB, 0 retractions, FAILED: runtime_oom" in table.output
    headline = pd.DataFrame({"tok_s_per_gpu": [2900.0, 1000.0], "trial": [2, 0]}, index=["winner", "baseline"])
    assert gain(optuna.load_study(study_name="s", storage=url), headline).worst_case == (
        "worst case: peak 172.4 of 179.1 GiB, 3 retractions, survived"
    )  # the report's headline says it too

    refused = CliRunner().invoke(
        cli, ["apply", "--storage", url, "--trial", "1", "--out", str(tmp_path / "d2"), "--gpus", "0"]
    )
    assert refused.exit_code == 1 and not (tmp_path / "d2").exists()
    assert "trial 1 failed the stress phase" in str(refused.exception) and "--allow-unstressed" in str(
        refused.exception
    )
    told = CliRunner().invoke(
        cli,
        ["apply", "--storage", url, "--trial", "1", "--out", str(tmp_path / "d3"), "--gpus", "0", "--allow-unstressed"],
    )
    assert told.exit_code == 0, told.output
    assert "--allow-unstressed: trial 1 failed the stress phase" in told.output
    assert not json.loads((tmp_path / "d3" / "provenance.json").read_text())["worst_case"]["passed"]


def test_a_study_with_the_confirmation_off_says_why_its_winner_was_never_stressed(tmp_path):
    url = f"sqlite:///{tmp_path / 'off.db'}"
    _study(url, settings={**SETTINGS, "study": {"confirm_top_k": 0}})
    refused = CliRunner().invoke(cli, ["apply", "--storage", url, "--out", str(tmp_path / "d"), "--gpus", "0"])
    assert refused.exit_code == 1 and "confirm_top_k = 0" in str(refused.exception)
    assert "--allow-unstressed" in str(refused.exception)
    told = CliRunner().invoke(
        cli, ["apply", "--storage", url, "--out", str(tmp_path / "d"), "--gpus", "0", "--allow-unstressed"]
    )
    assert told.exit_code == 0, told.output


def test_a_runner_up_the_confirmation_could_not_separate_is_stressed_too(tmp_path):
    study = _study(f"sqlite:///{tmp_path / 's.db'}")
    runs = [
        {"trial": n, "repeat": k, "result": _result(cfg, tok * (1 + 0.03 * (k - 1) * (-1) ** n)).to_dict()}
        for k in range(3)
        for n, cfg, tok in ((1, FAST, 2900.0), (2, SAFE, 2890.0), (0, BASE, 1000.0))
    ]
    confirmation = {
        "runs": runs,
        "order": [1, 2, 0],
        "n_trials": 3,
        "complete": True,
        **decide(_records(runs), [1, 2, 0], 0, resolution=0.02).to_dict(),
    }
    assert not confirmation["resolved"] and confirmation["runner_up_trial"] is not None
    runner = StressRunner({1: True, 2: True})
    out = _stress(study, CFG, confirmation, runner=runner)
    assert sorted(n for n, _ in runner.calls) == [1, 2] and out["winner_trial"] == confirmation["winner_trial"]
    assert not out["stress"]["demoted"]  # both survived: the verdict stands
