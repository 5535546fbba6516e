"""What a sweep shows while it runs: a live rich panel on a terminal, plain log lines anywhere else.

Both sinks take the same calls from the loop (trial started/finished, phase from ``run_trial``'s
``on_phase``, confirmation runs), so the loop never knows where its output goes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import IO, Any, TypedDict

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from autotune.results import MeasurementVerdict, TrialResult, granted_line
from autotune.settle import settling_of


class PhaseInfo(TypedDict, total=False):
    """What a launch's phase says beside its name (``run_trial``'s ``on_phase``), each key in the phases that have
    it: ``starting`` (port, argv), ``warmup`` (concurrency, pid), a re-measure (reason, stream_interval), the replay's
    ticks while it measures (``harness.workload.ReplayProgress``'s fields), ``stress`` (its target), the fidelity
    probe (prompts, tokens, mode)."""

    port: int
    argv: list[str]
    concurrency: int
    pid: int | None
    reason: str | None
    stream_interval: int
    phase: str
    elapsed_s: float
    tok_s: float
    completed: int
    errors: int
    window: int
    requests: int
    running: int
    max_tokens: int
    prompt_tokens_max: int
    prompts: int
    tokens: int
    mode: str


def _fmt_diff(diff: dict[str, Any]) -> str:
    if not diff:
        return "= baseline"
    return " ".join(f"{k}={'unset' if v is None else v}" for k, v in diff.items())


REPEATS_WORTH_SAYING = 0.25  # share of a window's requests that re-sent a prompt (harness measurement)
DRIFT_WORTH_SAYING = 0.25  # the window's halves' tokens this far apart (``workload.window_drift``): not steady yet


def settling_line(measurement: MeasurementVerdict | None) -> str | None:
    """How the trial's measurement settled (``autotune.settle``): "settled in 44 s (warm-up 14 s, window 30 s,
    ±1.2%)" or "unsettled: …" (recorded, never crowned); None for a result without one (older, or no window)."""
    settling = settling_of(measurement)
    if settling is None:
        return None
    lo, hi = settling.window
    hw = f", ±{settling.half_width:.1%}" if settling.half_width is not None else ""
    strip = sparkline(settling.tok_s)
    if settling.settled:
        return f"settled in {hi:g} s (warm-up {lo:g} s, window {hi - lo:g} s{hw}) {strip}"
    return f"unsettled: {settling.reason} (recorded, never crowned on this number) {strip}"


SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24  # characters: longer runs are averaged into this many


