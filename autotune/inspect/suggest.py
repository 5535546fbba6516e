"""The next step for a diagnosed server: replay its config through the planner, then search the few flag
changes that lift the binding limit and still leave memory headroom.

The planner's confidence is earned, not assumed: it is "high" only when ``plan()`` reproduces the capacity the
server actually reports (running requests, Mamba slots, KV tokens), and the gap is stated when it does not.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.errors import AutotuneError
from autotune.inspect.state import ServerState
from autotune.sglang.flags import FlagTable
from autotune.sglang.memory import MemoryPlan, plan
from autotune.sglang.profiles import load_gpu, load_model

GPU_NAMES = ("b200", "h200", "h100")
MFS_MAX = 0.95  # SGLang's own heuristic never goes above this; past it graph capture OOMs (docs/sglang-memory.md §4)
DEFAULT_TOKENS_PER_REQUEST = 4096  # KV a request may need when the live load says nothing better
_LEVEL = ("low", "medium", "high")


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    """A change to the running config and what the planner predicts for it."""

    changes: dict[str, Any]  # dest → new value
    argv: list[str]
    max_running_requests: int
    binding: str | None
    kv_tokens: int
    mamba_slots: int | None
    mem_fraction_static: float
    headroom_gib: float
    confidence: str
    note: str | None = None


@dataclass(frozen=True)
class Candidate:
    """A flag change the planner accepts (it starts with headroom to spare and lifts the running-request limit),
    and the planner's plan for it."""

    flags: dict[str, Any]  # dest → new value
    plan: MemoryPlan


@dataclass(frozen=True, kw_only=True)
class Advice:
    model: str | None  # the profile the planner used
    gpu: str | None
    config: dict[str, Any]  # the server's flags as the planner saw them
    confidence: str | None  # how well plan() reproduces the server (None: no plan)
    reproduction: str | None
    plan_gib: dict[str, float] | None
    suggestions: list[Suggestion] = field(default_factory=list)
    inert: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ratio: int | None = None
    requested_mrr: int | None = None


def _candidates(model_path: str, local: bool) -> list[str]:
    """Bundled-profile names a served model path may stand for, most specific first."""
    base = model_path.rstrip("/").rsplit("/", 1)[-1]
    names = [model_path] if local or "/" not in model_path else []
    lowered = base.lower()
    names += [base, lowered]
    parts = lowered.split("-")
    names += ["-".join(parts[:i]) for i in range(len(parts) - 1, 1, -1)]  # drop -instruct, -fp8, ...
    return list(dict.fromkeys(n for n in names if n))


def resolve_model(state: ServerState, override: str | None) -> tuple[Any, str | None, str | None]:
    """(profile, name, note): the ``--model`` override, else a bundled profile matching the served model."""
    if override:
        return load_model(override), override, None  # a bad --model is the user's error: let it raise
    if not state.model_path:
        return None, None, "model unknown: /server_info has no model_path (pass --model NAME or config.json)"
    local = os.path.exists(state.model_path)
    for name in _candidates(state.model_path, local):
        try:
            return (
                load_model(name),
                name,
                None if name == state.model_path else f"model profile {name!r} inferred from {state.model_path}",
            )
        except AutotuneError:
            continue
    arch = ", ".join(state.architectures) or "unknown architecture"
    return (
        None,
        None,
        (
            f"no model profile for {state.model_path} ({arch}): no planner advice "
            "(pass --model with a bundled profile or the model's config.json)"
        ),
    )


def resolve_gpu(state: ServerState, override: str | None) -> tuple[Any, str | None, str | None]:
    """(profile, name, note): ``--gpu``, else the bundled GPU whose memory matches the device's total."""
    if override:
        return load_gpu(override), override, None
    if not state.gpu and state.device == "cpu":
        return (
            None,
            None,
            "CPU server: the planner models GPU memory, so no planner advice "
            "(pass --gpu b200|h200|h100 to plan this config for that GPU instead)",
        )
    if not state.gpu:
        return (
            None,
            None,
            "GPU unknown (no GPU reading for this server): pass --gpu b200|h200|h100 for planner advice",
        )
    total_mib = state.gpu.total_gib * 1024.0
    for name in GPU_NAMES:
        profile = load_gpu(name)
        if abs(profile.memory_mib - total_mib) <= 0.03 * profile.memory_mib:
            return profile, name, None
    return (
        None,
        None,
        (
            f"GPU with {state.gpu.total_gib:.1f} GiB matches no bundled profile "
            f"({', '.join(GPU_NAMES)}): pass --gpu for planner advice"
        ),
    )


def _gap(planned: float | None, actual: float | None) -> float:
    if planned is None or actual is None:
        return 0.0 if planned == actual else 1.0
    return abs(planned - actual) / max(abs(actual), 1.0)


