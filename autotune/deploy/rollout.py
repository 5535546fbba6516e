"""Rolling restart of a fleet onto a new config: one server at a time, each verified before the next.

Per server: out of the router, drained, stopped, started on the new config, its capacity and a canary checked,
back into the router; a failure restores it (and by default the verified ones). Every step is logged before it
happens, so a killed rollout resumes or rolls back. docs/fleet.md has the whole contract.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.deploy.drain import DRAIN_TIMEOUT_S, Gate
from autotune.deploy.fleet import (
    Fleet,
    FleetServer,
    foreign_note,
    load_fleet,
    server_info,
    serving,
    set_server_config,
    start_server,
    stop_server,
    write_fleet,
)
from autotune.deploy.fleetfile import group_mismatch
from autotune.deploy.lease import refuse_while_lent
from autotune.deploy.rolloutlog import (  # the log's API, re-exported
    Figures as Figures,
)
from autotune.deploy.rolloutlog import (
    RolloutEvent as RolloutEvent,
)
from autotune.deploy.rolloutlog import (
    RolloutLog as RolloutLog,
)
from autotune.deploy.rolloutlog import (
    locked as locked,
)
from autotune.deploy.rolloutlog import (
    log_path as log_path,
)
from autotune.deploy.sglang_yaml import deployed_config, read_config_file, split_config, yaml_text
from autotune.errors import AutotuneError, FleetError
from autotune.harness.engines import logparse
from autotune.harness.serverinfo import sim_pace
from autotune.harness.trial import measurement_verdict
from autotune.harness.workload import PromptSample, metrics_from_records, replay

if TYPE_CHECKING:
    from autotune.deploy.apply import Winner
    from autotune.results import Capacity

Say = Callable[[str], None]
# A canary window that did not measure the server is replayed again, up to this many windows in all: the host running
# apply is often busy, and a failed canary restores the server and rolls the verified ones back.
CANARY_TRIES = 3


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """What the study measured for the config being rolled out; ``None`` fields are not checked."""

    max_running_requests: int | None = None
    kv_tokens: int | None = None
    mamba_slots: int | None = None
    tok_s: float | None = None
    kv_tolerance: float | None = 0.0  # relative (real GPUs differ by a few MiB of free memory); None: not compared
    tok_s_tolerance: float = 0.15  # a canary this much slower than the study's figure fails

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Expectation:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @classmethod
    def from_winner(
        cls, winner: Winner, *, kv_tolerance: float | None = 0.0, tok_s_tolerance: float = 0.15
    ) -> Expectation:
        cap = winner.capacity
        if cap is None and winner.tok_s is None:
            raise FleetError(
                "nothing to verify the rollout against: the config has no measured capacity or "
                "tok/s (roll out from --study, or keep provenance.json beside the config)"
            )
        return cls(
            max_running_requests=getattr(cap, "max_running_requests", None),
            kv_tokens=getattr(cap, "kv_tokens", None),
            mamba_slots=getattr(cap, "mamba_slots", None),
            tok_s=winner.tok_s,
            kv_tolerance=kv_tolerance,
            tok_s_tolerance=tok_s_tolerance,
        )


def device_tolerances(
    fleet: Fleet, kv_tolerance: float | None, tolerance: float | None
) -> tuple[float | None, float, list[str]]:
    """The capacity and canary tolerances for ``fleet``'s device where the user gave none, and what was assumed:
    a GPU server's KV pool is set by its config (compared exactly); a CPU server's follows the host memory free at
    its start (not compared: ``None``), and its canary shares the host's cores with the fleet (a wider margin)."""
    said = []
    if kv_tolerance is None and fleet.host_memory:
        said.append(
            "KV tokens not compared: a CPU server's pool follows the host memory free at its start "
            "(--kv-tolerance to compare)"
        )
    if tolerance is None and fleet.host_memory:
        said.append("canary tolerance 50 %: CPU servers share the host's cores (--tolerance to change)")
    kv = kv_tolerance if kv_tolerance is not None else (None if fleet.host_memory else 0.0)
    return kv, tolerance if tolerance is not None else (0.5 if fleet.host_memory else 0.15), said


