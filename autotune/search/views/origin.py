"""Where a re-tune starts: an earlier study read for ``autotune sweep --from STUDY`` (``search.warm`` applies it).

It takes the earlier study's winner and top ``FROM_TOP`` configs, translated to the installed SGLang and fitted to
this study, and its planner's learnt corrections scaled by the GPUs' memory; nothing of its figures. What each step
does and why: docs/search.md ("Re-tuning from an earlier study").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution

from autotune.config import StudyConfig
from autotune.errors import ConfigError
from autotune.harness.engines import study_gpu
from autotune.redaction import redact_url
from autotune.results import TrialResult
from autotune.search.confirm.ranking import contenders
from autotune.search.confirm.record import Confirmation
from autotune.search.correction import CorrectedFeasibility, replay
from autotune.search.seeding import finished
from autotune.search.space import Space, key_of
from autotune.search.views.settings import device_name, engine_table, simulated
from autotune.search.warm import Carried, WarmConfig, WarmRecord, learnt, scaled
from autotune.sglang.envs import EnvTable
from autotune.sglang.flags import BUNDLED_VERSION, FlagTable
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sglang.translate import translate

FROM_TOP = 3  # the earlier study's top configs carried besides its winner (see the module's docstring)
OPTION = "--from"


def _fail(message: str, fix: str) -> ConfigError:
    return ConfigError(message, key=OPTION, fix=fix)


def study_model(settings: Mapping[str, Any]) -> str | None:
    """The model a stored study tuned: its planner profile, else its model path."""
    eng = engine_table(settings)
    value = eng.get("profile") or eng.get("model")
    return None if value is None else str(value)


def study_version(study: optuna.Study, settings: Mapping[str, Any]) -> str:
    """The SGLang version a study ran: as recorded (``sglang_version``), else the simulator's (0.5.23's rules)."""
    recorded = study.user_attrs.get("sglang_version")
    if recorded:
        return str(recorded)
    return f"{BUNDLED_VERSION} (simulated)" if simulated(settings) else "unrecorded"


@dataclass(frozen=True)
class RankedConfig:
    """One of the earlier study's best configs: its label ("from s: winner (was trial 4)"), trial and the flags it
    launched with."""

    label: str
    trial: int
    config: dict[str, Any]


def ranked_configs(study: optuna.Study, name: str | None = None) -> list[RankedConfig]:
    """The confirmed winner, then the top ``FROM_TOP`` distinct others by the study's own ranking; ConfigError when
    nothing measured. ``name``: the study as labels name it."""
    top, _, _ = contenders(study, FROM_TOP + 1)
    confirmation = Confirmation.of(study)
    verdict = confirmation.verdict if confirmation is not None else None
    winner = verdict.winner_trial if verdict is not None else None
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    chosen = ([by_number[winner]] if winner in by_number else []) + [t for t in top if t.number != winner]
    out: list[RankedConfig] = []
    seen: set[str] = set()
    for t in chosen:
        result = TrialResult.of(t)
        config = dict(result.config if result is not None else t.user_attrs.get("config") or {})
        if key_of(config) in seen or len(out) > FROM_TOP:
            continue
        seen.add(key_of(config))
        what = "winner" if t.number == winner else f"#{len(out) + 1}"  # its rank in that study
        out.append(RankedConfig(f"from {name or study.study_name}: {what} (was trial {t.number})", t.number, config))
    if not out:
        raise _fail(
            f"study {study.study_name!r} has no finished trial that measured a throughput",
            f"finish it first (autotune sweep --study {study.study_name}), or name another study",
        )
    return out


def _snap(spec: Any, low: float, high: float, value: float) -> float:
    """``value`` clamped to [low, high] and onto the range's step (from low)."""
    step = spec.step
    v = min(max(float(value), low), high)
    if step:
        v = min(low + round((v - low) / step) * step, high)
    return int(round(v)) if spec.kind == "int" else round(v, 6)


def fit_space(config: Mapping[str, Any], cfg: StudyConfig, space: Space) -> tuple[dict[str, Any], list[str]]:
    """``config`` fitted to this study: fixed flags win, out-of-range values clamped, unknown choices replaced by
    the baseline's value, derived flags derived again after any change (see the module's docstring); one line per
    change."""
    out, lines = dict(config), []
    for key, value in cfg.engine.fixed.items():
        if key in out and out[key] != value:
            lines.append(f"{key}: {out[key]} → {value} (fixed in this study)")
        out[key] = value
    base = cfg.baseline_config()
    for param in space.params:
        if param.name not in out or out[param.name] is None or param.contains(out[param.name]):
            continue
        value, dist = out[param.name], param.distribution
        if isinstance(dist, CategoricalDistribution) or isinstance(value, (bool, str)):
            shown = ", ".join(map(str, getattr(dist, "choices", ())))
            if base.get(param.name) is not None:
                out[param.name] = base[param.name]
                lines.append(
                    f"{param.name}: {value} is not among this study's choices ({shown}); "
                    f"the baseline's {base[param.name]} instead"
                )
            else:
                out.pop(param.name)
                lines.append(
                    f"{param.name}: {value} is not among this study's choices ({shown}); left to SGLang's default"
                )
            continue
        low, high = float(dist.low), float(dist.high)  # type: ignore[attr-defined]
        if low <= float(value) <= high:
            continue  # in range, off the step: launched as given, as a hand-written [[enqueue]] value is
        out[param.name] = _snap(param.spec, low, high, value)
        lines.append(f"{param.name}: {value} clamped to {out[param.name]} (this study's range {low:g}–{high:g})")
    if not lines:
        return out, lines  # nothing changed: the config as that study measured it (an [[enqueue]]'s own values kept)
    for name in space.derived:
        out.pop(name, None)
    return space.complete(out), lines


