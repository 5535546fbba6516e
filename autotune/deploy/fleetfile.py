"""The fleet file: ``fleet.toml``'s model (servers, engine, device, env, launcher), its validation, reading and
writing.

Kept apart from the runtime (``deploy.fleet``): reading a fleet file starts nothing, and its checks (unique names
and ports; no GPU in two servers of one host; no secrets; a GPU fleet's servers name their GPUs, as many as their
config spans) hold before any command acts on it. A server's ``gpus`` is its group (``CUDA_VISIBLE_DEVICES=0,1``
for a TP=2 server); an older file's ``gpu = N`` reads as ``gpus = [N]``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from autotune import tls
from autotune.config.sections import ENGINE_KINDS, LAUNCHER_KINDS, LauncherSection, engine_kind
from autotune.deploy.sglang_yaml import read_config_file
from autotune.errors import ConfigError, FleetError
from autotune.redaction import looks_secret
from autotune.sglang.parallel import server_gpus

LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})
TLS_DIR = "tls"  # the fleet's CA and its servers' certificates and keys (``deploy.fleettls``), beside fleet.toml
TLS_CA = f"{TLS_DIR}/ca.pem"
KEYS_DIR = "keys"  # the fleet's API and admin keys (``deploy.fleetkeys``), beside fleet.toml
SECRET_KEYS = re.compile(r"pass(word|phrase|wd)|secret", re.IGNORECASE)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FleetServer(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    host: str = "localhost"  # where it runs: local, or "user@name" / "name" reached over SSH
    # the group this server spans (CUDA_VISIBLE_DEVICES); empty for SGLang's CPU backend (the simulator's CPU:
    # its index)
    gpus: list[int] = []
    port: int = Field(ge=1, le=65535)
    bind: str = "127.0.0.1"  # the address the server listens on
    config: str  # the sglang.yaml this server runs, relative to the fleet file
    log: str
    pid: str
    extra_args: list[str] = []
    sim_options: dict[str, Any] = {}
    # HTTPS with a certificate of the fleet's own CA (``deploy.fleettls``): the router and autotune's clients verify
    # it, so a process that takes the server's port is never sent a request
    tls: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_gpu(cls, data: Any) -> Any:
        """An older fleet file's ``gpu = N``: the group ``[N]``."""
        if isinstance(data, dict) and "gpu" in data:
            data = dict(data)
            if "gpus" in data:
                raise ValueError("give gpus (the server's group) or gpu, not both")
            gpu = data.pop("gpu")
            data["gpus"] = [] if gpu is None else [gpu]
        return data

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, gpus: list[int]) -> list[int]:
        if any(g < 0 for g in gpus):
            raise ValueError(f"GPU indices are 0 or more (not {', '.join(str(g) for g in gpus)})")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"a GPU is listed twice ({', '.join(str(g) for g in gpus)})")
        return gpus

    @property
    def gpu(self) -> int | None:
        """The group's first GPU (SGLang's device 0 of this server), None without GPUs."""
        return self.gpus[0] if self.gpus else None

    @property
    def gpu_line(self) -> str:
        """``0,1``: the group as CUDA_VISIBLE_DEVICES and the status table write it."""
        return ",".join(str(g) for g in self.gpus)

    @property
    def local(self) -> bool:
        return self.host in LOCAL_HOSTS

    @property
    def address(self) -> str:
        """Where to reach its HTTP endpoints from here."""
        if self.local:
            return "127.0.0.1" if self.bind in ("0.0.0.0", "") else self.bind
        return self.host.rpartition("@")[2].split(":")[0]

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def where(self) -> str:
        """``gpu 3, port 30003``, ``gpus 0,1, port 30000`` (a CPU server: ``port 30003``), for messages."""
        if not self.gpus:
            return f"port {self.port}"
        return f"gpu{'s' if len(self.gpus) > 1 else ''} {self.gpu_line}, port {self.port}"


ROUTER_OWNS = (
    "--host",
    "--port",
    "--worker-urls",
    "--prometheus-host",
    "--prometheus-port",
    "--policy",
    "--ca-cert-paths",
)


