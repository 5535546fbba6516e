"""The ``local`` launcher's case for the contract suite (``tests/test_launchers.py``): the simulated server as a
process group on this host; runs wherever the tests run."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from launchcase import CaseEnv

from autotune.launch.local import LocalLauncher


@contextlib.contextmanager
def case(tmp_path: Path) -> Iterator[CaseEnv]:
    devices = tmp_path / "devices"
    yield CaseEnv(
        launcher=LocalLauncher(watchdog_grace_s=1.0),
        python=sys.executable,
        env={"AUTOTUNE_SIM_DEVICE_DIR": str(devices)},
        device_dir=devices,
        work=tmp_path,
    )
