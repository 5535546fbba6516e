"""The rolling window ``autotune watch`` keeps per server, and the small state file that lets a restart (or
the next cron run of ``--once``) continue it.

Memory is bounded twice: samples older than the window are dropped, and a ``deque`` caps the count whatever
the clock does. A counter that falls means the server restarted: the window starts again from that sample.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.watch.metrics import SAMPLES, Histogram, Sample

STATE_VERSION = 1


class Window:
    """The samples of one server inside the last ``span_s`` seconds (at most ``max_samples`` of them)."""

    def __init__(self, span_s: float, max_samples: int, samples: Iterable[Sample] = ()):
        self.span_s, self.max_samples = float(span_s), int(max_samples)
        self.samples: deque[Sample] = deque(maxlen=self.max_samples)
        self.restarted = False  # the last add() found a counter lower than before
        for sample in samples:
            self.add(sample)

    def add(self, sample: Sample) -> None:
        last = self.samples[-1] if self.samples else None
        self.restarted = last is not None and any(sample.counters.get(k, v) < v for k, v in last.counters.items())
        if self.restarted:
            self.samples.clear()
        self.samples.append(sample)
        while self.samples and self.samples[0].t < sample.t - self.span_s:
            self.samples.popleft()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    @property
    def seconds(self) -> float:
        return self.samples[-1].t - self.samples[0].t if len(self.samples) > 1 else 0.0

    def counter_delta(self, name: str) -> float | None:
        """How much a counter grew across the window; None with fewer than two samples that export it."""
        have = [s.counters[name] for s in self.samples if name in s.counters]
        return have[-1] - have[0] if len(have) > 1 else None

    def histogram(self, name: str) -> Histogram | None:
        """The observations made inside the window (last minus first sample)."""
        have = [s.histograms[name] for s in self.samples if name in s.histograms]
        return have[-1].minus(have[0]) if len(have) > 1 else None

    def gauge(self, name: str, *, since: float | None = None) -> list[float]:
        """A gauge's values in time order, optionally only from samples at or after ``since``."""
        return [s.gauges[name] for s in self.samples if name in s.gauges and (since is None or s.t >= since)]


@dataclass
class ServerMemory:
    """What watch remembers about one server between cycles (and runs)."""

    window: Window
    first_accept: float | None = None  # the first speculative accept length watch saw (no study to compare with)

    def to_dict(self) -> dict[str, Any]:
        return {"samples": SAMPLES.dump_python(list(self.window.samples)), "first_accept": self.first_accept}


@dataclass
class WatchState:
    """Every watched server's memory, read from and written to one JSON file."""

    span_s: float
    max_samples: int
    servers: dict[str, ServerMemory] = field(default_factory=dict)

    def server(self, url: str) -> ServerMemory:
        if url not in self.servers:
            self.servers[url] = ServerMemory(window=Window(self.span_s, self.max_samples))
        return self.servers[url]

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "servers": {url: m.to_dict() for url, m in self.servers.items()}}

    @classmethod
    def load(cls, path: Path | None, *, span_s: float, max_samples: int) -> WatchState:
        """The state in ``path`` (fresh when it does not exist); a file that cannot be read is a ConfigError."""
        state = cls(span_s=span_s, max_samples=max_samples)
        if path is None or not path.exists():
            return state
        fix = "delete it to start a fresh window"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read the watch state ({exc.strerror})", file=str(path), fix=fix) from None
        except ValueError:
            raise ConfigError("not valid JSON", file=str(path), fix=fix) from None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ConfigError(f"not a version-{STATE_VERSION} watch state", file=str(path), key="version", fix=fix)
        try:
            for url, entry in (data.get("servers") or {}).items():
                samples = SAMPLES.validate_python(entry.get("samples", []))
                first = entry.get("first_accept")
                state.servers[url] = ServerMemory(
                    window=Window(span_s, max_samples, samples), first_accept=None if first is None else float(first)
                )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"malformed server entry ({exc!r})", file=str(path), key="servers", fix=fix) from None
        return state

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename), so a crash mid-write never leaves half a state behind."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(self.to_dict(), separators=(",", ":")))  # dumps: the C encoder
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
