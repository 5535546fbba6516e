"""A hand-written config SGLang refuses is an error in the study file before anything launches; a config the planner
skips for memory stays a skip."""

from __future__ import annotations

import pytest
from test_study import PlannerRunner
from tinystudy import write_tiny_study

from autotune.cli import main
from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.search.sweep import run_sweep

RULE = "must be unset when --speculative-num-steps is unset"


def refused_baseline(tmp_path):
    """The tiny study whose fixed flags set the draft-tree flags but leave ``speculative_num_steps`` to each config,
    and whose baseline sets none: SGLang's assertion refuses the baseline (and only it)."""
    path = write_tiny_study(tmp_path, name="tiny", trials=2, top_k=1)
    text = path.read_text().replace("speculative_num_steps = 3\n", "", 1)
    text = text.replace("[space]\n", '[space]\nspeculative_num_steps = { type = "int", low = 1, high = 3 }\n')
    path.write_text(text)
    return path


def test_a_baseline_sglang_refuses_is_one_error_line_and_exit_1_with_nothing_started(tmp_path, capsys):
    path = refused_baseline(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--config", str(path)])
    assert info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert str(path) in lines[0] and "[baseline]" in lines[0] and RULE in lines[0]
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "tiny.db").exists()  # no study, no trial, no server


def test_the_sweep_itself_refuses_it_before_the_first_launch(tmp_path):
    cfg = load_config(refused_baseline(tmp_path))
    runner = PlannerRunner()
    with pytest.raises(ConfigError) as info:
        run_sweep(cfg, runner=runner)
    assert info.value.key == "[baseline]" and RULE in str(info.value)
    assert runner.calls == []


def test_an_enqueued_config_is_named_by_its_label(tmp_path):
    path = write_tiny_study(tmp_path, name="tiny", trials=2)
    path.write_text(path.read_text() + '\n[[enqueue]]\nlabel = "no steps"\nflags = { speculative_num_steps = 0 }\n')
    cfg = load_config(path)
    runner = PlannerRunner()
    with pytest.raises(ConfigError) as info:
        run_sweep(cfg, runner=runner)
    assert info.value.key == '[[enqueue]] "no steps"' and ">= 1" in str(info.value)
    assert runner.calls == []


def test_a_config_the_planner_skips_for_memory_stays_a_skip(tmp_path):
    path = write_tiny_study(tmp_path, name="tiny", trials=2)
    path.write_text(path.read_text() + '\n[[enqueue]]\nlabel = "too big"\nflags = { max_mamba_cache_size = 4000 }\n')
    runner = PlannerRunner()
    summary = run_sweep(load_config(path), runner=runner)
    assert summary.statuses.get("skipped_infeasible", 0) >= 1
    assert all(config.get("max_mamba_cache_size") != 4000 for _, config in runner.calls)
