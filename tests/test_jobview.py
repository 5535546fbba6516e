"""[job] on recorded trials: the summary, ``trials``, the report's headline and ``apply`` say the job's hours."""

from __future__ import annotations

import dataclasses
import json

import pytest
import studyfactory as sf
from click.testing import CliRunner
from test_study import PlannerRunner, write_study

from autotune.cli import cli
from autotune.cli.sweep import render
from autotune.config import load_config
from autotune.deploy.apply import load_winner, provenance
from autotune.job import Job, job_time
from autotune.report.page import report
from autotune.results import TrialResult
from autotune.search.sweep import run_sweep
from autotune.search.views.jobview import job_for_study

SEED_JOB = {"completions": 902_087, "gpus": 7, "gpu_hour_cost": 4.0, "mean_output_tokens": None}


@pytest.fixture()
def study(tmp_path):
    url = f"sqlite:///{tmp_path / 'seed.db'}"
    made = sf.make_study(n_trials=12, seed=5, name="seed", storage=url)
    made.set_user_attr("autotune", {**made.user_attrs["autotune"], "job": SEED_JOB})
    made.set_user_attr("confirmation", {**made.user_attrs["confirmation"], "complete": True})
    return made, url


def test_the_job_before_and_after_follows_from_the_confirmed_medians(study):
    made, _ = study
    conf = made.user_attrs["confirmation"]
    winner = conf["winner_trial"]
    view = job_for_study(made, winner)
    base = TrialResult.from_dict(made.trials[0].user_attrs["result"])
    mean_out = base.metrics.output_tok_s / base.metrics.request_s
    job = Job(completions=902_087, gpus=7, gpu_hour_cost=4.0)
    expect_base = job_time(job, conf["stats"]["0"]["median"], mean_output_tokens=mean_out)
    expect_win = job_time(
        job,
        conf["stats"][str(winner)]["median"],
        mean_output_tokens=mean_out,
        tok_s_range=tuple(conf["stats"][str(winner)]["ci"]),
    )
    assert view["baseline"]["hours"] == pytest.approx(expect_base.hours, rel=1e-3)
    assert view["winner"]["hours"] == pytest.approx(expect_win.hours, rel=1e-3)
    lo, hi = view["winner"]["hours_range"]
    assert lo < view["winner"]["hours"] < hi
    assert view["output_from"] == "baseline's window" and view["mean_output_tokens"] == pytest.approx(mean_out, 0.01)
    line = view["line"]
    assert line.startswith("this job (902,087 completions on 7 GPUs): ") and "GPU-hours" in line and "→" in line
    assert f"{expect_win.hours:,.1f} h (" in line


def test_no_job_section_changes_nothing(study):
    made, _ = study
    made.set_user_attr("autotune", {k: v for k, v in made.user_attrs["autotune"].items() if k != "job"})
    assert job_for_study(made, 3) is None


def test_an_unusable_section_reads_as_none_and_the_jobs_own_output_length_wins(study):
    made, _ = study
    made.set_user_attr("autotune", {**made.user_attrs["autotune"], "job": {**SEED_JOB, "gpus": 0}})
    assert job_for_study(made, 3) is None
    made.set_user_attr("autotune", {**made.user_attrs["autotune"], "job": {**SEED_JOB, "mean_output_tokens": 500.0}})
    view = job_for_study(made, 0)
    assert view["output_from"] == "job" and view["mean_output_tokens"] == 500.0


def test_the_sweeps_summary_says_the_job(tmp_path):
    path = write_study(tmp_path, trials=5)
    path.write_text(path.read_text() + "\n[job]\ncompletions = 902087\ngpus = 7\n")
    summary = run_sweep(load_config(path), runner=PlannerRunner())
    assert summary.job["winner"]["servers"] == 7 and summary.job["baseline"]["hours"] > 0
    assert summary.job["line"] in render(summary)


def test_report_headline_apply_and_trials_show_the_job(study, tmp_path):
    made, url = study
    line = job_for_study(made, made.user_attrs["confirmation"]["winner_trial"])["line"]
    out, _ = report(study="seed", storage=url, out=tmp_path / "r.html")
    assert line.replace("→", "&rarr;") in out.read_text(encoding="utf-8") or line in out.read_text(encoding="utf-8")
    winner = load_winner(url, "seed")
    assert winner.job["line"] == line and provenance(winner)["job"]["winner"]["hours"] == winner.job["winner"]["hours"]
    result = CliRunner().invoke(
        cli, ["apply", "--study", "seed", "--storage", url, "--out", str(tmp_path / "d"), "--gpus", "0-6"]
    )
    assert result.exit_code == 0, result.output
    assert line in result.output
    assert json.loads((tmp_path / "d" / "provenance.json").read_text())["job"]["line"] == line
    listed = CliRunner().invoke(cli, ["trials", "--study", "seed", "--storage", url])
    assert listed.exit_code == 0, listed.output
    assert "this job (902,087 completions on 7 GPUs)" in listed.output


def test_trials_marks_the_confirmed_winner_with_its_confirmed_figure_and_whole_flag_names(study):
    made, url = study
    conf = made.user_attrs["confirmation"]
    listed = CliRunner().invoke(cli, ["trials", "--study", "seed", "--storage", url], terminal_width=100)
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if "★ winner" in line)
    assert row.split("│")[1].strip() == str(conf["winner_trial"])
    assert f"{conf['stats'][str(conf['winner_trial'])]['median']:,.0f}" in listed.output
    assert "…" not in listed.output  # nothing cut: long flag names wrap
    data = json.loads(CliRunner().invoke(cli, ["trials", "--study", "seed", "--storage", url, "--json"]).output)
    assert [r["number"] for r in data if r["winner"]] == [conf["winner_trial"]]


def test_a_winner_that_changes_outputs_is_said_in_one_line_with_its_probe_figures(tmp_path):
    from autotune.results import FidelityFigures, numerics_line

    probe = FidelityFigures.from_dict(
        {
            "role": "probe",
            "changes": [{"flag": "mamba_ssm_dtype", "value": "bfloat16", "reference": "float32"}],
            "tokens": 256,
            "prefix_match_mean": 102.0,
            "exact_share": 0.0625,
            "mean_abs_logprob_delta": 0.02,
        }
    )
    line = numerics_line(probe)
    assert (
        line == "outputs differ from the baseline (--mamba-ssm-dtype bfloat16): 102/256 match · 6% exact · |Δlp| 0.020"
    )
    assert numerics_line(None) is None and numerics_line(FidelityFigures(role="reference")) is None
    summary = run_sweep(load_config(write_study(tmp_path, trials=4)), runner=PlannerRunner())
    assert summary.best.numerics is None  # the planner runner probes nothing: no line
    summary = dataclasses.replace(summary, best=dataclasses.replace(summary.best, numerics=line))
    assert f"  {line}" in render(summary).splitlines()
