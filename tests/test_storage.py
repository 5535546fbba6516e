"""Storage URLs → Optuna storages, one-line errors, and which RUNNING trials belong to dead workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from autotune.errors import StorageError
from autotune.redaction import redact_url as redact
from autotune.search.storage import (
    Liveness,
    WorkerTag,
    check_storage,
    dead_running,
    fail_stale,
    journal_path,
    kind,
    open_storage,
)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg2://tuner:s3cret@db:5432/studies", "postgresql+psycopg2://tuner:***@db:5432/studies"),
        (
            "postgresql://tuner@db/studies?password=s3cret&sslmode=require",
            "postgresql://tuner@db/studies?password=***&sslmode=require",
        ),
        ("mysql+pymysql://u:p@ss:w0rd@h/db", "mysql+pymysql://u:***@h/db"),
        ("sqlite:///studies/a.db", "sqlite:///studies/a.db"),
    ],
)
def test_redact_hides_every_password(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgres://tuner:s3cret@db/x", "postgresql+psycopg2://"),  # SQLAlchemy's spelling, said as the fix
        ("studies.db", "sqlite:///file.db"),
        ("sqlite:studies.db", "sqlite:///file.db"),
        ("journal:", "journal:///"),
    ],
)
def test_malformed_url_is_one_line_naming_the_url_and_the_fix(url, words):
    with pytest.raises(StorageError) as info:
        kind(url)
    text = str(info.value)
    assert words in text and "\n" not in text and "s3cret" not in text


def test_journal_paths_resolve_absolute_and_relative(tmp_path):
    assert journal_path(f"journal://{tmp_path}/s.log") == tmp_path / "s.log"
    assert journal_path("journal:runs/s.log", tmp_path) == tmp_path / "runs" / "s.log"
    assert kind(f"journal://{tmp_path}/s.log") == "journal"


def test_unreachable_database_is_one_line_with_redacted_url_and_fix():
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        check_storage("postgresql+psycopg2://tuner:s3cret@127.0.0.1:1/studies")
    text = str(info.value)
    assert "tuner:***@127.0.0.1:1/studies" in text and "s3cret" not in text and "\n" not in text
    assert "refused" in text and "check host, port" in text
    assert time.monotonic() - started < 30  # a connect timeout, not a hang


def test_unknown_or_missing_driver_says_what_to_write_or_install():
    with pytest.raises(StorageError, match="unknown database driver .*postgresql\\+psycopg2"):
        open_storage("postgresql+nosuchdriver://u:pw@127.0.0.1:1/db")
    import importlib.util

    if importlib.util.find_spec("pymysql") is None:
        with pytest.raises(StorageError, match="pip install pymysql"):
            open_storage("mysql+pymysql://u:pw@127.0.0.1:1/db")


def test_unwritable_file_storage_is_a_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for url in (f"sqlite:///{blocker}/sub/x.db", f"journal://{blocker}/sub/x.log"):
        with pytest.raises(StorageError, match="check that the directory exists"):
            open_storage(url)


def postgres_url() -> str:
    url = os.environ.get("AUTOTUNE_TEST_POSTGRES")
    if not url:
        if os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1":
            pytest.fail("AUTOTUNE_TEST_POSTGRES is not set")
        pytest.skip("no PostgreSQL (set AUTOTUNE_TEST_POSTGRES)")
    return url


@pytest.fixture
def postgres_db():
    """A fresh database on the test server, dropped afterwards (tests never share state)."""
    import sqlalchemy

    server = postgres_url()
    name = f"autotune_{uuid.uuid4().hex[:10]}"
    admin = sqlalchemy.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    url = server.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "journal", "postgres"])
def any_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 's.db'}"
    if request.param == "journal":
        return f"journal://{tmp_path / 's.log'}"
    return request.getfixturevalue("postgres_db")


@pytest.mark.postgres
def test_every_storage_shares_one_study_between_two_openers(any_url):
    first = optuna.create_study(study_name="shared", storage=open_storage(any_url), direction="maximize")
    trial = first.ask()
    trial.set_user_attr("config", {"max_mamba_cache_size": 80})
    first.tell(trial, 1234.0)
    second = optuna.load_study(study_name="shared", storage=open_storage(any_url))
    [seen] = second.get_trials()
    assert seen.value == 1234.0 and seen.user_attrs["config"] == {"max_mamba_cache_size": 80}


def _exited_process_tag() -> WorkerTag:
    """The tag of a process on this host that has already exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    import psutil

    started = psutil.Process(proc.pid).create_time()
    proc.wait(timeout=30)
    return WorkerTag(host=WorkerTag.current(0).host, pid=proc.pid, started=started, gpu=1)


def _running(study: optuna.Study, tag: WorkerTag | None, config: dict) -> optuna.trial.FrozenTrial:
    trial = study.ask()
    trial.set_user_attr("config", config)
    trial.set_user_attr("role", "search")
    if tag is not None:
        trial.set_user_attr("worker", tag.__dict__)
    return study.get_trials(deepcopy=False)[trial.number]


