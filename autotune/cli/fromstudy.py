"""``autotune sweep --from STUDY``: open the earlier study and write the new study's warm-start record.

STUDY is named as the other commands name a study: a study file (``FILE.toml``: its ``[study]`` name and storage),
a storage URL holding one study, or a study name (``studies/NAME.db``, as ``--study`` alone). Everything here runs
before the first launch; each failure is one ``ConfigError`` naming ``--from`` and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna

from autotune.config import StudyConfig
from autotune.config.studyref import locate
from autotune.errors import ConfigError, StudyError
from autotune.harness.engines.base import InstalledSGLang
from autotune.search.objective import open_study
from autotune.search.runner import study_engine
from autotune.search.storage import load_study
from autotune.search.views.origin import OPTION, origin_line, warm_record
from autotune.search.warm import WARM_KEY, record_of
from autotune.sglang.flags import BUNDLED_VERSION, FlagTable

FIX = "pass --from FILE.toml (the earlier study's file), --from NAME (studies/NAME.db) or --from STORAGE_URL"


def open_source(ref: str) -> tuple[optuna.Study, str]:
    """(the earlier study, its storage URL), never created: a typo must not leave an empty database behind."""
    name: str | None
    storage: str | None
    try:
        if "://" in ref:
            name, storage, base = None, ref, None
        elif ref.endswith(".toml"):
            if not Path(ref).is_file():
                raise ConfigError(f"no study file {ref}", key=OPTION, fix=FIX)
            name, storage, base = locate(Path(ref), None, None)
        else:
            name, storage, base = locate(None, ref, None)
        assert storage is not None
        return load_study(storage, name, base_dir=base), storage
    except StudyError as exc:  # no such storage or study, or several studies in one storage
        raise ConfigError(str(exc), key=OPTION, fix=FIX) from None


def _installed(cfg: StudyConfig) -> tuple[FlagTable, str]:
    """The flag table and version of the SGLang this study launches (the simulator: 0.5.23's, simulated)."""
    engine = study_engine(cfg)
    installed = engine if isinstance(engine, InstalledSGLang) else None  # optional: the sglang engine's
    table = installed.flag_table() if installed is not None else FlagTable.bundled()
    version = installed.sglang_version() if installed is not None else None
    return table, str(version or f"{table.version or BUNDLED_VERSION} (simulated)")


def start_from(cfg: StudyConfig, ref: str, echo: Callable[[str], None]) -> None:
    """Record in ``cfg``'s study where it starts from (a resumed study keeps its record); print what was carried."""
    source, storage = open_source(ref)
    if source.study_name == cfg.name and Path(str(storage)) == Path(cfg.storage_url):
        raise ConfigError(
            f"study {cfg.name!r} cannot start from itself",
            key=OPTION,
            fix="give the new study its own --study NAME (or run without --from to resume it)",
        )
    table, version = _installed(cfg)
    record, lines = warm_record(source, storage, cfg, table=table, version=version)
    study = open_study(cfg)
    earlier = record_of(study)
    if earlier is not None and earlier.get("study") == record["study"]:
        echo(f"resuming: {origin_line(earlier)}")
        return
    if earlier is not None or study.get_trials(deepcopy=False):
        raise ConfigError(
            f"study {cfg.name!r} has already started"
            + (f" from study {earlier['study']}" if earlier else " without --from"),
            key=OPTION,
            fix="give the re-tune a new study: add --study NEW_NAME",
        )
    study.set_user_attr(WARM_KEY, record)
    study.set_user_attr("sglang_version", version)  # what a later --from of this study reads
    for line in lines:
        echo(line)
