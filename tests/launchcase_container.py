"""The container launcher's case for the contract suite: ``ContainerLauncher`` driving ``tests/fakedocker.py``.

Containers cannot run on our machines, so the runtime is the fake CLI (put first on PATH as ``docker``), which runs
each container's command on this host. The interpreter inside the "image" is this test's, so the simulated engine
is importable there.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from launchcase import CaseEnv

from autotune.launch.container import ContainerLauncher

FAKE = Path(__file__).with_name("fakedocker.py")


def install_fake(bin_dir: Path, name: str = "docker") -> Path:
    """``bin_dir/<name>``: the fake CLI run by this interpreter (the fake needs only the standard library)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / name
    wrapper.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    wrapper.chmod(0o755)
    return wrapper


@contextlib.contextmanager
def fake_runtime(tmp_path: Path) -> Iterator[Path]:
    """The fake ``docker`` first on PATH, its state in ``tmp_path``; yields the state folder. Whatever a test left
    running is removed on the way out."""
    state = tmp_path / "fakedocker"
    wrapper = install_fake(tmp_path / "bin")
    saved = {k: os.environ.get(k) for k in ("PATH", "FAKEDOCKER_STATE")}
    os.environ["PATH"] = f"{wrapper.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["FAKEDOCKER_STATE"] = str(state)
    try:
        yield state
    finally:
        boxes = state / "containers"
        for box in sorted(boxes.glob("*")) if boxes.is_dir() else []:
            subprocess.run([str(wrapper), "rm", "-f", box.name], capture_output=True, check=False, timeout=30)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def case(tmp_path: Path) -> Iterator[CaseEnv]:
    """The launcher under test on the fake CLI (no mounts: nothing is mounted on this host)."""
    devices = tmp_path / "devices"
    with fake_runtime(tmp_path):
        yield CaseEnv(
            launcher=ContainerLauncher(runtime="docker", python=sys.executable, mounts=[]),
            python=sys.executable,
            env={"AUTOTUNE_SIM_DEVICE_DIR": str(devices)},
            device_dir=devices,
            work=tmp_path,
        )
