"""Outputs checked for every finalist (issue 23, item 4): the confirmation's first launch of each contender probes
its outputs against the baseline's, table or not; a change no output-changing flag explains is "outputs changed
unexpectedly" and ``apply`` judges it as a numerics change.

The runner tests fake the launch (``HarnessRunner._run``) and the server's outputs (``fidelity.generate_outputs``),
so the probe's own comparison runs on exact records; one short sim study proves the catch end to end with the
simulator's ``--sim-numerics-flags``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner
from tinystudy import write_prompts

from autotune.config import load_config
from autotune.config.sections import NumericsLimits
from autotune.deploy.apply import Winner
from autotune.deploy.numerics import NumericsRefused, check_numerics
from autotune.harness import fidelity
from autotune.harness.fidelity import ProbeOutput, Reference
from autotune.results import FidelityFigures, TrialResult, numerics_line
from autotune.search import numerics as sn
from autotune.search.confirm.record import Confirmation, ConfirmationRun
from autotune.search.runner import HarnessRunner
from autotune.search.views.settings import StudySettings
from autotune.search.views.summary import UnexpectedEntry
from autotune.sim.divergence import SimNumerics

STUDY = """
[study]
name = "{name}"
trials = {trials}
seed = 0
sampler = "random"
confirm_top_k = 1
confirm_repeats = 1
confirm_max_repeats = 1
confirm_windows = 1

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"
sim_options = {{ startup_s = 0.2, warmup_s = 0.1, release_s = 0.2{sim} }}

[space]
chunked_prefill_size = {{ choices = [4096, 8192] }}

[workload]
prompts = "prompts.jsonl"
sample_size = 16
max_tokens = 128
concurrency = 32
warmup_s = 0.5
measure_s = 1.0
target_half_width = 0.5
settle_tolerance = 0.5

[objective]
numerics = {{ prompts = 4, tokens = 64{limit} }}

[baseline]
flags = {{ max_running_requests = 8 }}

