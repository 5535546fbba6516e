"""The ``ssh`` launcher's case for the contract suite (``tests/test_launchers.py``): the same shell lines the
launcher sends over SSH, run by a loopback transport with ``bash -c`` on this host (what sshd would do on the
remote one); host ``127.0.0.1``, ``remote_dir`` under the test's folder. No other host is ever contacted.

The server runs under ``sh``, which leaves its exit status beside the pid file, so a server that fails at startup
reports its real exit code (the contract's ``ServerExited``); one we stop (a signal) polls ``GONE`` (-1)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from launchcase import CaseEnv

from autotune.launch.ssh import SshLauncher


class Loopback:
    """A transport that runs each command here; it records the commands it was sent."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str]] = []

    def __call__(self, host: str, command: str, timeout_s: float) -> tuple[int, str, str]:
        assert host == "127.0.0.1", host  # loopback only
        self.commands.append((host, command))
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout_s, check=False)
        return done.returncode, done.stdout, done.stderr


@contextlib.contextmanager
def case(tmp_path: Path) -> Iterator[CaseEnv]:
    devices = tmp_path / "devices"
    transport = Loopback()
    launcher = SshLauncher.from_settings(
        {"host": "127.0.0.1", "remote_dir": str(tmp_path / "remote"), "transport": transport}
    )
    yield CaseEnv(
        launcher=launcher,
        python=sys.executable,
        env={"AUTOTUNE_SIM_DEVICE_DIR": str(devices)},
        device_dir=devices,
        work=tmp_path,
    )
    assert transport.commands, "the launcher sent nothing through its transport"
    left = sorted(p.name for p in (tmp_path / "runs").glob("*") if p.suffix in (".pid", ".shm"))
    assert not left, f"the stop left its bookkeeping on the host: {left}"  # pid file, the start's /dev/shm record
