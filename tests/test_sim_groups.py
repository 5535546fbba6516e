"""A TP server in the simulator holds every GPU of its group, and dies as SGLang does when it sees too few.

These prove the harness hands a server its whole group: the simulated driver shows each GPU of the group held
(with the planner's per-GPU figure) and freed again, and a group smaller than ``tp_size × pp_size`` fails at
startup with torch's ``invalid device ordinal`` from the first rank without a device.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from autotune.harness.engines import logparse
from autotune.sglang import parallel
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim import device
from tests.simserver import free_port

MODEL, GPU = "qwen3-next-80b-a3b", "h200"
ORDINAL = "RuntimeError: CUDA error: invalid device ordinal"


def _wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _argv(port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "autotune.sim",
        "--model-path",
        MODEL,
        "--sim-gpu",
        GPU,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--sim-startup-s",
        "0.3",
        "--sim-release-s",
        "0.2",
        *flags,
    ]


def _env(tmp_path: Path, visible: str | None) -> dict[str, str]:
    env = {**os.environ, device.ENV_DIR: str(tmp_path / "devices"), "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _per_gpu_mib(tp: int) -> float:
    """The planner's static memory (CUDA context included) on one GPU of a ``tp``-wide group of empty H200s."""
    gpu = load_gpu(GPU)
    context_gib = float(gpu.cuda_context_gib)
    p = plan(load_model(MODEL), gpu, {"tp_size": tp}, free_gib=gpu.memory_mib / 1024 - context_gib)
    return float(p.extra["static_gib"]) * 1024


def _serve_until_ready(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = log.open("wb")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    out.close()
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    assert _wait(ready, timeout=30), log.read_text()[-2000:]
    return proc


# -- which devices a server's ranks open ------------------------------------------------------------------------
def test_visible_indices_reads_every_entry_and_defaults_to_what_the_server_needs():
    assert device.visible_indices({"CUDA_VISIBLE_DEVICES": "2,3"}) == (2, 3)
    assert device.visible_indices({"CUDA_VISIBLE_DEVICES": " 5 , 1 "}) == (5, 1)
    assert device.visible_indices({"CUDA_VISIBLE_DEVICES": "4,x,6"}) == (4,)  # CUDA stops at a bad entry
    assert device.visible_indices({}, need=3) == (0, 1, 2)
    assert device.visible_indices({}) == (0,)
    assert device.visible_indices({"CUDA_VISIBLE_DEVICES": ""}, need=2) == (0, 1)
    assert device.visible_index({"CUDA_VISIBLE_DEVICES": "7,1"}) == 7


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, [("", 0)]),
        ({"tp_size": 2}, [("TP0", 0), ("TP1", 1)]),
        ({"tp_size": 2, "pp_size": 2}, [("PP0 TP0", 0), ("PP0 TP1", 1), ("PP1 TP0", 2), ("PP1 TP1", 3)]),
        ({"tp_size": 2, "dp_size": 2}, [("DP0 TP0", 0), ("DP0 TP1", 1), ("DP1 TP0", 2), ("DP1 TP1", 3)]),
        (
            {"tp_size": 4, "dp_size": 2, "enable_dp_attention": True},
            [("DP0 TP0", 0), ("DP0 TP1", 1), ("DP1 TP2", 2), ("DP1 TP3", 3)],
        ),
        ({"tp_size": 2, "base_gpu_id": 1, "gpu_id_step": 2}, [("TP0", 1), ("TP1", 3)]),
    ],
)
def test_ranks_open_the_ordinals_sglangs_launcher_gives_them(config, expected):
    ranks = parallel.ranks(config)
    assert [(r.label(config), r.gpu_id) for r in ranks] == expected
    if "base_gpu_id" not in config:
        assert len({r.gpu_id for r in ranks}) == parallel.server_gpus(config)


# -- a real sim server process -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_tp2_server_holds_both_gpus_of_its_group_and_frees_them(tmp_path):
    devices = tmp_path / "devices"
    proc = _serve_until_ready(_argv(free_port(), "--tp-size", "2"), _env(tmp_path, "2,3"), tmp_path / "sim.log")
    try:
        expected = _per_gpu_mib(2)
        assert expected < _per_gpu_mib(1) - 10 * 1024  # each GPU of the pair holds half the weights
        held = {i: device.read(i, devices) for i in (2, 3)}
        for reading in held.values():
            assert [p["pid"] for p in reading.processes] == [proc.pid]
            assert reading.used_mib == pytest.approx(expected, rel=1e-6)
        assert device.read(0, devices).used_mib == 0 and device.read(1, devices).used_mib == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert _wait(lambda: all(device.read(i, devices).used_mib == 0 for i in (2, 3)), timeout=5)
    assert all(device.read(i, devices).total_mib == load_gpu(GPU).memory_mib for i in (2, 3))


