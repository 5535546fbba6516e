"""SGLang's router (``sglang-router``, the ``autotune[router]`` extra) in front of a fleet of two or more servers:
started detached by ``fleet up`` (its record written the moment it starts), stopped by ``fleet down``, its workers
added and removed at run time. docs/fleet.md ("The router: one URL for the job").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

import httpx
import psutil

from autotune import tls
from autotune.deploy import fleetkeys
from autotune.deploy.detached import spawn
from autotune.deploy.fleetfile import TLS_CA, Fleet, FleetServer, RouterSection, replace_file
from autotune.deploy.inflight import ClientAdvice
from autotune.deploy.launchscript import ScriptEntry
from autotune.deploy.ports import pick_after
from autotune.errors import FleetError
from autotune.launch.process import port_is_free, stop_process_group
from autotune.launch.procgroup import alive_since
from autotune.launch.stopping import wait_until

MODULE = "sglang_router"
EXTRA = "pip install 'autotune[router]'"


def installed() -> bool:
    """The extra is importable by this interpreter (the router runs under it, beside ``fleet up``)."""
    return importlib.util.find_spec(MODULE) is not None


def section(fleet: Fleet) -> RouterSection:
    """The fleet's ``[router]``; a fleet file without one (written before the router) has it off."""
    return fleet.router if fleet.router is not None else RouterSection(router=False)


def wanted(fleet: Fleet) -> str | None:
    """None when the fleet runs behind a router; else why not, in words."""
    if len(fleet.servers) < 2:
        return "one server needs no router"
    if fleet.router is None:
        return "the fleet file has no [router] section (autotune apply --out writes one)"
    if not fleet.router.router:
        return "[router] says router = false"
    if not installed():
        return f"sglang-router is not installed ({EXTRA})"
    return None


# -- the process ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Record:
    """What ``run/router.json`` holds: enough to find, reach and stop the router again."""

    pid: int
    started: float  # the process's create time (psutil): a reused pid does not match it
    url: str
    host: str
    port: int
    metrics_port: int
    log: str
    worker_urls: list[str]
    argv: list[str]

    @property
    def metrics_base(self) -> str:
        """Where its Prometheus endpoint answers (``get(record.metrics_base, "/metrics")``)."""
        return f"http://127.0.0.1:{self.metrics_port}"

    def alive(self) -> bool:
        return alive_since(self.pid, self.started)


def record_path(fleet: Fleet) -> Path:
    return fleet.resolve(section(fleet).record)


def pid_path(fleet: Fleet) -> Path:
    """``run/router.pid``: what the launch script writes (and ``fleet up`` too), for a router started by hand."""
    return record_path(fleet).with_suffix(".pid")


def samples_path(fleet: Fleet) -> Path:
    """The readings of its counters ``deploy.routerview`` keeps, to give rates over the last minute."""
    return record_path(fleet).with_name("router-samples.jsonl")


def read_record(fleet: Fleet) -> Record | None:
    """The router's record, else one made from the launch script's pid file if that pid is a router."""
    try:
        return Record(**json.loads(record_path(fleet).read_text()))
    except (OSError, ValueError, TypeError):
        pass
    try:
        proc = psutil.Process(int(pid_path(fleet).read_text().split()[0]))
        if "router" not in " ".join(proc.cmdline()):
            return None
        r = section(fleet)
        return Record(
            pid=proc.pid,
            started=proc.create_time(),
            url=r.url,
            host=r.host,
            port=r.port,
            metrics_port=r.prometheus_port,
            log=str(fleet.resolve(r.log)),
            worker_urls=[],
            argv=[],
        )
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def running(fleet: Fleet) -> Record | None:
    """The fleet's router if its recorded process still runs."""
    record = read_record(fleet)
    return record if record is not None and record.alive() else None


def argv(fleet: Fleet, worker_urls: Iterable[str]) -> list[str]:
    """The router's command: argv tokens, never a shell line; it and its metrics bind ``[router] host``; a fleet
    whose servers prove themselves with its CA has the router verify every worker against it; a fleet with keys
    starts it reading them from their files."""
    ca = fleet.resolve(TLS_CA) if fleet.tls else None
    return fleetkeys.router_argv(fleet, command(section(fleet), list(worker_urls), ca=ca))


