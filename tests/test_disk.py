"""A full disk is one line and a failed trial: the study folder, or only its database, on a tiny tmpfs.

The end-to-end tests mount a real 3 MiB tmpfs (root in CI); without permission to mount they skip, unless
``AUTOTUNE_REQUIRE_ALL=1``. The disk is filled the moment the first trial's server starts, so the failure lands
mid-trial, where it used to leave a traceback and a RUNNING trial.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_study import PlannerRunner, write_study
from tinystudy import write_tiny_study

from autotune.config import load_config
from autotune.errors import DiskError
from autotune.search.objective import open_study
from autotune.search.seeding import launched
from autotune.search.storage import diskguard
from autotune.search.storage.diskguard import Ballast, Room, disk_error, free_bytes
from autotune.search.study import run_study


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        if os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1":
            pytest.fail(f"cannot mount a tmpfs: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs (not root?): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Write until the disk is full."""
    with contextlib.suppress(OSError), open(disk / f"filler-{uuid.uuid4().hex[:6]}", "wb") as fh:
        while True:
            fh.write(b"\0" * 65536)
            fh.flush()


def fill_once_started(disk: Path, server_log: Path, timeout_s: float = 60) -> threading.Thread:
    """Fill ``disk`` as soon as the first trial's server is running (its log exists)."""

    def run():
        deadline = time.monotonic() + timeout_s
        while not server_log.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        fill(disk)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def sweep(path: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_and_nothing_running(done: subprocess.CompletedProcess, storage: str, env: dict, where: str):
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and where in errors[0] and " free" in errors[0], done.stderr
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert not [t.number for t in study.trials if t.state == TrialState.RUNNING]
    failed = [t for t in study.trials if t.user_attrs.get("status") == "write_error"]
    assert len(failed) == 1 and failed[0].state == TrialState.FAIL and where in failed[0].user_attrs["reason"]
    listed = subprocess.run(
        [sys.executable, "-m", "autotune", "trials", "--storage", storage, "--study", "tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and "write_error" in listed.stdout, listed.stderr
    return failed[0]


@pytest.mark.slow
def test_study_folder_on_a_full_tmpfs_is_one_line_and_a_failed_trial(tiny_disk, tmp_path):
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    path = write_tiny_study(tiny_disk, name="tiny", trials=3)
    filler = fill_once_started(tiny_disk, tiny_disk / "tiny" / "trials" / "0" / "server.log")
    done = sweep(path, env)
    filler.join(timeout=10)
    storage = f"sqlite:///{tiny_disk / 'tiny.db'}"
    failed = assert_one_line_and_nothing_running(done, storage, env, str(tiny_disk))
    assert failed.number == 0
    assert not list(tiny_disk.glob(".*.reserve"))  # the reserve was given back and nothing is left behind
    for f in tiny_disk.glob("filler-*"):  # room again: the same command resumes and runs the failed config
        f.unlink()
    again = sweep(path, env)
    assert again.returncode == 0, again.stderr
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert [t.user_attrs.get("requeued_from") for t in study.trials if t.user_attrs.get("status") == "ok"][0] == 0


@pytest.mark.slow
def test_only_the_database_on_a_full_tmpfs_fails_the_trial_instead_of_leaving_it_running(tiny_disk, tmp_path):
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    path = write_tiny_study(tmp_path, name="tiny", trials=3)
    storage = f"sqlite:///{tiny_disk / 'tiny.db'}"
    filler = fill_once_started(tiny_disk, tmp_path / "tiny" / "trials" / "0" / "server.log")
    done = sweep(path, env, "--storage", storage)
    filler.join(timeout=10)
    assert (tmp_path / "tiny" / "trials" / "0" / "result.json").is_file()  # the trial itself ran and wrote
    assert_one_line_and_nothing_running(done, storage, env, str(tiny_disk / "tiny.db"))


def test_a_server_that_dies_for_want_of_room_for_its_log_is_a_write_error_not_bad_args(tiny_disk, tmp_path):
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    path = write_tiny_study(tiny_disk, name="tiny", trials=3)  # trial folders on the tiny disk ...
    storage = f"sqlite:///{tmp_path / 'tiny.db'}"  # ... the database elsewhere, with room
    filler = fill_once_started(tiny_disk, tiny_disk / "tiny" / "trials" / "0")
    done = sweep(path, env, "--storage", storage)
    filler.join(timeout=10)
    failed = assert_one_line_and_nothing_running(done, storage, env, str(tiny_disk / "tiny" / "trials" / "0"))
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert failed.number == 0 and not [t for t in study.trials if t.user_attrs.get("status") == "bad_args"]


def test_a_disk_without_room_for_one_trial_stops_before_any_trial_runs(tiny_disk, tmp_path):
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    path = write_tiny_study(tiny_disk, name="tiny", trials=2)
    with open(tiny_disk / "filler", "wb") as fh:  # leave ~700 KiB: the database fits, a first trial does not
        fh.write(b"\0" * (free_bytes(tiny_disk) - 700 * 1024))
    done = sweep(path, env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "has only" in errors[0] and "trials folder" in errors[0], done.stderr
    assert "warning: the trials folder" in done.stdout  # said before the search, with the estimate
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tiny_disk / 'tiny.db'}")
    assert {t.state for t in study.trials} <= {TrialState.WAITING}  # queued, never RUNNING


# --- the pieces, with failures injected ------------------------------------------------------------------------
def test_disk_errors_are_recognised_through_the_layers_that_wrap_them(tmp_path):
    err = disk_error(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.jsonl")))
    assert isinstance(err, DiskError) and err.path == str(tmp_path / "x.jsonl") and err.free_bytes is not None
    assert "No space left on device" in str(err) and "free there" in str(err)
    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as inner:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit") from inner
    except optuna.exceptions.StorageInternalError as wrapped:
        db = disk_error(wrapped, db_path=tmp_path / "s.db")
    assert db is not None and db.path == str(tmp_path / "s.db") and "database" in str(db)
    assert disk_error(RuntimeError("boom")) is None
    assert disk_error(OSError(errno.ENOENT, "missing")) is None


def test_ballast_is_real_blocks_given_back_once_and_a_dead_sweeps_is_removed(tmp_path):
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=10)
    stale = tmp_path / f".s.db.{done.pid}.reserve"  # left by a SIGKILLed sweep
    stale.write_bytes(b"\0" * 1024)
    live = tmp_path / f".s.db.{os.getppid()}.reserve"  # another live worker's: kept
    live.write_bytes(b"\0" * 1024)
    ballast = Ballast(tmp_path / "s.db", size=64 * 1024)
    assert ballast.place() and ballast.path.stat().st_size == 64 * 1024
    assert not stale.exists() and live.exists()
    assert ballast.release() and not ballast.path.exists() and not ballast.release()
    assert not Ballast(None).place()  # a database server: nothing beside it


def test_room_warns_from_measured_trial_folders_and_stops_under_the_floor(tmp_path, monkeypatch):
    trials = tmp_path / "trials"
    for n, size in ((0, 300_000), (1, 500_000), (2, 400_000)):
        (trials / str(n)).mkdir(parents=True)
        (trials / str(n) / "result.json").write_text('{"status": "ok"}')
        (trials / str(n) / "records.jsonl").write_bytes(b"x" * size)
    (trials / "3").mkdir()  # a failed trial writes little: not what a trial writes
    (trials / "3" / "result.json").write_text('{"status": "bad_args"}')
    room = Room(trials, tmp_path / "s.db")
    monkeypatch.setattr(diskguard, "free_bytes", lambda path: 1_000_000)
    line = room.warning(5)
    assert line is not None and "measured on 3 finished trial folder(s)" in line and "390.6 KiB" in line
    assert room.warning(2) is None
    room.check()  # 1 MB free holds one more 400 KB trial
    monkeypatch.setattr(diskguard, "free_bytes", lambda path: 300_000 if path == trials else 10**9)
    with pytest.raises(DiskError, match="trials folder") as info:
        room.check()
    assert info.value.free_bytes == 300_000 and info.value.path == str(trials)


class WritesFail(PlannerRunner):
    """The trial harness's contract: a trial file that cannot be written raises DiskError out of the trial."""

    def __call__(self, config, number):
        if number == 1:
            raise DiskError(
                "cannot write trials/1/records.jsonl: No space left on device; 10 bytes free there",
                path="trials/1/records.jsonl",
                free_bytes=10,
            )
        return super().__call__(config, number)


def test_a_trial_write_error_is_a_failed_trial_queued_again_and_the_sweep_stops(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=4))
    with pytest.raises(DiskError, match="records.jsonl"):
        run_study(cfg, runner=WritesFail())
    study = optuna.load_study(study_name="t", storage=cfg.storage_url)
    failed = study.trials[1]
    assert failed.state == TrialState.FAIL and failed.user_attrs["status"] == "write_error"
    assert failed.user_attrs["result"]["reason"].startswith("cannot write trials/1/records.jsonl")
    assert [t.user_attrs.get("requeued_from") for t in study.trials if t.state == TrialState.WAITING] == [1]
    study = run_study(cfg, runner=PlannerRunner())  # room again: resumes, the failed write does not count
    done = launched(study.trials)
    assert len(done) == 4 and any(t.user_attrs.get("requeued_from") == 1 for t in done)


def test_a_study_created_on_a_full_disk_is_a_disk_error_naming_the_database(tiny_disk, tmp_path):
    fill(tiny_disk)
    cfg = load_config(write_study(tmp_path, trials=2), storage=f"sqlite:///{tiny_disk / 't.db'}")
    with pytest.raises(DiskError, match="t.db") as info:
        open_study(cfg)
    assert info.value.free_bytes is not None and info.value.free_bytes < 64 * 1024
