"""How every command finds its study: ``--config FILE``, else ``--study`` with ``--storage``, else the quick
start's ``studies/example.toml`` — so ``sweep``, ``trials``, ``report`` and ``apply`` need the same arguments."""

from __future__ import annotations

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
    raise ConfigError("no study file given and studies/example.toml not found", file=str(DEFAULT_STUDY),
                      fix="pass --config FILE.toml")


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
