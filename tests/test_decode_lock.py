"""SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK in the planner, ``autotune plan --env`` and the simulator.

Mirrors SGLang 0.5.23 ``sglang/srt/mem_cache/kv_cache_configurator.py``: L227-229 (base ratio 3, drop 1 under the
switch, no_buffer adds 1 back) and ``_calculate_mamba_ratio`` L3062-3088 (radix off → 1; base − drop + tracking
slots, ``allocation_sizing.py`` L11-19), the switch declared at ``sglang/srt/environ.py`` L1637 (``EnvBool(False)``,
parsed by ``EnvBool.parse`` L143-150).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest
from click.testing import CliRunner
from simserver import sim_command

from autotune.cli import cli, main
from autotune.errors import ConfigError
from autotune.sglang.args import env_bool, mamba_slots_per_request
from autotune.sglang.envs import EnvTable, parse_envs
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim import device

SKIP = {"SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": "1"}
CASE = {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 96}


@pytest.mark.parametrize(
    ("strategy", "overlap", "radix_off", "without", "with_skip"),
    [
        ("extra_buffer", True, False, 5, 4),  # 3 + 2 ping-pong tracking slots; L3066-3080
        ("extra_buffer", False, False, 4, 3),  # 3 + 1 tracking slot without the overlap schedule
        ("extra_buffer_lazy", True, False, 4, 3),  # lazy defers the second slot (allocation_sizing.py L17-18)
        ("no_buffer", False, False, 3, 3),  # L3081-3086: the drop is added back, effective 3 either way
        ("no_buffer", False, True, 1, 1),  # L3063-3064: no radix cache, one slot per request
    ],
)
def test_ratio_follows_calculate_mamba_ratio(strategy, overlap, radix_off, without, with_skip):
    assert mamba_slots_per_request(strategy, overlap=overlap, radix_off=radix_off) == without
    assert mamba_slots_per_request(strategy, overlap=overlap, radix_off=radix_off, skip_decode_lock=True) == with_skip


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("true", True), ("Y", True), ("0", False), ("no", False), ("maybe", False)]
)  # EnvField.get L79-86: a bad value → the default
def test_env_bool_reads_like_envbool(value, on):
    assert env_bool({"X": value}, "X") is on
    assert env_bool({}, "X") is False


def test_plan_with_the_switch_raises_the_running_cap():
    model, gpu = load_model("qwen3.6-27b"), load_gpu("b200")
    base, skip = plan(model, gpu, CASE), plan(model, gpu, CASE, env=SKIP)
    assert base.extra["strategy"] == skip.extra["strategy"] == "extra_buffer" and base.extra["overlap"]
    assert skip.extra["ratio"] == base.extra["ratio"] - 1
    assert base.max_running_requests == 96 // base.extra["ratio"] and base.extra["binding"] == "mamba"
    assert skip.max_running_requests == 96 // skip.extra["ratio"] > base.max_running_requests
    assert skip.extra["skip_decode_lock"] and not base.extra["skip_decode_lock"]
    # no_buffer (overlap off, page 1 on triton without spec): the switch changes nothing.
    nb = {"max_mamba_cache_size": 96, "mamba_radix_cache_strategy": "no_buffer", "attention_backend": "triton"}
    assert plan(model, gpu, nb).max_running_requests == plan(model, gpu, nb, env=SKIP).max_running_requests


def test_plan_cli_env_option(capsys):
    argv = [
        "plan",
        "--model",
        "qwen3.6-27b",
        "--gpu",
        "b200",
        "--set",
        "speculative_algorithm=EAGLE",
        "--set",
        "max_mamba_cache_size=96",
        "--json",
    ]
    base = json.loads(CliRunner().invoke(cli, argv).output)
    skip = json.loads(CliRunner().invoke(cli, [*argv, "--env", "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1"]).output)
    assert skip["extra"]["ratio"] == base["extra"]["ratio"] - 1
    assert skip["max_running_requests"] == 96 // skip["extra"]["ratio"]
    table = CliRunner().invoke(cli, [*argv[:-1], "--env", "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1"]).output
    assert "ratio=4" in table and "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1" in table
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--env", "SGLANG_OPT_MAMBA_SKIP_DECODE_LOKC=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(err) == 1 and err[0].startswith("Error: SGLANG_OPT_MAMBA_SKIP_DECODE_LOKC")
    assert "did you mean SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK?" in err[0]


def test_env_table_is_0523s():
    table = EnvTable.bundled()
    var = table.lookup("SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK")
    assert (var.type, var.default) == ("bool", False)  # environ.py L1637
    assert parse_envs(["SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=true"]) == SKIP
    with pytest.raises(ConfigError, match="not a valid boolean"):
        parse_envs(["SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=maybe"])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_simulated_server_reads_the_switch_from_its_environment(tmp_path):
    env = {**os.environ, device.ENV_DIR: str(tmp_path / "devices"), "PYTHONUNBUFFERED": "1", **SKIP}
    argv = sim_command(
        0, "--speculative-algorithm", "EAGLE", "--max-mamba-cache-size", "96", startup_s=0.2, warmup_s=0.2
    )
    expected = plan(load_model("qwen3.6-27b"), load_gpu("b200"), CASE, env=SKIP).max_running_requests
    log = tmp_path / "sim.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        port, deadline = None, time.monotonic() + 40
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text()
            if "Uvicorn running on http://127.0.0.1:" in text:
                port = int(text.split("Uvicorn running on http://127.0.0.1:")[1].split()[0])
            time.sleep(0.05)
        assert port, log.read_text()[-2000:]
        state: dict = {}
        while time.monotonic() < deadline and not state:
            try:
                state = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()["internal_states"][0]
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.05)
        assert state["effective_max_running_requests_per_dp"] == expected == 24
        assert (
            f"capped to {expected} by the mamba state cache (max_mamba_cache_size=96, 4 state slots" in log.read_text()
        )
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_the_mamba_ratio_builtin_sees_the_trials_environment_lever():
    """``[space.derived]``'s ``mamba_ratio`` (and the planner's, for a known model) under ``env:NAME`` in a config."""
    from autotune.search.space import mamba_ratio, planner_ratio

    config = {"speculative_algorithm": "EAGLE", "page_size": 64}
    lever = {**config, "env:SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": True}
    assert mamba_ratio(lever) == mamba_ratio(config) - 1 == 4  # extra_buffer + overlap: 5 → 4 (L3066-3080)
    ratio = planner_ratio(load_model("qwen3.6-27b"), load_gpu("b200"))
    assert ratio(lever) == ratio(config) - 1
