"""One ``/metrics`` scrape reduced to what ``autotune watch`` compares: a few gauges, counters and the two
token-length histograms, under SGLang 0.5.23's names (``sglang:``-prefixed, see tests/data/recorded).

Parsed with ``prometheus_client``'s text parser. Only the series below are kept, so a sample is small and the
rolling window's memory does not grow with the number of series a server exports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

GAUGES = (
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "full_token_usage",
    "mamba_usage",
    "kv_used_tokens",
    "num_used_tokens",
    "mamba_used_tokens",
    "num_retracted_reqs",
    "spec_accept_length",
    "gen_throughput",
    "max_total_num_tokens",
)
COUNTERS = (
    "num_requests_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_retracted_requests_total",
    "spec_verify_calls_total",
)
HISTOGRAMS = ("prompt_tokens_histogram", "generation_tokens_histogram")
# Per-rank fractions are averaged across label sets (one per TP/DP rank); counts add up.
_FRACTIONS = ("_usage", "accept_length")
_WANTED = frozenset(
    f"sglang:{name}"
    for name in (
        *GAUGES,
        *COUNTERS,
        *HISTOGRAMS,
        *(h + part for h in HISTOGRAMS for part in ("_bucket", "_sum", "_count")),
    )
)


def watched_lines(text: str) -> str:
    """Only the watched series (and their HELP/TYPE lines): a real /metrics has hundreds of series, and the
    parser's cost grows with every line it is handed."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
        else:
            name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
        if name in _WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts at finite upper bounds (``+Inf`` is ``count``), with SGLang's exact sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float  # the ``_sum`` series: total tokens observed
    count: float

    def minus(self, earlier: Histogram) -> Histogram | None:
        """The observations between ``earlier`` and this one; None when the buckets differ or a count fell."""
        if earlier.bounds != self.bounds or self.count < earlier.count:
            return None
        return Histogram(
            bounds=self.bounds,
            cumulative=tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            total=self.total - earlier.total,
            count=self.count - earlier.count,
        )

    def buckets(self) -> list[tuple[float, float, float]]:
        """(lower, upper, observations) per bucket; the last one is open-ended (upper = ``inf``)."""
        out, lower, below = [], 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative, strict=True):
            out.append((lower, bound, cum - below))
            lower, below = bound, cum
        out.append((lower, math.inf, self.count - below))
        return out

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus's ``histogram_quantile``: linear within the bucket that holds the q-th observation."""
        if self.count <= 0:
            return None
        rank = q * self.count
        for lower, upper, n in self.buckets():
            if n > 0 and rank <= n:
                return lower if math.isinf(upper) else lower + (upper - lower) * rank / n
            rank -= n
        return self.bounds[-1] if self.bounds else None


@dataclass(frozen=True)
class Sample:
    """What one server's ``/metrics`` said at time ``t`` (seconds since the epoch)."""

    t: float
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        """``sglang:<name>`` → value, the shape ``diagnosis_probe.parse_prometheus`` gives the diagnosis."""
        return {f"sglang:{k}": v for k, v in {**self.gauges, **self.counters}.items()}


# A window's samples as the state file stores them: dumped in Python mode (floats as they are, so ``json.dumps``
# writes NaN and infinities as it always did; tuples come out as lists) and validated back, a malformed entry a
# ``ValueError`` (pydantic's ``ValidationError``).
SAMPLES = TypeAdapter(list[Sample])


def parse_sample(text: str, t: float) -> Sample:
    """The watched series of one Prometheus exposition; raises ``ValueError`` for text that is not one."""
    gauges: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(watched_lines(text)):
        for s in family.samples:
            name = s.name.removeprefix("sglang:")
            if name == s.name or math.isnan(s.value):
                continue
            if name in GAUGES:
                gauges.setdefault(name, []).append(s.value)
            elif name in COUNTERS:
                counters[name] = counters.get(name, 0.0) + s.value
            else:
                base, _, part = name.rpartition("_")
                if base not in HISTOGRAMS:
                    continue
                if part == "bucket":
                    le = float(s.labels["le"])
                    per = buckets.setdefault(base, {})
                    per[le] = per.get(le, 0.0) + s.value
                elif part == "sum":
                    sums[base] = sums.get(base, 0.0) + s.value
                elif part == "count":
                    counts[base] = counts.get(base, 0.0) + s.value
    histograms = {}
    for name, per in buckets.items():
        finite = sorted(b for b in per if math.isfinite(b))
        count = counts.get(name, per.get(math.inf, 0.0))
        histograms[name] = Histogram(
            bounds=tuple(finite), cumulative=tuple(per[b] for b in finite), total=sums.get(name, 0.0), count=count
        )
    levels = {
        name: (sum(values) / len(values) if name.endswith(_FRACTIONS) else sum(values))
        for name, values in gauges.items()
    }
    return Sample(t=t, gauges=levels, counters=counters, histograms=histograms)