def sparkline(rates: list[float]) -> str:
    """The slices' tok/s as block characters (lowest ▁ to highest █), averaged down to ``SPARK_WIDTH``: the shape of
    the run (ramp, waves, a trend) on one line."""
    if not rates:
        return ""
    n = min(len(rates), SPARK_WIDTH)
    cells = [rates[i * len(rates) // n : (i + 1) * len(rates) // n] for i in range(n)]
    means = [sum(c) / len(c) for c in cells]
    top = max(means)
    if top <= 0:
        return SPARKS[0] * n
    return "".join(SPARKS[min(len(SPARKS) - 1, int(m / top * len(SPARKS)))] for m in means)


def _fmt_result(result: TrialResult) -> str:
    if result.ok and result.metrics:
        cap = result.capacity
        running = f", {cap.max_running_requests} running" if cap and cap.max_running_requests else ""
        short = granted_line(result.config, cap)  # "asked for 32 running, got 24: the Mamba state pool bound it"
        running += f" ({short})" if short else ""
        fid = result.fidelity
        changed = " changed unexpectedly" if fid and fid.unexpected else ""  # no output-changing flag explains it
        outputs = (
            f", outputs{changed}: {fid.prefix_match_mean:.0f}/{fid.tokens} tokens match, {fid.exact_share:.0%} exact"
            if fid and fid.probed and fid.prefix_match_mean is not None
            else ""
        )
        repeats = (result.measurement.repeated_prompts if result.measurement else None) or 0.0
        resent = (
            f", {repeats:.0%} of the window re-sent a prompt verbatim (cache hits a one-pass job would not "
            f'get: set workload.repeats = "fresh" or grow workload.sample_size)'
            if repeats >= REPEATS_WORTH_SAYING
            else ""
        )
        settled = settling_line(result.measurement)
        drift = (result.measurement.window_drift if result.measurement else None) or 0.0
        unsettled = (
            f", the window's halves differ by {drift:.0%} (the load had not settled: lengthen "
            f"workload.warmup_s and measure_s)"
            if drift >= DRIFT_WORTH_SAYING and settled is None
            else ""
        )
        settle = f", {settled}" if settled else ""
        return f"ok {result.metrics.output_tok_s:,.0f} tok/s{running}{outputs}{resent}{unsettled}{settle}"
    return f"{result.status}: {result.reason or ''}".rstrip(": ")


class PlainProgress:
    """One line per event; for logs, pipes and CI."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self.durations: list[float] = []
        self.done = self.target = 0
        self._t0 = 0.0
        self.number: int | None = None
        self._phase = ""
        self.score_unit = "tok/s"  # "tok/s per GPU" once a trial's server spans several GPUs

    def _print(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=self.stream, flush=True)

    def log(self, message: str) -> None:
        self._print(message)

    def eta_s(self) -> float | None:
        if not self.durations or self.target <= self.done:
            return None
        return sum(self.durations) / len(self.durations) * (self.target - self.done)

    def trial_started(
        self, number: int, done: int, target: int, role: str, label: str | None, diff: dict[str, Any]
    ) -> None:
        self.number, self.done, self.target, self._t0 = number, done, target, time.monotonic()
        self._phase = ""
        who = f"{role} {label}" if label and label != role else role
        eta = self.eta_s()
        tail = f" (ETA {eta / 60:.1f} min)" if eta else ""
        self._print(f"trial {number} [{done + 1}/{target}] {who}: {_fmt_diff(diff)}{tail}")

    def phase(self, name: str, info: PhaseInfo | None = None) -> None:
        if name == self._phase:
            return  # live updates repeat a phase; a log keeps one line per phase
        self._phase = name
        self._print(f"  {name}")

    def trial_finished(self, number: int, result: TrialResult, best: float | None) -> None:
        self.durations.append(time.monotonic() - self._t0)
        self.done += 1
        # the best is the study's score: tok/s per GPU, which reads as plain tok/s until a server spans several
        self.score_unit = "tok/s per GPU" if result.gpus_spanned > 1 or self.score_unit != "tok/s" else "tok/s"
        best_txt = f" (best {best:,.0f} {self.score_unit})" if best else ""
        self._print(f"trial {number}: {_fmt_result(result)}{best_txt}")

    def confirm_started(self, index: int, total: int, trial: int, repeat: int) -> None:
        self._phase = ""
        self._print(f"confirm {index}/{total}: trial {trial}, launch {repeat + 1}")

    def confirm_finished(self, trial: int, result: TrialResult) -> None:
        more = [w.output_tok_s for w in result.windows or ()]  # the launch's later windows
        tail = (
            ("; later windows " + ", ".join("-" if v is None else f"{v:,.0f}" for v in more) + " tok/s") if more else ""
        )
        self._print(f"  trial {trial}: {_fmt_result(result)}{tail}")

    def close(self) -> None:
        return None


@dataclasses.dataclass
class PanelState:
    """What the live panel shows now; the loop's calls update it between redraws."""

    title: str = "starting"
    phase: str = ""
    diff: str = ""  # the config's difference from the baseline, as one line
    tok_s: float | None = None  # the replay's live tok/s, while it measures
    best: float | None = None


class LiveProgress(PlainProgress):
    """A rich panel: trial n/N, phase, live tok/s, the config's difference from the baseline, best, ETA."""

    def __init__(self, console: Console | None = None):
        super().__init__()
        self.console = console or Console()
        self.state = PanelState()
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
        self.live.start()

    def _render(self) -> Group:
        s = self.state
        table = Table.grid(padding=(0, 2))
        table.add_row("trial", Text(s.title, style="bold"))
        table.add_row("phase", s.phase)
        table.add_row("vs baseline", s.diff)
        table.add_row("live", f"{s.tok_s:,.0f} tok/s" if s.tok_s is not None else "-")
        table.add_row("best", f"{s.best:,.0f} {self.score_unit}" if s.best else "-")
        eta = self.eta_s()
        table.add_row("ETA", f"{eta / 60:.1f} min" if eta else "-")
        return Group(table)

    def _refresh(self) -> None:
        self.live.update(self._render())

    def _print(self, text: str) -> None:
        # Text, not markup: messages hold brackets ("[3/30]") and SGLang's own lines.
        self.live.console.print(Text.assemble((time.strftime("%H:%M:%S"), "dim"), " ", text), highlight=False)

    def trial_started(self, number, done, target, role, label, diff) -> None:
        super().trial_started(number, done, target, role, label, diff)
        who = f"{role} {label}" if label and label != role else role
        self.state = dataclasses.replace(
            self.state,
            title=f"{number} ({done + 1}/{target}) {who}",
            phase="planning",
            diff=_fmt_diff(diff),
            tok_s=None,
        )
        self._refresh()

    def phase(self, name: str, info: PhaseInfo | None = None) -> None:
        self.state.phase = name
        if info and info.get("tok_s") is not None:
            self.state.tok_s = float(info["tok_s"])
        self._refresh()

    def trial_finished(self, number, result, best) -> None:
        super().trial_finished(number, result, best)
        self.state.best, self.state.phase = best, "done"
        self._refresh()

    def confirm_started(self, index, total, trial, repeat) -> None:
        self.state.title, self.state.tok_s = f"confirmation {index}/{total}: trial {trial} launch {repeat + 1}", None
        self._refresh()

    def close(self) -> None:
        self.live.stop()


def make_progress(*, quiet_stdout: bool = False) -> PlainProgress:
    """The live panel on a terminal, plain lines otherwise (stderr when stdout carries JSON)."""
    if quiet_stdout:
        return PlainProgress(sys.stderr)
    if sys.stdout.isatty():
        return LiveProgress()
    return PlainProgress()