def command(r: RouterSection, urls: list[str], *, ca: Path | str | None = None) -> list[str]:
    metrics_host = "127.0.0.1" if r.host in ("0.0.0.0", "") else r.host
    verify = ["--ca-cert-paths", str(ca)] if ca is not None else []
    return [
        sys.executable,
        "-m",
        f"{MODULE}.launch_router",
        "--host",
        r.host,
        "--port",
        str(r.port),
        "--worker-urls",
        *urls,
        "--policy",
        r.policy,
        "--prometheus-host",
        metrics_host,
        "--prometheus-port",
        str(r.prometheus_port),
        *verify,
        *r.extra_args,
    ]


def start(fleet: Fleet, worker_urls: list[str], *, timeout_s: float = 60.0) -> Record:
    """Start the router detached on ``worker_urls`` and wait until it answers with every worker healthy; a
    router already running is kept and its workers set to ``worker_urls``. FleetError with its log's reason."""
    current = running(fleet)
    if current is not None and get(current.url, "/health") is not None:
        set_workers(current, worker_urls, timeout_s=timeout_s)
        return current
    stop(fleet)  # a record whose process died, or a router that does not answer: nothing is left to trip on
    r = section(fleet)
    for port in (r.port, r.prometheus_port):
        if not port_is_free(r.host, port):
            raise FleetError(
                f"port {r.host}:{port} of the router is in use (stop what holds it, or change "
                f"[router] port / metrics_port in {fleet.path})"
            )
    log_path, command = fleet.resolve(r.log), argv(fleet, worker_urls)
    fleetkeys.private_log(fleet, log_path)
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    proc, started = spawn(command, log_path, env=env)
    record = Record(
        pid=proc.pid,
        started=started,
        url=r.url,
        host=r.host,
        port=r.port,
        metrics_port=r.prometheus_port,
        log=str(log_path),
        worker_urls=list(worker_urls),
        argv=command,
    )
    # The record goes first: a fleet up killed while the router starts leaves one the next command finds.
    replace_file(record_path(fleet), json.dumps(asdict(record), indent=2) + "\n")
    pid_path(fleet).write_text(f"{proc.pid}\n")
    try:
        _wait_ready(record, proc, worker_urls, timeout_s)
    except FleetError:
        stop(fleet)
        raise
    return record


def _wait_ready(record: Record, proc: subprocess.Popen[bytes], urls: list[str], timeout_s: float) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            raise FleetError(
                f"the router exited with code {proc.returncode} before it answered: "
                f"{_log_reason(record.log)} (log: {record.log})"
            )
        return get(record.url, "/health") is not None and _healthy_urls(record) >= set(urls)

    if not wait_until(ready, timeout_s, 0.1):
        raise FleetError(
            f"the router did not answer with its {len(urls)} workers healthy within {timeout_s:.0f} s "
            f"(log: {record.log})"
        )


def _log_reason(log: str) -> str:
    try:
        lines = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["empty log"])[-1][-300:]


def stop(fleet: Fleet, *, grace_s: float = 10.0) -> bool:
    """SIGTERM, SIGKILL of its group after ``grace_s``, until its process has exited and both its ports are free;
    True if one ran."""
    record = read_record(fleet)
    if record is None:
        return False
    ran = record.alive()
    if ran:
        stop_process_group(record.pid, grace_s=grace_s)
        wait_until(lambda: not record.alive(), 10.0, 0.05)  # fleet down returns once the router has exited
    wait_until(lambda: all(port_is_free(record.host, p) for p in (record.port, record.metrics_port)), 10.0, 0.05)
    for path in (record_path(fleet), pid_path(fleet), samples_path(fleet)):
        path.unlink(missing_ok=True)
    return ran


# -- its HTTP API ----------------------------------------------------------------------------------------
def get(base: str, path: str, *, timeout_s: float = 3.0) -> Any:
    """GET ``base + path``: its JSON (or text), None on any failure."""
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, **tls.secured()) as client:
            response = client.get(base + path)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


class Worker(TypedDict, total=False):
    """One entry of the router's ``/workers`` (the keys autotune reads)."""

    id: str
    url: str
    is_healthy: bool
    load: int  # the router's own count of requests it has in flight there


