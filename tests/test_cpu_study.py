"""A study on SGLang's CPU backend (the simulator's model of it: pools in the host's memory) speaks of CPU time and
host memory in every view, and stores no GPU keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tinystudy import write_tiny_study

from autotune.results import GPU_ONLY, GPU_ONLY_PEAKS


def cli(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


@pytest.mark.slow
def test_a_cpu_study_says_cpu_time_and_host_memory_with_no_gpu_keys(tmp_path):
    path = write_tiny_study(tmp_path, name="cpu", trials=2)
    text = path.read_text().replace('kind = "sim"\n', 'kind = "sim"\ndevice = "cpu"\n', 1)
    path.write_text(text)
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    swept = cli("sweep", "--config", str(path), env=env, cwd=tmp_path)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    assert "server-min" in swept.stdout and "on SGLang's CPU backend" in swept.stdout
    assert "GPU-min" not in swept.stdout and "GPU-h" not in swept.stdout

    results = sorted((tmp_path / "cpu" / "trials").glob("*/result.json"))
    assert len(results) >= 2
    measured = 0
    for result in results:
        stored = json.loads(result.read_text())
        assert stored["device"] == "cpu" and not set(GPU_ONLY) & set(stored), (result, sorted(stored))
        if stored["status"] == "ok":
            host = stored["host"]
            assert host["peak_used_gib"] > 0 and not set(GPU_ONLY_PEAKS) & set(host), host
            measured += 1
    assert measured >= 1

    reported = cli("report", "--config", str(path), "--out", str(tmp_path / "report.html"), env=env, cwd=tmp_path)
    assert reported.returncode == 0, reported.stdout[-3000:] + reported.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    assert "CPU (simulated, paced as b200)" in page
    assert "the peak the host monitor observed" in page and "the peak the GPU monitor observed" not in page
