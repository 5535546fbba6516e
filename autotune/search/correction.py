"""The planner learns its error online, from everything a launched trial tells it.

Two corrections, each from what a trial reports and nothing else: the pools' free-memory offset (from the capacity
SGLang logged) and the room left for graphs and activations at peak (from NVML's peak and every OOM). ``predict``
applies both; ``sure_failure`` keeps the margin. What each learns from, and from what not: docs/search.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.results import TrialResult
from autotune.results.plan import PlanDetails
from autotune.search.space import Feasibility, key_of
from autotune.sglang.memory import MemoryPlan

LAUNCHED_FAILURES = frozenset({"startup_oom", "runtime_oom", "bad_args"})  # the same config fails the same way
OOM = frozenset({"startup_oom", "runtime_oom"})
OOM_MARGIN_GIB = 0.25  # an OOM says the room was below zero; assume at least this far below
MIN_ACT_SPREAD_GIB = 1.0  # two room measurements this far apart in activation memory fit a slope
MAX_SLOPE = 1.0  # |c1|: the activation peak is off by at most its own size
# An OOM that logged this share of the device less free than the plan expects at that point is another process's
# doing: the planner's errors are a few GiB (weights, workspace, graphs), never a quarter of the GPU.
TENANT_GAP_SHARE = 0.25
CAPACITY_KEYS = ("kv_tokens", "max_mamba_cache_size", "max_running_requests")


@dataclasses.dataclass(frozen=True)
class Prior:
    """Corrections learnt by an earlier study (``search.warm``: scaled to this GPU), used until this study measures
    its own of the same kind: its capacity offsets until a launch here gives one, its room points and OOM bounds until
    a launch here measures the room. Another device's error is a better start than none, never better than a
    measurement on this one; and it never removes the skip margin (``sure_failure``)."""

    offsets: tuple[float, ...] = ()
    room: tuple[tuple[float, float], ...] = ()
    ooms: tuple[tuple[float, float], ...] = ()


def _graph_stage(mp: Any) -> bool:
    """The plan got past pool sizing: it fits, or only graphs/activations did not fit (headroom is meaningful)."""
    if mp.kv_tokens <= 0 or mp.max_running_requests <= 0:
        return False
    if mp.fits or mp.failure == "runtime_oom":
        return True
    return mp.failure == "startup_oom" and str(mp.message or "").startswith("Capture cuda graph failed")


_PLANS: dict[
    tuple[Any, ...], MemoryPlan
] = {}  # (model, GPU, config, offset, inert) → plan: the planner is a pure function
_PLANS_MAX = 50_000


class CorrectedFeasibility(Feasibility):
    """``Feasibility`` with a planner that learns its capacity and room errors from each launched trial."""

    def _plan(self, config: Mapping[str, Any], offset: float = 0.0, *, inert: bool = True) -> MemoryPlan:
        key = (
            getattr(self.model, "name", id(self.model)),
            getattr(self.gpu, "name", id(self.gpu)),
            getattr(self.gpu, "memory_gib", None),
            key_of(config),
            round(offset, 9),
            inert,
        )
        mp = _PLANS.get(key)
        if mp is None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            mp = _PLANS[key] = super()._plan(config, offset, inert=inert)
        return mp

    def __init__(self, model: Any, gpu: Any, *, margin_gib: float = 1.0):
        super().__init__(model, gpu, margin_gib=margin_gib)
        self.room: list[tuple[float, float]] = []  # (planned activations GiB, measured − planned headroom GiB)
        self.ooms: list[tuple[float, float]] = []  # (planned activations GiB, planned headroom GiB) of OOMed configs
        self.prior = Prior()  # an earlier study's corrections (``--from``), until this study measures its own

    @property
    def offset_gib(self) -> float:
        offsets = self.offsets or list(self.prior.offsets)
        return float(sorted(offsets)[len(offsets) // 2]) if offsets else 0.0

    def _room_points(self) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """(room points, OOM bounds): this study's once it has either, else the prior's."""
        if self.room or self.ooms:
            return self.room, self.ooms
        return list(self.prior.room), list(self.prior.ooms)

    # -- the correction -------------------------------------------------------------------------------------
    def room_model(self) -> tuple[float, float]:
        """(c0, c1): the room correction at a config with ``a`` GiB of planned activations is c0 + c1·a."""
        c0, c1 = 0.0, 0.0
        room, ooms = self._room_points()
        if room:
            acts = [a for a, _ in room]
            if max(acts) - min(acts) >= MIN_ACT_SPREAD_GIB:
                n = len(room)
                ma, md = sum(acts) / n, sum(d for _, d in room) / n
                var = sum((a - ma) ** 2 for a in acts)
                c1 = sum((a - ma) * (d - md) for a, d in room) / var
                c1 = max(-MAX_SLOPE, min(MAX_SLOPE, c1))
                c0 = md - c1 * ma
                c0 += min(d - (c0 + c1 * a) for a, d in room)  # conservative: no measurement below the line
            else:
                c0 = min(d for _, d in room)
        for act, planned in ooms:  # it OOMed: the corrected room there was below zero
            bound = -planned - OOM_MARGIN_GIB
            if c0 + c1 * act > bound:
                c0 = bound - c1 * act
        return c0, c1

    def room_offset(self, activations: float) -> float:
        c0, c1 = self.room_model()
        return c0 + c1 * activations

    @property
    def learned(self) -> bool:
        return bool(self.offsets or self.room or self.ooms or self.prior != Prior())

    def raw(self, config: Mapping[str, Any], *, inert: bool = False) -> MemoryPlan:
        """The uncorrected planner's plan (what SGLang's arithmetic says with the modelled constants)."""
        return self._plan(config, 0.0, inert=inert)

    def predict(self, config: Mapping[str, Any], *, inert: bool = True) -> MemoryPlan:
        mp = super().predict(config, inert=inert)
        if not any(self._room_points()) or not _graph_stage(mp):
            return mp
        delta = self.room_offset(mp.gib.activations)
        headroom = mp.gib.headroom + delta
        gib = dataclasses.replace(mp.gib, headroom=round(headroom, 4))
        extra: PlanDetails = {**mp.extra, "room_correction_gib": round(delta, 3)}
        if headroom >= 0 and not mp.fits:
            return dataclasses.replace(
                mp,
                fits=True,
                failure=None,
                gib=gib,
                extra=extra,
                message=f"corrected planner: fits with {headroom:.2f} GiB headroom (the "
                f"uncorrected plan: {mp.message})",
            )
        if headroom < 0 and mp.fits:
            return dataclasses.replace(
                mp,
                fits=False,
                failure="runtime_oom",
                gib=gib,
                extra=extra,
                message=f"corrected planner: {headroom:.2f} GiB headroom at peak (planned "
                f"{mp.gib.headroom:.2f} GiB, corrected by {delta:+.2f} GiB from "
                f"{self._evidence()})",
            )
        return dataclasses.replace(mp, gib=gib, extra=extra)

    def _evidence(self) -> str:
        if self.room or self.ooms:
            return f"{len(self.room)} measured peaks and {len(self.ooms)} OOMs"
        return (
            f"the earlier study's {len(self.prior.room)} measured peaks and {len(self.prior.ooms)} OOMs, scaled to "
            "this GPU"
        )

    def sure_failure(self, memory_plan: MemoryPlan) -> bool:
        if memory_plan.fits:
            return False
        if not _graph_stage(memory_plan):
            return True  # bad arguments or pool arithmetic: no GPU starts it
        # Uncorrected, a deficit within the margin is launched (the estimate of graph and activation memory is the
        # least exact part of the plan). Once peaks or OOMs have measured the room, the correction is the estimate:
        # a corrected deficit is skipped.
        return bool(memory_plan.gib.headroom < (0.0 if self.room or self.ooms else -self.margin_gib))

    # -- learning -------------------------------------------------------------------------------------------
    def learn_capacity(self, config: Mapping[str, Any], capacity: Any) -> float | None:
        """The free-memory offset that reproduces the logged capacity: KV tokens, else Mamba slots, else the
        running cap (each where the pools decided it). Returns it (GiB) or None."""
        if capacity is None:
            return None
        offset = self.learn(config, capacity.kv_tokens)
        if offset is not None:
            return offset
        at0 = self._plan(config, 0.0, inert=False)
        if not at0.fits:
            return None
        for key, seen in (
            ("max_mamba_cache_size", capacity.mamba_slots),
            ("max_running_requests", capacity.max_running_requests),
        ):
            if not seen or key in config and key == "max_mamba_cache_size":
                continue  # an explicit slot count is the user's, not the pools'
            planned = getattr(at0, key) or 0
            if not planned or planned == seen:
                continue
            lo, hi = (0.0, 16.0) if seen < planned else (-16.0, 0.0)  # less capacity: less free memory

            def value_at(o: float, k: str = key) -> int:
                return int(getattr(self._plan(config, o, inert=False), k) or 0)

            if (value_at(lo) - seen) * (value_at(hi) - seen) > 0:
                continue  # not reachable by a free-memory offset (another cause)
            for _ in range(24):
                mid = (lo + hi) / 2
                if (value_at(mid) > seen) == (value_at(lo) > seen):
                    lo = mid
                else:
                    hi = mid
            self.offsets.append((lo + hi) / 2)
            return (lo + hi) / 2
        return None

    def tenant_oom(self, config: Mapping[str, Any], result: TrialResult) -> str | None:
        """Why an OOM is a tenant's, not the plan's: the free memory it logged is further below what the plan
        expects at that point than any planner error goes (``TENANT_GAP_SHARE`` of the device) — at load, what the
        idle device has free (``… GiB free`` while loading weights); later, what the pools leave (torch's ``of which
        … GiB is free``). None when the OOM is the plan's to learn from."""
        if result.status not in OOM:
            return None
        total = float(getattr(self.gpu, "memory_gib", 0.0) or 0.0)
        at_load = load_free_in_message(result.reason)
        if at_load is not None:
            free, stage = at_load, "the idle device has"
            expected = float(self._plan(config, 0.0, inert=False).extra.get("pre_gib") or 0.0)
        else:
            logged = free_in_message(result.reason)
            if logged is None:
                return None
            g = self._plan(config, self.offset_gib, inert=False).gib
            capture = "Capture cuda graph failed" in str(result.reason)
            free, stage = logged, "the plan leaves"
            expected = g.headroom + g.activations + (g.graphs if capture else 0.0)
        if total <= 0 or expected - free <= TENANT_GAP_SHARE * total:
            return None
        return (
            f"the OOM logged {free:.2f} GiB free where {stage} {expected:.2f} GiB: {expected - free:.1f} GiB "
            "missing, more than any planner error, so another process held the GPU (the tenant's OOM, not this "
            "config's; the planner learnt nothing from it)"
        )

    def learn_trial(self, config: Mapping[str, Any], result: TrialResult) -> dict[str, float]:
        """Learn from one launched trial: its capacity, its measured peak, its OOM. Returns what was learned;
        nothing from a launch next to a tenant (``shared_launch``, ``tenant_oom``)."""
        out: dict[str, float] = {}
        if shared_launch(result) or self.tenant_oom(config, result) is not None:
            return out
        if result.ok:
            offset = self.learn_capacity(config, result.capacity)
            if offset is not None:
                out["planner_offset_gib"] = round(offset, 3)
        if result.status not in OOM and not (result.ok and result.gpu and result.gpu.headroom_gib is not None):
            return out
        planned = self._plan(config, self.offset_gib, inert=False)  # capacity-corrected, room uncorrected
        if not _graph_stage(planned):
            return out
        if result.ok and result.gpu is not None and result.gpu.headroom_gib is not None:
            delta = float(result.gpu.headroom_gib) - planned.gib.headroom
            self.room.append((planned.gib.activations, delta))
            out["planner_room_gib"] = round(delta, 3)
        else:
            g = planned.gib
            self.ooms.append((g.activations, g.headroom))
            out["planner_oom_headroom_gib"] = round(g.headroom, 3)
            free = free_in_message(result.reason)
            if free is not None:  # torch says what was free: a measurement of the room, not just a bound
                capture = "Capture cuda graph failed" in str(result.reason)
                delta = free - (g.headroom + g.activations + (g.graphs if capture else 0.0))
                self.room.append((g.activations, delta))
                out["planner_room_gib"] = round(delta, 3)
        return out


