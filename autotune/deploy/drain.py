"""Taking one server out of the job's traffic before a rollout stops it, and putting it back after.

Behind a router (``deploy.router``): remove the server from the router (no new request reaches it), wait until
its own running and queued requests are zero (SGLang's ``/metrics`` gauges, else ``/server_info``), at most the
drain timeout, then let it stop; once it is verified on its new config, add it back. The job's client, which only
knows the router's URL, sees no failed request. Without a router there is nothing to take a server out of: the
gate counts what each stopped server still had in flight, so the rollout can say what the job lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.deploy import router
from autotune.deploy.fleet import server_info, serving
from autotune.deploy.fleetfile import Fleet, FleetServer
from autotune.deploy.routerview import total
from autotune.errors import FleetError

Say = Callable[[str], None]
DRAIN_TIMEOUT_S = 120.0


def in_flight(server: FleetServer, record: router.Record | None = None) -> int | None:
    """The server's running + queued requests, from its own metrics (or ``/server_info``; a server without
    ``--enable-metrics``: the router's count of its requests there); None if nothing says."""
    text = router.get(server.url, "/metrics")
    if isinstance(text, str) and "sglang:num_running_reqs" in text:
        return int(total(text, "sglang:num_running_reqs") + total(text, "sglang:num_queue_reqs"))
    info = server_info(server)
    states = (info or {}).get("internal_states") or []
    counts = [s.get("num_running_reqs") for s in states if isinstance(s, dict)]
    if counts and all(isinstance(c, (int, float)) for c in counts):
        return int(sum(float(c) for c in counts if c is not None))
    text = router.get(record.metrics_base, "/metrics") if record is not None else None
    if isinstance(text, str):
        return int(total(text, "smg_worker_requests_active", worker=server.url))
    return None


def wait_idle(
    server: FleetServer, timeout_s: float, *, record: router.Record | None = None, poll_s: float = 0.1
) -> int | None:
    """Wait until the server has no request in flight, at most ``timeout_s``; what it still has then. Zero must
    hold for two readings in a row: a request the router picked the server for just before it left may still be
    on its way."""
    deadline = time.monotonic() + timeout_s
    left, quiet = in_flight(server, record), 0
    while time.monotonic() < deadline:
        quiet = quiet + 1 if not left else 0
        if quiet >= 2:
            break
        time.sleep(poll_s)
        left = in_flight(server, record)
    return left


@dataclass(kw_only=True)
class Gate:
    """What a rollout does around each server's restart; ``lost`` is what stopped servers had in flight."""

    record: router.Record | None
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    say: Say = lambda _: None
    lost: dict[str, int] = field(default_factory=dict)
    out: str | None = None  # the one server out of the router now
    uncounted: list[str] = field(default_factory=list)  # stopped without a router, and nothing said what it had

    @classmethod
    def for_fleet(cls, fleet: Fleet, *, drain_timeout_s: float = DRAIN_TIMEOUT_S, say: Say = lambda _: None) -> Gate:
        record = router.running(fleet) if router.wanted(fleet) is None else None
        if record is not None and router.get(record.url, "/health") is None:
            record = None
        return cls(record=record, drain_timeout_s=drain_timeout_s, say=say)

    @property
    def routed(self) -> bool:
        return self.record is not None

    def warning(self, fleet: Fleet) -> str | None:
        """Said before a rollout without a router: the job's client will lose requests."""
        if self.routed:
            return None
        why = router.wanted(fleet) or "the router is not running (autotune fleet up starts it)"
        return (
            f"no router in front of the fleet ({why}): the job's client will see failed requests while each "
            "server restarts; the rollout counts what each stopped server had in flight"
        )

    def admit_all(self, fleet: Fleet) -> None:
        """Every healthy server of the fleet's own into the router (a rollout killed between a server's verification
        and its re-admission left it out), never a foreign one on a fleet port; the step that is redone takes its
        server out again."""
        if self.record is None:
            return
        for server in fleet.servers:
            if serving(fleet, server):
                router.add_worker(self.record, server.url)

    def take_out(self, server: FleetServer) -> None:
        """Before the stop: out of the router and drained, or (no router) count what it has in flight."""
        if self.record is None:
            left = in_flight(server)
            if left:
                self.lost[server.name] = self.lost.get(server.name, 0) + left
            elif left is None and server.name not in self.uncounted:
                self.uncounted.append(server.name)
            return
        if self.out not in (None, server.name):  # never two servers out of the router at once
            raise FleetError(
                f"server {self.out} is still out of the router: taking {server.name} out too would "
                "leave two servers out of it (autotune apply --resume or --rollback puts it back)"
            )
        router.remove_worker(self.record, server.url)
        self.out = server.name
        left = wait_idle(server, self.drain_timeout_s, record=self.record)
        if left:
            self.lost[server.name] = self.lost.get(server.name, 0) + left
            self.say(
                f"{server.name}: still {left} request(s) in flight after the {self.drain_timeout_s:.0f} s "
                "drain timeout; stopping it anyway"
            )
        else:
            self.say(f"{server.name}: out of the router and drained")

    def put_back(self, server: FleetServer) -> None:
        """After the server is verified (or restored): back into the router."""
        if self.record is None:
            return
        router.add_worker(self.record, server.url)
        if self.out == server.name:
            self.out = None
        self.say(f"{server.name}: back in the router")

    def summary(self) -> str | None:
        """After the rollout: what the stopped servers had in flight (with a router: only past a timeout)."""
        if self.routed and not self.lost:
            return None
        each = ", ".join(f"{n} {k}" for n, k in self.lost.items())
        line = f"the stopped servers had {sum(self.lost.values())} request(s) in flight when they stopped" + (
            f" ({each})" if each else ""
        )
        if self.uncounted:
            line += f"; {', '.join(self.uncounted)} did not say (no /metrics: start it with --enable-metrics)"
        return line

    def finish(self) -> list[str]:
        """Say the summary; the report's note when the job lost requests."""
        line = self.summary()
        if line:
            self.say(line)
        return [line] if line and self.lost else []