@dataclass(frozen=True, kw_only=True)
class Canary:
    """A short replay of the study's workload against the restarted server."""

    prompts: str
    sample_size: int = 200
    seed: int = 0
    concurrency: int | None = None  # None: 2 × the server's effective max running requests, as the study did
    max_tokens: int = 4096
    warmup_s: float = 5.0
    measure_s: float = 20.0
    endpoint: str = "generate"
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Canary:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @classmethod
    def from_workload(
        cls,
        workload: Mapping[str, Any],
        *,
        prompts: str | None,
        warmup_s: float,
        measure_s: float,
        concurrency: int | None = None,
    ) -> Canary:
        """The study's workload (same prompts, length cap, concurrency), replayed for a short window."""
        path = prompts or workload.get("prompts")
        if not path or not Path(path).is_file():
            raise FleetError(
                f"no prompt file for the canary ({path or 'the study names none'}): pass --prompts, "
                "or --canary-s 0 to check capacity only"
            )
        data = {k: v for k, v in workload.items() if k in cls.__dataclass_fields__}
        data.update(prompts=str(path), warmup_s=warmup_s, measure_s=measure_s)
        if concurrency is not None:
            data["concurrency"] = concurrency
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class Timing:
    grace_s: float = 30.0  # SIGTERM → SIGKILL: how long SGLang may drain in-flight requests
    startup_timeout_s: float = 900.0
    release_timeout_s: float = 60.0
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # out of the router: how long its requests in flight may take


@dataclass(kw_only=True)
class Report:
    """What a rollout did, for the one-line error or the final summary."""

    verified: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: str | None = None
    reason: str | None = None
    restored: list[str] = field(default_factory=list)
    reverted: list[str] = field(default_factory=list)
    untouched: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the job saw: requests in flight at each stop

    def summary(self) -> str:
        parts = []
        for label, names in (
            ("on the new config", self.verified),
            ("already on it", self.skipped),
            ("restored", self.restored),
            ("rolled back", self.reverted),
            ("not touched", self.untouched),
        ):
            if names:
                parts.append(f"{label}: {', '.join(names)}")
        if self.failed:
            parts.insert(0, f"server {self.failed} failed: {self.reason}")
        return "; ".join(parts + self.notes) or "nothing to do"


# -- verification ----------------------------------------------------------------------------------------
def check_capacity(expect: Expectation, capacity: Capacity) -> str | None:
    """Why the reported capacity does not match the study's, or None."""
    problems = []
    for name in ("max_running_requests", "mamba_slots", "kv_tokens"):
        want, got = getattr(expect, name), getattr(capacity, name, None)
        if want is None or (name == "kv_tokens" and expect.kv_tolerance is None):
            continue
        slack = (expect.kv_tolerance or 0.0) * want if name == "kv_tokens" else 0
        if got is None or abs(got - want) > slack:
            problems.append(f"{name} {got} (study: {want})")
    return ", ".join(problems) or None


def run_canary(server: FleetServer, canary: Canary, capacity: Capacity) -> Any:
    """The canary's figures: ``canary`` replayed against ``server``, and replayed again while its window did not
    measure the server (``harness.trial.measurement_verdict``: the replay client starved of CPU on the host running
    apply, or a simulated server's clock trailing its model), at most ``CANARY_TRIES`` times. Such a window says
    nothing of the new config, and a canary that failed on it would roll the fleet back; FleetError, naming why,
    when no try measured the server."""
    sample = PromptSample.load(canary.prompts, canary.sample_size, canary.seed)
    concurrency = canary.concurrency or max(1, 2 * (getattr(capacity, "max_running_requests", None) or 1))
    reason = None
    for _ in range(CANARY_TRIES):
        records = asyncio.run(
            replay(
                server.url,
                sample,
                concurrency=concurrency,
                max_tokens=canary.max_tokens,
                warmup_s=canary.warmup_s,
                measure_s=canary.measure_s,
                endpoint=canary.endpoint,
                ignore_eos=canary.ignore_eos,
                window_probe=functools.partial(sim_pace, server.url),
            )
        )
        verdict, reason, _ = measurement_verdict(records)
        if verdict is None:
            return metrics_from_records(records)
    raise FleetError(
        f"server {server.name} canary: none of {CANARY_TRIES} windows measured the server: {reason}; "
        "run apply where the replay has a core to itself, or pass --canary-s 0 to check capacity only"
    )


