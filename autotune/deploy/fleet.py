"""A fleet: N servers, each on its group of GPUs (one host or several), described by ``fleet.toml``; start, inspect,
stop. Servers run detached; a later command acts only on a server its record proves the fleet's. docs/fleet.md
("The fleet").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import httpx

from autotune import redaction, tls
from autotune.deploy import fleetkeys, keeperproc, leasefile, remote, router
from autotune.deploy.fleetfile import (  # the fleet file's API, re-exported
    LOCAL_HOSTS as LOCAL_HOSTS,
)
from autotune.deploy.fleetfile import (
    Fleet as Fleet,
)
from autotune.deploy.fleetfile import (
    FleetServer as FleetServer,
)
from autotune.deploy.fleetfile import (
    fleet_toml as fleet_toml,
)
from autotune.deploy.fleetfile import (
    load_fleet as load_fleet,
)
from autotune.deploy.fleetfile import (
    replace_file as replace_file,
)
from autotune.deploy.fleetfile import (
    server_config as server_config,
)
from autotune.deploy.fleetfile import (
    set_server_config as set_server_config,
)
from autotune.deploy.fleetfile import (
    write_fleet as write_fleet,
)
from autotune.deploy.rolloutlog import locked
from autotune.deploy.servercmd import (  # re-exported
    device_argv as device_argv,
)
from autotune.deploy.servercmd import (
    engine_for as engine_for,
)
from autotune.deploy.servercmd import (
    launch_env as launch_env,
)
from autotune.deploy.servercmd import (
    server_argv as server_argv,
)
from autotune.errors import AutotuneError, ConfigError, FleetError
from autotune.harness.engines import logparse
from autotune.harness.engines.base import group_reader, launch_gpus
from autotune.launch import Launcher, LaunchSpec, ServerHandle
from autotune.launch.base import MemoryReader, ServerRecord
from autotune.launch.memory import wait_released
from autotune.launch.ports import port_is_free
from autotune.launch.registry import make_launcher
from autotune.results import Capacity
from autotune.sglang.envs import env_strings

log = logging.getLogger(__name__)


# -- one server at runtime -----------------------------------------------------------------------------
class InternalState(TypedDict, total=False):
    """One scheduler's ``internal_states`` entry, the keys read here (``num_running_reqs`` where reported; 0.5.23 and
    the simulator do not report it: ``drain`` then counts from ``/metrics`` or the router)."""

    last_gen_throughput: float
    num_running_reqs: int


class ServerInfo(TypedDict, total=False):
    """A server's ``/server_info`` (SGLang's keys): its resolved args by dest name, and one state per DP scheduler."""

    internal_states: list[InternalState]


def server_info(server: FleetServer, *, timeout_s: float = 3.0) -> ServerInfo | None:
    """The server's ``/server_info``, None when it does not answer with one."""
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, **tls.secured()) as client:
            response = client.get(f"{server.url}/server_info")
        return redaction.scrub(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def healthy(server: FleetServer, *, timeout_s: float = 3.0) -> bool:
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, **tls.secured()) as client:
            return client.get(f"{server.url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def record_path(fleet: Fleet, server: FleetServer) -> Path:
    """Where the server's handle is recorded: beside its pid file, ``run/<name>.record.json``."""
    return fleet.resolve(server.pid).with_suffix(".record.json")


def write_record(fleet: Fleet, server: FleetServer, record: ServerRecord) -> None:
    """Written as soon as the launcher answers: a command killed while the server loads leaves it findable."""
    replace_file(record_path(fleet, server), json.dumps(record.to_dict()) + "\n")


def read_record(fleet: Fleet, server: FleetServer) -> ServerRecord | None:
    """The server's record; else, for a local server ``launch_fleet.sh`` started, one made from its pid file (proven
    then by its port in the process's command line); None without either."""
    try:
        return ServerRecord.from_dict(json.loads(record_path(fleet, server).read_text()))
    except (OSError, ValueError, AttributeError):
        pass
    pid_path = fleet.resolve(server.pid)
    try:
        pid = int(pid_path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return ServerRecord(
        launcher="local",
        launch_id=f"pid-file-{pid}",
        host=server.bind,
        port=server.port,
        log_path=str(fleet.resolve(server.log)),
        gpus=tuple(server.gpus),
        pid=pid,
        run_dir=str(pid_path.parent),
    )


def attached(fleet: Fleet, server: FleetServer) -> ServerHandle | None:
    """The server's handle, found again through the launcher its record names (whatever the file's launcher says
    now); None without a record. Its ``alive`` is False unless the record proves it the fleet's and running."""
    record = read_record(fleet, server)
    if record is None:
        return None
    settings = fleet.launcher_settings if record.launcher == fleet.launcher else {}
    return make_launcher(record.launcher, settings).attach(record)


def ours(fleet: Fleet, server: FleetServer) -> ServerHandle | None:
    """The fleet's own server for this entry while it runs (pending or serving), else None."""
    handle = attached(fleet, server) if server.local else None
    return handle if handle is not None and handle.alive else None


def foreign_note(fleet: Fleet, server: FleetServer) -> str | None:
    """One line when the entry's port is held by a server that is not the fleet's, else None."""
    if not server.local or ours(fleet, server) is not None:
        return None
    return _port_held(server)


def _port_held(server: FleetServer) -> str | None:
    """``foreign_note``'s line once the fleet's own server is known not to run: something listens on its port."""
    if port_is_free(server.bind, server.port) and not healthy(server):
        return None
    return f"port {server.port}: a server that is not this fleet's ({server.name}'s port; left alone)"


def serving(fleet: Fleet, server: FleetServer) -> bool:
    """The fleet's own server answers ``/health`` (a server on another host: ``/health`` alone)."""
    if not server.local:
        return healthy(server)
    return ours(fleet, server) is not None and healthy(server)


def server_gpus(fleet: Fleet, server: FleetServer) -> tuple[int, ...]:
    """The GPUs one server gets, its whole group: none on SGLang's CPU backend (and no CUDA_VISIBLE_DEVICES; see
    ``launch_gpus``)."""
    return launch_gpus(engine_for(fleet, server), tuple(server.gpus) or None)


def memory_reader(fleet: Fleet, server: FleetServer, launcher: Launcher) -> MemoryReader | None:
    """The reader of the server's devices, through the launcher (it knows where the server runs): every GPU of
    its group (the fullest one decides); None for host RAM (shared: never "back to nothing used") or no driver."""
    if fleet.host_memory:
        return None
    engine = engine_for(fleet, server)
    own = tuple(server.gpus)
    try:
        return launcher.memory_reader(server_gpus(fleet, server), lambda gpus: group_reader(engine, gpus or own[:1]))
    except AutotuneError:  # no driver to ask (NVML missing): the next start's capacity check still guards
        return None


def start_server(
    fleet: Fleet,
    server: FleetServer,
    config: Mapping[str, Any],
    *,
    timeout_s: float,
    launcher: str | Launcher | None = None,
) -> int | str:
    """Start one server detached through ``launcher`` (default: the fleet file's, with its settings), record its
    handle and wait until ``/health`` answers; its pid, else its job id or container name. FleetError with the
    log's reason if not. A server on another host goes through the ``ssh`` launcher (``deploy.remote``: the entry's
    host, the fleet's ``remote_dir``)."""
    if not server.local:  # the ssh launcher, built from the entry's host and the fleet's remote_dir
        return remote.start_server(
            fleet,
            server,
            server_argv(fleet, server, config),
            env={**engine_for(fleet, server, env=launch_env(fleet)).env(), **fleet.sglang_env, **env_strings(config)},
            gpus=server_gpus(fleet, server),
            timeout_s=timeout_s,
        )
    engine = engine_for(fleet, server, env=launch_env(fleet))
    pid_path, log_path = fleet.resolve(server.pid), fleet.resolve(server.log)
    fleetkeys.private_log(fleet, log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    # With the GPU reader, a failed start waits until the device has released the memory again, so the
    # previous config that goes back on it next sizes its pools as before. Host RAM has no such owner.
    made = make_launcher(fleet.launcher, fleet.launcher_settings) if launcher is None else make_launcher(launcher)
    reader = memory_reader(fleet, server, made)
    # the launcher keeps what proves the server's /dev/shm files its own in its run dir; ``down`` attaches to the
    # server by its record, takes a last look and removes what that proves
    spec = LaunchSpec(
        argv=server_argv(fleet, server, config),
        port=server.port,
        host=server.bind,
        env={**engine.env(), **fleet.sglang_env, **env_strings(config)},
        gpus=server_gpus(fleet, server),
        log_path=log_path,
        run_dir=pid_path.parent,
        detach=True,
        shm_dir=engine.shm_dir,
        name=f"autotune-fleet-{server.name}",
    )
    handle = None
    try:
        handle = made.start(spec, gpu_reader=reader)
        record = handle.record()  # first: if this command is killed while the server loads, the next one finds it
        write_record(fleet, server, record)
        if record.pid is not None:
            pid_path.parent.mkdir(parents=True, exist_ok=True)
            pid_path.write_text(f"{record.pid}\n")
        handle.wait_ready(timeout_s)
    except AutotuneError as exc:
        text = handle.log_text()[offset:] if handle is not None else ""
        reason = logparse.failure_line(text) or str(exc)
        if handle is not None:
            handle.stop(grace_s=5.0, release_timeout_s=30.0)
            pid_path.unlink(missing_ok=True)
            record_path(fleet, server).unlink(missing_ok=True)
        raise FleetError(f"server {server.name} ({server.where}) did not start: {reason} (log: {log_path})") from None
    handle.release()  # it serves on after this command; this process stops watching it
    return record.pid if record.pid is not None else (record.job_id or record.name or record.launch_id)


def stop_server(fleet: Fleet, server: FleetServer, *, grace_s: float, release_timeout_s: float = 60.0) -> bool:
    """The launcher's stop of the server its record proves the fleet's (SIGTERM: SGLang drains in-flight requests;
    the kill after ``grace_s``; its /dev/shm files), then wait until every GPU of its group is free again (the next
    server sizes its pools from free memory). True if one ran. A server that is not the fleet's is never touched."""
    if not server.local:
        problems = remote.stop_server(fleet, server, grace_s=grace_s, release_timeout_s=release_timeout_s)
        for problem in problems or ():  # as a local server's teardown error: said, the fleet's stop goes on
            log.warning("server %s on %s: %s", server.name, server.host, problem)
        return problems is not None
    handle = ours(fleet, server)
    if handle is None and (dead := attached(fleet, server)) is not None:
        dead.stop(grace_s=0.0)  # it died: what it proved its own in /dev/shm while it ran goes (neighbours' stay)
    if handle is not None:
        handle.stop(grace_s=grace_s, release_timeout_s=release_timeout_s)
        if handle.alive:
            raise FleetError(f"server {server.name}: {handle.teardown_error or 'still running after the stop'}")
        if handle.teardown_error:
            log.warning("server %s: %s", server.name, handle.teardown_error)
    record_path(fleet, server).unlink(missing_ok=True)
    fleet.resolve(server.pid).unlink(missing_ok=True)
    if handle is None:
        return False
    wait_gpus_free(fleet, server, timeout_s=release_timeout_s)
    return True


def wait_gpus_free(fleet: Fleet, server: FleetServer, *, timeout_s: float) -> None:
    """Until every GPU of the server's group is back to (nearly) nothing used: the fleet owns its GPUs, and the
    next server sizes its pools from free memory (a dead server's memory comes back once its driver context is
    gone). Host RAM is shared: no wait there."""
    reader = memory_reader(fleet, server, make_launcher(fleet.launcher, fleet.launcher_settings))
    if reader is not None:
        try:
            wait_released(reader, 0.0, timeout_s, tolerance_mib=1024.0)
        finally:
            reader.close()


# -- the fleet -----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ServerStatus:
    name: str
    host: str
    gpus: list[int]
    port: int
    config: str
    pid: int | None = None  # the fleet's own server, as its record names it: a local pid, or a job id
    job: str | None = None
    launcher: str | None = None
    running: bool = False  # its record proves it the fleet's, and it runs (pending or serving)
    note: str | None = None  # a server that is not the fleet's holds the port
    lent: str | None = None  # lent to a study (``deploy.lease``): the lease's line
    healthy: bool = False
    capacity: Capacity | None = None
    drift: list[str] = field(default_factory=list)  # flags whose running value differs from `config`
    tok_s: float | None = None

    @property
    def gpu(self) -> int | None:
        """The group's first GPU (None without GPUs)."""
        return self.gpus[0] if self.gpus else None

    @property
    def state(self) -> str:
        if self.lent is not None:
            return "lent"
        if self.note is not None:
            return "foreign"
        if self.healthy:
            return "healthy"
        return "unhealthy" if self.running else "down"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host": self.host,
            "gpus": self.gpus,
            "gpu": self.gpu,
            "port": self.port,
            "config": self.config,
            "pid": self.pid,
            "job": self.job,
            "launcher": self.launcher,
            "state": self.state,
            "note": self.note,
            "lent": self.lent,
            "drift": self.drift,
            "tok_s": self.tok_s,
            "capacity": self.capacity.to_dict() if self.capacity else None,
        }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return bool(abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a))))
        except (TypeError, ValueError):
            return False
    return bool(a == b)


