"""Every command that reads a study (``apply``, ``report``, ``trials``) opens it through ``search.storage`` and
works on each storage kind: SQLite, a journal file and PostgreSQL. Failures are one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import studyfactory as sf
from click.testing import CliRunner
from test_storage import postgres_db  # noqa: F401  (the fixture: a fresh database per test)
from tinystudy import write_tiny_study

from autotune.cli import cli
from autotune.config import load_config
from autotune.deploy.apply import load_winner
from autotune.errors import StorageError, StudyError
from autotune.report.page import report
from autotune.search.storage import load_study, open_storage, study_names


@pytest.fixture(params=["sqlite", "journal", "postgres"])
def url(request, tmp_path) -> str:
    """A storage holding one finished, confirmed study ``s`` (the same one on every kind)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 's.db'}"
    elif request.param == "journal":
        url = f"journal://{tmp_path / 's.log'}"
    else:
        url = request.getfixturevalue("postgres_db")
    sf.make_study(n_trials=12, seed=3, name="s", storage=open_storage(url), trials_dir=tmp_path / "s")
    return url


@pytest.mark.postgres
def test_apply_writes_the_winner_from_every_storage(url, tmp_path):
    winner = load_winner(url)
    assert winner.study == "s" and winner.confirmed and winner.tok_s
    out = tmp_path / "deploy"
    res = CliRunner().invoke(cli, ["apply", "--storage", url, "--out", str(out), "--gpus", "0", "--allow-unstressed"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "provenance.json").read_text())["trial"] == winner.trial


@pytest.mark.postgres
def test_report_reads_every_storage(url, tmp_path):
    out = tmp_path / "r.json"
    report(storage=url, out=out, fmt="json")
    assert json.loads(out.read_text(encoding="utf-8"))
    res = CliRunner().invoke(
        cli, ["report", "--storage", url, "--study", "s", "--format", "csv", "--out", str(tmp_path / "csv")]
    )
    assert res.exit_code == 0, res.output


@pytest.mark.postgres
def test_trials_reads_every_storage(url):
    res = CliRunner().invoke(cli, ["trials", "--storage", url, "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output)) == 12


@pytest.mark.postgres
def test_loading_never_creates_and_names_the_studies_there(url):
    assert study_names(url) == ["s"]
    with pytest.raises(StudyError, match=r"no study named 'nope' in .*\(studies there: s\)"):
        load_study(url, "nope")
    with pytest.raises(StudyError, match="no study named 'nope'"):
        load_winner(url, "nope")
    assert study_names(url) == ["s"]


def test_apply_on_a_journal_named_by_a_relative_path_in_the_study_file(tmp_path):
    sf.make_study(n_trials=6, seed=1, name="rel", storage=open_storage(f"journal://{tmp_path / 'runs/rel.log'}"))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n', encoding="utf-8")
    (tmp_path / "rel.toml").write_text(
        '[study]\nname = "rel"\nstorage = "journal:runs/rel.log"\n[workload]\nprompts = "prompts.jsonl"\n',
        encoding="utf-8",
    )
    out = tmp_path / "deploy"
    res = CliRunner().invoke(
        cli, ["apply", "--config", str(tmp_path / "rel.toml"), "--out", str(out), "--gpus", "0", "--allow-unstressed"]
    )
    assert res.exit_code == 0, res.output
    assert (out / "sglang.yaml").is_file()


def test_a_password_never_shows_in_a_loading_error():
    for url in (
        "postgresql+psycopg2://u:s3cret@127.0.0.1:1/x",
        "postgresql+psycopg2://u@127.0.0.1:1/x?password=s3cret",
    ):
        with pytest.raises(StorageError) as info:
            load_study(url, "s")
        assert "s3cret" not in str(info.value) and "***" in str(info.value)


def test_a_compared_study_that_cannot_be_found_is_an_error_not_a_silent_skip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'one.db'}"
    sf.make_study(n_trials=8, seed=2, name="one", storage=url)
    with pytest.raises(StudyError, match="no study named 'ghost' to compare with"):
        report(storage=url, compare=["ghost"], out=tmp_path / "r.json", fmt="json")


@pytest.mark.slow
def test_trials_on_a_finished_study_prints_no_library_warning(tmp_path):
    """``autotune trials --config`` builds the study's sampler (multivariate, grouped TPE with a constant liar:
    features Optuna marks experimental); a user sees the table and no warning line. In a subprocess: this suite's
    own warning filters do not hold there, as they would not for a user."""
    study = write_tiny_study(tmp_path, name="w", trials=4)
    cfg = load_config(study)
    sf.make_study(n_trials=6, seed=1, name="w", storage=open_storage(cfg.storage_url, base_dir=cfg.base_dir))
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "trials", "--config", str(study)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "baseline" in done.stdout  # the table itself
    lines = (done.stdout + done.stderr).splitlines()
    assert not [line for line in lines if "Warning" in line or "warn(" in line], done.stderr