@pytest.mark.timeout(60)
def test_server_info_and_sim_gpu_describe_the_whole_group(tmp_path):
    port = free_port()
    proc = _serve_until_ready(_argv(port, "--tp-size", "2"), _env(tmp_path, None), tmp_path / "sim.log")
    try:
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
        assert info["tp_size"] == 2 and info["internal_states"][0]["world_size"] == 2
        gpu = httpx.get(f"http://127.0.0.1:{port}/sim/gpu", timeout=5).json()
        # CUDA_VISIBLE_DEVICES unset: the machine shows devices 0 and 1, the two the server needs.
        assert [d["index"] for d in gpu["devices"]] == [0, 1]
        assert gpu["index"] == 0 and gpu["devices"][0]["used_mib"] == gpu["devices"][1]["used_mib"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


@pytest.mark.timeout(60)
def test_the_first_rank_past_the_visible_gpus_is_the_one_that_dies(tmp_path):
    log = tmp_path / "sim.log"
    with log.open("wb") as out:  # tp 2 × pp 2 opens ordinals 0-3; with 3 visible, PP1 TP1 (ordinal 3) has none
        proc = subprocess.run(
            _argv(free_port(), "--tp-size", "2", "--pp-size", "2"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(tmp_path, "4,5,6"),
            timeout=30,
        )
    assert proc.returncode == -signal.SIGKILL
    assert " PP1 TP1] Scheduler hit an exception" in log.read_text()
    assert {i for i in (4, 5, 6) if device.read(i, tmp_path / "devices").processes} == {4, 5, 6}


@pytest.mark.timeout(60)
def test_tp2_server_on_one_visible_gpu_dies_with_invalid_device_ordinal(tmp_path):
    log = tmp_path / "sim.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            _argv(free_port(), "--tp-size", "2"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(tmp_path, "2"),
            timeout=30,
        )
    text = log.read_text()
    assert proc.returncode == -signal.SIGKILL  # SGLang's parent kills its own tree when a scheduler dies
    assert "TP1] Scheduler hit an exception: Traceback (most recent call last):" in text
    assert ORDINAL in text.splitlines()
    assert "Load weight begin" not in text  # the rank dies on its first CUDA call, before loading
    assert logparse.diagnose(text, proc.returncode) == ("crash", ORDINAL)
    assert _wait(lambda: device.read(2, tmp_path / "devices").used_mib == 0, timeout=5)


# -- through the harness: a trial hands the server its group ------------------------------------------------------
PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"


def _trial(tmp_path: Path, gpus: tuple[int, ...], name: str):
    from autotune.config import Timeouts
    from autotune.harness.engines import make_engine
    from autotune.harness.setup import TrialSetup
    from autotune.harness.trial import run_trial
    from autotune.harness.workload import WorkloadSpec

    (tmp_path / "shm").mkdir(exist_ok=True)
    engine = make_engine(
        "sim",
        model_path=MODEL,
        sim_gpu=GPU,
        sim_options={"startup_s": 0.3, "release_s": 0.3, "shm": str(tmp_path / "shm")},
    )
    setup = TrialSetup(
        engine=engine,
        workload=WorkloadSpec(prompts=PROMPTS, sample_size=40, warmup_s=1.0, measure_s=2.0, concurrency=16),
        gpus=gpus,
        run_dir=tmp_path / "runs",
        shm_dir=tmp_path / "shm",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    return run_trial(setup, {"tp_size": 2}, trial_dir=tmp_path / name)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_trial_on_one_gpu_for_a_tp2_config_fails_at_startup_with_the_ordinal_line(tmp_path, monkeypatch):
    monkeypatch.setenv(device.ENV_DIR, str(tmp_path / "devices"))
    result = _trial(tmp_path, (0,), "one")
    assert result.status == "crash"  # the launch's group was too small: not a verdict on the config
    assert result.reason == ORDINAL
    assert result.gpus == [0] and result.metrics is None
    assert "TP1] Scheduler hit an exception" in (tmp_path / "one" / "server.log").read_text()
    assert _wait(lambda: device.read(0, tmp_path / "devices").used_mib == 0, timeout=5)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_trial_on_two_gpus_runs_tp2_across_both_and_releases_them(tmp_path, monkeypatch):
    devices = tmp_path / "devices"
    monkeypatch.setenv(device.ENV_DIR, str(devices))
    result = _trial(tmp_path, (0, 1), "two")
    assert result.status == "ok", result.reason
    assert result.gpus == [0, 1] and result.gpus_spanned == 2
    assert result.metrics.output_tok_s > 0
    assert result.tok_s_per_gpu == pytest.approx(result.metrics.output_tok_s / 2)
    per_gpu = {d.index: d for d in result.gpu.per_gpu}
    assert set(per_gpu) == {0, 1}
    expected_gib = _per_gpu_mib(2) / 1024
    for entry in per_gpu.values():
        assert entry.peak_used_gib >= expected_gib - 0.01  # each GPU held the planner's per-GPU figure
    assert all(device.read(i, devices).used_mib == 0 for i in (0, 1))  # teardown waited for both to free
    assert not any(device.read(i, devices).processes for i in (0, 1))
