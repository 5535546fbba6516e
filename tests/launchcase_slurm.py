"""The ``slurm`` launcher's case for the contract suite: the simulated server as a batch job on the real cluster
(CI starts a single-node one, ``.ci/slurm.sh``). The job runs on this host, so this interpreter and the test's
simulated-GPU registry are the job's too. Skipped without ``sbatch`` unless ``AUTOTUNE_REQUIRE_ALL=1``."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launchcase import CaseEnv

from autotune.launch.slurm import SlurmLauncher


@functools.cache
def _why_no_slurm() -> str | None:
    if shutil.which("sbatch") is None:
        return "no Slurm here (sbatch not found; .ci/slurm.sh starts a single-node cluster)"
    try:  # the client tools alone (a login node, a laptop) are not a cluster: a controller must answer
        done = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"Slurm's controller does not answer (squeue: {exc}; .ci/slurm.sh starts a single-node cluster)"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"Slurm's controller does not answer (squeue: {said}; .ci/slurm.sh starts a single-node cluster)"
    return None


def slurm_missing() -> str | None:
    """Why Slurm cannot run here (no ``sbatch``, or no controller answering ``squeue``), or None; a missing cluster
    fails instead under ``AUTOTUNE_REQUIRE_ALL=1``."""
    why = _why_no_slurm()
    if why is not None and os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1":
        pytest.fail(why)
    return why


def queue() -> list[str]:
    """Every job this test run's processes submitted that the controller still lists (pending, running or
    completing), as ``id name state``. Jobs are told apart by their working directory (the cwd of whoever ran
    ``sbatch``): another checkout's tests on the same cluster are not ours to count or cancel."""
    done = subprocess.run(["squeue", "-h", "-o", "%i %j %T|%Z"], capture_output=True, text=True, timeout=30, check=True)
    here = os.path.realpath(os.getcwd())
    rows = [line.rpartition("|") for line in done.stdout.split("\n")[:-1]]
    return [row for row, _, cwd in rows if os.path.realpath(cwd) == here]


@contextlib.contextmanager
def empty_queue() -> Iterator[None]:
    """The queue is empty before and after: what a test leaves is cancelled, then reported as a failure."""
    assert queue() == [], f"jobs queued before the test: {queue()}"
    yield
    left = queue()
    if left:
        subprocess.run(["scancel", "--full", "--signal=KILL", *[line.split()[0] for line in left]], check=False)
        deadline = time.monotonic() + 15
        while queue() and time.monotonic() < deadline:
            time.sleep(0.2)
    assert left == [], f"jobs left in squeue after the test: {left}"


@contextlib.contextmanager
def case(tmp_path: Path) -> Iterator[CaseEnv]:
    devices = tmp_path / "devices"
    skip = slurm_missing()
    env = CaseEnv(
        launcher=SlurmLauncher(watchdog_grace_s=1.0),
        python=sys.executable,
        env={"AUTOTUNE_SIM_DEVICE_DIR": str(devices)},
        device_dir=devices,
        work=tmp_path,
        skip=skip,
    )
    if skip:
        yield env
        return
    with empty_queue():
        yield env