class RouterSection(_Model):
    """``[router]``: sglang-router in front of a fleet of two or more servers (``deploy.router``); it runs on the
    host that runs ``fleet up``, its workers are the servers' URLs. ``router = false`` turns it off."""

    router: bool = True
    host: str = "127.0.0.1"  # where the job's client reaches it
    port: int = Field(default=30000, ge=1, le=65535)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)  # its Prometheus endpoint (default: port + 1)
    policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    extra_args: list[str] = []  # more sglang_router.launch_router flags, as argv tokens
    log: str = "logs/router.log"
    record: str = "run/router.json"  # its pid, ports, log and --worker-urls, written when it starts

    @field_validator("extra_args")
    @classmethod
    def _not_ours(cls, args: list[str]) -> list[str]:
        owned = [a for a in args if a.split("=", 1)[0] in ROUTER_OWNS]
        if owned:
            raise ValueError(
                f"{', '.join(owned)} is set by the fleet file itself (use host, port, metrics_port "
                "or policy; --ca-cert-paths follows the servers' tls)"
            )
        return args

    @property
    def prometheus_port(self) -> int:
        return self.metrics_port or self.port + 1

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"


class KeeperSection(_Model):
    """``[keeper]``: the fleet's keeper (``deploy.keeper``), which ``fleet up`` leaves running beside the fleet: it
    restarts a server that died or stopped answering, and keeps the router on the fleet's own servers only."""

    keep: bool = True  # false: fleet up starts no keeper (``autotune fleet keep`` runs one in the foreground)
    interval_s: float = Field(default=1.0, gt=0, le=60)  # how often it looks at every server
    unresponsive_s: float = Field(default=30.0, gt=0)  # a serving server silent this long is restarted
    backoff_s: list[float] = Field(default=[5.0, 30.0, 120.0], min_length=1)  # before the 1st, 2nd, … restart
    crash_limit: int = Field(default=3, ge=1)  # deaths within crash_window_s after which it stops restarting
    crash_window_s: float = Field(default=600.0, gt=0)
    start_timeout_s: float = Field(default=900.0, gt=0)  # a restart's startup, as fleet up --timeout
    log: str = "logs/keeper.log"
    record: str = "run/keeper.json"  # its pid and start time, written when it starts

    @field_validator("backoff_s")
    @classmethod
    def _not_negative(cls, backoff: list[float]) -> list[float]:
        if any(b < 0 for b in backoff):
            raise ValueError("backoff_s: seconds are 0 or more")
        return backoff