def drift(config: Mapping[str, Any], server_info: Mapping[str, Any]) -> list[str]:
    """Flags of ``config`` that ``/server_info`` (the resolved args) reports with another value."""
    return sorted(k for k, v in config.items() if v is not None and k in server_info and not _same(server_info[k], v))


def _tok_s(server: FleetServer, info: ServerInfo | None) -> float | None:
    states = (info or {}).get("internal_states") or [{}]
    value = states[0].get("last_gen_throughput") if isinstance(states[0], dict) else None
    if value is not None:
        return float(value)
    try:
        with httpx.Client(timeout=3.0, trust_env=False, **tls.secured()) as client:
            text = client.get(f"{server.url}/metrics").text
    except httpx.HTTPError:
        return None
    found = re.search(r"^sglang:gen_throughput(?:\{[^}]*\})?\s+([0-9.eE+-]+)", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def server_status(fleet: Fleet, server: FleetServer, *, figures: bool = True) -> ServerStatus:
    """Its state (lent, foreign, healthy, unhealthy, down) and, with ``figures``, its capacity, drift and tok/s."""
    status = ServerStatus(
        name=server.name, host=server.host, gpus=list(server.gpus), port=server.port, config=server.config
    )
    lent = leasefile.current(fleet)
    if lent is not None and lent.server == server.name:
        status.lent = lent.line
        return status  # the study's now: what runs on its GPUs is not the fleet's server
    if server.local:
        handle = ours(fleet, server)
        if handle is None:
            status.note = _port_held(server)  # not ours: attached once, above
            return status  # down, or someone else's: nothing it answers is the fleet's
        record = handle.record()
        status.pid, status.job, status.launcher, status.running = record.pid, record.job_id, record.launcher, True
    status.healthy = healthy(server)
    if not status.healthy or not figures:
        return status
    info = server_info(server)
    if info is not None:
        status.capacity = logparse.capacity("", info)
        try:
            status.drift = drift(server_config(fleet, server), info)
        except ConfigError:
            status.drift = ["(config file unreadable)"]
    status.tok_s = _tok_s(server, info)
    return status


def status(fleet: Fleet, *, figures: bool = True) -> list[ServerStatus]:
    return [server_status(fleet, server, figures=figures) for server in fleet.servers]


def _selected(fleet: Fleet, names: Iterable[str] | None) -> list[FleetServer]:
    return [fleet.server(n) for n in names] if names else list(fleet.servers)


def up(fleet: Fleet, *, timeout_s: float = 900.0, names: Iterable[str] | None = None) -> list[str]:
    """Start every server that is not already up. Configs and ports are checked before anything starts."""
    todo = []
    lent = leasefile.current(fleet)
    for server in _selected(fleet, names):
        config = server_config(fleet, server)  # a bad config file stops the command before any launch
        if lent is not None and lent.server == server.name and lent.holder_alive():
            continue  # its study's until the sweep gives it back
        if server.local and ours(fleet, server) is not None:
            continue
        if not server.local and healthy(server):
            continue
        if server.local and not port_is_free(server.bind, server.port):
            raise FleetError(
                f"port {server.bind}:{server.port} of server {server.name} is in use "
                "(stop what holds it, or change the port in the fleet file)"
            )
        todo.append((server, config))
    if todo:
        launch_env(fleet)  # an unset ${NAME} stops the command before any launch, too
    started, failures = [], []
    # Servers on different GPUs (groups never overlap) load in parallel: 7 come up in one startup time. Servers in
    # one host's RAM start one after another: each sizes its pools from what the one before left free.
    workers = 1 if fleet.host_memory else max(1, len(todo))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(start_server, fleet, s, c, timeout_s=timeout_s): s.name for s, c in todo}
        for future, name in futures.items():
            try:
                future.result()
                started.append(name)
            except FleetError as exc:
                failures.append(str(exc))
    if failures:
        running = f"; started: {', '.join(started)} (autotune fleet down stops them)" if started else ""
        raise FleetError("; ".join(failures) + running)
    router_up(fleet, timeout_s=timeout_s)
    return started


