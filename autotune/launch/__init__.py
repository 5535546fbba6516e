"""Where servers run: the ``Launcher`` contract (``base``) and its implementations, registered by name.

A new launcher is one module here and one entry in ``LAUNCHERS``; ``tests/test_launchers.py`` runs the contract
suite over every entry (each launcher's test case lives in ``tests/launchcase_<name>.py``).
"""

from __future__ import annotations

from autotune.launch.base import (
    Launcher,
    LauncherFactory,
    LaunchSpec,
    ServerExited,
    ServerHandle,
    ServerStartTimeout,
)
from autotune.launch.container import ContainerLauncher
from autotune.launch.local import LocalLauncher
from autotune.launch.slurm import SlurmLauncher
from autotune.launch.ssh import SshLauncher

LAUNCHERS: dict[str, LauncherFactory] = {"local": LocalLauncher, "container": ContainerLauncher, "slurm": SlurmLauncher,
                                         "ssh": SshLauncher}

__all__ = ["LAUNCHERS", "LaunchSpec", "Launcher", "ServerExited", "ServerHandle", "ServerStartTimeout"]