def verify(fleet: Fleet, server: FleetServer, expect: Expectation, canary: Canary | None) -> Figures:
    """Capacity, then canary; FleetError naming what differs. Returns the figures measured."""
    info = server_info(server)
    if info is None:
        raise FleetError(f"server {server.name} does not answer /server_info")
    capacity = logparse.capacity("", info)
    mismatch = check_capacity(expect, capacity)
    if mismatch:
        raise FleetError(f"server {server.name} reports a different capacity: {mismatch}")
    figures = Figures(capacity=capacity.pools())
    if canary is not None:
        metrics = run_canary(server, canary, capacity)
        figures["tok_s"] = metrics.output_tok_s
        if metrics.errors or not metrics.output_tokens:
            raise FleetError(
                f"server {server.name} canary: {metrics.errors} failed requests, {metrics.output_tokens} tokens"
            )
        if expect.tok_s and metrics.output_tok_s < expect.tok_s * (1 - expect.tok_s_tolerance):
            raise FleetError(
                f"server {server.name} canary ran at {metrics.output_tok_s:.0f} tok/s, more than "
                f"{expect.tok_s_tolerance:.0%} below the study's {expect.tok_s:.0f} tok/s"
            )
    return figures


# -- steps -----------------------------------------------------------------------------------------------
def stage_config(fleet: Fleet, config: Mapping[str, Any], *, header: str = "") -> str:
    """Write ``config`` as ``configs/<hash>.yaml`` beside the fleet file, as ``apply --out`` writes it (``header``,
    ``enable-metrics``: the canary, the router's view and ``watch`` read /metrics); returns its relative path."""
    document, cli = split_config(deployed_config(config))
    if cli:
        raise FleetError(f"these flags cannot be written to an sglang.yaml: {' '.join(cli)}")
    text = yaml_text(document)
    relative = f"configs/{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    path = fleet.resolve(relative)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(yaml_text(document, header=header))
        os.replace(tmp, path)
    return relative


def _others_healthy(fleet: Fleet, name: str) -> None:
    down = [s.name for s in fleet.servers if s.name != name and not serving(fleet, s)]
    if down:
        raise FleetError(
            f"server(s) {', '.join(down)} not healthy: replacing {name} now would take a second "
            "server down (bring them up with autotune fleet up, then --resume)"
        )


def _replace(fleet: Fleet, server: FleetServer, config_file: str, timing: Timing, gate: Gate) -> None:
    config = _read(fleet, config_file)  # before the stop: a bad file must not take the server down
    gate.take_out(server)  # out of the router and drained first (without one: what it has in flight is counted)
    stop_server(fleet, server, grace_s=timing.grace_s, release_timeout_s=timing.release_timeout_s)
    start_server(fleet, server, config, timeout_s=timing.startup_timeout_s)


def _read(fleet: Fleet, config_file: str) -> dict[str, Any]:
    return read_config_file(fleet.resolve(config_file))


def _restore(fleet_path: Path, name: str, previous: str, log: RolloutLog, timing: Timing, gate: Gate) -> bool:
    """Put one server back on ``previous`` (and into the router); True when it answers /health again."""
    fleet = load_fleet(fleet_path)
    server = fleet.server(name)
    try:
        _replace(fleet, server, previous, timing, gate)
    except AutotuneError as exc:
        log.append("restore_failed", server=name, reason=str(exc))
        gate.say(f"{name}: could not restore {previous}: {exc}")
        return False
    if server.config != previous:
        write_fleet(set_server_config(fleet, name, previous))
    gate.say(f"{name}: back on {previous}")
    gate.put_back(server)
    return True


