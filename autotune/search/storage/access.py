"""Where a study lives: storage URL → Optuna storage, and the trials behind Optuna's public API.

Every use of Optuna's private storage API is here; who still works on a trial is ``liveness``.

URLs: ``sqlite:///file.db``, ``postgresql+psycopg2://user:pw@host/db``, ``mysql+pymysql://…``, and
``journal:///abs/path.log`` or ``journal:relative.log`` (Optuna's JournalStorage on a file).
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial

from autotune.errors import StorageError, StudyError
from autotune.redaction import redact_text
from autotune.redaction import redact_url as redact
from autotune.search.storage.diskguard import disk_error

HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 10  # one write per worker per interval: cheap, and a dead node is noticed in ~30 s
GRACE_FACTOR = 3  # a worker may miss two beats (a busy node, a slow database) before its trial counts as dead
RETRY_KEEP = ("role", "label", "config")  # what a retried trial inherits: the config, not the dead run's record
SQL_SCHEMES = ("postgresql", "mysql", "mariadb", "oracle", "mssql")
_FIXES = {
    "sqlite": "check that the directory exists and is writable",
    "rdb": "check host, port, user and database name, and that the server accepts connections from this machine",
    "journal": "check that the directory exists and is writable",
}


# --- URLs ---------------------------------------------------------------------------------------------------
def kind(url: str) -> str:
    """``sqlite``, ``rdb`` (a database server) or ``journal``; anything else is a StorageError with a fix."""
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite" and url.startswith("sqlite:///"):
        return "sqlite"
    if scheme == "journal" and url[len("journal:") :].strip("/"):
        return "journal"
    if scheme in SQL_SCHEMES and "://" in url:
        return "rdb"
    fix = (
        "write postgresql+psycopg2://user:password@host:5432/db"
        if scheme == "postgres"
        else "use sqlite:///file.db, postgresql+psycopg2://user:password@host/db, mysql+pymysql://…, "
        "or journal:///path/to/study.log"
    )
    raise StorageError(f"cannot read storage URL {redact(url)!r} ({fix})")


def journal_path(url: str, base_dir: Path | None = None) -> Path:
    """``journal:///abs/x.log`` → ``/abs/x.log``; ``journal:x.log`` resolves against ``base_dir`` (default cwd)."""
    rest = url[len("journal:") :]
    path = Path("/" + rest.lstrip("/")) if rest.startswith("///") else Path(rest.removeprefix("//"))
    return path if path.is_absolute() else (base_dir or Path.cwd()) / path


def storage_file(url: str, base_dir: Path | None = None) -> Path | None:
    """The file a file-backed storage lives in (SQLite, journal); None for a database server."""
    what = kind(url)
    if what == "sqlite":
        path = url.removeprefix("sqlite:///")
        return None if path in ("", ":memory:") else Path(path)
    if what == "journal":
        return journal_path(url, base_dir)
    return None


def heartbeat_s() -> int:
    """The heartbeat interval in whole seconds (Optuna's unit): ``$AUTOTUNE_HEARTBEAT_S`` or 10."""
    raw = os.environ.get(HEARTBEAT_ENV, "")
    if not raw:
        return DEFAULT_HEARTBEAT_S
    if not raw.isdigit() or int(raw) < 1:
        raise StorageError(f"{HEARTBEAT_ENV}={raw!r} is not a whole number of seconds ≥ 1 (unset it or fix it)")
    return int(raw)


def grace_s(interval: int | None = None) -> int:
    return GRACE_FACTOR * (interval or heartbeat_s())


# --- opening -----------------------------------------------------------------------------------------------
class RetryOnce:
    """Optuna's ``RetryHeartbeatStaleTrialCallback(max_retry=1)``, keeping only the config and adding
    ``requeued_from``: the retry is the sweep's usual requeue, and a retry that dies too is not retried again."""

    def __init__(self) -> None:
        retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
        self._retry = retry(max_retry=1) if retry else optuna.storages.RetryFailedTrialCallback(max_retry=1)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.user_attrs.get("requeued_from") is not None:
            return  # already the second run of this config
        clean = copy.deepcopy(trial)
        clean.user_attrs = {
            **{k: trial.user_attrs[k] for k in RETRY_KEEP if k in trial.user_attrs},
            "requeued_from": trial.number,
        }
        self._retry(study, clean)


def _engine_kwargs(url: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}  # workers queue on SQLite's file lock instead of failing
    kwargs: dict[str, Any] = {"pool_pre_ping": True}  # a database restart or idle timeout is survived
    if url.startswith(("postgresql", "mysql", "mariadb")):
        kwargs["connect_args"] = {"connect_timeout": 10}  # an unreachable host fails in seconds, not minutes
    return kwargs


def _first_line(exc: BaseException, url: str) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\([\w.]+\)\s*", "", text)  # SQLAlchemy's "(psycopg2.OperationalError) " prefix
    return redact_text(text, url)


