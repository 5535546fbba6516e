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
