"""The tokens and log-probabilities a simulated request emits.

Every request reads its tokens from one pre-built filler stream (4-digit ids, each exactly 6 text characters,
so a span is a string slice on the pacing loop's hot path). A ``TokenPlan`` says where in that stream a request
starts and, when its server's numerics differ from the reference, from which position on it reads a different
stretch of the stream instead: the continuation after a divergence. Each token's log-probability comes from a
fixed table at the same stream position, minus the plan's shift. All of this is a model of how outputs behave,
not of what a real model would say.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["ID_PERIOD", "STREAM", "TokenPlan", "filler", "logprob_at", "segment_offset", "token_id_at"]

STREAM = 1 << 14  # filler positions a plan may start at; a plan reads up to 2×STREAM tokens on the fast path
ID_PERIOD = 9000  # ids repeat every ID_PERIOD stream positions (7919 is coprime with 9000)
_IDS = [1000 + (i * 7919) % ID_PERIOD for i in range(2 * STREAM)]
_TEXT = "".join(f" w{i}" for i in _IDS)
_IDTXT = ",".join(map(str, _IDS)) + ","
# Greedy log-probabilities: mostly confident (close to 0), with an occasional uncertain token (down to ≈ -3).
_LOGPROBS = [-(0.001 + 3.0 * (((i * 104729) % 32749) / 32749) ** 6) for i in range(2 * STREAM)]


def filler(offset: int, start: int, end: int) -> tuple[str, str]:
    """Text and comma-joined ids of tokens [start, end) of a stream whose filler starts at ``offset``."""
    a, b = offset + start, offset + end
    if b <= 2 * STREAM:
        return _TEXT[a * 6 : b * 6], _IDTXT[a * 5 : b * 5 - 1]
    ids = [_IDS[(offset + i) % (2 * STREAM)] for i in range(start, end)]
    return "".join(f" w{i}" for i in ids), ",".join(map(str, ids))


def token_id_at(offset: int, position: int) -> int:
    return _IDS[(offset + position) % (2 * STREAM)]


def logprob_at(offset: int, position: int) -> float:
    return _LOGPROBS[(offset + position) % (2 * STREAM)]


def segment_offset(base: int, key: str) -> int:
    """Where the continuation named ``key`` starts reading, for a request whose reference starts at ``base``.

    The step is never a multiple of ``ID_PERIOD`` (before or after wrapping at ``STREAM``), so every token of the
    continuation differs from the reference token at the same position; different keys almost always give
    different steps (a 64-bit hash folded onto ``ID_PERIOD - 1`` steps).
    """
    if not key:
        return base
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    step = 1 + digest % (ID_PERIOD - 1)
    if (step - STREAM) % ID_PERIOD == 0:
        step += 1
    return (base + step) % STREAM


@dataclass(frozen=True, slots=True)
class TokenPlan:
    """Which stream positions a request's output tokens come from.

    ``segments`` are ``(first_position, offset)`` pairs in increasing position order, the first at 0: from that
    output position on, tokens are read at ``offset``. ``shift`` (nats, ≥ 0) is subtracted from every token's
    log-probability (the server's arithmetic differs from the first token on, even before a token changes).
    """

    segments: tuple[tuple[int, int], ...]
    shift: float = 0.0

    @classmethod
    def reference(cls, base: int) -> TokenPlan:
        return cls(((0, base % STREAM),))

    @property
    def diverges_at(self) -> int | None:
        """The first output position whose token differs from the reference (None: never)."""
        return self.segments[1][0] if len(self.segments) > 1 else None

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(offset, lo, hi)`` for each segment's share of positions [start, end)."""
        out = []
        bounds = [pos for pos, _ in self.segments[1:]] + [max(end, start)]
        for (pos, offset), nxt in zip(self.segments, bounds, strict=True):
            lo, hi = max(start, pos), min(end, nxt)
            if lo < hi:
                out.append((offset, lo, hi))
        return out

    def span(self, start: int, end: int) -> tuple[str, str]:
        """Text and comma-joined ids of output tokens [start, end)."""
        if len(self.segments) == 1:
            return filler(self.segments[0][1], start, end)
        parts = [filler(offset, lo, hi) for offset, lo, hi in self._pieces(start, end)]
        return "".join(t for t, _ in parts), ",".join(i for _, i in parts if i)

    def ids(self, start: int, end: int) -> list[int]:
        return [token_id_at(offset, i) for offset, lo, hi in self._pieces(start, end) for i in range(lo, hi)]

    def logprobs(self, start: int, end: int) -> list[float]:
        """Log-probability of each output token [start, end) as the server computed it."""
        return [
            logprob_at(offset, i) - self.shift for offset, lo, hi in self._pieces(start, end) for i in range(lo, hi)
        ]