@pytest.mark.postgres
def test_dead_local_worker_is_seen_at_once_and_live_ones_are_left_alone(any_url, tmp_path):
    study = optuna.create_study(study_name="live", storage=open_storage(any_url))
    dead = _running(study, _exited_process_tag(), {"a": 1})
    alive = _running(study, WorkerTag.current(0), {"a": 2})
    stale = dead_running(study, tmp_path)
    assert [t.number for t in stale] == [dead.number]
    assert alive.number not in [t.number for t in stale]


def test_other_hosts_worker_on_a_journal_is_judged_by_its_heartbeat_file(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_HEARTBEAT_S", "1")
    study = optuna.create_study(study_name="j", storage=open_storage(f"journal://{tmp_path / 'j.log'}"))
    far = WorkerTag(host="other-node", pid=4242, started=1.0, gpu=0)
    trial = _running(study, far, {"a": 1})
    beat = tmp_path / "workers" / far.beat_name
    beat.parent.mkdir()
    beat.write_text(json.dumps({"at": time.time()}))
    assert dead_running(study, tmp_path / "workers") == []  # a fresh beat: alive
    old = time.time() - 10
    os.utime(beat, (old, old))
    assert [t.number for t in dead_running(study, tmp_path / "workers")] == [trial.number]
    # no shared directory: the beat stored on the trial itself decides
    fresh = _running(study, far, {"a": 2})
    study._storage.set_trial_user_attr(fresh._trial_id, "beat_at", time.time())
    assert fresh.number not in [t.number for t in dead_running(study, tmp_path / "elsewhere")]
    study._storage.set_trial_user_attr(fresh._trial_id, "beat_at", time.time() - 10)
    assert fresh.number in [t.number for t in dead_running(study, tmp_path / "elsewhere")]


def test_optuna_heartbeat_fails_a_silent_remote_trial_and_retries_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_HEARTBEAT_S", "1")
    study = optuna.create_study(study_name="hb", storage=open_storage(f"sqlite:///{tmp_path / 'hb.db'}"))
    far = WorkerTag(host="other-node", pid=4242, started=1.0, gpu=0)
    trial = _running(study, far, {"max_mamba_cache_size": 80})
    trial_id = trial._trial_id
    study._storage.record_heartbeat(trial_id)  # the remote worker beat once, then its node died
    assert dead_running(study, tmp_path) == []  # another host's: Optuna's heartbeat decides
    fail_stale(study)
    assert study.get_trials(deepcopy=False)[trial.number].state == TrialState.RUNNING  # within the grace period
    deadline = time.monotonic() + 30
    while study.get_trials(deepcopy=False)[trial.number].state == TrialState.RUNNING:
        assert time.monotonic() < deadline, "the stale trial was never failed"
        fail_stale(study)
        time.sleep(0.2)
    trials = study.get_trials()
    assert trials[trial.number].state == TrialState.FAIL
    [retry] = [t for t in trials if t.state == TrialState.WAITING]
    assert retry.user_attrs == {
        "config": {"max_mamba_cache_size": 80},
        "role": "search",
        "requeued_from": trial.number,
    }  # not the dead run's worker tag
    # the retry dies too: it is not retried a second time
    again = study.ask()
    assert again.number == retry.number
    again.set_user_attr("worker", far.__dict__)
    study._storage.record_heartbeat(again._trial_id)
    deadline = time.monotonic() + 30
    while study.get_trials(deepcopy=False)[again.number].state == TrialState.RUNNING:
        assert time.monotonic() < deadline, "the stale retry was never failed"
        fail_stale(study)
        time.sleep(0.2)
    assert not study.get_trials(states=(TrialState.WAITING,))


@pytest.mark.parametrize("where", ["sqlite:///{}/l.db", "journal://{}/l.log"])
def test_liveness_tags_the_trial_and_beats_until_closed(tmp_path, monkeypatch, where):
    monkeypatch.setenv("AUTOTUNE_HEARTBEAT_S", "1")
    study = optuna.create_study(study_name="l", storage=open_storage(where.format(tmp_path)))
    live = Liveness(study, gpu=3, state_dir=tmp_path / "workers")
    try:
        trial = study.ask()
        live.claim(trial)
        frozen = study.get_trials()[trial.number]
        assert frozen.user_attrs["worker"]["pid"] == os.getpid()
        assert frozen.user_attrs["gpu"] == f"{WorkerTag.current(3).host}:3"
        assert ("beat_at" in frozen.user_attrs) == where.startswith("journal")  # SQL: Optuna's heartbeat table
        first = live.beat_file.stat().st_mtime_ns
        deadline = time.monotonic() + 10
        while live.beat_file.stat().st_mtime_ns == first:
            assert time.monotonic() < deadline, "the heartbeat file never moved"
            time.sleep(0.1)
        assert dead_running(study, tmp_path / "workers") == []
    finally:
        live.close()
    assert not live.beat_file.exists()
