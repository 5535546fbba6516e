"""A measured rate as the user's job: hours, GPU-hours and cost on the job's fleet."""

from __future__ import annotations

import pytest

from autotune.job import Job, JobShapeError, job_line, job_time

SEED = Job(completions=902_087, gpus=7, gpu_hour_cost=4.0)


def test_hours_follow_from_the_job_tokens_and_the_fleet_rate():
    t = job_time(SEED, 1_000.0, mean_output_tokens=1_150.0)
    assert t.servers == 7 and t.fleet_tok_s == 7_000.0
    assert t.hours == pytest.approx(902_087 * 1_150.0 / 7_000.0 / 3600)
    assert t.gpu_hours == pytest.approx(7 * t.hours) and t.cost == pytest.approx(4.0 * t.gpu_hours)
    # the job's own mean output length wins over the sample's
    own = job_time(Job(completions=902_087, gpus=7, mean_output_tokens=575.0), 1_000.0, mean_output_tokens=1_150.0)
    assert own.hours == pytest.approx(t.hours / 2) and own.cost is None


def test_servers_spanning_two_gpus_leave_an_odd_gpu_idle():
    t = job_time(SEED, 1_800.0, span=2, mean_output_tokens=1_000.0)
    assert t.servers == 3 and t.gpu_hours == pytest.approx(t.hours * 6)
    with pytest.raises(JobShapeError, match="cannot hold one server of 8 GPUs"):
        job_time(SEED, 1_000.0, span=8, mean_output_tokens=1_000.0)
    with pytest.raises(ValueError):
        job_time(SEED, 0.0, mean_output_tokens=1_000.0)


def test_the_rate_interval_becomes_an_hours_interval_slow_bound_longest():
    t = job_time(SEED, 1_000.0, mean_output_tokens=1_000.0, tok_s_range=(1_100.0, 900.0))
    lo, hi = t.hours_range
    assert lo < t.hours < hi
    assert hi == pytest.approx(job_time(SEED, 900.0, mean_output_tokens=1_000.0).hours)


def test_the_line_says_before_and_after_and_what_was_saved():
    base = job_time(SEED, 1_000.0, mean_output_tokens=1_000.0)
    win = job_time(SEED, 4_500.0, mean_output_tokens=1_000.0, tok_s_range=(4_400.0, 4_600.0))
    line = job_line(SEED, base, win)
    assert line.startswith("this job (902,087 completions on 7 GPUs): ")
    assert f"{base.hours:,.1f} h → {win.hours:,.1f} h (" in line
    assert f"({base.gpu_hours - win.gpu_hours:,.0f} saved)" in line and f"${win.cost:,.0f}" in line
    assert "→" not in job_line(SEED, None, win)


def test_a_study_files_job_section_loads_and_a_bad_value_is_one_line(tmp_path):
    from pathlib import Path

    from autotune.config import load_config
    from autotune.errors import ConfigError

    example = (Path(__file__).resolve().parents[1] / "studies" / "example.toml").read_text()
    prompts = Path(__file__).resolve().parents[1] / "studies"
    study = prompts / f"job-{tmp_path.name}.toml"  # beside the example: its relative prompt path must resolve
    try:
        study.write_text(example + "\n[job]\ncompletions = 902087\ngpus = 7\ngpu_hour_cost = 4.5\n")
        job = load_config(study).job
        assert job is not None and job.as_job() == Job(completions=902_087, gpus=7, gpu_hour_cost=4.5)
        study.write_text(example + "\n[job]\ncompletions = 902087\n")
        with pytest.raises(ConfigError) as err:
            load_config(study)
        assert "job.gpus" in str(err.value) and "\n" not in str(err.value)
    finally:
        study.unlink(missing_ok=True)
