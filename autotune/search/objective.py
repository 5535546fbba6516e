"""The study's objective: the sampler, the directions, a trial result's values (output tok/s per GPU the server
spans) and constraint violations (an OOM a completed trial with value 0 and a violated constraint), and the study
opened with them (``open_study``). docs/search.md ("The search and the confirmation").
"""

from __future__ import annotations

import warnings

import optuna
from optuna.trial import FrozenTrial

from autotune.config import StudyConfig
from autotune.errors import ConfigError, StudyError
from autotune.redaction import redact_url as redact
from autotune.results import TrialResult
from autotune.search.numerics import constraint_entries as numerics_entries
from autotune.search.storage import load_study, open_storage, storage_error, storage_file
from autotune.search.storage.diskguard import disk_error
from autotune.sglang.parallel import server_gpus

WORST = 1e9  # the second objective's value for a config that never served (finite: plots and samplers cope)


def gpus_spanned(result: TrialResult) -> int:
    """The GPUs the server held: those recorded, else as many as its config spans (a result from an in-process
    prediction, or a study stored before groups, names none)."""
    return len(result.gpus) if result.gpus else server_gpus(result.config or {})


def per_gpu(result: TrialResult) -> float | None:
    """Output tok/s ÷ GPUs spanned: the score a trial is ranked by (None without a measurement)."""
    tok_s = result.output_tok_s
    return None if tok_s is None else tok_s / gpus_spanned(result)


def constraints(trial: FrozenTrial) -> list[float]:
    """Optuna's constraints_func: values > 0 are violations (stored by the loop as ``user_attrs["constraint"]``)."""
    return list(trial.user_attrs.get("constraint", [0.0]))


def make_sampler(cfg: StudyConfig, *, salt: int = 0) -> optuna.samplers.BaseSampler:
    """The configured sampler. ``salt`` (trials already stored) keeps a resumed sweep from replaying the
    random start-up proposals of the first run.

    Optuna marks multivariate and group TPE, ``constant_liar``, ``constraints_func`` and the GP sampler
    experimental and warns each time one is built: the tool chose them, so a user (``autotune trials``, a worker)
    reads no library warning for them. Only that category is ignored, and only while the sampler is built."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        return _sampler(cfg, cfg.study.seed + salt)


def _sampler(cfg: StudyConfig, seed: int) -> optuna.samplers.BaseSampler:
    kind = cfg.study.sampler
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, constraints_func=constraints)
    if kind == "cmaes":
        if cfg.objective.second:
            raise ConfigError(
                "CMA-ES cannot optimise two objectives",
                file=str(cfg.path),
                key="study.sampler",
                fix='use sampler = "tpe"',
            )
        return optuna.samplers.CmaEsSampler(seed=seed)
    # Multivariate + group TPE models the flags jointly (memory levers interact) and copes with conditions.
    startup = max(4, min(10, cfg.study.trials // 4))
    # constant_liar: parallel workers see each other's running trials and do not propose the same config.
    return optuna.samplers.TPESampler(
        seed=seed,
        multivariate=True,
        group=True,
        n_startup_trials=startup,
        constraints_func=constraints,
        constant_liar=True,
    )


def directions(cfg: StudyConfig) -> list[str]:
    second = cfg.objective.second
    return ["maximize"] + ([second.direction] if second else [])


def objective_values(cfg: StudyConfig, result: TrialResult) -> tuple[list[float], list[float]]:
    """(values, constraint) for a COMPLETE trial. Constraint entries > 0 are violations."""
    second = cfg.objective.second
    slos = cfg.objective.parsed_constraints()
    if result.status != "ok" or result.metrics is None:
        worst = [WORST if second and second.direction == "minimize" else 0.0] if second else []
        return [0.0, *worst], [1.0] + [0.0] * len(slos) + numerics_entries(cfg, result)
    # Per GPU: a server over 2 GPUs must deliver twice the tok/s of a 1-GPU one to rank alike, as a fleet of
    # either would on the same GPUs (equal to output tok/s for 1-GPU servers).
    values = [per_gpu(result) or 0.0]
    if second:
        values.append(_metric(result, second.metric) or (WORST if second.direction == "minimize" else 0.0))
    violations = [-1.0]
    for metric, op, limit in slos:
        value = _metric(result, metric)
        if value is None:
            violations.append(0.0)
        else:
            violations.append(value - limit if op in ("<=", "<") else limit - value)
    return values, violations + numerics_entries(cfg, result)  # the fidelity limits, when the study sets any


def _metric(result: TrialResult, name: str) -> float | None:
    m = result.metrics
    if m is None:
        return None
    if name in ("output_tok_s", "request_s", "accept_length"):
        value = getattr(m, name)
    else:
        stat, family, _ = name.split("_")
        value = getattr(getattr(m, f"{family}_ms"), stat)
    return None if value is None else float(value)


def open_study(cfg: StudyConfig, *, create: bool = True) -> optuna.Study:
    """The study of ``cfg``, with its sampler: created or resumed (``load_if_exists``: re-running continues it),
    or with ``create=False`` loaded and never created (``load_study``'s errors)."""
    if not create:
        return load_study(cfg.storage_url, cfg.name, base_dir=cfg.base_dir, sampler=make_sampler(cfg))
    url = cfg.storage_url
    storage = open_storage(url, base_dir=cfg.base_dir)  # StorageError (one line, redacted) when unusable
    try:
        return optuna.create_study(
            study_name=cfg.name,
            storage=storage,
            sampler=make_sampler(cfg),
            directions=directions(cfg),
            load_if_exists=True,
        )
    except ValueError as exc:
        raise StudyError(f"study {cfg.name!r} in {redact(url)} cannot be used: {exc}") from None
    except Exception as exc:  # SQLAlchemy's errors once the database is queried
        full = disk_error(exc, db_path=storage_file(url, cfg.base_dir))
        raise (full or storage_error(exc, url)) from None