def shared_launch(result: TrialResult) -> bool:
    """The trial launched while other processes held more than the idle floor of its GPU (recorded by the sweep
    in ``measurement.device_at_launch``): its capacity, peak and OOM are the tenant's, not the plan's."""
    seen = result.measurement.device_at_launch if result.measurement else None
    if not isinstance(seen, Mapping):
        return False  # older trials and runners without a device: as before
    held = seen.get("held_gib", seen.get("others_gib"))
    return held is not None and float(held) > float(seen.get("floor_gib") or 0.0)


_FREE = re.compile(r"of which (-?[0-9.]+) GiB is free")


_LOAD_FREE = re.compile(r"GiB of weights, (-?[0-9.]+) GiB free")


def load_free_in_message(reason: str | None) -> float | None:
    """The free memory an OOM while loading weights reports (``(56.58 GiB of weights, 17.80 GiB free)``), GiB."""
    m = _LOAD_FREE.search(reason or "")
    return float(m.group(1)) if m else None


def free_in_message(reason: str | None) -> float | None:
    """The free memory torch's OOM message reports (``... of which 3.21 GiB is free``), in GiB."""
    m = _FREE.search(reason or "")
    return float(m.group(1)) if m else None


def replay(feasibility: Feasibility | None, trials: list[FrozenTrial]) -> None:
    """Learn from a resumed study's finished launches, in order (what the corrections were when it stopped)."""
    if feasibility is None:
        return
    for t in sorted(trials, key=lambda t: t.number):
        result = TrialResult.of(t)
        if t.state != TrialState.COMPLETE or result is None or t.user_attrs.get("reused_from") is not None:
            continue
        if result.status == "skipped_infeasible":
            continue
        if isinstance(feasibility, CorrectedFeasibility):
            feasibility.learn_trial(result.config, result)
        elif result.ok and result.capacity:
            feasibility.learn(result.config, result.capacity.kv_tokens)