def reproduce(p: Any, state: ServerState) -> tuple[str, str]:
    """(confidence, sentence): does ``plan()`` of the server's flags give the capacity the server reports?"""
    if not p.fits:
        return "low", f"the planner says this config would not start ({p.failure}: {p.message}), yet it runs"
    mrr_gap = _gap(p.max_running_requests, state.effective_mrr)
    slot_gap = _gap(p.max_mamba_cache_size, state.mamba_slots)
    kv_gap = _gap(p.kv_tokens, state.kv_tokens)
    facts = f"{p.max_running_requests} running, {p.max_mamba_cache_size or 0} Mamba slots, {p.kv_tokens:,} KV tokens"
    if mrr_gap == 0 and slot_gap == 0 and kv_gap <= 0.01:
        exact = "exactly" if kv_gap == 0 else f"(KV within {100 * kv_gap:.1f} %)"
        return "high", f"the planner reproduces the server {exact}: {facts}"
    worst = max(mrr_gap, slot_gap, kv_gap)
    level = "medium" if mrr_gap == 0 and worst <= 0.10 else "low"
    return level, (
        f"the planner predicts {facts}; the server has {state.effective_mrr} running, "
        f"{state.mamba_slots or 0} slots, {state.kv_tokens:,} KV tokens (off by up to {100 * worst:.0f} %)"
    )


_INERT_WHY = {
    "mamba_full_memory_ratio": "while --max-mamba-cache-size is set",
    "num_continuous_decode_steps": "nothing in SGLang 0.5.23 reads it",
}


def _inert_lines(inert: list[str], config: dict[str, Any]) -> list[str]:
    out = []
    for dest in inert:
        flag = "--" + dest.replace("_", "-")
        out.append(
            f"{flag} {config.get(dest, '')}".rstrip()
            + f" changes nothing: {_INERT_WHY.get(dest, 'under the other flags')}"
        )
    return out


def _mfs_grid(current: float) -> list[float]:
    start = round(current + 0.01, 2)
    return [
        round(start + 0.01 * i, 2)
        for i in range(int(round((MFS_MAX - start) / 0.01)) + 1)
        if start + 0.01 * i <= MFS_MAX + 1e-9
    ]


def _tokens_per_request(state: ServerState) -> int:
    """KV a running request may grow to: twice what the live load holds per request, at least a default."""
    m = state.metrics or {}
    running, used = (
        m.get("sglang:num_running_reqs"),
        m.get("sglang:kv_used_tokens", m.get("sglang:num_used_tokens")),
    )
    observed = 2 * int(used / running) if running and used else 0
    need = max(DEFAULT_TOKENS_PER_REQUEST, observed)
    return min(need, state.context_len) if state.context_len else need


def search(
    state: ServerState,
    plan_fn: Callable[..., Any],
    model: Any,
    gpu: Any,
    config: dict[str, Any],
    current: Any,
    confidence: str,
) -> list[Suggestion]:
    """The best combined change first (the safest of the highest), then the single changes that lift
    ``max_running_requests``, each with its predicted capacity."""
    extra = current.extra
    ratio = extra.get("ratio")
    # SGLang's request cap before the pools cut it: explicit, 48 under speculative decoding, else its estimate.
    requested = extra.get("requested_mrr") or config.get("max_running_requests") or (48 if extra.get("spec") else 4096)
    margin = max(2.0, 0.02 * float(extra.get("total_gib") or 0.0))
    tokens_per_request = _tokens_per_request(state)
    floor = state.effective_mrr
    hybrid = current.max_mamba_cache_size is not None and bool(ratio)
    mfs = float(config.get("mem_fraction_static") or current.mem_fraction_static)
    planned: dict[tuple, Any] = {}  # planner calls, cached: the searches below revisit the same candidates

    def lifts(flags: dict[str, Any]) -> Candidate | None:
        """The candidate, if it starts with headroom to spare and lifts the running-request limit."""
        key = tuple(sorted(flags.items()))
        if key not in planned:
            p = plan_fn(model, gpu, {**config, **flags})
            good = p.fits and p.gib.headroom >= margin and p.kv_tokens >= p.max_running_requests * tokens_per_request
            planned[key] = p if good else None
        p = planned[key]
        return Candidate(flags, p) if p is not None and p.max_running_requests > floor else None

    combos: list[Candidate] = []
    if hybrid:
        for value in [mfs, *_mfs_grid(mfs)]:
            # K = ratio × T slots serve T requests; past SGLang's request cap the cap must rise with them.
            def lifts_at(t: int, value: float = value) -> Candidate | None:
                flags: dict[str, Any] = {} if value == mfs else {"mem_fraction_static": value}
                flags["max_mamba_cache_size"] = ratio * t
                if t > requested:
                    flags["max_running_requests"] = t
                return lifts(flags)

            best = _bisect(lifts_at, floor + 1, 1024)
            if best:
                combos.append(best)
    singles: list[Candidate | None] = []
    if hybrid:
        singles.append(_bisect(lambda t: lifts({"max_mamba_cache_size": ratio * t}), floor + 1, requested))
        if "max_mamba_cache_size" not in config:
            r = float(config.get("mamba_full_memory_ratio") or 0.9)
            singles += [lifts({"mamba_full_memory_ratio": round(r * k, 2)}) for k in (1.5, 2, 3)]
            if not config.get("mamba_ssm_dtype"):
                singles.append(lifts({"mamba_ssm_dtype": "bfloat16"}))
    singles += [lifts({"mem_fraction_static": value}) for value in _mfs_grid(mfs)]
    singles += [lifts({"max_running_requests": cap}) for cap in (64, 96, 128) if cap > requested]
    if extra.get("binding") == "kv" and not config.get("kv_cache_dtype"):
        singles.append(lifts({"kv_cache_dtype": "fp8_e4m3"}))
    return _rank(combos, [x for x in singles if x], FlagTable.bundled(), confidence, margin)