def _gpu_memory(name: str | None) -> float | None:
    try:
        return load_gpu(str(name)).memory_gib if name else None
    except ConfigError:
        return None


def corrections(study: optuna.Study, settings: Mapping[str, Any], cfg: StudyConfig) -> tuple[Carried, str]:
    """The earlier study's learnt planner corrections scaled to this study's GPU, and one line saying how."""
    eng = engine_table(settings)
    src_gpu, profile = eng.get("sim_gpu"), study_model(settings)
    try:
        feas = CorrectedFeasibility(load_model(str(profile)), load_gpu(str(src_gpu)))
    except (ConfigError, OSError, ValueError):
        return {}, "no planner corrections carried (the earlier study's model or GPU has no planner profile)"
    replay(feas, finished(study.get_trials(deepcopy=False)))
    here = study_gpu(cfg.engine)
    old, new = _gpu_memory(str(src_gpu)), here.memory_gib
    ratio = new / old if old and new else 1.0
    moved = scaled(learnt(feas), ratio)
    data: Carried = {
        "offsets": moved["offsets"],
        "room": moved["room"],
        "ooms": moved["ooms"],
        "scale": round(ratio, 4),
        "memory_gib": [round(old or 0.0, 1), round(new or 0.0, 1)],
    }
    n = len(data["offsets"]) + len(data["room"]) + len(data["ooms"])
    how = (
        f"× {ratio:.3f} ({src_gpu} {old:.0f} GiB → {here.name} {new:.0f} GiB)"
        if not math.isclose(ratio, 1.0)
        else "unscaled (the same GPU memory)"
    )
    return data, (f"planner starts from {n} learnt corrections of that study, {how}, until this study measures its own")


def warm_record(
    source: optuna.Study,
    storage: str,
    cfg: StudyConfig,
    *,
    table: FlagTable,
    version: str,
    envs: EnvTable | None = None,
    name: str | None = None,
) -> tuple[WarmRecord, list[str]]:
    """The record ``search.warm`` reads (``WARM_KEY``), and the lines the sweep prints before it starts. ``table``:
    the installed SGLang's flags (``version``: its version); ``name``: the earlier study as shown (its own name)."""
    settings = dict(source.user_attrs.get("autotune") or {})
    model, mine = study_model(settings), cfg.engine.profile or cfg.engine.model
    if model is not None and model != mine:
        raise _fail(
            f"study {source.study_name!r} tuned model {model}, this study tunes {mine}",
            "re-tune from a study of the same model, or run without --from",
        )
    ranked = ranked_configs(source, name)
    space = Space.from_config(cfg)
    planner = CorrectedFeasibility.from_config(cfg)
    seen = {key_of(config) for config in cfg.given_configs()}  # the baseline and the file's own [[enqueue]]
    configs: list[WarmConfig] = []
    lines: list[str] = []
    for entry in ranked:
        label, number = entry.label, entry.trial
        config, renamed = translate(entry.config, table, envs)
        config, fitted = fit_space(config, cfg, space)
        lines += [f"{label}: {line}" for line in renamed + fitted]
        refused = planner.predict(config, inert=False) if planner is not None else None
        if refused is not None and refused.failure == "bad_args":
            lines.append(f"{label}: not enqueued, sglang {version} refuses it: {refused.message}")
            continue
        if key_of(config) in seen:
            lines.append(
                f"{label}: not enqueued, the same config as this study's baseline, an [[enqueue]] or one above"
            )
            continue
        seen.add(key_of(config))
        configs.append({"label": label, "trial": number, "config": config})
    data, planner_line = corrections(source, settings, cfg)
    record: WarmRecord = {
        "study": name or source.study_name,
        "storage": redact_url(storage),
        "sglang_version": study_version(source, settings),
        "gpu": device_name(settings) if settings else "unrecorded",
        "model": model,
        "to": {"sglang_version": version, "gpu": device_name(cfg.to_dict())},
        "configs": configs,
        "corrections": data,
        "notes": lines,
    }
    return record, [str(origin_line(record)), *lines, planner_line]


def origin_line(record: Mapping[str, Any] | None) -> str | None:
    """One line on where a study started (None for a cold one): the summary's, ``trials``' and the sweep's."""
    if not record:
        return None
    n = len(record.get("configs") or ())
    return (
        f"started from study {record['study']} ({record['storage']}; sglang {record['sglang_version']} on "
        f"{record['gpu']}): {n} of its best configs enqueued and measured here, its planner corrections scaled to "
        f"this GPU; every figure shown is this study's own"
    )