[[enqueue]]
label = "chunked"
flags = {{ chunked_prefill_size = 4096 }}
"""


def write_study(tmp_path: Path, *, name: str = "catch", trials: int = 2, sim: str = "", limit: str = "") -> Path:
    write_prompts(tmp_path)
    path = tmp_path / f"{name}.toml"
    path.write_text(STUDY.format(name=name, trials=trials, sim=sim, limit=limit))
    return path


# --- which confirmation launches probe, on exact records ---------------------------------------------------------
def _outputs(prompts, tokens: int, *, diverge: bool) -> list[ProbeOutput]:
    """The fake server's greedy outputs: the reference's, or changed from token 10 of every prompt on."""
    out = []
    for i, _ in enumerate(prompts):
        ids = [i * 1000 + j for j in range(tokens)]
        if diverge:
            ids[10:] = [-1] * (tokens - 10)
        out.append(ProbeOutput(tuple(ids), tuple([-0.1] * tokens)))
    return out


@pytest.fixture
def fake_runner(tmp_path, monkeypatch):
    """A HarnessRunner whose launches are records: each ``_run`` call, and the probe's figures computed by
    ``run_probe`` from fake outputs (a config with ``chunked_prefill_size = 4096`` answers differently)."""
    cfg = load_config(write_study(tmp_path))
    runner = HarnessRunner(cfg, stop_event=threading.Event())
    calls: list[dict] = []
    serving: dict = {}

    def generate(base_url, prompts, tokens, *, timeout_s=600.0):
        return _outputs(prompts, tokens, diverge=serving["config"].get("chunked_prefill_size") == 4096)

    def run(config, trial_dir, probe, workload=None, *, after=()):
        calls.append({"config": dict(config), "dir": Path(trial_dir), "probe": probe, "after": tuple(after)})
        serving["config"] = dict(config)
        figures = fidelity.run_probe("http://fake", probe, trial_dir=trial_dir) if probe is not None else None
        return TrialResult(status="ok", config=dict(config), fidelity=figures)

    monkeypatch.setattr(fidelity, "generate_outputs", generate)
    monkeypatch.setattr(runner, "_run", run)
    return cfg, runner, calls


def test_the_first_confirmation_launch_of_every_contender_but_the_baseline_and_its_twins_probes(fake_runner):
    cfg, runner, calls = fake_runner
    base = cfg.baseline_config()
    twin = {**dict(reversed(list(base.items()))), "schedule_policy": None}  # the same flags as launched

    assert runner.repeat(dict(base), 0, 0).fidelity is None
    assert runner.repeat(twin, 4, 0).fidelity is None
    assert [c["probe"] for c in calls] == [None, None]  # no probe, and no reference recorded for them

    chunked = runner.repeat({"chunked_prefill_size": 4096}, 1, 0, after=("window-2",))
    # No reference yet (this study is not numerics-aware): a reference-only launch of the baseline recorded it first.
    recorded, probed = calls[2], calls[3]
    assert recorded["config"] == base and recorded["probe"].records and recorded["probe"].only
    assert probed["dir"].name == "repeat-1" and probed["probe"].reference is not None
    assert probed["after"] == ("window-2",)  # the caller's follow-up steps still ride in the same launch
    fid = chunked.fidelity
    assert fid.role == "probe" and fid.changes == () and fid.unexpected is True
    assert fid.prefix_match_mean == 10 and fid.exact_share == 0.0
    assert {d["flag"] for d in fid.differs} == {"chunked_prefill_size", "max_running_requests"}
    line = numerics_line(fid)
    assert line.startswith("outputs changed unexpectedly") and "--chunked-prefill-size 4096" in line
    assert "--max-running-requests unset" in line

    # A contender whose outputs equal the baseline's: compared, and no alarm.
    same = runner.repeat({"max_running_requests": 8, "schedule_policy": "lpm"}, 2, 0).fidelity
    assert same.role == "probe" and same.exact_share == 1.0 and same.unexpected is False
    assert numerics_line(same) is None
    # Only the first confirmation launch probes; the reference was recorded once.
    assert runner.repeat({"chunked_prefill_size": 4096}, 1, 1).fidelity is None
    assert sum(1 for c in calls if c["probe"] is not None and c["probe"].records) == 1


def test_a_table_flag_is_still_a_change_the_table_explains():
    probe = fidelity.FidelityProbe(
        prompts=("a",),
        tokens=4,
        reference=Reference(("a",), 4, (ProbeOutput((1, 2, 3, 4), (-0.1,) * 4),)),
        changes=(fidelity.FlagChange(flag="mamba_ssm_dtype", value="bfloat16"),),
    )
    figures = dataclasses.replace(
        fidelity.compare(probe.reference.outputs, [ProbeOutput((1, 9, 9, 9), (-0.1,) * 4)], 4),
        changes=tuple(c.to_dict() for c in probe.changes),
    )
    judged = fidelity.verdict(figures, ())
    assert (judged.outputs_differ, judged.unexpected, judged.differs) == (True, False, ())


# --- apply ---------------------------------------------------------------------------------------------------------
def _winner(fid: dict, limits: dict | None = None) -> Winner:
    config = {"chunked_prefill_size": 4096}
    settings = {"engine": {"model": "qwen3.6-27b"}, **({"objective": {"numerics": limits}} if limits else {})}
    return Winner(
        study="s",
        trial=3,
        config=config,
        result=TrialResult(status="ok", config=config, fidelity=FidelityFigures.from_dict(fid)),
        tok_s=1.0,
        baseline_config={},
        settings=StudySettings.of(settings),
    )


UNEXPECTED = {
    "role": "probe",
    "changes": [],
    "prefix_match_mean": 10.0,
    "exact_share": 0.0,
    "tokens": 64,
    "mean_abs_logprob_delta": 0.0,
    "outputs_differ": True,
    "unexpected": True,
    "differs": [{"flag": "chunked_prefill_size", "value": 4096, "reference": None}],
}


def test_apply_judges_an_unexpected_change_as_a_numerics_change():
    block = check_numerics(_winner(UNEXPECTED))  # measured, no limit set: deployed, said, in provenance
    assert block.unexpected is True and block.problem is None and block.fidelity.exact_share == 0.0
    with pytest.raises(NumericsRefused, match="changed its outputs unexpectedly .*--chunked-prefill-size 4096"):
        check_numerics(_winner(UNEXPECTED, {"min_exact_share": 1.0}))
    assert check_numerics(_winner(UNEXPECTED, {"min_exact_share": 1.0}), accept=True).accepted is True
    equal = {**UNEXPECTED, "exact_share": 1.0, "prefix_match_mean": 64.0, "outputs_differ": False, "unexpected": False}
    assert check_numerics(_winner(equal, {"min_exact_share": 1.0})).problem is None  # no false alarm


def test_numerics_limits_a_study_stored_by_another_version_are_read_as_none():
    assert _winner(UNEXPECTED, {"min_exact_share": 1.0}).settings.numerics.min_exact_share == 1.0
    for stored in ({"min_exact_share": 1.0, "renamed_limit": 2.0}, {"tokens": "many"}):  # a field it does not know
        assert _winner(UNEXPECTED, stored).settings.numerics == NumericsLimits()
    assert check_numerics(_winner(UNEXPECTED, {"min_exact_share": 1.0, "renamed_limit": 2.0})).problem is None


def test_the_contender_probe_is_what_a_trial_is_known_by():
    def run(repeat: int, fidelity: dict | None) -> ConfirmationRun:
        result = TrialResult(status="ok", config={}, fidelity=FidelityFigures.from_dict(fidelity))
        return ConfirmationRun(trial=3, repeat=repeat, result=result)

    conf = Confirmation(runs=(run(1, None), run(0, UNEXPECTED)))  # the first launch's probe, whatever came before
    assert sn.contender_fidelity(None, conf.probe(3)) == FidelityFigures.from_dict(UNEXPECTED)
    reference = FidelityFigures(role="reference")
    assert sn.contender_fidelity(reference, conf.probe(0)) == reference  # the baseline: not probed, the reference
    failed = Confirmation(runs=(run(0, {"role": "probe", "error": "no reference"}),))
    table = FidelityFigures(role="probe", changes=({"flag": "mamba_ssm_dtype", "value": "bfloat16"},))
    assert sn.contender_fidelity(table, failed.probe(3)) == table  # a failed contender probe never hides a measured one
    assert numerics_line(sn.contender_fidelity(None, failed.probe(3))) == (
        "outputs not checked against the baseline: no reference"
    )


# --- the simulator ---------------------------------------------------------------------------------------------------
def test_the_sim_option_makes_a_flag_outside_the_table_change_outputs_and_nothing_without_it():
    args = {"chunked_prefill_size": 4096, "schedule_policy": "fcfs"}
    assert SimNumerics.for_server(args, hybrid=True).changes == ()
    caught = SimNumerics.for_server(args, hybrid=True, unlisted=("chunked_prefill_size", "schedule_policy"))
    assert [key for key, _ in caught.changes] == ["chunked_prefill_size=4096"]  # fcfs is SGLang's default
    plain = SimNumerics.for_server({}, hybrid=True).plan("a prompt", 0, base=7)
    changed = caught.plan("a prompt", 0, base=7)
    assert plain.diverges_at is None and changed.diverges_at is not None and changed.diverges_at >= 1


@pytest.mark.slow
def test_a_sim_study_catches_a_non_table_flag_that_changes_outputs_and_apply_treats_it_as_numerics(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    path = write_study(tmp_path, sim=', numerics_flags = "chunked_prefill_size"', limit=", min_exact_share = 1.0")
    from autotune.search.sweep import run_sweep

    summary = run_sweep(load_config(path))
    progress = capsys.readouterr()
    assert "outputs changed unexpectedly: " in progress.out + progress.err  # the confirmation run's line says it
    study = optuna.load_study(study_name="catch", storage=load_config(path).storage_url)
    trials = {t.user_attrs.get("label"): t for t in study.get_trials() if t.state.name == "COMPLETE"}
    chunked = trials["chunked"].number
    assert trials["chunked"].user_attrs["result"]["fidelity"] is None  # no table flag: the search did not probe
    first = {r["trial"]: r["result"] for r in study.user_attrs["confirmation"]["runs"] if r["repeat"] == 0}
    caught = first[chunked]["fidelity"]
    assert caught["unexpected"] and caught["changes"] == [] and caught["exact_share"] < 1.0
    base = trials["baseline"].number  # the reference: never probed (far behind the leader, not even relaunched)
    assert (
        first[base].get("fidelity") is None
        if base in first
        else [g["trial"] for g in study.user_attrs["confirmation"]["given"]] == [base]
    )
    assert first[chunked]["durations_s"]["probe"] > 0
    # The sweep's summary names it in one line (the uncapped contender wins: 32 streams against a cap of 8).
    assert summary.best.trial == chunked
    assert summary.best.numerics.startswith("outputs changed unexpectedly")
    assert summary.unexpected == [] and Confirmation.of(study).unexpected() == [chunked]
    from autotune.cli.sweep import render

    assert f"  {summary.best.numerics}" in render(summary).splitlines()
    other = dataclasses.replace(
        summary,
        best=None,
        outcome="baseline",  # a finalist, not the winner
        unexpected=[UnexpectedEntry(chunked, summary.best.numerics)],
    )
    assert f"  trial {chunked}: outputs changed unexpectedly" in render(other)

    from autotune.cli import cli

    runner = CliRunner()
    shown = runner.invoke(cli, ["trials", "--config", str(path)])
    assert shown.exit_code == 0, shown.output
    assert f"trial {chunked}: outputs changed unexpectedly" in shown.output
    refused = runner.invoke(cli, ["apply", "--config", str(path), "--out", str(tmp_path / "d1"), "--gpus", "0"])
    assert isinstance(refused.exception, NumericsRefused)  # the CLI's one-line error (exit 1)
    assert (
        "changed its outputs unexpectedly" in str(refused.exception)
        and "--chunked-prefill-size 4096" in str(refused.exception)
        and "--accept-numerics" in str(refused.exception)
        and not (tmp_path / "d1").exists()
    )
    ok = runner.invoke(
        cli, ["apply", "--config", str(path), "--out", str(tmp_path / "d2"), "--gpus", "0", "--accept-numerics"]
    )
    assert ok.exit_code == 0, ok.output
    prov = json.loads((tmp_path / "d2" / "provenance.json").read_text())["numerics"]
    assert "--accept-numerics: trial" in ok.output and "changed its outputs unexpectedly" in ok.output
    assert prov["unexpected"] is True and "unexpectedly" in prov["problem"] and prov["fidelity"]["exact_share"] < 1.0