def known_failure(trials: list[FrozenTrial], key: str) -> FrozenTrial | None:
    """A finished trial that *launched* exactly this config and failed deterministically (OOM, bad args). An
    earlier planner skip is not one: the corrected planner judges the config again."""
    for t in trials:
        if t.state == TrialState.COMPLETE and t.user_attrs.get("launch_key") == key:
            if t.user_attrs.get("status") in LAUNCHED_FAILURES:
                return t
    return None


def earlier_skip(trials: list[FrozenTrial], key: str) -> FrozenTrial | None:
    """The first trial the planner skipped with exactly this config (not a reuse of a known outcome)."""
    for t in sorted(trials, key=lambda t: t.number):
        if (
            t.state == TrialState.COMPLETE
            and t.user_attrs.get("launch_key") == key
            and t.user_attrs.get("status") == "skipped_infeasible"
            and t.user_attrs.get("reused_from") is None
        ):
            return t
    return None


def skip_was_wrong(
    feasibility: Feasibility | None, trials: list[FrozenTrial], key: str, config: Mapping[str, Any], result: TrialResult
) -> str | None:
    """When a config that ran cleanly had been (or, uncorrected, would have been) skipped: say so."""
    if feasibility is None or not result.ok:
        return None
    skipped = earlier_skip(trials, key)
    if skipped is not None:
        why = skipped.user_attrs.get("reason") or "planner"
        return (
            f"the planner was wrong to skip this config in trial {skipped.number} ({why}); the corrected planner "
            "let it through and it ran"
        )
    if isinstance(feasibility, CorrectedFeasibility) and feasibility.learned:
        raw = feasibility.raw(config)
        if Feasibility.sure_failure(feasibility, raw):
            return (
                f"the uncorrected planner would have skipped this config ({raw.message or raw.failure}); the "
                "corrected planner let it through and it ran"
            )
    return None
