"""A study file (TOML) → a frozen, validated ``StudyConfig``: everything a sweep could trip on later is one
``ConfigError`` naming the file, the dotted key and the fix, before any server starts. The sections' own models
are in ``config.sections``; this module runs the checks that need the whole file. docs/study-file.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import Field, ValidationError

from autotune.config.context import context_limit
from autotune.config.pool import check_pool
from autotune.config.sections import (
    UNSET,
    BaselineSection,
    EngineSection,
    Enqueued,
    JobSection,
    LauncherSection,
    ObjectiveSection,
    ParamSpec,
    StrictModel,
    StudySection,
    WorkloadSection,
)
from autotune.errors import ConfigError, WorkloadError
from autotune.prompts import PromptSample
from autotune.sglang.envs import ENV_PREFIX
from autotune.sglang.flags import FlagTable
from autotune.sglang.profiles import load_gpu, load_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeouts:
    """A trial's time limits (``engine.timeouts`` in the study file; ``autotune measure --startup-timeout``)."""

    startup_s: float = 900.0
    teardown_s: float = 60.0
    grace_s: float = 10.0
    request_s: float = 600.0


class Given(NamedTuple):
    """A config the study file names, as launched: its role (``baseline`` or ``enqueued``), label and flags."""

    role: str
    label: str
    config: dict[str, Any]


class StudyConfig(StrictModel):
    study: StudySection = StudySection()
    engine: EngineSection = EngineSection()
    space: dict[str, ParamSpec] = {}
    derived: dict[str, str] = {}  # [space.derived]: flag = expression over other flags
    workload: WorkloadSection = WorkloadSection()
    objective: ObjectiveSection = ObjectiveSection()
    baseline: BaselineSection = BaselineSection()
    enqueue: list[Enqueued] = []
    launcher: LauncherSection = LauncherSection()  # [launcher.slurm], [launcher.container]
    job: JobSection | None = None  # [job]: results also read as the job's hours, GPU-hours and cost
    # Filled by load_config, not read from the file.
    path: Path | None = None
    notes: tuple[str, ...] = Field((), exclude=True)  # warnings for the user (a prompt file short of sample_size)

    @property
    def name(self) -> str:
        assert self.study.name
        return self.study.name

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    @property
    def work_dir(self) -> Path:
        """``<toml dir>/<name>/``: trial directories, confirmation runs and the server run dir."""
        return self.base_dir / self.name

    @property
    def storage_url(self) -> str:
        assert self.study.storage
        return self.study.storage

    def to_dict(self) -> dict[str, Any]:
        """The JSON stored as ``study.user_attrs["autotune"]``."""
        data = self.model_dump(mode="json", by_alias=True)
        data["path"] = str(self.path) if self.path else None
        return data

    def baseline_config(self) -> dict[str, Any]:
        """The baseline as launched: the fixed flags, then the baseline's own."""
        return {**self.engine.fixed, **self.baseline.flags}

    def given(self) -> list[Given]:
        """The configs the study file names, as launched (fixed flags first): the baseline, then each enqueued
        config in order."""
        return [
            Given("baseline", self.baseline.label, self.baseline_config()),
            *(Given("enqueued", e.label, {**self.engine.fixed, **e.flags}) for e in self.enqueue),
        ]

    def given_configs(self) -> list[dict[str, Any]]:
        """The baseline's config, then each enqueued one's (``given`` without roles and labels)."""
        return [config for _, _, config in self.given()]


def _fix_for(err: Any) -> str:  # pydantic's ErrorDetails
    kind = err["type"]
    if "fix" in err.get("ctx", {}):  # a validator that knows the fix says it (sections.fix_error)
        return str(err["ctx"]["fix"])
    if kind == "extra_forbidden":
        return "remove it or check its spelling"
    if kind.startswith(("int_", "float_", "string_", "bool_", "list_", "dict_", "model_")):
        return f"expected {kind.split('_')[0]}"
    if kind == "literal_error":
        return "use one of the listed values"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal"):
        return "use a value in range"
    return "see the study file reference"


def _raise_validation(exc: ValidationError, file: str) -> None:
    err = exc.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    ctx = err.get("ctx", {})
    msg = str(ctx["error"]) if err["type"] == "value_error" and "error" in ctx else err["msg"]  # a validator's words
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    raise ConfigError(msg, file=file, key=".".join(map(str, loc)) or None, fix=_fix_for(err)) from None


