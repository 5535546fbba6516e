"""The simulator's numerics model: after how many tokens a greedy output stops matching the reference.

Each output-changing flag that differs from the reference draws, per request, the position of its first changed
token from a log-normal of its own (seeded, so a rerun diverges at the same place); ``--sim-numerics-flags``
extends it past the table. A model chosen to be plausible, not a measurement of SGLang: docs/numerics.md §2.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autotune.sglang.numerics import changes_numerics, numerics_flag
from autotune.sim.args import sglang_defaults
from autotune.sim.requests import stable_hash
from autotune.sim.tokens import STREAM, TokenPlan, segment_offset

__all__ = ["DIVERGENCE", "GENERIC", "UNLISTED", "Divergence", "SimNumerics", "divergence_for"]


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where one flag's first changed token falls (log-normal, in output tokens) and how far logprobs move."""

    median_tokens: float
    sigma: float
    logprob_shift: float  # nats subtracted from every output token's log-probability

    def draw(self, rng: random.Random) -> int:
        """An output position ≥ 1 (the first token always matches: the prompt's prefill is shared)."""
        return max(1, int(rng.lognormvariate(math.log(self.median_tokens), self.sigma)))


GENERIC = Divergence(median_tokens=200, sigma=1.0, logprob_shift=0.01)  # any table flag without its own entry
_FOUR_BIT = Divergence(median_tokens=8, sigma=1.0, logprob_shift=0.2)
# A flag outside the table that changes outputs (``--sim-numerics-flags``) stands for a bug, not rounding: outputs part
# within tens of tokens, so a probe of 64 tokens sees it on nearly every prompt.
UNLISTED = Divergence(median_tokens=16, sigma=0.5, logprob_shift=0.05)

# flag → value → model ("*": any other non-reference value); None: no divergence on a bfloat16 checkpoint.
DIVERGENCE: dict[str, dict[Any, Divergence | None]] = {
    "mamba_ssm_dtype": {
        "bfloat16": Divergence(120, 0.8, 0.02),
        "float16": Divergence(300, 0.8, 0.008),
        "*": Divergence(120, 0.8, 0.02),
    },
    "kv_cache_dtype": {
        "fp8_e4m3": Divergence(40, 0.9, 0.05),
        "fp8_e5m2": Divergence(20, 0.9, 0.08),
        "mxfp8": Divergence(50, 0.9, 0.04),
        "nvfp4": _FOUR_BIT,
        "fp4_mx_block16": _FOUR_BIT,
        "bf16": None,
    },
    "quantization": {
        "fp8": Divergence(60, 1.0, 0.04),
        "w8a8_fp8": Divergence(60, 1.0, 0.04),
        "*": Divergence(30, 1.0, 0.1),
    },
    "dtype": {"bfloat16": None, "float16": Divergence(250, 0.9, 0.01), "float32": Divergence(150, 0.9, 0.02)},
}


def divergence_for(flag: str, value: Any) -> Divergence | None:
    """The model for ``flag`` set to a non-reference ``value`` (``GENERIC`` for flags without their own)."""
    per_value = DIVERGENCE.get(flag)
    if per_value is None:
        return GENERIC
    return per_value[value] if value in per_value else per_value.get("*", GENERIC)


@dataclass(frozen=True)
class SimNumerics:
    """One server's numerics: its non-reference flags (``"flag=value"`` keys) with their divergence models."""

    changes: tuple[tuple[str, Divergence], ...] = ()

    @classmethod
    def for_server(
        cls, server_args: Mapping[str, Any], *, hybrid: bool, ssm_dtype: str = "float32", unlisted: Iterable[str] = ()
    ) -> SimNumerics:
        """From a server's args; Mamba flags are inert on a model without Mamba/GDN layers. ``unlisted``
        (``--sim-numerics-flags``): flags outside the table that change outputs here anyway, at any value other
        than SGLang's default, with the ``UNLISTED`` model (the bug a contender probe must catch)."""
        defaults = {"mamba_ssm_dtype": ssm_dtype} if hybrid else None
        changes = []
        for change in changes_numerics(server_args, None, defaults=defaults):
            if "mamba" in change.flag and not hybrid:
                continue
            model = divergence_for(change.flag, change.value)
            if model is not None:
                changes.append((f"{change.flag}={change.value}", model))
        parser_defaults = sglang_defaults()
        for flag in unlisted:
            value = server_args.get(flag)
            if numerics_flag(flag) is None and value not in (None, False) and value != parser_defaults.get(flag):
                changes.append((f"{flag}={value}", UNLISTED))
        return cls(tuple(changes))

    @property
    def shift(self) -> float:
        return sum(model.logprob_shift for _, model in self.changes)

    def plan(self, text: str, seed: int, *, base: int) -> TokenPlan:
        """The token plan of a request with prompt ``text`` whose reference tokens start at stream ``base``
        (any integer; folded onto the stream)."""
        draws = sorted(
            (model.draw(random.Random(stable_hash("diverge", seed, text, key))), key) for key, model in self.changes
        )
        base %= STREAM
        segments = [(0, base)]
        keys: list[str] = []
        for position, key in draws:
            keys.append(key)
            offset = segment_offset(base, "|".join(sorted(keys)))
            if segments[-1][0] == position:
                segments[-1] = (position, offset)
            else:
                segments.append((position, offset))
        return TokenPlan(tuple(segments), self.shift)