def _run(fleet_path: Path, begin: RolloutEvent, done: set[str], log: RolloutLog, timing: Timing, gate: Gate) -> Report:
    target, previous = begin["config"], begin["previous"]
    expect = Expectation.from_dict(begin.get("expect") or {})
    canary = Canary.from_dict(stored) if (stored := begin.get("canary")) else None
    report = Report(verified=sorted(done, key=begin["servers"].index))
    remaining = [n for n in begin["servers"] if n not in done]
    for index, name in enumerate(remaining):
        fleet = load_fleet(fleet_path)
        server = fleet.server(name)
        _others_healthy(fleet, name)
        log.append("step", server=name, to=target)
        gate.say(f"{name}: restarting on {target}")
        try:
            _replace(fleet, server, target, timing, gate)
            figures = verify(fleet, server, expect, canary)
        except AutotuneError as exc:
            log.append("failed", server=name, reason=str(exc))
            report.failed, report.reason = name, str(exc)
            report.untouched = remaining[index + 1 :]
            if not _restore(fleet_path, name, previous[name], log, timing, gate):
                # Reverting others now would take a second server down: leave that to --rollback.
                report.reason = (
                    f"{exc}; it did not come back on {previous[name]} either and is down (the fleet "
                    f"file still says {previous[name]}): bring it back with autotune fleet up --server "
                    f"{name} --fleet {fleet_path}"
                )
            else:
                log.append("restored", server=name)
                report.restored.append(name)
                if begin.get("rollback_on_failure", True):
                    try:
                        report.reverted = _revert(fleet_path, report.verified, previous, log, timing, gate)
                    except FleetError as revert_error:
                        report.reason = f"{exc}; {revert_error}"
                    report.verified = [n for n in report.verified if n not in report.reverted]
            report.notes += gate.finish()
            log.append("end", result="failed", summary=report.summary())
            raise FleetError(f"rollout stopped: {report.summary()}") from None
        write_fleet(set_server_config(load_fleet(fleet_path), name, target))
        log.append("verified", server=name, **figures)
        report.verified.append(name)
        gate.say(f"{name}: verified: {figures_line(figures)}")
        gate.put_back(server)  # and only then the next server
    report.notes += gate.finish()
    log.append("end", result="done", summary=report.summary())
    return report


def _revert(
    fleet_path: Path,
    names: list[str],
    previous: Mapping[str, str],
    log: RolloutLog,
    timing: Timing,
    gate: Gate,
    *,
    settled: frozenset[str] = frozenset(),
) -> list[str]:
    """Return ``names`` to their previous configs, one at a time, servers that are down first.

    ``settled`` servers are known (from the log) to run their previous config already: they are left alone
    while healthy. Any other server may run the new config even if the fleet file does not say so yet (a
    step killed after the start, before the verification), so it is always restarted.
    """
    fleet = load_fleet(fleet_path)
    order = sorted(names, key=lambda n: (serving(fleet, fleet.server(n)), -names.index(n)))
    reverted: list[str] = []
    for name in order:
        fleet = load_fleet(fleet_path)
        server = fleet.server(name)
        if name in settled and server.config == previous[name] and serving(fleet, server):
            continue
        _others_healthy(fleet, name)
        log.append("revert", server=name, to=previous[name])
        if not _restore(fleet_path, name, previous[name], log, timing, gate):
            raise FleetError(
                f"rollback stopped: server {name} did not come back on {previous[name]} "
                f"(rolled back so far: {', '.join(reverted) or 'none'})"
            )
        log.append("reverted", server=name)
        reverted.append(name)
    return reverted


def _settled(events: list[RolloutEvent]) -> frozenset[str]:
    """Servers whose last logged event put them back on their previous config."""
    last: dict[str, str] = {}
    for event in events:
        if "server" in event:
            last[event["server"]] = event["event"]
    return frozenset(n for n, e in last.items() if e in ("restored", "reverted"))


def figures_line(figures: Figures) -> str:
    """``running cap 40, KV 798,000 tokens, 200 Mamba slots; canary 2,667 tok/s``: a verification in words."""
    capacity = figures.get("capacity") or {}
    parts = [
        f"{label} {value:,}{unit}"
        for key, label, unit in (
            ("max_running_requests", "running cap", ""),
            ("kv_tokens", "KV", " tokens"),
            ("mamba_slots", "Mamba slots", ""),
        )
        if (value := capacity.get(key)) is not None
    ]
    tok_s = figures.get("tok_s")
    return ", ".join(parts) + (f"; canary {tok_s:,.0f} tok/s" if tok_s is not None else "")


LOCK_WAIT_S = 10.0  # a keeper's look at the fleet holds the lock for moments; a restart of its for minutes


@contextmanager
def _holding(fleet: Fleet, what: str) -> Iterator[None]:
    """The fleet's lock for ``what`` (a rollout, a resume, a rollback), refused in one line while a server is lent."""
    with locked(fleet, holder=what, wait_s=LOCK_WAIT_S):
        refuse_while_lent(fleet, what)
        yield