class Fleet(_Model):
    engine: str = "sglang"  # one of ENGINE_KINDS
    model: str
    python: str | None = None  # interpreter on each host (default: this one, or "python3" remotely)
    device: Literal["cuda", "cpu"] = "cuda"  # "cpu": SGLang's CPU backend (host RAM, no CUDA_VISIBLE_DEVICES)
    env: dict[str, str] = {}  # the engine's environment; "${NAME}" is read from the starter's environment
    sglang_env: dict[str, str] = {}  # the winner's SGLang environment levers ([space.env]), given to every server
    sim_gpu: str | None = None
    launcher: str = "local"  # where this host's servers run (one of LAUNCHER_KINDS); other hosts: over SSH
    launcher_settings: dict[str, Any] = {}  # the study's [launcher.<name>] table, as make_launcher takes it
    remote_dir: str = "autotune-fleet"  # remote hosts: relative log/pid paths live under this directory
    servers: list[FleetServer] = Field(min_length=1)
    router: RouterSection | None = None  # absent: no router (a fleet file written before it; deploy.router.wanted)
    keeper: KeeperSection = KeeperSection()  # absent: a keeper with these defaults
    # The fleet's API key on every server and the router, an admin key on the router's control plane, in keys/
    # (``deploy.fleetkeys``): what a fleet that binds beyond loopback runs with
    keys: bool = False
    path: Path | None = Field(default=None, exclude=True)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine not in ENGINE_KINDS:
            raise ValueError(f"unknown engine {engine!r} (use one of: {', '.join(ENGINE_KINDS)})")
        return engine

    @field_validator("launcher")
    @classmethod
    def _known_launcher(cls, launcher: str) -> str:
        if launcher not in LAUNCHER_KINDS:
            raise ValueError(f"unknown launcher {launcher!r} (use one of: {', '.join(LAUNCHER_KINDS)})")
        return launcher

    @model_validator(mode="after")
    def _launcher_settings(self) -> Fleet:
        """Checked as the study's ``[launcher.<name>]`` is, so a bad table stops ``fleet up`` before any start."""
        if self.launcher_settings and self.launcher not in LauncherSection.model_fields:
            raise ValueError(f"launcher {self.launcher!r} takes no launcher_settings")
        if self.launcher_settings:
            try:
                LauncherSection.model_validate({self.launcher: self.launcher_settings})
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                raise ValueError(
                    f"launcher_settings.{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}"
                ) from None
        return self

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return env

    @model_validator(mode="after")
    def _unique(self) -> Fleet:
        for what, key in (("name", lambda s: s.name), ("port", lambda s: (s.host, s.port))):
            seen: set[Any] = set()
            for server in self.servers:
                if key(server) in seen:
                    raise ValueError(f"two servers share the same {what} ({server.name})")
                seen.add(key(server))
        owner: dict[tuple[str, int], str] = {}  # (host, GPU) → the server using it
        for server in self.servers:
            host = "localhost" if server.local else server.host
            for gpu in server.gpus:
                other = owner.setdefault((host, gpu), server.name)
                if other != server.name:
                    raise ValueError(
                        f"servers {other} and {server.name} both use GPU {gpu} on {host} "
                        "(give each GPU of a host to one server)"
                    )
        if self.router is not None and self.router.router:
            local = {s.port for s in self.servers if s.local}
            taken = sorted(local & {self.router.port, self.router.prometheus_port})
            if taken or self.router.port == self.router.prometheus_port:
                raise ValueError(
                    f"router.port: {self.router.port} (metrics {self.router.prometheus_port}) collides "
                    f"with port {(taken or [self.router.port])[0]} (give the router ports no server uses)"
                )
            own = {self.router.log, self.router.record, str(Path(self.router.record).with_suffix(".pid"))}
            for server in self.servers:  # a server's pid file or log that is the router's would prove the wrong one
                if server.local and own & {server.pid, server.log, str(Path(server.pid).with_suffix(".record.json"))}:
                    raise ValueError(
                        f"server {server.name}: its pid file or log is the router's (rename the server, "
                        "or give [router] another log and record)"
                    )
        for server in self.servers:
            if not server.gpus and not self.host_memory:
                raise ValueError(
                    f"server {server.name} has no gpus (every server of a GPU fleet names its GPUs, e.g. gpus = [0, 1])"
                )
            if not server.local and server.bind.startswith("127."):
                raise ValueError(
                    f"server {server.name} on {server.host} binds {server.bind}, which cannot be "
                    "polled from here; set bind to that host's address or 0.0.0.0"
                )
            if self.keys and (not server.local or self.launcher != "local"):
                raise ValueError(
                    f"server {server.name}: keys = true needs every server started on this host by the "
                    "local launcher (the key files and the script that reads them are here)"
                )
            if server.tls and not server.local:
                raise ValueError(
                    f"server {server.name} on {server.host}: tls needs the fleet's certificate on that "
                    "host, which autotune does not copy there yet (set tls = false for it)"
                )
        return self

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    @property
    def tls(self) -> bool:
        """Some server proves itself with the fleet's CA: the router verifies workers against it."""
        return any(s.tls for s in self.servers)

    @property
    def simulated(self) -> bool:
        """The fleet runs a model of a GPU (``config.EngineKind.simulated``): its ``sim_gpu`` applies."""
        return engine_kind(self.engine).simulated

    @property
    def host_memory(self) -> bool:
        """SGLang's CPU backend (or the simulator's model of it): its pools live in host RAM, shared with everything
        else on the host."""
        return self.device == "cpu"

    def resolve(self, relative: str) -> Path:
        path = Path(relative)
        return path if path.is_absolute() else self.base_dir / path

    def server(self, name: str) -> FleetServer:
        for server in self.servers:
            if server.name == name:
                return server
        raise FleetError(f"no server named {name!r} in the fleet ({', '.join(s.name for s in self.servers)})")


