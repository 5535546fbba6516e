"""A launcher by name: what the trial and the fleet call, so neither builds a process, a job or a container."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.errors import ConfigError
from autotune.launch import LAUNCHERS
from autotune.launch.base import Launcher


def make_launcher(launcher: str | Launcher = "local", settings: Mapping[str, Any] | None = None) -> Launcher:
    """The ``LAUNCHERS`` entry of that name, built by its ``from_settings`` from ``settings`` (the study's
    ``[launcher.<name>]`` table; none: the launcher's defaults); a launcher instance is returned as it is."""
    if not isinstance(launcher, str):
        return launcher
    if launcher not in LAUNCHERS:
        raise ConfigError(
            f"unknown launcher {launcher!r}", key="launcher", fix=f"use one of {', '.join(sorted(LAUNCHERS))}"
        )
    made: Launcher = LAUNCHERS[launcher].from_settings(dict(settings or {}))
    return made
