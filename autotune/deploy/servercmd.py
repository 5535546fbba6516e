"""What a fleet server runs: its engine, its environment and its command (the certificate and key the fleet gives
it included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.deploy import fleetkeys, fleettls
from autotune.deploy.fleetfile import Fleet, FleetServer
from autotune.errors import ConfigError, FleetError
from autotune.harness.engines import make_engine
from autotune.harness.engines.base import Engine
from autotune.redaction import resolve_env


def engine_for(fleet: Fleet, server: FleetServer, *, env: Mapping[str, str] | None = None) -> Engine:
    """The fleet's engine for one server; ``env`` (resolved, see ``launch_env``) only matters for a launch."""
    python = fleet.python if server.local else (fleet.python or "python3")
    return make_engine(
        fleet.engine,
        model_path=fleet.model,
        python=python,
        env=env,
        device=fleet.device,
        sim_gpu=fleet.sim_gpu or "b200",
        sim_options=server.sim_options or None,
    )


def launch_env(fleet: Fleet) -> dict[str, str]:
    """The fleet's ``env`` with every ``${NAME}`` filled from this environment; FleetError naming one unset."""
    try:
        return resolve_env(fleet.env)
    except ConfigError as exc:
        where = f"{fleet.path}: " if fleet.path else ""
        raise FleetError(f"{where}{exc}") from None


def device_argv(fleet: Fleet, argv: list[str]) -> list[str]:
    """SGLang's own ``--device cpu`` for a CPU fleet, unless the command already names a device."""
    if fleet.device == "cpu" and not any(a == "--device" or a.startswith("--device=") for a in argv):
        return ["--device", "cpu"]
    return []


def server_argv(fleet: Fleet, server: FleetServer, config: Mapping[str, Any]) -> list[str]:
    """The server's command: the engine's for its config, its extra flags, the fleet's device, its certificate,
    started so that it reads the fleet's API key from its file (a fleet with keys)."""
    argv = [*engine_for(fleet, server).argv(config, port=server.port, host=server.bind), *server.extra_args]
    return fleetkeys.server_argv(fleet, [*argv, *device_argv(fleet, argv), *fleettls.ssl_argv(fleet, server)])
