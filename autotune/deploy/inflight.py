"""What the job's client must send: the in-flight requests per server that keep the winner's running cap
full (``cap + queue``: the running cap, and the 99.9 % quantile of the completions during one refill), written
by ``apply`` into ``client.json``, the launch script's header and ``provenance.json`` from the stored trial.
The arithmetic, and when the study's own client was the limit: docs/fleet.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from autotune.results import TrialResult
from autotune.results.stored import from_known
from autotune.search.views.settings import StudySettings

__all__ = ["ClientAdvice", "client_advice", "read_advice"]

FILE = "client.json"
QUANTILE = 0.999  # of the completions during one refill: the share of refills the queue covers


class _Winner(Protocol):  # what ``deploy.apply.Winner`` offers (a Protocol keeps this module below apply)
    @property
    def trial(self) -> int: ...

    @property
    def result(self) -> TrialResult: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def settings(self) -> StudySettings: ...


@dataclass(frozen=True, kw_only=True)
class ClientAdvice:
    """The in-flight requests per server and fleet, and the trial figures they come from (None: not measured)."""

    trial: int
    servers: int
    running_cap: int | None  # per server: the reported cap per DP worker × DP workers
    queue: int | None  # requests waiting beside the cap (``refill_s`` × λ, its 99.9 % quantile)
    per_server: int | None  # running_cap + queue
    fleet: int | None  # per_server × servers
    measured_concurrency: int | None  # what the trial's replay kept in flight on its one server
    measured_generating: float | None  # streams generating on average in the trial's window
    completions_s: float | None  # λ: requests finished per second in the window
    refill_s: float | None  # how long a replacement takes to reach a slot (two chunk gaps)
    binding: bool = False  # measured_concurrency < running_cap: the study's client was the limit
    router_url: str | None = None  # the fleet's router (``deploy.router``): the one URL the job's client needs
    router_note: str | None = None  # without one: what it would give
    api_key_file: str | None = None  # a fleet with keys: the file (beside fleet.toml) whose text the job sends

    def lines(self) -> list[str]:
        """What ``apply`` prints and the launch script's header says, in that order."""
        if self.router_url is not None:
            keep = f"keep {self.fleet} requests in flight" if self.fleet else "keep the servers' running caps full"
            out = [
                f"client: point the job at {self.router_url}; {keep} (sglang-router spreads them over the "
                f"{self.servers} servers)"
            ]
        else:
            out = []
        if self.per_server is None:
            cap = f"{self.running_cap} running requests per server" if self.running_cap else "the running cap"
            out += [
                f"client: keep more than {cap} in flight (trial {self.trial} has no measured window to size the queue)"
            ]
        else:
            servers = f"the {self.servers} servers" if self.servers > 1 else "the one server"
            out += [
                f"client: keep {self.per_server} requests in flight per server (running cap {self.running_cap} "
                f"+ queue {self.queue}), {self.fleet} across {servers}"
            ]
        if self.measured_concurrency is not None and self.measured_generating is not None:
            waiting = max(0.0, self.measured_concurrency - self.measured_generating)
            out.append(
                f"trial {self.trial} measured with {self.measured_concurrency} in flight: "
                f"{self.measured_generating:.1f} generating of the cap of {self.running_cap}, "
                f"≈{waiting:.0f} waiting or in prefill"
            )
        if self.router_note:
            out.append(self.router_note)
        if self.api_key_file:
            out.append(
                f"client: send Authorization: Bearer <the text of {self.api_key_file}> with every request "
                "(the fleet binds beyond loopback: the router and the servers refuse requests without it)"
            )
        if self.binding:
            at_least = self.per_server or (self.running_cap or 0) + 1
            out.append(
                f"warning: the study's client was the binding limit: trial {self.trial} kept "
                f"{self.measured_concurrency} requests in flight, below the winner's running cap of "
                f"{self.running_cap}, so the study never saw the cap full and its tok/s is the client's; "
                f"raise [workload] concurrency to at least {at_least} (or leave it unset: 2 × the cap) "
                "and run the sweep again"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lines": self.lines()}

    def json_text(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def read_advice(out_dir: Path) -> ClientAdvice:
    """The advice ``apply`` wrote into ``out_dir`` (what it prints is what it wrote)."""
    advice: ClientAdvice = from_known(ClientAdvice, json.loads((Path(out_dir) / FILE).read_text()))
    return advice


def dp_workers(config: dict[str, Any]) -> int:
    """SGLang's schedulers per server: each DP worker (replica or attention DP rank) runs its own cap."""
    for key in ("attn_dp_size", "dp_size"):
        value = config.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return 1


def poisson_quantile(mean: float, q: float = QUANTILE) -> int:
    """The smallest k with P(N ≤ k) ≥ q for N ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    if mean > 500:  # the normal approximation (exp(-mean) underflows); z(0.999) ≈ 3.09
        return math.ceil(mean + 3.09 * math.sqrt(mean))
    k, term = 0, math.exp(-mean)
    total = term
    while total < q:
        k += 1
        term *= mean / k
        total += term
    return k


def _measured_concurrency(winner: _Winner, per_dp_cap: int | None) -> int | None:
    """What the replay kept in flight: the window's own figure, else the study's setting (auto: 2 × the cap)."""
    metrics = winner.result.metrics
    if metrics is not None and metrics.concurrency > 0:
        return metrics.concurrency
    setting = winner.settings.workload.get("concurrency")
    if isinstance(setting, int) and setting > 0:
        return setting
    return 2 * per_dp_cap if per_dp_cap else None  # ``harness.trial.auto_concurrency``


def _refill_s(result: TrialResult) -> float | None:
    """Two chunk gaps at the window's ITL p99 (per token) × tokens per chunk."""
    metrics = result.metrics
    if metrics is None or not metrics.itl_ms.p99:
        return None
    interval = result.measurement.stream_interval if result.measurement else None
    steps = interval if isinstance(interval, int) and interval > 0 else 1
    per_chunk = max(1.0, metrics.accept_length or 1.0) * steps
    return round(2 * metrics.itl_ms.p99 / 1000 * per_chunk, 4)


def client_advice(winner: _Winner, *, servers: int) -> ClientAdvice:
    """The advice for ``servers`` servers of the winner, from its stored trial."""
    capacity, metrics = winner.result.capacity, winner.result.metrics
    per_dp = capacity.max_running_requests if capacity is not None else None
    cap = per_dp * dp_workers(winner.config) if per_dp else None
    concurrency = _measured_concurrency(winner, per_dp)
    generating = None
    if metrics is not None and metrics.itl_ms.mean:
        generating = round(metrics.output_tok_s * metrics.itl_ms.mean / 1000, 2)
    rate = metrics.request_s if metrics is not None and metrics.request_s > 0 else None
    refill = _refill_s(winner.result)
    queue = max(1, poisson_quantile(rate * refill)) if cap and rate and refill else None
    per_server = cap + queue if cap and queue else None
    return ClientAdvice(
        trial=winner.trial,
        servers=servers,
        running_cap=cap,
        queue=queue,
        per_server=per_server,
        fleet=per_server * servers if per_server else None,
        measured_concurrency=concurrency,
        measured_generating=generating,
        completions_s=rate,
        refill_s=refill,
        binding=bool(cap and concurrency is not None and concurrency < cap),
    )