def _split_space(raw: dict[str, Any], file: str) -> dict[str, Any]:
    """TOML puts ``[space.derived]`` inside ``[space]``; lift it out so params and derived flags stay apart."""
    space = raw.get("space")
    if space is None:
        return raw
    if not isinstance(space, dict):
        raise ConfigError("must be a table of flag = {…}", file=file, key="space", fix="write [space] entries")
    space = dict(space)
    derived = space.pop("derived", {})
    levers = space.pop("env", {})  # [space.env]: environment levers, searched like flags under ``env:NAME``
    if not isinstance(levers, dict):
        raise ConfigError("must be a table of NAME = {…}", file=file, key="space.env", fix="write [space.env] entries")
    space.update({ENV_PREFIX + str(name): spec for name, spec in levers.items()})
    for name, spec in space.items():
        if not isinstance(spec, dict):
            raise ConfigError(
                "a parameter must be a table",
                file=file,
                key=f"space.{name}",
                fix='write e.g. {type = "int", low = 1, high = 8} or {choices = [...]}',
            )
    return {**raw, "space": space, "derived": derived}


def load_config(
    path: str | Path,
    *,
    name: str | None = None,
    storage: str | None = None,
    trials: int | None = None,
    engine: str | None = None,
) -> StudyConfig:
    """Read, validate and resolve a study file; keyword arguments are CLI overrides."""
    path = Path(path)
    file = str(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("study file not found", file=file, fix="pass --config with an existing .toml") from None
    except OSError as exc:
        raise ConfigError(f"cannot read study file ({exc.strerror})", file=file, fix="check permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML ({exc})", file=file, fix="fix the TOML syntax") from None
    filled = [key for key in ("path", "derived", "notes") if key in raw]  # fields load_config fills, not keys
    if filled:
        raise ConfigError("unknown key", file=file, key=filled[0], fix="remove it or check its spelling")
    raw = _split_space(raw, file)
    study = dict(raw.get("study", {}))
    study.setdefault("name", path.stem)
    for key, value in (("name", name), ("storage", storage), ("trials", trials)):
        if value is not None:
            study[key] = value
    raw["study"] = study
    if engine is not None:
        raw["engine"] = {**raw.get("engine", {}), "kind": engine}
    try:
        cfg = StudyConfig.model_validate(raw)
    except ValidationError as exc:
        _raise_validation(exc, file)
    return _resolve(cfg, path.resolve(), file)


def _resolve_storage(url: str | None, base: Path, name: str) -> str:
    if not url:
        return f"sqlite:///{base / (name + '.db')}"
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and url[len(prefix) :] not in ("", ":memory:"):
        return prefix + str(base / url[len(prefix) :])
    return url


def _resolve(cfg: StudyConfig, path: Path, file: str) -> StudyConfig:
    base = path.parent
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.study.name or ""):
        raise ConfigError(
            f"study name {cfg.study.name!r} is not usable as a file name",
            file=file,
            key="study.name",
            fix="use letters, digits, '.', '_' or '-'",
        )
    study = cfg.study.model_copy(update={"storage": _resolve_storage(cfg.study.storage, base, cfg.name)})
    prompts = cfg.workload.prompts if cfg.workload.prompts.is_absolute() else (base / cfg.workload.prompts)
    workload = cfg.workload.model_copy(update={"prompts": prompts.resolve()})
    cfg = cfg.model_copy(update={"study": study, "workload": workload, "path": path})
    cfg = _check_flags(_check_engine(cfg, file), file)
    check_pool(cfg, cfg.engine.pool, file=file)  # a pool too small for every config: one line, not a budget of crashes
    return _check_prompts(cfg, file)


def _flag_error(exc: ConfigError, file: str, key: str, *, table: bool = False) -> ConfigError:
    """Re-anchor another module's ConfigError at the study file's dotted key (``table``: add the flag name)."""
    return exc.at(file=file, key=f"{key}.{exc.key}" if table and exc.key else key)


