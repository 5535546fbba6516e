"""Where servers run: the ``Launcher`` contract (``base``) and its implementations, registered by name.

A new launcher is one module here and one entry in ``LAUNCHERS`` (``_CLASSES``: its class and module);
``tests/test_launchers.py`` runs the contract suite over every entry (each launcher's test case lives in
``tests/launchcase_<name>.py``).

The registry is built on first use: every launch starts a watchdog process (``python -m autotune.launch.watchdog``),
and importing a submodule runs this file first, so an eager registry cost each watchdog the import of every launcher
and, through them, httpx (with ``wait_healthy`` apart in ``health``: 0.24 → 0.07 CPU-s a watchdog).
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
