"""``--speculative-adaptive`` in SGLang 0.5.23: speculative steps chosen per running batch size at run time; when the
flag is dropped or refused, what it resolves to, and its memory. The rules with their SGLang lines:
docs/sglang-memory.md §1 (and §3, §5 for the scratch and the graphs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.results.plan import AdaptiveFigures
from autotune.sglang.args import PlanStop

__all__ = ["AdaptiveSpec", "SlotConfig", "load_config", "resolve", "settled_steps", "slot_for", "unsupported_reason"]


@dataclass(frozen=True)
class SlotConfig:
    """One batch-size slot of the adaptive table (``AdaptiveStepSlot``'s knobs, its defaults for absent ones)."""

    candidates: tuple[int, ...]
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    ceiling_coeff: float = 0.0


# DEFAULT_ADAPTIVE_CONFIG, adaptive_spec_params.py L28-53.
DEFAULT_TABLE: dict[int, SlotConfig] = {
    1: SlotConfig((1, 3, 5, 7), 0.0, -0.25),
    8: SlotConfig((0, 1, 3), 0.0, 0.0),
    32: SlotConfig((0, 1), 0.0, 0.0),
    64: SlotConfig((0,), 0.0, 0.0),
}


@dataclass(frozen=True)
class AdaptiveSpec:
    """The adaptive controller a config starts: its table, the initial steps and the draft-token bound."""

    table: Mapping[int, SlotConfig]
    initial_steps: int
    candidates: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(sorted({s for c in self.table.values() for s in c.candidates})))

    @property
    def max_draft_tokens(self) -> int:
        """``resolve_max_speculative_num_draft_tokens`` (``spec_info.py`` L268-289): max(candidates) + 1."""
        return max(self.candidates) + 1

    def slot_initial(self, key: int) -> int:
        """A slot's first steps (``AdaptiveStepSlot.__init__``, L178-181): the initial steps if a candidate,
        else its middle candidate."""
        cands = self.table[key].candidates
        return self.initial_steps if self.initial_steps in cands else cands[len(cands) // 2]

    def to_dict(self) -> AdaptiveFigures:
        return {
            "initial_steps": self.initial_steps,
            "candidates": list(self.candidates),
            "max_draft_tokens": self.max_draft_tokens,
            "slots": {
                str(k): {
                    "candidate_steps": list(v.candidates),
                    "up_hysteresis": v.up_hysteresis,
                    "down_hysteresis": v.down_hysteresis,
                    "ceiling_coeff": v.ceiling_coeff,
                }
                for k, v in sorted(self.table.items())
            },
        }

    @classmethod
    def from_dict(cls, data: AdaptiveFigures) -> AdaptiveSpec:
        """Back from ``to_dict`` (the plan's ``extra["adaptive"]``, which the simulator reads)."""
        table = {
            int(k): SlotConfig(
                tuple(int(x) for x in v["candidate_steps"]),
                float(v["up_hysteresis"]),
                float(v["down_hysteresis"]),
                float(v["ceiling_coeff"]),
            )
            for k, v in data["slots"].items()
        }
        return cls(table, int(data["initial_steps"]))

    def steps_for(self, batch: int, graph_bs: tuple[int, ...] | list[int] | None, alpha: float) -> int:
        """The steps a batch of ``batch`` runs at once its slot has settled at acceptance ``alpha``."""
        key = slot_for(batch, list(self.table), graph_bs)
        return settled_steps(self.table[key], self.slot_initial(key), alpha)


def load_config(path: str | None) -> dict[int, SlotConfig]:
    """``_load_adaptive_config`` (L103-139): the default table, or a JSON file's integer-string keys (top-level
    knobs shared, a slot's own winning). A missing file or a bad entry is SGLang's own error at startup."""
    if path is None:
        return dict(DEFAULT_TABLE)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanStop(
            "bad_args",
            f"FileNotFoundError: [Errno 2] No such file or directory: {path!r} (--speculative-adaptive-config)",
        ) from None
    except (OSError, ValueError) as exc:
        raise PlanStop("bad_args", f"--speculative-adaptive-config {path}: {exc}") from None
    table: dict[int, SlotConfig] = {}
    shared = {k: v for k, v in raw.items() if not str(k).isdigit()} if isinstance(raw, dict) else {}
    for key, entry in raw.items() if isinstance(raw, dict) else ():
        if not str(key).isdigit():
            continue
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
            raise PlanStop(
                "bad_args", f"ValueError: BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}"
            )
        knobs = {**shared, **entry}
        table[int(key)] = SlotConfig(
            tuple(sorted(set(steps))),
            float(knobs.get("up_hysteresis", 0.0)),
            float(knobs.get("down_hysteresis", -0.25)),
            float(knobs.get("ceiling_coeff", 0.0)),
        )
    if not table:
        keys = list(raw) if isinstance(raw, dict) else []
        raise PlanStop(
            "bad_args",
            "ValueError: speculative_adaptive_config must contain at least one integer-string "
            f'BS key, e.g. {{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {keys}',
        )
    return table


def unsupported_reason(algorithm: str | None, f: Mapping[str, Any], attn_dp: int) -> str | None:
    """``adaptive_unsupported_reason`` (L56-104), for the flags the planner knows; ``algorithm`` is resolved
    (NEXTN/MTP already EAGLE)."""
    if algorithm not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={algorithm} (only EAGLE/EAGLE3 are supported)"
    topk = f.get("speculative_eagle_topk")
    if topk is not None and int(topk) != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    if attn_dp > 1 or f.get("enable_dp_attention"):
        return "attention DP is not supported (adaptive tier decisions are not synchronized across DP ranks)"
    if f.get("enable_multi_layer_eagle"):
        return "enable_multi_layer_eagle=True is not supported (MultiLayerEagleWorkerV2 does not implement adaptive)"
    if f.get("enable_two_batch_overlap"):
        return (
            "enable_two_batch_overlap=True is not supported (adaptive state swap would discard the "
            "TboAttnBackend wrapper)"
        )
    if f.get("enable_pdmux"):
        return "enable_pdmux=True is not supported (adaptive state swap does not update decode_attn_backend_group)"
    return None


def resolve(f: Mapping[str, Any], attn_dp: int) -> tuple[dict[str, Any], AdaptiveSpec | None, list[str]]:
    """The flags the speculative resolution then sees, the controller (None when off) and SGLang's warnings:
    ``_maybe_disable_adaptive`` and ``_init_adaptive_speculative_params`` (speculative_hook.py L261-264,
    L1374-1426), which run before the EAGLE family's auto parameters (L1159, skipped under adaptive)."""
    if not f.get("speculative_adaptive"):
        return dict(f), None, []
    algo = f.get("speculative_algorithm")
    name = str(algo).upper() if algo else None
    resolved = "EAGLE" if name in ("NEXTN", "MTP") else name
    reason = unsupported_reason(resolved, f, attn_dp)
    if reason is not None:
        return dict(f), None, [f"speculative_adaptive disabled: {reason}. Falling back to static speculative params."]
    table = load_config(f.get("speculative_adaptive_config"))
    candidates = sorted({s for c in table.values() for s in c.candidates})
    out = dict(f)
    if out.get("speculative_eagle_topk") is None:
        out["speculative_eagle_topk"] = 1
    steps = out.get("speculative_num_steps")
    if steps is None:
        steps = out["speculative_num_steps"] = candidates[len(candidates) // 2]
    if int(steps) not in candidates:
        raise PlanStop(
            "bad_args",
            f"ValueError: --speculative-num-steps={steps} is not in the adaptive config "
            f"candidate_steps {candidates}. Pass one of those values.",
        )
    out["speculative_num_draft_tokens"] = int(steps) + 1
    return out, AdaptiveSpec(table, int(steps)), []


def slot_for(batch: int, table_keys: list[int] | tuple[int, ...], graph_bs: list[int] | tuple[int, ...] | None) -> int:
    """``AdaptiveSpeculativeParams._route`` (L342-358): pad ``batch`` to the next captured graph size (unchanged
    past the largest, or without graphs), then the largest slot key not above it (the smallest key below all)."""
    padded = batch
    if graph_bs:
        bigger = [b for b in graph_bs if b >= batch]
        padded = min(bigger) if bigger else batch
    keys = sorted(table_keys)
    below = [k for k in keys if k <= padded]
    return below[-1] if below else keys[0]


def expected_accepted_drafts(alpha: float, steps: int) -> float:
    """Mean accepted drafts per request of a verify over a ``steps``-token chain, each accepted with ``alpha``
    (the quantity ``AdaptiveStepSlot.update`` averages: L187-211)."""
    return sum(alpha**i for i in range(1, steps + 1))


def settled_steps(slot: SlotConfig, initial: int, alpha: float) -> int:
    """The steps a slot settles on when its EMA sits at its expectation: ``_recompute_params`` (L213-261) iterated
    from ``initial`` until it stops moving (or revisits a step: the larger of a 2-cycle, which its up-move
    reaches). The EMA's warm-up, lag and noise are not modelled."""
    cands = list(slot.candidates)
    steps, seen = initial, []
    while steps not in seen:
        seen.append(steps)
        steps = _next_steps(slot, cands, steps, alpha)
    cycle = seen[seen.index(steps) :]
    return max(cycle)


def _next_steps(slot: SlotConfig, cands: list[int], steps: int, alpha: float) -> int:
    idx = cands.index(steps)
    if steps == 0:  # a zero-step interval probes the smallest positive step next
        return cands[min(idx + 1, len(cands) - 1)]
    ema = expected_accepted_drafts(alpha, steps)
    start = idx
    while idx > 0:
        prev = cands[idx - 1]
        if ema <= (0.5 if prev == 0 else prev - 0.5) + slot.down_hysteresis:
            idx -= 1
        else:
            break
    if idx == start:
        while idx < len(cands) - 1 and ema > cands[idx] - 0.5 + slot.up_hysteresis:
            idx += 1
    target = cands[idx]
    if slot.ceiling_coeff > 0:
        ceiling = max(1, math.ceil(ema * slot.ceiling_coeff))
        if ceiling < target <= steps:
            while idx > 0 and cands[idx] > ceiling:
                idx -= 1
            target = cands[idx]
    return target
