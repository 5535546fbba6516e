"""An unsettled config that measured above the baseline is confirmed, not dropped, and the summary never says "no
config beat the baseline" while one measured above it (in-process runner, no servers)."""

from __future__ import annotations

import html

from click.testing import CliRunner
from test_study import PlannerRunner, write_study

from autotune.cli import cli
from autotune.cli.sweep import render
from autotune.config import load_config
from autotune.deploy.apply import load_winner, provenance
from autotune.report.headline import verdict_facts
from autotune.report.page import build
from autotune.report.page import render as render_page
from autotune.results import TrialResult
from autotune.search.objective import open_study
from autotune.search.sweep import run_sweep
from autotune.search.views.summary import defaults_lead, verdict_note

BASELINE_SLOTS = 80  # the test study's baseline: every other config measures more, in windows that never settle


class Unsettled(PlannerRunner):
    """The fake planner's figures; every config but the baseline's ends its windows at the cap, unsettled."""

    def __call__(self, config: dict, number: int) -> TrialResult:
        result = super().__call__(config, number)
        if not result.ok or config.get("max_mamba_cache_size") == BASELINE_SLOTS:
            return result
        return TrialResult.from_dict({**result.to_dict(), "measurement": {"settled": False, "settling": None}})


def test_unsettled_configs_above_the_baseline_are_confirmed_not_dropped(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=5))
    runner = Unsettled()
    summary = run_sweep(cfg, runner=runner)
    study = open_study(cfg, create=False)
    conf = study.user_attrs["confirmation"]
    search = [
        t
        for t in study.get_trials()
        if t.user_attrs.get("status") == "ok" and (t.user_attrs["result"]["measurement"] or {}).get("settled") is False
    ]
    assert search, "no unsettled trial: the fake did not mark any"
    assert set(conf["order"]) & {t.number for t in search}  # relaunched by the confirmation
    assert "no config beat the baseline" not in render(summary)


def test_a_summary_with_only_unsettled_configs_above_the_baseline_names_them_and_the_fix(tmp_path):
    path = write_study(tmp_path, trials=4)
    path.write_text(path.read_text().replace("[study]\n", "[study]\nconfirm_top_k = 0\n", 1))
    summary = run_sweep(load_config(path), runner=Unsettled())  # no confirmation: the search figures stand
    above = summary.above_baseline
    assert summary.outcome == "baseline" and summary.best is None and above
    assert all(e.gain > 1 and not e.settled and not e.confirmed for e in above)
    text = render(summary)
    assert "no config beat the baseline" not in text and "no config was shown to beat the baseline" in text
    first = above[0]
    assert f"trial {first.trial} {first.gain:.2f}× (search run, did not settle)" in summary.note
    assert "workload.measure_max_s" in summary.note


def test_one_verdict_text_in_the_summary_report_trials_apply_and_provenance(tmp_path):
    path = write_study(tmp_path, trials=4)
    path.write_text(path.read_text().replace("[study]\n", "[study]\nconfirm_top_k = 0\n", 1))
    cfg = load_config(path)
    summary = run_sweep(cfg, runner=Unsettled())  # unsettled configs above the baseline, none crowned
    study = open_study(cfg, create=False)
    assert summary.outcome == "baseline" and summary.above_baseline, render(summary)
    note = verdict_note(study)
    assert "no config was shown to beat the baseline" in note and "(search run, did not settle)" in note
    assert summary.note == note and f"note: {note}" in render(summary)
    assert verdict_facts(study).note == note  # the report's header
    assert f"verdict: {note}" in CliRunner().invoke(cli, ["trials", "--config", str(cfg.path)]).output
    picked = summary.above_baseline[0].trial  # apply --trial N deploys one anyway; provenance.json keeps the verdict
    assert provenance(load_winner(cfg.storage_url, study.study_name, trial=picked))["verdict"] == note


class Slow(PlannerRunner):
    """The fake planner's figures at a tenth: every searched config below what SGLang's defaults are predicted at."""

    def __call__(self, config: dict, number: int) -> TrialResult:
        result = super().__call__(config, number)
        if not result.ok or result.metrics is None:
            return result
        data = result.to_dict()
        data["metrics"] = {**data["metrics"], "output_tok_s": data["metrics"]["output_tok_s"] / 10}
        return TrialResult.from_dict(data)


def test_defaults_above_every_searched_config_are_said_in_the_summary_and_the_report(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    summary = run_sweep(cfg, runner=Slow())
    study = open_study(cfg, create=False)
    defaults = summary.defaults
    assert defaults is not None and defaults.output_tok_s
    top = max(e.output_tok_s for e in [summary.best, *summary.enqueued] if e and e.output_tok_s)
    assert defaults.output_tok_s > top, render(summary)
    lead = summary.defaults_lead
    assert lead and lead.startswith(f"SGLang's defaults ({defaults.output_tok_s:,.0f} tok/s")
    assert "came out above every searched config" in lead and '[[enqueue]] label = "defaults"' in lead
    assert lead in render(summary) and defaults_lead(study) == lead
    page = render_page(build(study, base_dir=tmp_path), {})
    assert html.escape(lead) in page


def test_no_defaults_line_when_the_study_beat_them(tmp_path):
    summary = run_sweep(load_config(write_study(tmp_path, trials=4)), runner=PlannerRunner())
    assert summary.defaults is not None and summary.gain_over_defaults and summary.gain_over_defaults > 1
    assert summary.defaults_lead is None
