"""How every command finds its study and its fleet, so a fresh clone's commands need no more arguments.

The study: ``--config FILE``, else ``--study`` with ``--storage``, else the quick start's ``studies/example.toml``
(``sweep``, ``trials``, ``report``, ``apply``). The fleet: ``--fleet FILE``, else the ``fleet.toml`` the last
``autotune apply`` of the default study wrote (recorded in that study's folder), else ``./fleet.toml``
(``fleet up|status|down``, ``watch``, ``apply --rolling``)."""

from __future__ import annotations

import datetime as dt
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from autotune.config import load_config
from autotune.errors import ConfigError

DEFAULT_STUDY = Path("studies") / "example.toml"


def resolve_config(path: Path | None) -> Path:
    """The given file, else ``studies/example.toml`` in the working directory, else beside the package."""
    if path is not None:
        return path
    here = Path.cwd() / DEFAULT_STUDY
    if here.is_file():
        return here
    packaged = Path(__file__).resolve().parents[2] / DEFAULT_STUDY  # beside the package: autotune/config/..
    if packaged.is_file():
        return packaged
    raise ConfigError(
        "no study file given and studies/example.toml not found", file=str(DEFAULT_STUDY), fix="pass --config FILE.toml"
    )


def study_file(config: Path | None, study: str | None, storage: str | None) -> Path | None:
    """The study file a command reads: ``config``; the default one when neither ``study`` nor ``storage`` names
    a study another way; None when they do (the command then opens ``study`` in ``storage``)."""
    if config is not None:
        return config
    if study is None and storage is None:
        return resolve_config(None)
    return None


def locate(config: Path | None, study: str | None, storage: str | None) -> tuple[str | None, str | None, Path | None]:
    """(study name, storage URL, the directory a relative journal path resolves against), the way every command
    reads them: the study file (``study_file``), else ``--study`` in ``--storage`` or in ``studies/<name>.db``."""
    path = study_file(config, study, storage)
    if path is not None:
        cfg = load_config(path, name=study, storage=storage)
        return cfg.name, cfg.storage_url, cfg.base_dir
    if study and not storage:
        storage = f"sqlite:///studies/{study}.db"
    return study, storage, None


# -- the fleet ---------------------------------------------------------------------------------------------
LAST_APPLY = "last-apply.json"  # in the study's folder (``StudyConfig.work_dir``): the fleet apply last wrote
HERE_FLEET = Path("fleet.toml")


@dataclass(frozen=True)
class FleetRef:
    """The fleet file a command reads and why that one (``said``: one line for the user when it was not named)."""

    path: Path
    said: str | None = None


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (as the user would type it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _work_dir(study: Path) -> Path | None:
    """The study's folder (``<toml dir>/<name>/``) read from the file alone: a fleet command never fails on a
    study file it does not need."""
    try:
        raw = tomllib.loads(study.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    section = raw.get("study")
    name = section.get("name") if isinstance(section, dict) else None
    return study.parent / str(name or study.stem)


def record_apply(study: Path, fleet: Path, *, trial: int | None = None) -> Path | None:
    """Note in ``study``'s folder that ``fleet`` is the fleet apply wrote for it (relative to the folder, so a
    moved checkout still finds it); None when the study's folder cannot be named."""
    work = _work_dir(study)
    if work is None:
        return None
    work.mkdir(parents=True, exist_ok=True)
    note = {
        "fleet": os.path.relpath(fleet.resolve(), work.resolve()),
        "trial": trial,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    path = work / LAST_APPLY
    path.write_text(json.dumps(note, indent=2) + "\n")
    return path


def _last_applied(study: Path) -> Path | None:
    """The fleet file the last apply of ``study`` wrote, as recorded (it may since have been removed)."""
    work = _work_dir(study)
    if work is None or not (work / LAST_APPLY).is_file():
        return None
    try:
        fleet = json.loads((work / LAST_APPLY).read_text()).get("fleet")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(os.path.normpath(work / fleet)) if isinstance(fleet, str) and fleet else None


def locate_fleet(given: Path | None) -> FleetRef:
    """``given``; else the fleet the default study's last apply wrote; else ``./fleet.toml``. The working
    directory's own come first: a default study found only beside the package (no ``studies/example.toml`` here)
    is read after ``./fleet.toml``, so a fleet directory's file wins there. None of them: one ConfigError naming
    where it looked and the fix."""
    if given is not None:
        return FleetRef(given)
    try:
        study: Path | None = resolve_config(None)
    except ConfigError:
        study = None
    here = Path.cwd() / HERE_FLEET
    # (file, where it is, why it was used); the default study's own before ./fleet.toml when it lies here
    places: list[tuple[Path | None, str, str]] = [(here, f"./{HERE_FLEET}", "the working directory's")]
    if study is not None:
        last = (
            _last_applied(study),
            f"the last apply of {_shown(study)}",
            f"the last autotune apply of {_shown(study)}",
        )
        places.insert(0 if study.parent.parent.resolve() == Path.cwd().resolve() else 1, last)
    looked = []
    for path, where, why in places:
        if path is not None and path.is_file():
            return FleetRef(path, f"fleet: {_shown(path)} ({why})")
        if path is not None:
            looked.append(where if path == here else f"{_shown(path)} ({where})")
    raise ConfigError(
        f"no fleet file: looked for {' and '.join(looked)}",
        key="--fleet",
        fix="run `autotune apply --out DIR --gpus 0-1` first, or pass --fleet FILE",
    )
