"""Where servers run: the ``Launcher`` contract (``base``) and its implementations, registered by name in
``LAUNCHERS``, built on first use (every watchdog imports this file). A new launcher is one module and one entry;
docs/contributing.md ("Extending autotune").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autotune.launch.base import (
    Launcher,
    LauncherFactory,
    LaunchSpec,
    PortTaken,
    ServerExited,
    ServerHandle,
    ServerStartTimeout,
)

if TYPE_CHECKING:
    from autotune.launch.container import ContainerLauncher
    from autotune.launch.local import LocalLauncher
    from autotune.launch.slurm import SlurmLauncher
    from autotune.launch.ssh import SshLauncher

    LAUNCHERS: dict[str, LauncherFactory]

_CLASSES = {
    "LocalLauncher": "local",
    "ContainerLauncher": "container",
    "SlurmLauncher": "slurm",
    "SshLauncher": "ssh",
}  # class → its module, and the name it is registered under

__all__ = [
    "LAUNCHERS",
    "ContainerLauncher",
    "LaunchSpec",
    "Launcher",
    "LocalLauncher",
    "PortTaken",
    "ServerExited",
    "ServerHandle",
    "ServerStartTimeout",
    "SlurmLauncher",
    "SshLauncher",
]


def __getattr__(name: str) -> Any:
    if name == "LAUNCHERS":
        registry: dict[str, LauncherFactory] = {
            where: getattr(importlib.import_module(f"autotune.launch.{where}"), cls) for cls, where in _CLASSES.items()
        }
        globals()["LAUNCHERS"] = registry
        return registry
    if name in _CLASSES:
        return getattr(importlib.import_module(f"autotune.launch.{_CLASSES[name]}"), name)
    raise AttributeError(f"module 'autotune.launch' has no attribute {name!r}")
