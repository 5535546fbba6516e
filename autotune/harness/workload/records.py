"""What a replay recorded: one ``RequestRecord`` per request, the window, and figures read off them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autotune.results import halves_drift
from autotune.settle import Settling

CUT = "cut"  # finish reason of a stream the client closed at window end (not an error)


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the replay started."""

    row: int
    sent: float
    pass_no: int = 0  # the walk through the sample that sent it; a ``fresh`` replay marks the prompt with it
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)
    finish_reason: str | None = None
    error: str | None = None
    ended: float | None = None
    accept_length: float | None = None
    prompt_tokens: int | None = None  # as the server counted them (its final chunk's meta_info / usage)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass(frozen=True)
class SimPace:
    """The simulated server's pacing counters at a window's edge (``sim_pace`` in its /server_info): how far its
    modelled clock has advanced and how far its wall clock trailed it, seconds since it started."""

    modelled_s: float
    lag_s: float


@dataclass
class ReplayRecords:
    requests: list[RequestRecord]
    window: tuple[float, float]
    concurrency: int
    endpoint: str
    stopped_early: str | None = None  # why the replay ended before the window did
    # Share of one core the replay's process was running or waiting for a CPU during the window (≈ 1.0: the
    # client could not keep up, so the figure is the client's, not the server's); None before the window ended.
    client_busy: float | None = None
    probes: list[SimPace | None] = field(default_factory=list)  # ``window_probe`` readings at the window's edges
    settling: Settling | None = None  # how the warm-up and window settled (``autotune.settle``); None: stopped early
    later: list[ReplayRecords] = field(default_factory=list)  # the windows the same loop ran on to (``replay``)

    def write_jsonl(self, path: Path) -> None:
        """One line per request; times rounded to 0.1 ms (a long window has ~1k chunks per request)."""
        with open(path, "w", encoding="utf-8") as fh:
            for rec in self.requests:
                row = asdict(rec)
                row["chunks"] = [[round(t, 4), n] for t, n in rec.chunks]
                for key in ("sent", "ended"):
                    row[key] = None if row[key] is None else round(row[key], 4)
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")

    @staticmethod
    def read_jsonl(path: Path) -> list[RequestRecord]:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return [RequestRecord(**{**r, "chunks": [tuple(c) for c in r["chunks"]]}) for r in rows]


def repeated_prompt_share(records: ReplayRecords) -> float:
    """Share of the window's requests whose exact prompt this replay had already sent. The replay walks a fixed
    sample round-robin, so a small sample under high concurrency comes round again; with ``repeats = "verbatim"``
    the same text goes out again and a radix cache serves it whole, hits a one-pass job of distinct prompts never
    gets. A ``fresh`` replay marks each pass, so its share is 0."""
    lo, hi = records.window
    seen: set[tuple[int, int]] = set()
    repeats = sent = 0
    for rec in records.requests:  # in the order they were sent
        key = (rec.row, rec.pass_no)
        if lo <= rec.sent < hi:
            sent += 1
            repeats += key in seen
        seen.add(key)
    return round(repeats / sent, 4) if sent else 0.0


def window_drift(records: ReplayRecords) -> float:
    """``halves_drift`` of the window's output tokens. A closed loop whose streams start together runs a workload of
    long prompts and short answers in waves (all prefill, then all decode) that a short window catches at one phase;
    the replay's ramp and settle rule (``autotune.settle``) exist for that, and this figure shows what is left.
    Decode-heavy workloads read near 0 even before any request finishes, because their batch stays full."""
    lo, hi = records.window
    mid = (lo + hi) / 2
    first = second = 0
    for rec in records.requests:
        for t, n in rec.chunks:
            if lo <= t < mid:
                first += n
            elif mid <= t < hi:
                second += n
    return halves_drift(first, second)
