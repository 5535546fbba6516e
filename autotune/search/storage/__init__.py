"""Where a study lives and who is still working on it: ``access`` (storage URL → Optuna storage, loading a
study, every use of Optuna's private storage API), ``liveness`` (worker tags, heartbeats, dead trials) and
``diskguard`` (a full disk as one line, the ballast that leaves room to record it)."""

from autotune.redaction import redact_url as redact  # the URL as every storage message shows it
from autotune.search.storage.access import (
    HEARTBEAT_ENV,
    RetryOnce,
    check_storage,
    close_storage,
    grace_s,
    heartbeat_s,
    journal_path,
    kind,
    load_study,
    open_storage,
    quiet_ask,
    storage_error,
    storage_file,
    storage_of,
    study_names,
    trial_handle,
    trial_id,
)
from autotune.search.storage.liveness import Liveness, WorkerTag, dead_running, fail_stale, is_dead, node_lock

__all__ = [
    "HEARTBEAT_ENV",
    "Liveness",
    "RetryOnce",
    "WorkerTag",
    "check_storage",
    "close_storage",
    "dead_running",
    "fail_stale",
    "grace_s",
    "heartbeat_s",
    "is_dead",
    "journal_path",
    "kind",
    "load_study",
    "node_lock",
    "open_storage",
    "quiet_ask",
    "redact",
    "storage_error",
    "storage_file",
    "storage_of",
    "study_names",
    "trial_handle",
    "trial_id",
]
