"""Which folder a study's trials are written to: the study's own, by its identity (a uuid in the study and in the
folder's ``study.json``), never by what is on disk. docs/search.md ("Nothing poisons a study"), docs/contracts.md.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, cast

import optuna

from autotune.config import StudyConfig
from autotune.redaction import redact_url
from autotune.results import TrialResult
from autotune.search.storage.liveness import flocked

IDENTITY_ATTR = "files"  # study user attr: an Identity
MARKER = "study.json"
DEFAULT = "trials"


class Identity(TypedDict):
    """A study's identity: JSON stored as ``user_attrs["files"]`` and in its trials folder's ``study.json``, with
    these keys (studies and folders marked before read the same)."""

    id: str
    study: str
    study_id: int | None
    storage: str  # redacted
    storage_tag: str  # ``storage_tag`` of the unredacted URL: equal storages, equal tags
    created: str


def storage_tag(url: str) -> str:
    """A short tag for a storage URL (the study lock's, ``search.study``): equal URLs, equal tags."""
    return hashlib.sha1(url.encode()).hexdigest()[:10]


def identity(study: optuna.Study, cfg: StudyConfig) -> Identity:
    """The study's identity record, created once (callers hold the node's lock, so workers agree)."""
    stored = study.user_attrs.get(IDENTITY_ATTR)
    if isinstance(stored, dict) and stored.get("id"):
        return cast(Identity, stored)
    record = Identity(
        id=uuid.uuid4().hex[:12],
        study=study.study_name,
        study_id=getattr(study, "_study_id", None),
        storage=redact_url(cfg.storage_url),
        storage_tag=storage_tag(cfg.storage_url),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    study.set_user_attr(IDENTITY_ATTR, record)
    return cast(Identity, study.user_attrs.get(IDENTITY_ATTR) or record)


def read_marker(folder: Path) -> Identity | None:
    """The identity a trials folder is marked with, as ``_claim`` wrote it (None: unmarked or unreadable)."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return cast(Identity, data) if isinstance(data, dict) else None


def _claim(folder: Path, ident: Identity) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(json.dumps(ident, indent=2) + "\n")
    return folder


def _empty(folder: Path) -> bool:
    return not folder.exists() or (folder.is_dir() and not any(p.name != MARKER for p in folder.iterdir()))


def _holds_our_trials(study: optuna.Study, folder: Path) -> bool:
    """Whether the study's stored results point into ``folder`` (a study from before identities, resumed)."""
    root = folder.resolve()
    for t in study.get_trials(deepcopy=False):
        result = TrialResult.of(t)
        where = result.trial_dir if result is not None else None
        if where and root in Path(where).resolve().parents:
            return True
    return False


def study_folder(cfg: StudyConfig, study: optuna.Study, *, log: Callable[[str], None] | None = None) -> Path:
    """The study's trials folder (created and marked): see the module docstring for the rules."""
    with flocked(cfg.work_dir / "trials.lock"):  # one process of this node at a time choosing (and claiming) it
        ident = identity(study, cfg)
        default, own = cfg.work_dir / DEFAULT, cfg.work_dir / f"{DEFAULT}-{ident['id']}"
        mine = read_marker(own)
        if mine is not None and mine.get("id") == ident["id"]:
            return own
        marker = read_marker(default)
        if marker is not None and marker.get("id") == ident["id"]:
            return default
        if _empty(default) or (marker is None and _holds_our_trials(study, default)):
            return _claim(default, ident)
        if marker is not None and marker.get("storage_tag") == ident["storage_tag"]:
            # This storage holds one study of this name, and it is not the folder's: that study is gone.
            aside = cfg.work_dir / f"{DEFAULT}.old-{time.strftime('%Y%m%d-%H%M%S')}"
            while aside.exists():
                aside = aside.with_name(aside.name + "-1")
            default.rename(aside)
            if log is not None:
                log(
                    f"moved {default} aside to {aside.name}: it belongs to study {marker.get('id')}, "
                    f"no longer in {ident['storage']}"
                )
            return _claim(default, ident)
        if log is not None:
            whose = f"study {marker.get('id')} in {marker.get('storage')}" if marker else "an earlier study"
            log(f"{default} belongs to {whose}; this study writes {own.name}")
        return _claim(own, ident)


def fresh(path: Path) -> Path:
    """``path``, or its first free sibling ``<name>.2``, ``<name>.3`` …: a run never writes into another's folder."""
    if not path.exists():
        return path
    j = 2
    while path.with_name(f"{path.name}.{j}").exists():
        j += 1
    return path.with_name(f"{path.name}.{j}")
