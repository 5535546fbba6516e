"""Environment levers in the study: ``[space.env]`` and ``env`` in ``[baseline]``, ``[[enqueue]]`` and
``[engine.fixed]``, checked against SGLang 0.5.23's ``Envs`` table (``sglang/srt/environ.py`` class ``Envs``,
L251; the decode-lock switch L1637), kept in a trial's config as ``env:NAME`` and given to its server's
environment, never its argv."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib

import pytest
from inprocess import run_cli
from tinystudy import write_tiny_study

from autotune.cli import main
from autotune.config import load_config
from autotune.harness.engines.sim import SimEngine
from autotune.sglang.envs import ENV_PREFIX, env_strings, split_env
from autotune.sglang.flags import FlagTable

SKIP = "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK"
LEVERS = f"""
[space.env]
{SKIP} = {{ choices = [false, true] }}
SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND = {{ choices = [true] }}
"""


def study(tmp_path, *, name="levers", trials=2, space=LEVERS, baseline_env=f"{{ {SKIP} = 1 }}"):
    path = write_tiny_study(tmp_path, name=name, trials=trials, top_k=0, measure_s=1.0, warmup_s=0.5)
    text = path.read_text().replace("[workload]", space + "\n[workload]")
    text = text.replace(
        "flags = { max_mamba_cache_size = 80 }", f"flags = {{ max_mamba_cache_size = 80 }}\nenv = {baseline_env}"
    )
    text += (
        '\n[[enqueue]]\nlabel = "plain"\nflags = { max_mamba_cache_size = 160, max_running_requests = 48 }\n'
        f'env = {{ {SKIP} = "no" }}\n'
    )
    path.write_text(text)
    return path


def test_levers_load_typed_beside_the_flags(tmp_path):
    cfg = load_config(study(tmp_path))
    key = ENV_PREFIX + SKIP
    assert cfg.space[key].choices == [False, True]  # EnvBool: typed like SGLang parses it (environ.py L143-150)
    base, plain = cfg.given_configs()
    assert base[key] is True and base["max_mamba_cache_size"] == 80 and plain[key] is False
    flags, env = split_env(base)
    assert key not in flags and env == {SKIP: True} and env_strings(base) == {SKIP: "1"}
    argv = FlagTable.bundled().to_argv(base)
    assert not any("SGLANG" in a or a.startswith("--env") for a in argv) and "--max-mamba-cache-size" in argv
    sim = SimEngine(model_path="qwen3.6-27b", sim_gpu="b200")
    assert not any(SKIP in a for a in sim.argv(base, port=1))


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (
            (f"{SKIP} = {{ choices", "SGLANG_OPT_MAMBA_SKIP_DECODE_LOKC = { choices"),
            "space.env.SGLANG_OPT_MAMBA_SKIP_DECODE_LOKC",
        ),
        (
            (f"env = {{ {SKIP} = 1 }}", "env = { SGLANG_OPT_MAMBA_SKIP_DECODE_LOKC = 1 }"),
            "baseline.env.SGLANG_OPT_MAMBA_SKIP_DECODE_LOKC",
        ),
    ],
)
def test_a_misspelt_name_is_one_error_line_with_did_you_mean(tmp_path, capsys, edit, where):
    path = study(tmp_path)
    path.write_text(path.read_text().replace(*edit, 1))
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--config", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and where in lines[0]
    assert f"did you mean {SKIP}?" in lines[0] and not (tmp_path / "levers").exists()


def test_a_bad_value_is_refused_before_any_server(tmp_path, capsys):
    path = study(tmp_path, baseline_env=f'{{ {SKIP} = "maybe" }}')
    with pytest.raises(SystemExit):
        main(["sweep", "--config", str(path)])
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "baseline.env" in err and "not a valid boolean" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sweep_gives_the_server_its_environment_and_apply_carries_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))  # the in-process `fleet up` too
    path = study(tmp_path, trials=2)
    run = lambda *a: run_cli(capsys, *a)  # noqa: E731  (in this process: the servers are real simulated ones)
    done = run("sweep", "--config", str(path), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(run("trials", "--config", str(path), "--json").stdout)
    # The simulated server read the switch from its own environment: 80 slots at ratio 4 (kv_cache_configurator.py
    # L3066-3069), not 5; the enqueued config without it gets 160 // 5.
    assert rows[0]["params"][ENV_PREFIX + SKIP] is True and rows[0]["max_running_requests"] == 80 // 4
    assert rows[1]["params"][ENV_PREFIX + SKIP] is False and rows[1]["max_running_requests"] == 160 // 5
    # asked for 48, granted 32: SGLang's warning (kv_cache_configurator.py L3141) names the Mamba pool
    assert rows[1]["granted"] == "asked for 48 running, got 32: the Mamba state pool bound it"
    assert rows[0]["granted"] is None  # nothing asked
    table = run("trials", "--config", str(path)).stdout
    assert f"env:{SKIP}=False" in table and "asked for 48" in table  # beside the flags and the running cap
    out = tmp_path / "fleet"
    applied = run(
        "apply", "--config", str(path), "--trial", "0", "--out", str(out), "--gpus", "0", "--allow-unstressed"
    )
    assert applied.returncode == 0, applied.stderr[-2000:]
    start = next(line for line in (out / "launch_fleet.sh").read_text().splitlines() if line.startswith("start "))
    words = shlex.split(start)
    assert words[4:6] == ["env", f"{SKIP}=1"] and words[6] == sys.executable  # before the argv, one word each
    assert SKIP not in (out / "sglang.yaml").read_text()
    fleet = tomllib.loads((out / "fleet.toml").read_text())
    assert fleet["sglang_env"][SKIP] == "1"
    assert json.loads((out / "provenance.json").read_text())["sglang_env"][SKIP] == "1"
    # `fleet up` gives fleet.toml's sglang_env to the server: it runs the cap the trial measured
    from autotune.deploy.fleet import status, up
    from autotune.deploy.fleetfile import load_fleet

    fleet = load_fleet(out / "fleet.toml")
    try:
        assert up(fleet, timeout_s=60)
        assert status(fleet)[0].capacity.max_running_requests == 80 // 4
    finally:
        assert run("fleet", "down", "--fleet", str(out / "fleet.toml"), "--grace", "5").returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_slurm_launcher_gives_the_job_its_environment(tmp_path):
    from launchcase_slurm import empty_queue, slurm_missing

    why = slurm_missing()
    if why:
        pytest.skip(why)
    path = study(tmp_path, name="slurmlevers", trials=1)
    text = path.read_text().replace('kind = "sim"', 'kind = "sim"\nlauncher = "slurm"')
    path.write_text(text[: text.index("[[enqueue]]")])  # the baseline alone: one job
    env = {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}  # jobs inherit it (--export=ALL)
    with empty_queue():
        done = subprocess.run(
            [sys.executable, "-m", "autotune", "sweep", "--config", str(path), "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=130,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(
        subprocess.run(
            [sys.executable, "-m", "autotune", "trials", "--config", str(path), "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        ).stdout
    )
    # the batch job's server read the switch: 80 slots at ratio 4 (kv_cache_configurator.py L3066-3069)
    assert rows[0]["params"][ENV_PREFIX + SKIP] is True and rows[0]["max_running_requests"] == 80 // 4