def _bisect(test: Callable[[int], Any], low: int, high: int) -> Any:
    """The result of ``test`` at the largest value in [low, high] where it is truthy (``test`` is monotone)."""
    best = None
    while low <= high:
        mid = (low + high) // 2
        result = test(mid)
        if result:
            best, low = result, mid + 1
        else:
            high = mid - 1
    return best


def _key(item: Candidate) -> tuple:
    changes, p = item.flags, item.plan
    return (-p.max_running_requests, len(changes), changes.get("mem_fraction_static", 0.0), -p.gib.headroom)


def _rank(
    combos: list[Candidate], singles: list[Candidate], table: Any, confidence: str, margin: float
) -> list[Suggestion]:
    """First the highest-capacity combination with comfortable headroom, then the highest outright if it differs,
    then the best single change per flag; at most six."""
    picked: list[Candidate] = []
    safe = sorted((c for c in combos if c.plan.gib.headroom >= 2 * margin), key=_key)
    picked += safe[:1]
    best = sorted(combos, key=_key)[:1]
    if best and (not picked or best[0].plan.max_running_requests > picked[0].plan.max_running_requests):
        picked += best
    by_flag: dict[str, Candidate] = {}
    for item in sorted(singles, key=_key):
        by_flag.setdefault(next(iter(item.flags)), item)
    picked += sorted(by_flag.values(), key=_key)
    out: list[Suggestion] = []
    for candidate in picked:
        changes, p = candidate.flags, candidate.plan
        if any(sug.changes == changes for sug in out):
            continue
        level = confidence if p.gib.headroom >= 2 * margin else _LEVEL[max(0, _LEVEL.index(confidence) - 1)]
        note = None
        if changes.get("mamba_ssm_dtype") == "bfloat16":
            note = "halves the SSM state precision: check output quality"
        elif changes.get("kv_cache_dtype"):
            note = "fp8 KV: check output quality"
        elif level != confidence:
            note = f"thin headroom ({p.gib.headroom:.1f} GiB)"
        out.append(
            Suggestion(
                changes=changes,
                argv=table.to_argv(changes),
                max_running_requests=p.max_running_requests,
                binding=p.extra.get("binding"),
                kv_tokens=p.kv_tokens,
                mamba_slots=p.max_mamba_cache_size,
                mem_fraction_static=p.mem_fraction_static,
                headroom_gib=round(p.gib.headroom, 2),
                confidence=level,
                note=note,
            )
        )
    return out[:6]


def advise(state: ServerState, cap: Any, *, model: str | None = None, gpu: str | None = None) -> Advice:
    """Replay the server's config through the planner and search the next step; explain what is missing."""
    profile, model_name, model_note = resolve_model(state, model)
    gpu_profile, gpu_name, gpu_note = resolve_gpu(state, gpu)
    notes = [n for n in (model_note, gpu_note) if n]
    config: dict[str, Any] | None = None
    try:
        config = FlagTable.bundled().check(state.user_flags())
    except AutotuneError as exc:
        notes.append(f"the server's flags are not all SGLang 0.5.23 flags ({exc}): no planner advice")
    if config is None or profile is None or gpu_profile is None:
        return Advice(
            model=model_name,
            gpu=gpu_name,
            config=state.user_flags() if config is None else config,
            confidence=None,
            reproduction=None,
            plan_gib=None,
            notes=notes,
        )
    current = plan(profile, gpu_profile, config)
    confidence, sentence = reproduce(current, state)
    plan_gib = {**asdict(current.gib), "total": current.extra.get("total_gib")}
    suggestions = search(state, plan, profile, gpu_profile, config, current, confidence)
    if not suggestions:
        notes.append(
            "no single or combined change the planner trusts lifts max_running_requests "
            "while keeping headroom: this config is at the memory wall"
        )
    return Advice(
        model=model_name,
        gpu=gpu_name,
        config=config,
        confidence=confidence,
        reproduction=sentence,
        plan_gib=plan_gib,
        suggestions=suggestions,
        inert=_inert_lines(list(current.inert), config),
        notes=notes,
        ratio=current.extra.get("ratio"),
        requested_mrr=current.extra.get("requested_mrr"),
    )