# -- entry points ---------------------------------------------------------------------------------------
def start(
    fleet_path: Path,
    config: Mapping[str, Any],
    *,
    expect: Expectation,
    canary: Canary | None,
    timing: Timing = Timing(),
    rollback_on_failure: bool = True,
    source: Mapping[str, Any] | None = None,
    say: Say = lambda _: None,
    header: str = "",
) -> Report:
    """Roll ``config`` out to every server of the fleet, one at a time (``header``: atop its sglang.yaml)."""
    fleet = load_fleet(fleet_path)
    log = RolloutLog(log_path(fleet))
    with _holding(fleet, "a rollout"):
        current = log.current()
        if current and current[-1].get("event") != "end":
            raise FleetError(
                f"an earlier rollout in {log.path} did not finish: finish it with --resume or "
                "undo it with --rollback first"
            )
        target = stage_config(fleet, config, header=header)
        wanted = _read(fleet, target)
        mismatch = group_mismatch(fleet, wanted)
        if mismatch:
            raise FleetError(f"{fleet.path}: the new config does not fit the fleet's servers: {mismatch}")
        strangers = [note for note in (foreign_note(fleet, s) for s in fleet.servers) if note]
        if strangers:  # a rollout acts only on servers its records prove the fleet's; nothing has changed yet
            raise FleetError("; ".join(strangers) + " (stop it, or move the fleet's server to a free port)")
        skipped: list[str] = []
        servers: list[str] = []
        for server in fleet.servers:
            same = server.config == target or _read(fleet, server.config) == wanted
            (skipped if same and serving(fleet, server) else servers).append(server.name)
        begin = log.append(
            "begin",
            config=target,
            previous={s.name: s.config for s in fleet.servers},
            servers=servers,
            expect=asdict(expect),
            canary=asdict(canary) if canary else None,
            rollback_on_failure=rollback_on_failure,
            source=dict(source or {}),
        )
        report = _run(fleet.path or fleet_path, begin, set(), log, timing, _gate(fleet, timing, say))
        report.skipped = skipped
        return report


def resume(fleet_path: Path, *, timing: Timing = Timing(), say: Say = lambda _: None) -> Report:
    """Finish the latest rollout; the server that was mid-step is redone from its stop."""
    fleet = load_fleet(fleet_path)
    log = RolloutLog(log_path(fleet))
    with _holding(fleet, "a resumed rollout"):
        current = log.current()
        if not current or current[-1].get("event") == "end":
            raise FleetError(f"no unfinished rollout in {log.path}")
        done = {e["server"] for e in current if e.get("event") == "verified"}
        log.append("resume", done=sorted(done))
        return _run(fleet.path or fleet_path, current[0], done, log, timing, _gate(fleet, timing, say))


def rollback(fleet_path: Path, *, timing: Timing = Timing(), say: Say = lambda _: None) -> Report:
    """Return every server the latest rollout touched to its previous config, one at a time."""
    fleet = load_fleet(fleet_path)
    log = RolloutLog(log_path(fleet))
    with _holding(fleet, "a rollback"):
        current = log.current()
        if not current:
            raise FleetError(f"no rollout recorded in {log.path}")
        if current[-1].get("event") == "end" and current[-1].get("result") == "rolled_back":
            raise FleetError("the latest rollout was already rolled back")
        begin = current[0]
        touched = [n for n in begin["servers"] if any(e.get("server") == n for e in current)]
        log.append("rollback", servers=touched)
        gate = _gate(fleet, timing, say)
        reverted = _revert(
            fleet.path or fleet_path, touched, begin["previous"], log, timing, gate, settled=_settled(current)
        )
        log.append("end", result="rolled_back")
        return Report(
            reverted=reverted, untouched=[n for n in begin["servers"] if n not in touched], notes=gate.finish()
        )


def _gate(fleet: Fleet, timing: Timing, say: Say) -> Gate:
    """The router gate for this rollout (``deploy.drain``); every healthy server in the router first, and the
    warning said before anything stops when there is no router."""
    gate = Gate.for_fleet(fleet, drain_timeout_s=timing.drain_timeout_s, say=say)
    gate.admit_all(fleet)
    warning = gate.warning(fleet)
    if warning:
        say(warning)
    return gate