def open_storage(url: str, *, heartbeat: int | None = None, base_dir: Path | None = None) -> BaseStorage:
    """An Optuna storage for ``url``, connected and checked: any failure is one StorageError line naming
    the redacted URL and the fix. SQL storages get Optuna's heartbeat (``heartbeat`` s, default
    ``$AUTOTUNE_HEARTBEAT_S``) and retry a trial whose worker died once."""
    what = kind(url)
    interval = heartbeat or heartbeat_s()
    try:
        if what == "journal":
            path = journal_path(url, base_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path)))
        if what == "sqlite":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        quiet_ask()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(
                url,
                engine_kwargs=_engine_kwargs(url),
                heartbeat_interval=interval,
                grace_period=grace_s(interval),
                heartbeat_stale_trial_callback=RetryOnce(),
            )
    except StorageError:
        raise
    except ImportError:
        driver = url.split("://", 1)[0].partition("+")[2] or "psycopg2-binary"
        raise StorageError(
            f"no database driver for {redact(url)} (pip install {driver}; for PostgreSQL "
            "pip install psycopg2-binary and write postgresql+psycopg2://...)"
        ) from None
    except Exception as exc:  # SQLAlchemy's errors for malformed or unreachable URLs, OSError for files
        if type(exc).__name__ == "NoSuchModuleError":  # SQLAlchemy knows no such dialect+driver
            raise StorageError(
                f"unknown database driver in {redact(url)} (write postgresql+psycopg2://... or mysql+pymysql://...)"
            ) from None
        full = disk_error(exc, db_path=storage_file(url, base_dir))  # a full disk says so, with its free space
        if full is not None:
            raise full from None
        if isinstance(exc, OSError) or type(exc).__module__.startswith(("sqlalchemy", "optuna", "psycopg2")):
            raise StorageError(f"cannot open storage {redact(url)}: {_first_line(exc, url)} ({_FIXES[what]})") from None
        raise


def check_storage(url: str, *, base_dir: Path | None = None) -> None:
    """Open and release ``url``: the check to run before any server starts."""
    storage = open_storage(url, base_dir=base_dir)
    close_storage(storage)


def close_storage(storage: BaseStorage) -> None:
    if isinstance(storage, RDBStorage):
        storage.engine.dispose()


def load_study(
    url: str,
    name: str | None = None,
    *,
    base_dir: Path | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
) -> optuna.Study:
    """An existing study on any storage (SQLite, journal, a database server), never created: a typo must not
    leave an empty database behind. ``name`` None: the storage's only study. Every failure is one line."""
    if kind(url) == "sqlite":
        path = url.removeprefix("sqlite:///")
        if path != ":memory:" and not Path(path).is_file():
            raise StorageError(f"no study storage at {path} (run `autotune sweep` first, or pass --storage URL)")
    names = study_names(url, base_dir=base_dir)
    shown = redact(url)
    if name is None:
        if not names:
            raise StudyError(f"storage {shown} holds no study; run `autotune sweep` first")
        if len(names) > 1:
            raise StudyError(
                f"storage {shown} holds {len(names)} studies; pick one with --study ({', '.join(sorted(names))})"
            )
        name = names[0]
    if name not in names:
        raise StudyError(
            f"no study named {name!r} in {shown} (studies there: {', '.join(sorted(names)) or 'none'}); "
            "run `autotune sweep` first or pass --study NAME"
        )
    try:
        return optuna.load_study(study_name=name, storage=open_storage(url, base_dir=base_dir), sampler=sampler)
    except Exception as exc:
        raise storage_error(exc, url) from None


def study_names(url: str, *, base_dir: Path | None = None) -> list[str]:
    """The names of the studies ``url`` holds (journal files and database URLs alike)."""
    try:
        return optuna.get_all_study_names(storage=open_storage(url, base_dir=base_dir))
    except StorageError:
        raise
    except Exception as exc:
        raise storage_error(exc, url) from None


def storage_error(exc: Exception, url: str) -> Exception:
    """A driver's or Optuna's error while reading a study, as one redacted StorageError line (others as they are)."""
    if isinstance(exc, (StorageError, StudyError)):
        return exc
    if isinstance(exc, OSError) or type(exc).__module__.startswith(("sqlalchemy", "optuna", "psycopg2")):
        return StorageError(f"cannot open storage {redact(url)}: {_first_line(exc, url)}")
    return exc


# --- the trials behind Optuna's public API ------------------------------------------------------------------
def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """The storage's id of a trial (Optuna's public API gives only its number)."""
    return trial._trial_id


def trial_handle(study: optuna.Study, trial_id: int) -> optuna.Trial:
    """A writable handle on a stored trial (by storage id), for a trial this process did not ask."""
    return optuna.Trial(study, trial_id)


def storage_of(study: optuna.Study) -> BaseStorage:
    return study._storage


def quiet_ask() -> None:
    """Silence Optuna's warning that heartbeats need ``optimize``: the sweep's ask/tell loop beats itself
    (``Liveness``). Installed when a heartbeat storage opens, so it holds in any warnings context then active."""
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used", category=UserWarning)
