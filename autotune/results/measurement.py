"""How far a trial's window can be trusted (``MeasurementVerdict``), with the two records it holds about a window
that delivered nothing: the requests the server refused (``Rejections``) and what moved on the server meanwhile
(``ServerProgress``), both filled by ``harness.outcome``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Self

from autotune.results.stored import Sparse, from_known, typed


@dataclass(frozen=True, kw_only=True)
class Rejections:
    """Requests of a replay the server refused or aborted: how many ``of`` the requests sent, by kind (``HTTP 400``,
    ``aborted by server``; most first), and the first one's message, shortened. Stored as its fields (the
    ``dataclasses.asdict`` of ``MeasurementVerdict``'s stored form)."""

    count: int
    of: int
    kinds: Mapping[str, int]
    first: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Rejections | None:
        return from_known(cls, data)


@dataclass(frozen=True, kw_only=True)
class ServerProgress(Sparse):
    """The server's own evidence of work since the replay began: prefill batches and their new tokens and decode
    batches (its log lines), the simulator's modelled seconds across the window. Empty (false) when none moved;
    stored without its None fields."""

    prefill_batches: int | None = None
    prefill_tokens: int | None = None
    decode_batches: int | None = None
    sim_modelled_s: float | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self | None:
        return from_known(cls, data)  # stored empty ({}: nothing moved) reads as an empty record, not None


@dataclass(frozen=True, kw_only=True)
class MeasurementVerdict(Sparse):
    """How far the window can be trusted (``harness.trial.measurement_verdict``): the client's CPU share, the sim
    server's lag, how it settled, the --stream-interval it ran with, and the first attempt when re-measured."""

    client_busy: float | None = None
    repeated_prompts: float | None = None  # share of the window's requests that re-sent a prompt
    window_drift: float | None = None
    settled: bool | None = None  # the settle rule met before its caps (``autotune.settle``)
    settling: Mapping[str, Any] | None = None  # ``Settling.to_dict()``: every slice's tok/s, the window's span
    sim_lag: float | None = None
    stream_interval: int | None = None
    untrusted_tok_s: float | None = None  # an untrusted window's figure: kept for diagnosis, never a tok/s
    rejected: Rejections | None = None  # requests the server refused (``harness.outcome.rejections``)
    progress: ServerProgress | None = None  # what moved in a window that delivered no token
    held_streams: int | None = None  # streams a server that answered none of them held open
    first: Mapping[str, Any] | None = None  # the first attempt's status, reason and figures, when re-measured
    device_at_launch: Mapping[str, Any] | None = None  # what the device held at launch (``search.correction``)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self | None:
        if not data:
            return None
        return super().from_dict(
            {
                **data,
                "rejected": typed(Rejections, data.get("rejected")),
                "progress": typed(ServerProgress, data.get("progress")),
            }
        )