def router_up(fleet: Fleet, *, timeout_s: float = 60.0) -> router.Record | None:
    """The fleet's router on its own healthy servers (never a foreign one on a fleet port), when it has one
    (``deploy.router.wanted``); None otherwise."""
    if router.wanted(fleet) is not None:
        return None
    urls = [s.url for s in fleet.servers if serving(fleet, s)]
    return router.start(fleet, urls, timeout_s=min(timeout_s, 120.0)) if urls else None


def down(fleet: Fleet, *, grace_s: float = 30.0, names: Iterable[str] | None = None) -> list[str]:
    """Stop the fleet's own servers (all by default: the keeper first, then the router); the names that ran. A server
    stopped alone leaves the router first, under the fleet's lock (the keeper sees it stopped on purpose)."""
    if not names:
        keeperproc.stop(fleet)
        router.stop(fleet, grace_s=min(grace_s, 10.0))
        return [s.name for s in fleet.servers if stop_server(fleet, s, grace_s=grace_s)]
    with locked(fleet, holder="fleet down", wait_s=30.0):
        record = router.running(fleet)
        for server in _selected(fleet, names):
            if record is not None:
                router.remove_worker(record, server.url)
        return [s.name for s in _selected(fleet, names) if stop_server(fleet, s, grace_s=grace_s)]
