"""``autotune watch``: sample a tuned fleet over time and say when production has drifted from what the
config was tuned for (longer prompts, a KV pool running dry, the binding limit moving, speculative steps no
longer paying, throughput below the confirmed figure).

Read-only, on the same probe as ``inspect`` (GETs of ``/server_info``, ``/model_info``, ``/metrics``). Each
cycle adds one sample per server to a bounded rolling window kept in a small state file, so a restart or the
next ``--once`` run from cron continues where the last one stopped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from autotune import tls
from autotune.inspect.diagnose import InspectError, diagnose, explain_capacity
from autotune.inspect.probe import ProbeFailure, normalise_url, probe
from autotune.inspect.state import ServerState
from autotune.watch.metrics import parse_sample
from autotune.watch.reference import Tuned, TunedWorkload
from autotune.watch.rules import Context, Finding, Limits, evaluate
from autotune.watch.suggest import drifted_rows, rebalance, suggestion_line, traffic, write_study
from autotune.watch.window import WatchState

EXIT_OK, EXIT_DRIFT, EXIT_UNREACHABLE = 0, 1, 2
MAX_SAMPLES = 1000  # the window's hard cap, whatever --window / --interval say


@dataclass(frozen=True, kw_only=True)
class WatchOptions:
    interval_s: float = 30.0
    window_s: float = 600.0
    limits: Limits = field(default_factory=Limits)
    model: str | None = None
    gpu: str | None = None
    timeout_s: float = 5.0
    out_dir: Path = Path("watch")
    state_path: Path | None = None
    rows: int = 200  # prompts in a drifted study's sample
    seed: int = 0
    fleet: Path | None = None  # the fleet file watched: its fixes say how to re-tune in place (``sweep --borrow``)
    names: dict[str, str] = field(default_factory=dict)  # server URL → its name in the fleet file

    @property
    def max_samples(self) -> int:
        return min(MAX_SAMPLES, math.ceil(self.window_s / self.interval_s) + 2)


@dataclass(kw_only=True)
class ServerReport:
    url: str
    findings: list[Finding]
    gauges: dict[str, float]
    traffic: dict[str, float | None]
    samples: int
    window_s: float
    study_file: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class CycleReport:
    t: float
    servers: list[ServerReport]
    failures: list[ProbeFailure]

    @property
    def exit_code(self) -> int:
        if not self.servers:
            return EXIT_UNREACHABLE
        return EXIT_DRIFT if any(s.findings for s in self.servers) else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "exit": self.exit_code,
            "servers": [asdict(s) for s in self.servers],
            "failures": [{"url": f.url, "kind": f.kind, "message": f.message} for f in self.failures],
        }


class Watcher:
    """Probes every server once per ``cycle()`` and evaluates the rules on its window."""

    def __init__(
        self,
        urls: Sequence[str],
        tuned: Tuned | None,
        options: WatchOptions,
        *,
        transport: httpx.BaseTransport | None = None,
    ):
        self.urls = [normalise_url(u) for u in urls]
        self.tuned, self.options = tuned, options
        self.state = WatchState.load(options.state_path, span_s=options.window_s, max_samples=options.max_samples)
        self._texts: dict[str, str] = {}
        # The probe reduces /metrics to levels; watch also needs the histograms, so it keeps the body the probe
        # already fetched (one GET per endpoint, and still GET only).
        self.client = httpx.Client(
            timeout=options.timeout_s,
            transport=transport,
            follow_redirects=False,
            **tls.secured(),
            event_hooks={"response": [self._keep_metrics]},
        )

    def _keep_metrics(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/metrics") and response.status_code == 200:
            response.read()
            base = str(response.request.url).removesuffix("/metrics")
            self._texts[base] = response.text

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cycle(self, now: float | None = None) -> CycleReport:
        now = time.time() if now is None else now
        servers: list[ServerReport] = []
        failures: list[ProbeFailure] = []
        for url in self.urls:
            self._texts.pop(url, None)
            result = probe(url, client=self.client)
            if isinstance(result, ProbeFailure):
                failures.append(result)
                continue
            text = self._texts.pop(url, None)
            if text is None:
                failures.append(
                    ProbeFailure(
                        url=url,
                        kind="no_metrics",
                        message=(
                            f"{url}: no readable /metrics ({result.metrics_note or 'no sglang: series'}); "
                            "watch needs the server started with --enable-metrics"
                        ),
                    )
                )
                continue
            try:
                servers.append(self._server(result, text, now))
            except (KeyError, TypeError, ValueError) as exc:  # a malformed field: this server only
                failures.append(
                    ProbeFailure(
                        url=url, kind="malformed", message=f"{url}: malformed /server_info or /metrics ({exc!r})"
                    )
                )
        if self.options.state_path is not None:
            self.state.save(self.options.state_path)
        return CycleReport(t=now, servers=servers, failures=failures)

    def _server(self, result: Any, text: str, now: float) -> ServerReport:
        sample = parse_sample(text, now)
        memory = self.state.server(result.url)
        memory.window.add(sample)
        accept = sample.gauges.get("spec_accept_length") or 0.0
        if memory.first_accept is None and accept > 0:
            memory.first_accept = accept
        cap = explain_capacity(ServerState.from_probe(result))
        ctx = Context(
            url=result.url,
            window=memory.window,
            memory=memory,
            tuned=self.tuned,
            limits=self.options.limits,
            binding=cap.binding,
            hybrid=cap.mamba_slots is not None,
        )
        findings = evaluate(ctx)
        t = traffic(memory.window)
        report = ServerReport(
            url=result.url,
            findings=findings,
            gauges=dict(sample.gauges),
            traffic={"requests": t.requests, "prompt_mean": t.prompt_mean, "output_mean": t.output_mean},
            samples=len(memory.window),
            window_s=memory.window.seconds,
            notes=["counters fell: the server restarted, the window starts again"] if memory.window.restarted else [],
        )
        if findings:
            self._fix(report, result, t)
        return report

    def _fix(self, report: ServerReport, result: Any, t: Any) -> None:
        """Attach the planner's suggestion and a re-tuning study file to every finding of one server."""
        d = diagnose(result, model=self.options.model, gpu=self.options.gpu)
        advice = d.advice
        # KV a request of today's traffic needs: what finished requests held, or what running ones hold now
        # (the histograms only see a request when it ends), whichever is larger.
        held = [x for x in (t.tokens_per_request, _held_per_request(report.gauges)) if x]
        # Longer traffic: give Mamba memory back to KV. Shorter (or no trade that helps): inspect's own next step.
        planner = rebalance(advice, max(held)) if held else None
        if planner is None and advice is not None and advice.suggestions:
            planner = advice.suggestions[0]
        fallback = self.tuned.workload.max_tokens if self.tuned else TunedWorkload().max_tokens
        try:
            rows = drifted_rows(t, n=self.options.rows, seed=self.options.seed, fallback_output=fallback)
            report.study_file = str(write_study(d, planner, rows, self.options.out_dir))
        except (ValueError, InspectError) as exc:
            report.notes.append(f"no study file: {exc}")
        if advice is not None and (advice.model is None or advice.gpu is None):
            report.notes += advice.notes  # why there is no planner advice (which --model/--gpu to pass)
        fixed: list[Finding] = []
        for f in report.findings:
            fix: list[str] = []
            if f.rule == "acceptance":
                fix.append("the planner does not model acceptance: re-tune the speculative flags.")
            elif planner is not None:
                fix.append(f"planner: {suggestion_line(planner)}.")
            elif advice is not None and advice.model and advice.gpu:
                fix.append("planner: no change it trusts serves today's traffic better.")
            name = self.options.names.get(report.url)
            if report.study_file and self.options.fleet is not None and name is not None:
                fleet = self.options.fleet
                fix.append(
                    f"Re-tune for today's traffic in place, on this server's GPUs while the others serve: "
                    f"autotune sweep --config {report.study_file} --borrow {name} --fleet {fleet}; then roll "
                    f"the winner out: autotune apply --config {report.study_file} --fleet {fleet} --rolling"
                )
            elif report.study_file:
                fix.append(f"Re-tune for today's traffic: autotune sweep --config {report.study_file}")
            fixed.append(Finding(server=f.server, rule=f.rule, evidence=f.evidence, reason=f.reason, fix=fix))
        report.findings = fixed


def _held_per_request(gauges: dict[str, float]) -> int | None:
    """KV held per running request right now, when no request finished inside the window."""
    running = gauges.get("num_running_reqs") or 0.0
    used = gauges.get("kv_used_tokens", gauges.get("num_used_tokens"))
    return round(used / running) if running and used else None


def run(
    watcher: Watcher,
    *,
    cycles: int | None,
    on_report: Callable[[CycleReport], None],
    sleep: Callable[[float], None] = time.sleep,
) -> CycleReport:
    """``cycles`` cycles (None: until interrupted), one every ``interval_s``; returns the last report."""
    done = 0
    while True:
        started = time.monotonic()
        report = watcher.cycle()
        on_report(report)
        done += 1
        if cycles is not None and done >= cycles:
            return report
        sleep(max(0.0, watcher.options.interval_s - (time.monotonic() - started)))
