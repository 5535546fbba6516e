"""A launcher by name: what the trial and the fleet call, so neither builds a process, a job or a container."""

from __future__ import annotations

from autotune.errors import ConfigError
from autotune.launch import LAUNCHERS
from autotune.launch.base import Launcher


def make_launcher(launcher: str | Launcher = "local") -> Launcher:
    """The ``LAUNCHERS`` entry of that name, built without settings; a launcher instance is returned as it is."""
    if not isinstance(launcher, str):
        return launcher
    if launcher not in LAUNCHERS:
        raise ConfigError(f"unknown launcher {launcher!r}", key="launcher",
                          fix=f"use one of {', '.join(sorted(LAUNCHERS))}")
    made: Launcher = LAUNCHERS[launcher]()
    return made