def workers(record: Record) -> list[Worker]:
    """The router's ``/workers``: id, url, is_healthy, load (its own count of requests it has in flight there)."""
    data = get(record.url, "/workers")
    return list(data.get("workers") or []) if isinstance(data, dict) else []


def _healthy_urls(record: Record) -> set[str]:
    return {w["url"] for w in workers(record) if w.get("is_healthy")}


def _change(method: str, url: str, **kwargs: Any) -> None:
    try:
        with httpx.Client(timeout=10.0, trust_env=False, **tls.secured()) as client:
            response = client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise FleetError(f"the router did not take {method} {url}: {exc}") from None
    if response.status_code >= 300:
        raise FleetError(f"the router refused {method} {url}: {response.status_code} {response.text[:200]}")


def remove_worker(record: Record, url: str, *, timeout_s: float = 30.0) -> bool:
    """Take ``url`` out of the router (no new request goes there); returns once the router lists it no more.
    False when it was not in the router."""
    found = [w for w in workers(record) if w.get("url") == url]
    for worker in found:
        _change("DELETE", f"{record.url}/workers/{worker['id']}")
    if not wait_until(lambda: url not in {w.get("url") for w in workers(record)}, timeout_s, 0.1):
        raise FleetError(f"the router still lists {url} after {timeout_s:.0f} s")
    return bool(found)


def add_worker(record: Record, url: str, *, timeout_s: float = 60.0) -> None:
    """Put ``url`` (back) into the router; returns once the router lists it healthy."""
    if url not in {w.get("url") for w in workers(record)}:
        _change("POST", f"{record.url}/workers", json={"url": url})
    if not wait_until(lambda: url in _healthy_urls(record), timeout_s, 0.1):
        raise FleetError(f"the router does not list {url} as healthy after {timeout_s:.0f} s")


def set_workers(record: Record, urls: list[str], *, timeout_s: float = 60.0) -> None:
    """Make the router's workers exactly ``urls``."""
    for worker in workers(record):
        if worker.get("url") not in urls:
            remove_worker(record, worker["url"], timeout_s=timeout_s)
    for url in urls:
        add_worker(record, url, timeout_s=timeout_s)


# -- what apply writes -------------------------------------------------------------------------------------
def for_servers(servers: list[FleetServer], layout: Fleet | None = None) -> RouterSection | None:
    """``[router]`` for a new fleet file: the laid-out fleet's own, else for two or more servers one on
    127.0.0.1 at the first two ports after the highest server port that no server uses and nothing holds now
    (``deploy.ports.pick_after``); None for one server."""
    if layout is not None and layout.router is not None:
        return layout.router
    if len(servers) < 2:
        return None
    port, metrics_port = pick_after([s.port for s in servers], 2, RouterSection().host)
    return RouterSection(port=port, metrics_port=metrics_port)


def advise(client: ClientAdvice, routing: RouterSection | None) -> ClientAdvice:
    """The client advice with the router's URL, or with what a router would give where there is none."""
    if routing is None:
        return client
    if routing.router and installed():
        return replace(client, router_url=routing.url)
    why = "router = false in [router]" if not routing.router else f"sglang-router is not installed ({EXTRA})"
    return replace(
        client,
        router_note=(
            f"no router ({why}): with it, the job points at one URL ({routing.url}) that spreads its requests over "
            f"the {client.servers} servers, and a rollout drains each server through it instead of failing the "
            "requests it had in flight"
        ),
    )


def script_entry(
    routing: RouterSection | None, urls: list[str], *, ca: str | None = None, keyed: Fleet | None = None
) -> ScriptEntry | None:
    """The launch script's line for the router (after the servers': it waits for them), when it runs; ``keyed``:
    the fleet whose keys it reads from their files."""
    if routing is None or not routing.router or not installed():
        return None
    line = command(routing, urls, ca=ca)
    return ScriptEntry(
        log=routing.log,
        pid=str(Path(routing.record).with_suffix(".pid")),
        gpus="",
        argv=fleetkeys.router_argv(keyed, line, relative=True) if keyed is not None else line,
    )
