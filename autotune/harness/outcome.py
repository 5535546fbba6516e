"""What a replay window that delivered no token says about the server, and which requests the server refused.

"No token arrived in the window" has three different causes, and only one is a crash: the server refused the
requests (HTTP errors, a body too large, a prompt over the context length: counted and named), the server was
alive and working but slower than the window (``too_slow``: its log shows prefill or decode batches since the
replay began, or the simulator's clock advanced; or it accepted the client's streams and held them open without
answering any, a server starved of memory or CPU: the fix is a longer window, a lower load or a faster host), or it
did nothing.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from autotune.harness.workload.records import CUT, SimPace
from autotune.results import TOO_SLOW, MeasurementVerdict, Rejections, ServerProgress, Status

_PREFILL = re.compile(r"Prefill batch[.,] #new-seq: (\d+), #new-token: (\d+)")
_DECODE = re.compile(r"Decode batch[.,] #running-req: (\d+)")
STUDY_OPTIONS = ("workload.measure_s", "workload.warmup_s")  # the window's and warm-up's names in a study file
DOMINANT = 0.5  # rejections at or above this share of the requests sent are named in the reason


def _kind(error: str) -> str | None:
    """The refusal an error records (``HTTP 400``, ``aborted``), or None for a client-side failure."""
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    if error.startswith("aborted by server"):
        return "aborted by server"
    return None


def rejections(requests: Sequence[Any]) -> Rejections | None:
    """Requests of the replay the server refused or aborted, counted by kind with the first one's message
    (shortened); None when it refused none."""
    kinds: Counter[str] = Counter()
    first = None
    for rec in requests:
        kind = _kind(rec.error) if rec.error else None
        if kind is not None:
            kinds[kind] += 1
            first = first or rec.error[:200]
    if not kinds:
        return None
    return Rejections(count=sum(kinds.values()), of=len(requests), kinds=dict(kinds.most_common()), first=first)


def rejection_line(rejected: Rejections) -> str:
    """``the server rejected 60 of the 64 requests sent (60 × HTTP 400; first: …)``."""
    kinds = ", ".join(f"{n} × {kind}" for kind, n in rejected.kinds.items())
    return f"the server rejected {rejected.count} of the {rejected.of} requests sent ({kinds}; first: {rejected.first})"


def dominated(rejected: Rejections | None) -> bool:
    """Whether refusals are at least ``DOMINANT`` of the requests sent (then the reason names them)."""
    return rejected is not None and rejected.count >= DOMINANT * max(rejected.of, 1)


def progress(log_since_replay: str, probes: Sequence[SimPace | None]) -> ServerProgress:
    """The server's own evidence of work since the replay began: prefill batches and their new tokens, decode
    batches (SGLang's log lines, which the simulator prints too), and the simulator's modelled seconds across the
    window (its ``sim_pace`` probes). Empty (false) when there is none."""
    prefills = _PREFILL.findall(log_since_replay)
    decodes = len(_DECODE.findall(log_since_replay))
    marks = [p for p in probes if isinstance(p, SimPace)]
    moved = len(marks) == 2 and marks[1].modelled_s > marks[0].modelled_s
    return ServerProgress(
        prefill_batches=len(prefills) if prefills else None,
        prefill_tokens=sum(int(tokens) for _, tokens in prefills) if prefills else None,
        decode_batches=decodes or None,
        sim_modelled_s=round(marks[1].modelled_s - marks[0].modelled_s, 4) if moved else None,
    )


def _evidence(seen: ServerProgress) -> str:
    parts = []
    if seen.prefill_batches is not None:
        n = seen.prefill_batches
        parts.append(f"{n} prefill batch{'es' * (n != 1)} ({seen.prefill_tokens or 0:,} new tokens)")
    if seen.decode_batches is not None:
        n = seen.decode_batches
        parts.append(f"{n} decode batch line{'s' * (n != 1)}")
    text = f"its log shows {' and '.join(parts)} since the replay began" if parts else ""
    if seen.sim_modelled_s is not None:
        text += ("; " if text else "") + f"its simulated clock advanced {seen.sim_modelled_s:g} s in the window"
    return text


class NoTokens(NamedTuple):
    """Why a live server's window delivered no token: the trial's status, its reason, and the verdict on the window
    (the server's progress, the requests it refused, the streams it held)."""

    status: Status
    reason: str
    measurement: MeasurementVerdict


def no_tokens(
    requests: Sequence[Any],
    log_since_replay: str,
    probes: Sequence[SimPace | None],
    *,
    window_s: float,
    options: tuple[str, str] = STUDY_OPTIONS,
) -> NoTokens:
    """(status, reason, verdict) of a window in which no token arrived from a live server: ``crash`` naming the
    refusals when they dominate, ``too_slow`` with the server's progress as evidence, else ``crash``. ``options``:
    the window's and the warm-up's length as the command names them (a study's keys, ``measure``'s options)."""
    rejected = rejections(requests)
    seen = progress(log_since_replay, probes)
    figures = MeasurementVerdict(progress=seen, rejected=rejected)
    if rejected is not None and dominated(rejected):
        return NoTokens("crash", f"no tokens arrived in the measured window: {rejection_line(rejected)}", figures)
    if seen:
        return NoTokens(
            TOO_SLOW,
            f"no token arrived in the {window_s:g} s window, but the server was alive and "
            f"progressing ({_evidence(seen)}): lengthen {options[0]} (and {options[1]}), or the "
            f"host is too slow for this config",
            figures,
        )
    held = [r for r in requests if r.error is None and r.finish_reason == CUT and not r.chunks]
    if held and len(held) * 2 >= len(requests):  # accepted and kept open, never answered: alive, not serving
        return NoTokens(
            TOO_SLOW,
            f"no token arrived in the {window_s:g} s window: the server accepted the client's "
            f"streams and held {len(held)} of the {len(requests)} sent open without answering "
            f"any (starved of memory or CPU?): lower the running cap or the client's "
            f"concurrency, lengthen {options[0]}, or use a faster host",
            dataclasses.replace(figures, held_streams=len(held)),
        )
    first_error = next((r.error for r in requests if r.error), None)
    return NoTokens(
        "crash",
        f"no tokens arrived in the measured window and the server showed no progress ({first_error or 'no error'})",
        figures,
    )
