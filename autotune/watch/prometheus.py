"""``autotune watch``'s own findings as Prometheus series: ``autotune_drift{server, rule}``,
``autotune_watch_up{server}`` and the last cycle's timestamp.

One collector holds the latest cycle, so ``--prom-file`` (node_exporter's textfile collector) and ``--listen``
(scraped directly over HTTP) expose exactly the same series.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import GaugeMetricFamily, Metric

from autotune.watch.rules import RULES
from autotune.watch.watcher import CycleReport


class DriftCollector:
    """The series of the latest cycle (``report``; none before the first). The HTTP thread reads it while the
    watch loop replaces it: one attribute assignment, so a scrape sees one whole cycle or the one before."""

    def __init__(self, report: CycleReport | None = None) -> None:
        self.report = report

    def collect(self) -> Iterator[Metric]:
        report = self.report
        if report is None:
            return
        drift = GaugeMetricFamily(
            "autotune_drift",
            "1 when autotune watch finds this drift rule firing on this server",
            labels=["server", "rule"],
        )
        up = GaugeMetricFamily(
            "autotune_watch_up", "1 when autotune watch could read the server this cycle", labels=["server"]
        )
        for server in report.servers:
            up.add_metric([server.url], 1)
            firing = {f.rule for f in server.findings}
            for rule in RULES:
                drift.add_metric([server.url, rule], 1 if rule in firing else 0)
        for failure in report.failures:
            up.add_metric([failure.url], 0)
        yield drift
        yield up
        yield GaugeMetricFamily(
            "autotune_watch_last_cycle_timestamp_seconds", "When autotune watch last sampled the fleet", value=report.t
        )


def registry_of(collector: DriftCollector) -> CollectorRegistry:
    """A registry holding only watch's series (not the process's default Python/GC metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def write_prometheus(report: CycleReport, path: Path) -> None:
    """The cycle's series as a textfile, written atomically by ``prometheus_client``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry_of(DriftCollector(report)))
