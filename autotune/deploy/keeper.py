"""The fleet's keeper: one process per fleet that keeps its servers serving between rollouts (a dead or unresponsive
server out of the router at once, restarted on the recorded config after a backoff, back in once it serves; a crash
loop ends the restarts; a router URL no fleet server answers removed). docs/fleet.md ("The keeper").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.deploy import lease, leasefile, router
from autotune.deploy.fleet import (
    attached,
    drift,
    healthy,
    server_config,
    server_info,
    serving,
    start_server,
    stop_server,
    wait_gpus_free,
)
from autotune.deploy.fleetfile import Fleet, FleetServer, KeeperSection, load_fleet
from autotune.deploy.fleetlog import FleetLog
from autotune.deploy.rolloutlog import locked
from autotune.errors import AutotuneError, ConfigError, FleetError
from autotune.harness.engines import logparse
from autotune.launch.ports import port_is_free
from autotune.results import Capacity

log = logging.getLogger(__name__)

HOLDER = "the fleet's keeper"
UNREADABLE_LIMIT = 10  # looks in a row with the fleet file unreadable (deleted, moved) before the keeper exits
IDLE_LIMIT_S = 60.0  # nothing of the fleet has run this long (no server record, router or lease): the keeper exits


@dataclass
class Watched:
    """What the keeper knows of one server between looks."""

    last_healthy: float | None = None  # when it last answered /health (monotonic); None: not seen serving yet
    deaths: deque[float] = field(default_factory=deque)  # monotonic times of its deaths in the crash window
    gave_up: bool = False
    capacity: Capacity | None = None  # what it reported when the keeper first saw it serving
    died_at: float | None = None  # the death the running repair answers
    log_offset: int | None = None  # where its log's current life begins, when the keeper started it


class Keeper:
    """``cycle()`` is one look at the fleet; ``run()`` looks until ``stop`` is set. Restarts run in threads of their
    own (one per server), so a server that takes minutes to load does not blind the keeper to the others."""

    def __init__(self, fleet_path: Path):
        self.path = fleet_path
        self.stop = threading.Event()
        self.watched: dict[str, Watched] = {}
        self.repairs: dict[str, threading.Thread] = {}
        self._held: contextlib.ExitStack | None = None
        self._idle_since: float | None = None
        self._had_router = False  # a router ran while the keeper looked: one that is gone is started again
        self._loaded: tuple[tuple[int, int], Fleet] | None = None
        fleet = load_fleet(fleet_path)
        self.events = FleetLog.of(fleet)
        self.policy: KeeperSection = fleet.keeper

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self) -> None:
        self.events.append(
            "keeper_start", f"keeper started (pid {os.getpid()}), looking every {self.policy.interval_s:g} s"
        )
        unreadable = 0
        try:
            while not self.stop.is_set():
                try:
                    self.cycle()
                    unreadable = 0
                    if self._idle_since is not None and time.monotonic() - self._idle_since > IDLE_LIMIT_S:
                        self.events.append(
                            "keeper_stop",
                            f"keeper stopped: nothing of the fleet has run for "
                            f"{IDLE_LIMIT_S:g} s (autotune fleet up starts it again)",
                        )
                        return
                except (ConfigError, FleetError, OSError) as exc:
                    unreadable += 1
                    log.warning("the keeper could not look at the fleet: %s", exc)
                    if unreadable >= UNREADABLE_LIMIT:
                        self.events.append("keeper_stop", f"keeper stopped: the fleet file cannot be read ({exc})")
                        return
                self.stop.wait(self.policy.interval_s)
            self.events.append("keeper_stop", "keeper stopped")
        finally:
            self.stop.set()
            for thread in list(self.repairs.values()):
                thread.join(timeout=5.0)
            self._release()

    def _fleet(self) -> Fleet:
        """The fleet file, read again only when it changed (a rollout rewrites it): a look a second stays cheap."""
        stat = self.path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        if self._loaded is None or self._loaded[0] != stamp:
            self._loaded = (stamp, load_fleet(self.path))
        return self._loaded[1]

    def cycle(self) -> None:
        fleet = self._fleet()
        self.policy = fleet.keeper
        self.repairs = {name: t for name, t in self.repairs.items() if t.is_alive()}
        if not self._hold(fleet):
            return  # a rollout, a rollback or fleet down has the fleet: it is theirs until they let go
        try:
            lent = leasefile.current(fleet)
            if lent is not None and lent.server not in self.repairs and not lent.holder_alive():
                self._start_repair(lent.server, self._return_lease, ())
            record = router.running(fleet) or self._router_back(fleet, lent)
            self._had_router = self._had_router or record is not None
            listed = {str(w.get("url")) for w in router.workers(record)} if record is not None else set()
            running = [
                self._look(fleet, server, record, listed)
                for server in fleet.servers
                if server.name not in self.repairs and (lent is None or server.name != lent.server)
            ]
            busy = lent is not None or record is not None or self.repairs or any(running)
            self._idle_since = None if busy else (self._idle_since or time.monotonic())
        finally:
            if not any(t.is_alive() for t in self.repairs.values()):
                self._release()

    # -- one server ------------------------------------------------------------------------------------
    def _look(self, fleet: Fleet, server: FleetServer, record: router.Record | None, listed: set[str]) -> bool:
        """Act on what one server is now; False when nothing of it runs by the fleet's records (stopped on purpose)."""
        w = self.watched.setdefault(server.name, Watched())
        if not server.local:  # another host: /health is all the proof there is; no restart from here
            if not healthy(server) and server.url in listed and record is not None:
                self._remove(record, server, "does not answer /health")
            return True
        handle = attached(fleet, server)
        if handle is None:  # stopped on purpose (fleet down --server, a rollout's stop) or never started
            w.last_healthy = None
            if server.url in listed and record is not None:
                self._remove(
                    record,
                    server,
                    "no server of this fleet runs there"
                    + (
                        ""
                        if port_is_free(server.bind, server.port)
                        else " (a process that is not the fleet's holds the port)"
                    ),
                )
            return False
        now = time.monotonic()
        if handle.alive:
            if healthy(server):
                self._serving(fleet, server, w, record, listed, now)
            elif w.last_healthy is not None and now - w.last_healthy >= self.policy.unresponsive_s:
                self._died(
                    fleet,
                    server,
                    w,
                    record,
                    listed,
                    cause="unresponsive",
                    line=f"stopped answering /health for {now - w.last_healthy:.0f} s",
                )
            return True  # else still loading (its starter's timeout decides), or a short silence
        text = handle.log_text()[w.log_offset :] if w.log_offset is not None else handle.log_tail(400)
        cause = logparse.classify(text, None) or "unknown"
        said = logparse.failure_line(text, None)
        line = f"exited ({cause}: {said})" if said else "exited (killed, or no failure line in its log)"
        if cause == "runtime_oom":
            line += (
                f"; the config's worst case failed in production (an OOM at a peak the study's stress phase "
                f"did not reach): autotune apply --rollback --fleet {fleet.path} returns the previous config"
            )
        self._died(fleet, server, w, record, listed, cause=cause, line=line)
        return True

    def _serving(
        self, fleet: Fleet, server: FleetServer, w: Watched, record: router.Record | None, listed: set[str], now: float
    ) -> None:
        if w.gave_up:
            w.gave_up = False
            w.deaths.clear()
            self.events.append(
                "serving", "serving again (started by hand); the keeper watches it again", server=server.name
            )
        w.last_healthy = now
        if w.capacity is None:
            info = server_info(server)
            w.capacity = logparse.capacity("", info) if info is not None else None
        if record is not None and server.url not in listed:
            with contextlib.suppress(FleetError):
                router.add_worker(record, server.url, timeout_s=10.0)
                self.events.append("readmitted", "serving but missing from the router: added back", server=server.name)

    def _died(
        self,
        fleet: Fleet,
        server: FleetServer,
        w: Watched,
        record: router.Record | None,
        listed: set[str],
        *,
        cause: str,
        line: str,
    ) -> None:
        now = time.monotonic()
        if record is not None and server.url in listed:
            self._remove(record, server, None)
        self.events.append(
            "exited" if cause != "unresponsive" else "unresponsive",
            line + ("; out of the router" if server.url in listed else ""),
            server=server.name,
            cause=cause,
        )
        w.last_healthy, w.died_at = None, now
        self._count_death(w, now)
        self._start_repair(server.name, self._repair, (w,))

    def _start_repair(self, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        thread = threading.Thread(target=target, args=(name, *args), name=f"keeper-{name}", daemon=True)
        self.repairs[name] = thread
        thread.start()

    def _return_lease(self, name: str) -> None:
        """The lent server back from a sweep that is gone (killed): started, verified, readmitted; the lease ends."""
        try:
            said = lease.returned(load_fleet(self.path), reason="its sweep is gone")
        except AutotuneError as exc:
            self.events.append("restart_failed", f"could not take it back from its lease: {exc}", server=name)
            self.stop.wait(max(5.0, self.policy.interval_s))  # the next look tries again
            return
        if said is not None:
            self.watched[name] = Watched(last_healthy=time.monotonic())

    def _count_death(self, w: Watched, now: float) -> None:
        w.deaths.append(now)
        while w.deaths and now - w.deaths[0] > self.policy.crash_window_s:
            w.deaths.popleft()

    # -- the restart -------------------------------------------------------------------------------------
    def _repair(self, name: str, w: Watched) -> None:
        """Restart ``name`` until it serves, its crash loop is reached or the keeper stops."""
        try:
            while not self.stop.is_set():
                fleet = load_fleet(self.path)
                server = fleet.server(name)
                if len(w.deaths) > self.policy.crash_limit:
                    self._give_up(fleet, server, w)
                    return
                if self._restart_once(fleet, server, w):
                    return
        except AutotuneError as exc:  # the fleet file changed under it (the server renamed away, a bad config)
            self.events.append("gave_up", f"not restarted: {exc}", server=name)
            w.gave_up = True

    def _restart_once(self, fleet: Fleet, server: FleetServer, w: Watched) -> bool:
        """One restart after its backoff: True once the server serves again, False after a failed start (counted
        as a death)."""
        attempt = len(w.deaths)
        delay = self.policy.backoff_s[min(attempt, len(self.policy.backoff_s)) - 1]
        with contextlib.suppress(AutotuneError):  # whatever is left of the dead one: its record, its process group
            stop_server(fleet, server, grace_s=5.0, release_timeout_s=60.0)
        self.events.append(
            "restarting",
            f"restarting in {delay:g} s on {server.config} ({attempt} death(s) in "
            f"{self.policy.crash_window_s:g} s; more than {self.policy.crash_limit} end the restarts)",
            server=server.name,
            attempt=attempt,
        )
        if self.stop.wait(delay):
            return True
        said = False
        while not port_is_free(server.bind, server.port):
            if not said:
                self.events.append(
                    "foreign",
                    f"port {server.port} is held by a process that is not this fleet's: "
                    "not restarted until it is free; the router sends it nothing",
                    server=server.name,
                )
                said = True
            if self.stop.wait(max(1.0, self.policy.interval_s)):
                return True
        try:
            wait_gpus_free(fleet, server, timeout_s=60.0)
            log_path = fleet.resolve(server.log)
            w.log_offset = log_path.stat().st_size if log_path.exists() else 0
            start_server(fleet, server, server_config(fleet, server), timeout_s=self.policy.start_timeout_s)
        except (FleetError, ConfigError) as exc:
            self.events.append("restart_failed", f"restart failed: {exc}", server=server.name, attempt=attempt)
            self._count_death(w, time.monotonic())
            return False
        self._verified(fleet, server, w)
        return True

    def _verified(self, fleet: Fleet, server: FleetServer, w: Watched) -> None:
        """Compare what the restarted server runs and reports with the fleet's record of it, then readmit it."""
        info = server_info(server) or {}
        notes = []
        changed = drift(server_config(fleet, server), info)
        if changed:
            notes.append(f"runs other values than {server.config} for {', '.join(changed)}")
        capacity = logparse.capacity("", info) if info else None
        now_caps = capacity.pools() if capacity is not None else {}
        if now_caps and w.capacity is not None:
            before = w.capacity.pools()
            lower = [
                f"{key} {value} (was {was})"
                for key, value in now_caps.items()
                if value is not None and (was := before[key]) is not None and value < was
            ]
            if lower:
                notes.append(
                    "smaller than before its death: "
                    + ", ".join(lower)
                    + (
                        " (a CPU server sizes its pools from the host memory free at its start)"
                        if fleet.host_memory
                        else " (memory its GPUs did not get back?)"
                    )
                )
        w.capacity = w.capacity or capacity
        record = router.running(fleet)
        back = ""
        if record is not None:
            try:
                router.add_worker(record, server.url, timeout_s=60.0)
                back = "; back in the router"
            except FleetError as exc:
                back = f"; not back in the router: {exc}"
        took = time.monotonic() - (w.died_at or time.monotonic())
        self.events.append(
            "restarted",
            f"serving again {took:.1f} s after it died{back}" + (f"; {'; '.join(notes)}" if notes else ""),
            server=server.name,
            seconds=round(took, 1),
            capacity=now_caps,
        )
        w.last_healthy = time.monotonic()

    def _give_up(self, fleet: Fleet, server: FleetServer, w: Watched) -> None:
        with contextlib.suppress(AutotuneError):
            stop_server(fleet, server, grace_s=5.0)
        w.gave_up = True
        self.events.append(
            "gave_up",
            f"died {len(w.deaths)} times in {self.policy.crash_window_s:g} s: the keeper "
            f"stops restarting it (a crash loop; its log: {fleet.resolve(server.log)}); "
            f"autotune fleet up --server {server.name} --fleet {fleet.path} starts it again",
            server=server.name,
        )

    # -- the router and the lock -------------------------------------------------------------------------
    def _router_back(self, fleet: Fleet, lent: leasefile.Lease | None) -> router.Record | None:
        """A router whose record says it ran, and whose process is gone: started again on the fleet's serving
        servers (the job's one URL is the router's)."""
        if router.wanted(fleet) is not None or (router.read_record(fleet) is None and not self._had_router):
            return None  # no router wanted, or none ran (fleet down stops the keeper before the router)
        urls = [s.url for s in fleet.servers if (lent is None or s.name != lent.server) and serving(fleet, s)]
        try:
            record = router.start(fleet, urls, timeout_s=60.0)
        except FleetError as exc:
            self.events.append("restart_failed", f"the router exited and did not start again: {exc}")
            return None
        self.events.append(
            "restarted", f"the router exited: started again (pid {record.pid}) on {len(urls)} serving server(s)"
        )
        return record

    def _remove(self, record: router.Record, server: FleetServer, why: str | None) -> None:
        try:
            router.remove_worker(record, server.url, timeout_s=10.0)
        except FleetError as exc:
            self.events.append("removed", f"could not take it out of the router: {exc}", server=server.name)
            return
        if why is not None:
            self.events.append("removed", f"out of the router: {why}", server=server.name)

    def _hold(self, fleet: Fleet) -> bool:
        if self._held is not None:
            return True
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(locked(fleet, holder=HOLDER))
        except FleetError:
            return False
        self._held = stack
        return True

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()
