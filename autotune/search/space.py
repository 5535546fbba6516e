"""The search space: Optuna distributions over SGLang flags, conditions, derived flags (tiny expressions read by a
whitelisting AST walker, never ``eval``; ``mamba_ratio`` among their names), inert-flag pruning.
docs/study-file.md ("[space] and [space.derived]").
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from autotune.config import StudyConfig
from autotune.config.sections import ParamSpec
from autotune.errors import ConfigError
from autotune.harness.engines import study_gpu
from autotune.sglang.args import (
    SKIP_DECODE_LOCK,
    PlanStop,
    env_bool,
    mamba_slots_per_request,
    resolve_spec,
    resolve_strategy,
)
from autotune.sglang.envs import env_strings
from autotune.sglang.memory import MemoryPlan, plan
from autotune.sglang.profiles import load_model

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMP: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_FUNCS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "int": int, "round": round}
_CONSTANTS = {"none": None, "None": None, "unset": None, "true": True, "false": False, "True": True, "False": False}
BUILTINS = ("mamba_ratio",)  # values computed from the config itself, readable by derived expressions


def mamba_ratio(config: Mapping[str, Any]) -> int:
    """SGLang 0.5.23's slots→requests rule (``sglang.args.mamba_slots_per_request``) when no model profile is
    known. ``auto`` is extra_buffer on CUDA for the hybrid architectures that support it when the overlap
    schedule is on or pages are larger than one token, else no_buffer."""
    strategy = str(config.get("mamba_radix_cache_strategy") or "auto")
    overlap = not config.get("disable_overlap_schedule")
    if strategy == "auto":
        strategy = "extra_buffer" if overlap or int(config.get("page_size") or 1) > 1 else "no_buffer"
    return mamba_slots_per_request(
        strategy,
        overlap=overlap,
        radix_off=bool(config.get("disable_radix_cache")),
        skip_decode_lock=env_bool(env_strings(config), SKIP_DECODE_LOCK),
    )


def planner_ratio(model: Any, gpu: Any) -> Callable[[Mapping[str, Any]], int]:
    """The same rule resolved by the planner for a known model and GPU (attention backend and page size
    depend on both, e.g. a B200 with speculative decoding pages by 64 and so keeps extra_buffer)."""

    def ratio(config: Mapping[str, Any]) -> int:
        try:
            return resolve_strategy(model, gpu, config, resolve_spec(model, config), env=env_strings(config)).ratio
        except PlanStop:  # arguments SGLang rejects: the planner records the trial as bad_args anyway
            return mamba_ratio(config)

    return ratio


class Missing(Exception):
    """An expression named a flag the config leaves unset."""


class Expr:
    """A parsed expression; ``names`` are the flags it reads."""

    def __init__(self, text: str):
        self.text = text
        try:
            self._tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"cannot parse {text!r}: {exc.msg}") from None
        self.names: set[str] = set()
        self._check(self._tree)

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            if node.id not in _CONSTANTS and node.id not in _FUNCS:
                self.names.add(node.id)
            return
        allowed = (
            ast.Constant,
            ast.BinOp,
            ast.UnaryOp,
            ast.BoolOp,
            ast.Compare,
            ast.Call,
            ast.List,
            ast.Tuple,
            ast.Load,
            ast.USub,
            ast.UAdd,
            ast.Not,
            ast.And,
            ast.Or,
            *_BIN,
            *_CMP,
        )
        if not isinstance(node, allowed):
            raise ValueError(f"{type(node).__name__} is not allowed in {self.text!r}")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS):
            raise ValueError(f"only {', '.join(_FUNCS)} may be called in {self.text!r}")
        if isinstance(node, ast.Call) and node.keywords:
            raise ValueError(f"keyword arguments are not allowed in {self.text!r}")
        for child in ast.iter_child_nodes(node):
            if not (isinstance(node, ast.Call) and child is node.func):
                self._check(child)

    def __call__(self, values: Mapping[str, Any]) -> Any:
        return self._eval(self._tree, values)

    def _eval(self, node: ast.AST, values: Mapping[str, Any]) -> Any:
        ev = self._eval
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            return values.get(node.id)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e, values) for e in node.elts]
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand, values)
            if isinstance(node.op, ast.Not):
                return not v
            if v is None:
                raise Missing
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BoolOp):
            results = (ev(v, values) for v in node.values)
            return all(results) if isinstance(node.op, ast.And) else any(results)
        if isinstance(node, ast.BinOp):
            left, right = ev(node.left, values), ev(node.right, values)
            if left is None or right is None:
                raise Missing
            return _BIN[type(node.op)](left, right)
        if isinstance(node, ast.Compare):
            left = ev(node.left, values)
            for op, comp in zip(node.ops, node.comparators, strict=True):
                right = ev(comp, values)
                ordering = not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                if ordering and (left is None or right is None):
                    return False
                if not _CMP[type(op)](_norm(left), _norm(right)):
                    return False
                left = right
            return True
        if isinstance(node, ast.Call):
            args = [ev(a, values) for a in node.args]
            if any(a is None for a in args):
                raise Missing
            return _FUNCS[node.func.id](*args)  # type: ignore[attr-defined]
        raise ValueError(f"cannot evaluate {self.text!r}")  # unreachable: _check whitelists


def _norm(v: Any) -> Any:
    """Compare strings case-insensitively ("EAGLE" == "eagle"), the way SGLang upper-cases algorithms."""
    if isinstance(v, str):
        return v.lower()
    if isinstance(v, list):
        return [_norm(x) for x in v]
    return v


@dataclass(frozen=True)
class Param:
    name: str
    spec: ParamSpec
    distribution: BaseDistribution
    when: Expr | None

    def active(self, values: Mapping[str, Any]) -> bool:
        cond = self.spec.condition
        if cond is not None:
            value = _norm(values.get(cond.flag))
            if cond.in_ is not None and value not in _norm(list(cond.in_)):
                return False
            if cond.not_in is not None and value in _norm(list(cond.not_in)):
                return False
        if self.when is not None:
            try:
                return bool(self.when(values))
            except Missing:
                return False
        return True

    def suggest(self, trial: optuna.Trial) -> Any:
        dist, name = self.distribution, self.name
        if isinstance(dist, CategoricalDistribution):
            return trial.suggest_categorical(name, dist.choices)
        if isinstance(dist, IntDistribution):
            return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
        assert isinstance(dist, FloatDistribution)
        value = trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
        return round(value, 6)  # a stepped float carries binary noise (0.8700000000000001) into argv otherwise

    def contains(self, value: Any) -> bool:
        """Whether an enqueued value can be recorded as this parameter without Optuna warning."""
        dist = self.distribution
        if isinstance(dist, CategoricalDistribution):
            return value in dist.choices
        if value is None or isinstance(value, bool):
            return False
        return dist._contains(dist.to_internal_repr(value))


def _distribution(spec: ParamSpec) -> BaseDistribution:
    if spec.kind == "categorical":
        return CategoricalDistribution(spec.choice_values)
    assert spec.low is not None and spec.high is not None  # a numeric spec has both (config's validation)
    if spec.kind == "int":
        return IntDistribution(int(spec.low), int(spec.high), step=int(spec.step or 1), log=spec.log)
    return FloatDistribution(float(spec.low), float(spec.high), step=spec.step, log=spec.log)


class Space:
    """The tuned flags of a study, in declaration order (a condition reads flags declared before it)."""

    def __init__(
        self,
        params: list[Param],
        derived: dict[str, Expr],
        fixed: Mapping[str, Any],
        ratio_of: Callable[[Mapping[str, Any]], int] = mamba_ratio,
    ):
        self.params = params
        self.derived = derived
        self.fixed = dict(fixed)
        self.ratio_of = ratio_of

    @classmethod
    def from_config(cls, cfg: StudyConfig) -> Space:
        file = str(cfg.path) if cfg.path else None
        params: list[Param] = []
        seen = set(cfg.engine.fixed)
        for name, spec in cfg.space.items():
            key = f"space.{name}"
            when = _expr(spec.when, file, f"{key}.when") if spec.when else None
            needs = (when.names if when else set()) | ({spec.condition.flag} if spec.condition else set())
            unknown = sorted(needs - seen)
            if unknown:
                raise ConfigError(
                    f"condition reads {unknown[0]!r}, which is neither fixed nor declared before it",
                    file=file,
                    key=key,
                    fix="declare that flag earlier in [space] or in engine.fixed",
                )
            params.append(Param(name, spec, _distribution(spec), when))
            seen.add(name)
        derived = {}
        for name, text in cfg.derived.items():
            expr = _expr(text, file, f"space.derived.{name}")
            unknown = sorted(expr.names - seen - set(BUILTINS))
            if unknown:
                raise ConfigError(
                    f"reads {unknown[0]!r}, which is neither fixed nor in [space]",
                    file=file,
                    key=f"space.derived.{name}",
                    fix="derive only from searched or fixed flags",
                )
            derived[name] = expr
        ratio_of: Callable[[Mapping[str, Any]], int] = mamba_ratio
        if cfg.engine.profile and any("mamba_ratio" in expr.names for expr in derived.values()):
            ratio_of = planner_ratio(load_model(cfg.engine.profile), study_gpu(cfg.engine))
        return cls(params, derived, cfg.engine.fixed, ratio_of)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def without(self, names: set[str]) -> Space:
        return Space([p for p in self.params if p.name not in names], self.derived, self.fixed, self.ratio_of)

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Sample the active parameters and return the full launch config (fixed + tuned + derived)."""
        values: dict[str, Any] = dict(self.fixed)
        for param in self.params:
            if param.active(values):
                values[param.name] = param.suggest(trial)
        return self.complete(values)

    def record(self, trial: optuna.Trial, config: Mapping[str, Any]) -> None:
        """Register an enqueued config's in-space values as the trial's params, so the sampler learns from it."""
        for param in self.params:
            if param.name in config and param.contains(config[param.name]):
                param.suggest(trial)

    def complete(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Add derived flags and drop unset ones: the config that is launched."""
        out = dict(values)
        for name, expr in self.derived.items():
            try:
                out[name] = expr({**out, "mamba_ratio": self.ratio_of(out)})
            except Missing:  # an input is unset: keep the flag as given (e.g. an enqueued config's own value)
                out[name] = out.get(name)
            except (TypeError, ZeroDivisionError) as exc:
                raise ConfigError(
                    f"cannot derive {name} = {expr.text} ({exc})", key=f"space.derived.{name}", fix="fix the expression"
                ) from None
        return {k: v for k, v in out.items() if v is not None and v is not False}


def _expr(text: str, file: str | None, key: str) -> Expr:
    try:
        return Expr(text)
    except ValueError as exc:
        raise ConfigError(
            str(exc),
            file=file,
            key=key,
            fix="use flags, numbers, + - * / //, comparisons, and/or/not, in, min/max/int/round",
        ) from None


def key_of(config: Mapping[str, Any]) -> str:
    """A config's identity: the same flags and values give the same key, whatever their order."""
    return json.dumps(dict(config), sort_keys=True, default=str)


def config_diff(config: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
    """Flags whose value differs from the reference (None where the reference sets a flag this config drops)."""
    keys = sorted(set(config) | set(reference))
    return {k: config.get(k) for k in keys if config.get(k) != reference.get(k)}


class Feasibility:
    """The planner's verdict on a config, corrected from what real trials reported.

    SGLang sizes its pools from free memory after weights; the planner's static constants can be off by a
    little on a given machine. Each measured trial's KV capacity gives the free-memory offset that makes the
    planner agree with it (``kv_tokens`` is linear in free memory), and the median offset is applied to
    every later prediction.
    """

    def __init__(self, model: Any, gpu: Any, *, margin_gib: float = 1.0):
        self.model, self.gpu, self.margin_gib = model, gpu, margin_gib
        self.offsets: list[float] = []

    @classmethod
    def from_config(cls, cfg: StudyConfig) -> Self | None:
        if not cfg.engine.profile:
            return None  # a real model without a planner profile: launch everything
        return cls(load_model(cfg.engine.profile), study_gpu(cfg.engine))

    @property
    def offset_gib(self) -> float:
        return float(sorted(self.offsets)[len(self.offsets) // 2]) if self.offsets else 0.0

    def _plan(self, config: Mapping[str, Any], offset: float = 0.0, *, inert: bool = True) -> MemoryPlan:
        if not offset:
            return plan(self.model, self.gpu, dict(config), _inert=inert)
        pre = plan(self.model, self.gpu, dict(config), _inert=False).extra.get("pre_gib")
        return plan(self.model, self.gpu, dict(config), free_gib=None if pre is None else pre - offset, _inert=inert)

    def predict(self, config: Mapping[str, Any], *, inert: bool = True) -> MemoryPlan:
        """The corrected plan; ``inert=False`` skips the inert-flag analysis (a dozen re-plans) when unused."""
        return self._plan(config, self.offset_gib, inert=inert)

    def learn(self, config: Mapping[str, Any], kv_tokens: int | None) -> float | None:
        """Fit the free-memory offset that reproduces a measured KV capacity; returns it (GiB) or None."""
        if not kv_tokens:
            return None
        at0, at1 = self._plan(config, 0.0), self._plan(config, 1.0)
        slope = at0.kv_tokens - at1.kv_tokens  # tokens lost per GiB less free memory
        if not at0.fits or not at1.fits or slope <= 0:
            return None
        offset = (at0.kv_tokens - kv_tokens) / slope
        self.offsets.append(offset)
        return offset

    def clear(self, memory_plan: MemoryPlan) -> bool:
        """Whether the planner is sure ``memory_plan``'s config starts: it fits with ``margin_gib`` of headroom at
        peak. Where the search places a config itself (an edge start, the memory fraction at the wall)."""
        return memory_plan.fits and memory_plan.gib.headroom >= self.margin_gib

    def sure_failure(self, memory_plan: MemoryPlan) -> bool:
        """Skip without launching only when the planner is sure: pool arithmetic, bad args, or a clear deficit.

        A headroom deficit within the margin is launched: the estimate of graph and activation memory is the
        least exact part of the plan, and the real engine decides.
        """
        if memory_plan.fits:
            return False
        headroom = memory_plan.gib.headroom
        if memory_plan.failure == "bad_args" or headroom >= 0:
            return True
        return headroom < -self.margin_gib

    def inert_everywhere(self, space: Space, contexts: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """Parameters the planner calls inert at every probed value in every context that starts: {name: why}.

        Contexts are whole configs (the baseline, the enqueued ones, the space's low and high corners), since
        a flag is only inert relative to the others (the ratio, once the slot count is explicit).
        """
        corners = []
        for pick in (0, -1):
            corner = {p.name: _probes(p.spec)[pick] for p in space.params if _probes(p.spec)}
            corners.append({**space.fixed, **corner})
        out = {}
        for param in space.params:
            if param.spec.when or param.spec.condition or not _probes(param.spec):
                continue
            verdicts = []
            for context in [*contexts, *corners]:
                for value in _probes(param.spec):
                    mp = self._plan(space.complete({**context, param.name: value}))
                    if mp.fits:
                        verdicts.append(param.name in mp.inert)
            if verdicts and all(verdicts):
                out[param.name] = "the planner finds it changes nothing in any probed config"
        return out


def _probes(spec: ParamSpec) -> list[Any]:
    if spec.kind == "categorical":
        return [v for v in spec.choice_values if v is not None]
    values = [spec.low, spec.high]
    return [int(v) for v in values if v is not None] if spec.kind == "int" else values
