"""Every command finds its study the same way: the quick start's study file when none is named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import studyfactory as sf
from click.testing import CliRunner

from autotune.cli import cli
from autotune.config import load_config
from autotune.config.studyref import DEFAULT_STUDY, resolve_config, study_file

ROOT = Path(__file__).resolve().parents[1]


def _quick_start(tmp_path: Path):
    """The shipped studies and prompts in ``tmp_path``, the example study already swept (synthetic trials)."""
    shutil.copytree(ROOT / "studies", tmp_path / "studies", ignore=shutil.ignore_patterns("*.db", "example"))
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    cfg = load_config(tmp_path / DEFAULT_STUDY)
    sf.make_study(n_trials=8, seed=3, name=cfg.name, storage=cfg.storage_url)
    return cfg


def test_the_default_is_the_example_unless_a_study_is_named_another_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert study_file(None, None, None) == ROOT / DEFAULT_STUDY  # none here: the packaged example
    assert study_file(tmp_path / "s.toml", "x", None) == tmp_path / "s.toml"
    assert study_file(None, "x", None) is None and study_file(None, None, "sqlite:///x.db") is None
    (tmp_path / "studies").mkdir()
    (tmp_path / DEFAULT_STUDY).write_text("")
    assert resolve_config(None) == tmp_path / DEFAULT_STUDY  # the working directory's comes first


def test_report_with_no_arguments_reads_the_quick_start_study(tmp_path, monkeypatch):
    cfg = _quick_start(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["report"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "reports" / f"{cfg.name}.html").is_file()


def test_report_naming_a_missing_default_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("autotune.config.studyref.Path.is_file", lambda self: False)
    with pytest.raises(Exception, match="studies/example.toml not found"):
        resolve_config(None)


def test_apply_finds_the_study_as_report_does(tmp_path, monkeypatch):
    cfg = _quick_start(tmp_path)
    sf.make_study(n_trials=6, seed=4, name="other", storage=f"sqlite:///{tmp_path / 'studies' / 'other.db'}")
    monkeypatch.chdir(tmp_path)
    quick = CliRunner().invoke(cli, ["apply", "--out", "d1", "--gpus", "0-1"])  # nothing named: the example
    assert quick.exit_code == 0, quick.output
    assert f"study {cfg.name}, trial" in quick.output and (tmp_path / "d1" / "fleet.toml").is_file()
    named = CliRunner().invoke(cli, ["apply", "--study", "other", "--out", "d2", "--gpus", "0"])  # studies/other.db
    assert named.exit_code == 0, named.output
    assert "study other, trial" in named.output


@pytest.mark.slow
def test_from_the_quick_starts_study_to_a_watched_fleet_with_the_readmes_arguments(tmp_path, monkeypatch):
    """apply, fleet up, watch --once and fleet down on the fleet apply wrote, with what the README shows."""
    _quick_start(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    run = CliRunner().invoke
    applied = run(cli, ["apply", "--out", "deploy", "--gpus", "0-1"])
    assert applied.exit_code == 0, applied.output
    yaml_text = (tmp_path / "deploy" / "sglang.yaml").read_text()
    assert "enable-metrics: true" in yaml_text and "enable-metrics added" in yaml_text
    fleet = str(Path("deploy") / "fleet.toml")
    try:
        up = run(cli, ["fleet", "up", "--fleet", fleet])
        assert up.exit_code == 0, up.output
        shown = run(cli, ["fleet", "status", "--fleet", fleet], terminal_width=200)
        assert shown.exit_code == 0 and "running cap" in shown.output and "tok/s (last)" in shown.output
        watched = run(cli, ["watch", "--fleet", fleet, "--once"])
        assert watched.exit_code == 0, watched.output
        assert "--enable-metrics" not in watched.output
    finally:
        down = run(cli, ["fleet", "down", "--fleet", fleet])
    assert down.exit_code == 0, down.output


def test_plan_never_sends_the_user_to_a_flag_it_called_inert():
    from autotune.cli.plan import inert_advice

    said = (
        "max_running_requests is capped to 16 by the mamba state cache (max_mamba_cache_size=80, 5 state slots "
        "per request). To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, or halve the "
        "state size with --mamba-ssm-dtype bfloat16."
    )
    advice = inert_advice(said, ["mamba_full_memory_ratio"])
    assert advice.startswith("autotune: --mamba-full-memory-ratio is inert")
    assert "change --max-mamba-cache-size or --mamba-ssm-dtype instead" in advice
    assert inert_advice(said, []) is None
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            "--model",
            "qwen3.6-27b",
            "--gpu",
            "b200",
            "--set",
            "speculative_algorithm=EAGLE",
            "--set",
            "max_mamba_cache_size=80",
            "--set",
            "mamba_full_memory_ratio=0.4",
        ],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    assert "--mamba-full-memory-ratio is inert for this config" in result.output