def _check_flags(cfg: StudyConfig, file: str) -> StudyConfig:
    """Normalise every flag name to SGLang's dest and every value to its type, through the bundled flag table."""
    table = FlagTable.bundled()

    def flags(config: dict[str, Any], key: str, env: dict[str, Any], key_env: str) -> dict[str, Any]:
        """A table's flags and its environment levers (``key_env``) as one checked config (levers as env:NAME)."""
        try:
            out = dict(table.check(config))
        except ConfigError as exc:
            raise _flag_error(exc, file, key, table=True) from None
        try:
            return {**out, **table.check({ENV_PREFIX + str(k): v for k, v in env.items()})}
        except ConfigError as exc:
            raise _flag_error(exc, file, key_env, table=True) from None

    def dest(name: str, key: str) -> str:
        try:
            return table.key(name)  # a flag's dest, or a lever's env:NAME
        except ConfigError as exc:
            raise _flag_error(exc, file, key.replace(ENV_PREFIX, "env.")) from None

    def coerce(name: str, value: Any, key: str) -> Any:
        if value is None:
            return None
        try:
            return table.coerce(name, value)
        except ConfigError as exc:
            raise _flag_error(exc, file, key) from None

    space: dict[str, ParamSpec] = {}
    for name, spec in cfg.space.items():
        key = f"space.{name}".replace(ENV_PREFIX, "env.")
        flag = dest(name, key)
        update: dict[str, Any] = {}
        if spec.kind == "categorical":
            values = [coerce(flag, v, f"{key}.choices") for v in spec.choice_values]
            update["choices"] = [UNSET if v is None else v for v in values]
        if spec.condition is not None:
            update["condition"] = spec.condition.model_copy(
                update={"flag": dest(spec.condition.flag, f"{key}.condition.flag")}
            )
        space[flag] = spec.model_copy(update=update)
    derived = {dest(name, f"space.derived.{name}"): expr for name, expr in cfg.derived.items()}
    clash = sorted(set(space) & set(derived))
    if clash:
        raise ConfigError(
            "a flag cannot be both searched and derived",
            file=file,
            key=f"space.derived.{clash[0]}",
            fix="remove it from one of the two tables",
        )
    fixed = dict(cfg.engine.fixed)
    fixed_env = fixed.pop("env", None) or {}  # [engine.fixed.env]
    engine = cfg.engine.model_copy(update={"fixed": flags(fixed, "engine.fixed", fixed_env, "engine.fixed.env")})
    baseline = cfg.baseline.model_copy(
        update={"flags": flags(cfg.baseline.flags, "baseline.flags", cfg.baseline.env, "baseline.env"), "env": {}}
    )
    enqueue = [
        e.model_copy(update={"flags": flags(e.flags, f"enqueue.{i}.flags", e.env, f"enqueue.{i}.env"), "env": {}})
        for i, e in enumerate(cfg.enqueue)
    ]
    return cfg.model_copy(
        update={"space": space, "derived": derived, "engine": engine, "baseline": baseline, "enqueue": enqueue}
    )


def _check_engine(cfg: StudyConfig, file: str) -> StudyConfig:
    """Profiles, timeouts, sampler extras and the prompt file: each failure is one line before any launch."""
    eng = cfg.engine
    profile = eng.profile or eng.model
    model_key = "engine.profile" if eng.profile else "engine.model"
    if eng.simulated or eng.profile:
        try:
            load_model(_maybe_path(profile, cfg.base_dir))
        except ConfigError as exc:
            raise _flag_error(exc, file, model_key) from None
    try:
        if eng.sim_gpu is not None:
            load_gpu(eng.sim_gpu)
    except ConfigError as exc:
        raise _flag_error(exc, file, "engine.sim_gpu") from None
    known = {f.name for f in dataclasses.fields(Timeouts)}
    for key in eng.timeouts:
        if key not in known:
            raise ConfigError(
                "unknown timeout", file=file, key=f"engine.timeouts.{key}", fix=f"use one of {', '.join(sorted(known))}"
            )
    if eng.launcher == "ssh" and not cfg.launcher.ssh.host:
        raise ConfigError(
            "the ssh launcher needs a host",
            file=file,
            key="launcher.ssh.host",
            fix='add [launcher.ssh] host = "user@name:port"',
        )
    extra = {"gp": ("torch", "pip install torch"), "cmaes": ("cmaes", "pip install cmaes")}.get(cfg.study.sampler)
    if extra and importlib.util.find_spec(extra[0]) is None:
        raise ConfigError(
            f"sampler {cfg.study.sampler!r} needs the {extra[0]} package",
            file=file,
            key="study.sampler",
            fix=f'{extra[1]}, or use sampler = "tpe"',
        )
    if eng.simulated or eng.profile:
        return cfg.model_copy(update={"engine": eng.model_copy(update={"profile": _maybe_path(profile, cfg.base_dir)})})
    return cfg


def _check_prompts(cfg: StudyConfig, file: str) -> StudyConfig:
    """The prompt file read as every trial will replay it: a bad line or a prompt no launch can serve is one
    error naming the prompt file and its line; a file shorter than ``sample_size`` becomes a note."""
    wl = cfg.workload
    try:
        sample = PromptSample.load(wl.prompts, wl.sample_size, wl.seed)
    except WorkloadError as exc:
        if (exc.file or "").startswith(f"{wl.prompts}:"):  # a line of the prompt file: its file:line, not the study's
            raise
        raise _flag_error(exc, file, "workload.prompts") from None
    eng = cfg.engine
    served = _maybe_path(eng.model, cfg.base_dir)  # the sglang engine's checkpoint, when it is on disk
    model = eng.profile if eng.simulated or not Path(served).expanduser().exists() else served
    limit, source, _ = context_limit(model or eng.model, cfg.baseline_config())
    sample.check_fit(limit, wl.max_tokens, source=source)
    return cfg.model_copy(update={"notes": (sample.note,) if sample.note else ()})


def _maybe_path(name: str, base: Path) -> str:
    """A profile given as a relative path resolves against the TOML; a bundled name stays a name."""
    candidate = base / name
    return str(candidate.resolve()) if ("/" in name or name.endswith(".json")) and candidate.exists() else name