# -- the file ------------------------------------------------------------------------------------------
def _find_secrets(data: Any, where: str = "") -> str | None:
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{where}.{key}" if where else str(key)
            if here == "env" and isinstance(value, dict):
                # Variable names may say SECRET or PASSWORD; what must not be here is a literal value.
                found = next((k for k, v in value.items() if isinstance(v, str) and looks_secret(str(k), v)), None)
                if found:
                    return f"env.{found}"
                continue
            if SECRET_KEYS.search(str(key)):
                return here
            found = _find_secrets(value, here)
            if found:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = _find_secrets(value, f"{where}.{i}")
            if found:
                return found
    return None


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet file; every problem is one FleetError naming the file and the field."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FleetError(f"{path}: fleet file not found (write one with autotune apply --out DIR)") from None
    except OSError as exc:
        raise FleetError(f"{path}: cannot read the fleet file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"{path}: not valid TOML ({exc})") from None
    secret = _find_secrets(raw)
    if secret and secret.startswith("env."):
        name = secret.removeprefix("env.")
        raise FleetError(
            f"{path}: {secret}: looks like a secret, which a fleet file must not hold "
            f'(write {name} = "${{{name}}}" and set {name} in the environment that starts the fleet)'
        )
    if secret:
        raise FleetError(
            f"{path}: {secret}: passwords and secrets are not allowed in a fleet file "
            "(reach remote hosts with an SSH key or agent)"
        )
    try:
        fleet = Fleet.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise FleetError(f"{path}: {where + ': ' if where else ''}{msg}") from None
    fleet.path = path.resolve()
    mismatch = group_mismatch(fleet)
    if mismatch:
        raise FleetError(f"{path}: {mismatch}")
    if fleet.tls and fleet.resolve(TLS_CA).is_file():  # this process's clients verify its servers by the fleet's CA
        tls.trust(fleet.resolve(TLS_CA))
    present_keys(fleet)
    return fleet


def present_keys(fleet: Fleet) -> None:
    """This process's clients send the fleet's keys (``autotune.tls.present``): the API key to its servers and the
    router, the admin key to the router's worker endpoints; nothing for a fleet without keys or before they exist."""
    api, admin = fleet.resolve(f"{KEYS_DIR}/api.key"), fleet.resolve(f"{KEYS_DIR}/admin.key")
    if not fleet.keys or not api.is_file():
        return
    key = api.read_text().strip()
    for server in fleet.servers:
        tls.present(server.url, key)
    if fleet.router is not None:
        tls.present(fleet.router.url, key)
        if admin.is_file():
            tls.present(fleet.router.url, admin.read_text().strip(), prefix="/workers")


def spans(config: Mapping[str, Any]) -> str:
    """``tp_size 2 × pp_size 1 × dp_size 1``: what a config's GPU count is made of, for messages."""
    return " × ".join(f"{key} {config.get(key) or 1}" for key in ("tp_size", "pp_size", "dp_size"))


def group_mismatch(fleet: Fleet, config: Mapping[str, Any] | None = None) -> str | None:
    """Why a server's group is not the size its config (or ``config``) spans, or None. A CPU fleet has no groups;
    a server whose config file cannot be read is left to the command that reads it (``fleet up`` names it)."""
    if fleet.host_memory:
        return None
    for server in fleet.servers:
        try:
            wanted = config if config is not None else server_config(fleet, server)
        except ConfigError:
            continue
        need = server_gpus(wanted)
        if len(server.gpus) != need:
            return (
                f"servers.{server.name}.gpus: [{', '.join(str(g) for g in server.gpus)}] is "
                f"{len(server.gpus)} GPU(s), but its config spans {need} ({spans(wanted)}) "
                f"(give it {need} GPU(s), or lay the fleet out again with autotune apply --gpus ... --out DIR)"
            )
    return None


def fleet_toml(fleet: Fleet) -> str:
    data = fleet.model_dump(exclude_none=True)
    servers = data.pop("servers")
    doc = {k: v for k, v in data.items() if v != {}}
    doc["servers"] = [{k: v for k, v in server.items() if not (v == [] or v == {})} for server in servers]
    head = "# autotune fleet: one `servers` entry per server; `config` is the sglang.yaml it runs.\n"
    return head + tomli_w.dumps(doc)


def replace_file(path: Path, text: str, *, private: bool = False) -> None:
    """Write ``text`` atomically (a reader, or a SIGKILL mid-write, sees the old file or the new one): the fleet file
    and the records beside it (servers', router's, keeper's, a lease); ``private``: readable by the user only from
    the moment it exists (the fleet's keys and its CA's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if private:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def private_folder(folder: Path) -> Iterator[Path]:
    """A folder only the user can read (the fleet's ``tls/``, ``keys/``), one writer at a time in it: servers start
    in parallel and a keeper may restart one, so what one writes is never made twice."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    with os.fdopen(os.open(folder / ".lock", os.O_WRONLY | os.O_CREAT, 0o600), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def write_fleet(fleet: Fleet, path: str | Path | None = None) -> Path:
    path = Path(path or fleet.path or "fleet.toml")
    replace_file(path, fleet_toml(fleet))
    return path


def set_server_config(fleet: Fleet, name: str, config_file: str) -> Fleet:
    """A copy of ``fleet`` with server ``name`` recorded as running ``config_file``."""
    servers = [s.model_copy(update={"config": config_file}) if s.name == name else s for s in fleet.servers]
    return fleet.model_copy(update={"servers": servers})


def server_config(fleet: Fleet, server: FleetServer) -> dict[str, Any]:
    return read_config_file(fleet.resolve(server.config))
