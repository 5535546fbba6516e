"""Who is still working on a study: each worker tags the trial it runs and keeps a heartbeat (Optuna's on SQL
storages, a file and a trial attribute on the journal), so a dead worker's trial is failed and retried once and a
live one's never touched. docs/study-file.md ("Several GPUs").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import optuna
import psutil
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.search.storage.access import grace_s, heartbeat_s, storage_of, trial_id


# --- who runs a trial --------------------------------------------------------------------------------------
def _started(pid: int) -> float | None:
    """The process's start time; None when it is gone or a zombie (dead, only not yet reaped)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


@dataclass(frozen=True, kw_only=True)
class WorkerTag:
    """The process that runs a trial, stored as ``user_attrs["worker"]``."""

    host: str
    pid: int
    started: float | None
    gpu: int | str | None  # the GPU index, or a group's label ("0,1"; a shared pool's worker "0,1,2,3/worker1")

    @classmethod
    def current(cls, gpu: int | str | None) -> WorkerTag:
        return cls(host=socket.gethostname(), pid=os.getpid(), started=_started(os.getpid()), gpu=gpu)

    @classmethod
    def of(cls, trial: FrozenTrial) -> WorkerTag | None:
        data = trial.user_attrs.get("worker")
        return cls(**data) if isinstance(data, dict) else None

    @property
    def label(self) -> str:
        """The GPU as reports name it: ``host:index``."""
        return f"{self.host}:{self.gpu}"

    @property
    def beat_name(self) -> str:
        return f"{self.host}-{self.pid}.beat"

    def local_alive(self) -> bool | None:
        """True/False for a worker on this host (pid + start time); None for another host's."""
        if self.host != socket.gethostname():
            return None
        started = _started(self.pid)
        return started is not None and (self.started is None or abs(started - self.started) < 1.0)


class Liveness:
    """This worker's claim on its running trial: the tag, Optuna's heartbeat on SQL storages, and a heartbeat
    file in ``state_dir`` that other workers read for storages without one. A daemon thread, so a crash
    between ask and tell never keeps the process alive."""

    def __init__(self, study: optuna.Study, *, gpu: int | str | None, state_dir: Path, interval: int | None = None):
        self.study, self.tag = study, WorkerTag.current(gpu)
        self.interval = interval or heartbeat_s()
        self.beat_file = Path(state_dir) / self.tag.beat_name
        self.beat_file.parent.mkdir(parents=True, exist_ok=True)
        self._trial_id: int | None = None
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="autotune-heartbeat", daemon=True)
        self._thread.start()

    def claim(self, trial: optuna.Trial) -> None:
        """Tag ``trial`` as ours and start beating for it."""
        trial.set_user_attr("worker", asdict(self.tag))
        trial.set_user_attr("gpu", self.tag.label)
        self._trial_id = trial_id(trial)
        self._beat()

    def release(self) -> None:
        self._trial_id = None

    def _beat(self) -> None:
        now = time.time()
        self.beat_file.write_text(json.dumps({**asdict(self.tag), "at": now}))
        running, storage = self._trial_id, storage_of(self.study)
        if running is None:
            return
        if _heartbeat_on(storage):
            storage.record_heartbeat(running)  # type: ignore[attr-defined]
        else:  # no heartbeat in the storage (journal): the beat travels with the trial, to any host
            storage.set_trial_user_attr(running, "beat_at", now)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a missed beat is survivable; a dead thread is not
                self._beat()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.beat_file.unlink(missing_ok=True)


def _heartbeat_on(storage: BaseStorage) -> bool:
    """Optuna's heartbeat is on (``create_study`` wraps the RDBStorage in a cache that forwards it)."""
    get = getattr(storage, "get_heartbeat_interval", None)
    return get is not None and get() is not None


def _on_one_host(storage: BaseStorage) -> bool:
    backend = getattr(storage, "_backend", storage)
    return isinstance(backend, RDBStorage) and backend.url.startswith("sqlite")


def _age_s(trial: FrozenTrial) -> float:
    start = trial.datetime_start
    return (datetime.now() - start).total_seconds() if start else float("inf")


def is_dead(trial: FrozenTrial, storage: BaseStorage, state_dir: Path | None) -> bool:
    """Whether a RUNNING trial's worker is gone (see the module docstring for the rules)."""
    tag = WorkerTag.of(trial)
    grace = grace_s()
    if tag is None:
        # Asked but not yet tagged (a few ms), or left by an older sweep. SQLite lives on one host, where the
        # ask and this check share a lock: dead at once. Elsewhere: once a heartbeat interval old.
        return _on_one_host(storage) or _age_s(trial) > heartbeat_s()
    alive = tag.local_alive()
    if alive is not None:
        return not alive
    if _heartbeat_on(storage):
        return False  # another host's worker on a SQL storage: Optuna's heartbeat decides (fail_stale_trials)
    beats = [trial.user_attrs.get("beat_at")]
    if state_dir is not None:
        with contextlib.suppress(FileNotFoundError):
            beats.append((state_dir / tag.beat_name).stat().st_mtime)
    last = max((b for b in beats if b is not None), default=None)
    return _age_s(trial) > grace if last is None else time.time() - last > grace


def dead_running(study: optuna.Study, state_dir: Path | None = None) -> list[FrozenTrial]:
    """RUNNING trials whose worker is gone by the rules above (for the sweep to mark interrupted and requeue).
    Another host's worker on a SQL storage is Optuna's heartbeat's to judge: see ``fail_stale``."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return [t for t in running if is_dead(t, storage_of(study), state_dir)]


def fail_stale(study: optuna.Study) -> None:
    """Optuna's heartbeat check on SQL storages: fail trials silent past the grace period and retry each once
    (``RetryOnce``). Run after the sweep's own recovery, which records more about trials it can judge."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """One process of this node at a time in the block: an exclusive ``flock`` on ``path`` (created, with its
    folder, when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def node_lock(state_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Serialise ask-and-tag against the dead-trial check among this node's workers: an untagged trial
    seen by the check is then always a dead one."""
    return flocked(state_dir / "ask.lock")
