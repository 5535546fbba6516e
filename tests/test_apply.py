"""`autotune apply`: the winner of a study → sglang.yaml, launch_fleet.sh, fleet.toml, provenance.json."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import optuna
import pytest
import yaml
from click.testing import CliRunner
from studyfactory import passed_stress

from autotune.cli import cli, main
from autotune.deploy.apply import load_winner, winner_from_yaml, write_artifacts
from autotune.deploy.fleet import load_fleet
from autotune.deploy.sglang_yaml import config_diff, read_config_file, split_config, yaml_to_argv
from autotune.errors import ConfigError, StudyError
from autotune.results import Capacity, Metrics, Percentiles, TrialResult, Window
from autotune.sglang.flags import FlagTable

DATA = Path(__file__).resolve().parents[1] / "autotune" / "data" / "sglang-0.5.23-flags.json"
BASELINE = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "max_mamba_cache_size": 80,
}
WINNER = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "max_mamba_cache_size": 200,
    "mem_fraction_static": 0.93,
    "max_running_requests": 64,
    "mamba_radix_cache_strategy": "extra_buffer",
    "enable_metrics": True,
    "disable_radix_cache": False,
    "cuda_graph_bs_decode": [1, 2, 4, 8, 16, 32],
    "json_model_override_args": '{"rope_theta": 1000000}',
    "chunked_prefill_size": None,
}


def result(config, tok_s, *, status="ok", mrr=40, kv=798_000, slots=200) -> TrialResult:
    metrics = (
        Metrics(output_tok_s=tok_s, request_s=1.0, ttft_ms=Percentiles(), itl_ms=Percentiles(), e2e_ms=Percentiles())
        if status == "ok"
        else None
    )
    return TrialResult(
        status=status,
        config=dict(config),
        engine="sim",
        metrics=metrics,
        capacity=Capacity(max_running_requests=mrr, kv_tokens=kv, mamba_slots=slots),
    )


def make_study(
    storage: str, name: str = "s", *, trials=(), confirm: int | None = None, settings: dict | None = None
) -> optuna.Study:
    """A study following the storage contract: ``trials`` is a list of (TrialResult, role)."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.set_user_attr(
        "autotune",
        settings
        or {
            "engine": {"kind": "sim", "model": "qwen3.6-27b", "sim_gpu": "b200"},
            "workload": {"prompts": "prompts.jsonl", "sample_size": 20, "max_tokens": 256},
        },
    )
    for res, role in trials:
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE,
                value=res.output_tok_s or 0.0,
                user_attrs={"result": res.to_dict(), "role": role},
            )
        )
    if confirm is not None:
        runs = [
            {"trial": confirm, "repeat": k, "result": result(WINNER, v).to_dict()}
            for k, v in enumerate((2950.0, 3010.0, 2990.0))
        ]
        study.set_user_attr(
            "confirmation",
            {
                "runs": runs,
                "winner_trial": confirm,
                "baseline_trial": 0,
                "gain": 0.45,
                "ci_low": 0.41,
                "ci_high": 0.49,
                "note": "",
                "stress": passed_stress(confirm),
            },
        )
    return study


@pytest.fixture
def storage(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    make_study(
        url,
        trials=[
            (result(BASELINE, 2050.0, mrr=16, slots=80), "baseline"),
            (result(WINNER, 3000.0), "search"),
            (result({**WINNER, "max_mamba_cache_size": 400}, 0.0, status="startup_oom"), "search"),
            (result({**WINNER, "max_running_requests": 48}, 3100.0), "search"),
        ],
        confirm=1,
    )
    return url


def bundled_flag_names() -> dict[str, dict]:
    """Option string → row of the bundled 0.5.23 flag inventory (read straight from the data file)."""
    return {flag: row for row in json.loads(DATA.read_text()) for flag in row["flags"]}


def test_yaml_round_trips_to_the_winners_argv(tmp_path):
    table = FlagTable.bundled()
    document, cli_args = split_config(WINNER)
    path = tmp_path / "sglang.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    assert cli_args == []
    assert yaml_to_argv(yaml.safe_load(path.read_text())) == table.to_argv(WINNER)
    assert read_config_file(path) == {k: v for k, v in table.check(WINNER).items() if v not in (None, False)}


def test_every_yaml_key_is_a_0_5_23_flag_sglang_accepts_in_yaml(tmp_path):
    config = {**WINNER, "disable_cuda_graph": True, "enable_tf32_matmul": False, "tp_size": 1}
    document, cli_args = split_config(config)
    known = bundled_flag_names()
    for key, value in document.items():
        row = known[f"--{key}"]
        assert "-" in key or "_" not in key  # dash style: SGLang passes keys verbatim as --key
        assert not any(f.startswith("--no-") for f in row["flags"]), key  # BooleanOptionalAction
        assert row["dest"] not in ("disable_cuda_graph", "enable_dp_attention")
        assert value is not False and value is not None
    # What YAML cannot hold still reaches the server, on the command line.
    assert sorted(cli_args) == ["--disable-cuda-graph", "--no-enable-tf32-matmul"]
    assert "tp-size" in document and "model-path" not in document


def test_yaml_rejects_keys_sglang_would_reject():
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        yaml_to_argv({"mem_fraction_static": 0.9})  # underscore key: SGLang says unrecognized argument
    with pytest.raises(ConfigError, match="rejects"):
        yaml_to_argv({"disable-cuda-graph": True})
    with pytest.raises(ConfigError):
        yaml_to_argv({"mamba-scheduler-strategy": "extra_buffer"})  # removed in 0.5.23


def test_load_winner_prefers_the_confirmed_trial(storage):
    winner = load_winner(storage)
    assert winner.trial == 1 and winner.confirmed  # trial 3 measured faster once, but the confirmation decides
    assert winner.tok_s == 2990.0 and winner.gain == 0.45 and winner.gain_ci == (0.41, 0.49)
    assert winner.baseline_config == BASELINE
    chosen = load_winner(storage, "s", trial=3)
    assert chosen.trial == 3 and not chosen.confirmed and chosen.tok_s == 3100.0


def test_a_confirmation_launch_of_several_windows_counts_as_the_mean_of_its_windows(storage):
    """Each launch's figure is its windows' mean, as the confirmation counted it, not its first window alone."""
    study = optuna.load_study(study_name="s", storage=storage)
    conf = dict(study.user_attrs["confirmation"])
    later = [2800.0, 2600.0]  # the first window is 2950 / 3010 / 2990; these two follow it in every launch
    conf["runs"] = [
        {
            **run,
            "result": {
                **run["result"],
                "windows": [
                    Window(
                        index=i + 2,
                        status="ok",
                        output_tok_s=v,
                        tok_s_per_gpu=v,
                        output_tokens=1,
                        window_s=1.0,
                        settled=True,
                        first_pass=i + 1,
                        last_pass=i + 1,
                    ).to_dict()
                    for i, v in enumerate(later)
                ],
            },
        }
        for run in conf["runs"]
    ]
    study.set_user_attr("confirmation", conf)
    winner = load_winner(storage)
    assert winner.tok_s_runs == [pytest.approx((first + sum(later)) / 3) for first in (2950.0, 3010.0, 2990.0)]
    assert winner.tok_s == pytest.approx((2990.0 + sum(later)) / 3)  # the median launch


@pytest.mark.parametrize("trial, message", [(2, "not a completed, measured trial"), (99, "usable trials: 0, 1, 3")])
def test_unusable_trials_are_refused(storage, trial, message):
    with pytest.raises(StudyError, match=message):
        load_winner(storage, trial=trial)


def test_study_without_a_completed_trial(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    make_study(url, name="empty", trials=[(result(WINNER, 0.0, status="startup_oom"), "search")])
    with pytest.raises(StudyError, match="no completed trial"):
        load_winner(url)
    with pytest.raises(StudyError, match="no study named 'nope'"):
        load_winner(url, "nope")


def test_artifacts(storage, tmp_path):
    out = tmp_path / "deploy dir"
    paths = write_artifacts(
        load_winner(storage), out, gpus=[0, 1, 2], base_port=30000, model="/models/Qwen 3.6 $(rm -rf ~)"
    )
    assert sorted(p.name for p in paths) == [
        "client.json",
        "fleet.toml",
        "launch_fleet.sh",
        "provenance.json",
        "sglang.yaml",
    ]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["study"] == "s" and prov["trial"] == 1 and prov["output_tok_s"] == 2990.0
    assert prov["gain_ci"] == [0.41, 0.49] and prov["sglang_version"] == "0.5.23" and prov["gpu"] == "b200"
    assert prov["model_path"] == "/models/Qwen 3.6 $(rm -rf ~)" and prov["date"]

    fleet = load_fleet(out / "fleet.toml")
    assert [(s.gpu, s.port, s.config) for s in fleet.servers] == [
        (0, 30000, "sglang.yaml"),
        (1, 30001, "sglang.yaml"),
        (2, 30002, "sglang.yaml"),
    ]
    assert fleet.engine == "sim" and fleet.model == "/models/Qwen 3.6 $(rm -rf ~)"

    script = (out / "launch_fleet.sh").read_text()
    assert "set -euo pipefail" in script
    subprocess.run(["bash", "-n", str(out / "launch_fleet.sh")], check=True, timeout=10)
    starts = [
        shlex.split(line)[1:]
        for line in script.splitlines()
        if line.startswith("start ") and "sglang_router" not in line
    ]
    assert len(starts) == 3
    log, pid, gpu, *argv = starts[1]
    assert (log, pid, gpu) == ("logs/gpu1.log", "run/gpu1.pid", "1")
    assert argv[1:5] == ["-m", "autotune.sim", "--config", "sglang.yaml"]  # two tokens: --config=x is ignored
    assert argv[argv.index("--model-path") + 1] == "/models/Qwen 3.6 $(rm -rf ~)"  # quoted, never expanded
    assert argv[argv.index("--port") + 1] == "30001"


def kill_started(out, pids: list[int]) -> None:
    """SIGKILL what the launch script started: each process (it may not have reached its own ``setsid`` yet, so its
    group is not its pid) and then its group; two servers: their router too, when sglang-router is installed."""
    router = out / "run/router.pid"
    for pid in [*pids, *([int(router.read_text())] if router.exists() else [])]:
        for kill in (os.kill, os.killpg):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def test_launch_script_starts_servers_that_the_pid_files_name(storage, tmp_path):
    """Run the generated script with a stand-in interpreter that records its argv and then sleeps."""
    fake = tmp_path / "fakepython"
    fake.write_text('#!/usr/bin/env bash\necho "$@" > "argv-$CUDA_VISIBLE_DEVICES.txt"\nexec sleep 30\n')
    fake.chmod(0o755)
    out = tmp_path / "deploy"
    write_artifacts(load_winner(storage), out, gpus=[3, 4], python=str(fake))
    subprocess.run(["bash", str(out / "launch_fleet.sh")], check=True, timeout=20, capture_output=True)
    pids = [int((out / f"run/gpu{g}.pid").read_text()) for g in (3, 4)]
    try:
        deadline = time.monotonic() + 10
        for gpu, pid in zip((3, 4), pids, strict=True):
            while os.getpgid(pid) != pid:  # its own process group (once setsid has run): `kill -- -PID`
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert (out / f"logs/gpu{gpu}.log").exists()
        recorded = out / "argv-4.txt"
        while not (recorded.exists() and recorded.read_text().endswith("\n")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "--config sglang.yaml --model-path qwen3.6-27b" in recorded.read_text()
    finally:
        kill_started(out, pids)


def test_winner_from_yaml_reads_provenance_only_when_it_matches(storage, tmp_path):
    out = tmp_path / "deploy"
    write_artifacts(load_winner(storage), out, gpus=[0], model="m")
    winner = winner_from_yaml(out / "sglang.yaml")
    assert winner.tok_s == 2990.0 and winner.capacity.mamba_slots == 200 and winner.trial == 1
    (out / "sglang.yaml").write_text((out / "sglang.yaml").read_text().replace("200", "208"))
    edited = winner_from_yaml(out / "sglang.yaml")
    assert edited.tok_s is None and edited.capacity is None  # the study never measured the edited config


def test_apply_gives_the_servers_free_ports_when_the_default_is_held_and_refuses_a_given_one_in_use(
    storage, tmp_path, monkeypatch, capsys
):
    """Another process's server on the default port must never pass for the fleet's: apply skips it (and says so),
    and a --base-port the user gave that is in use is one Error line naming the port."""
    import socket

    from autotune.deploy import ports

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        monkeypatch.setattr(ports, "DEFAULT_BASE_PORT", taken)  # a port this test holds stands for a busy 30000
        res = CliRunner().invoke(cli, ["apply", "--storage", storage, "--out", str(tmp_path / "out"), "--gpus", "0,1"])
        assert res.exit_code == 0, res.output
        written = load_fleet(tmp_path / "out" / "fleet.toml")
        chosen = [s.port for s in written.servers]
        assert taken not in chosen and len(set(chosen)) == 2 and min(chosen) > taken
        assert written.router is not None  # two servers: a router, on ports neither taken nor a server's
        assert {written.router.port, written.router.prometheus_port}.isdisjoint({taken, *chosen})
        said = [line for line in res.output.splitlines() if line.startswith("port(s) ")]
        assert (
            said
            and said[0].startswith(f"port(s) {taken}")
            and said[0].endswith(f"in use on this host: the servers listen on gpu0 {chosen[0]}, gpu1 {chosen[1]}")
        )

        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    "apply",
                    "--storage",
                    storage,
                    "--out",
                    str(tmp_path / "given"),
                    "--gpus",
                    "0",
                    "--base-port",
                    str(taken),
                ]
            )
    assert exit_info.value.code == 1 and not (tmp_path / "given").exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"Error: --base-port: port {taken} is in use on 127.0.0.1 (stop what holds it, or give another "
        "--base-port (without one, apply picks free ports))"
    ]


def test_config_diff():
    assert config_diff(BASELINE, WINNER)[:2] == [
        ("cuda_graph_bs_decode", None, [1, 2, 4, 8, 16, 32]),
        ("enable_metrics", None, True),
    ]
    assert ("max_mamba_cache_size", 80, 200) in config_diff(BASELINE, WINNER)
    assert config_diff({"a": 1, "b": False}, {"a": 1}) == []


def test_cli_writes_artifacts_and_dry_run_writes_nothing(storage, tmp_path, fleet_base_port):
    runner = CliRunner()
    out = tmp_path / "out"
    res = runner.invoke(cli, ["apply", "--storage", storage, "--out", str(out), "--gpus", "0-6"])
    assert res.exit_code == 0, res.output
    assert len(load_fleet(out / "fleet.toml").servers) == 7
    assert [s.port for s in load_fleet(out / "fleet.toml").servers] == list(range(fleet_base_port, fleet_base_port + 7))

    dry = tmp_path / "dry"
    res = runner.invoke(cli, ["apply", "--storage", storage, "--dry-run", "--out", str(dry)])
    assert res.exit_code == 0, res.output
    assert "study baseline" in res.output and "max_mamba_cache_size: 80 -> 200" in res.output
    assert not dry.exists()

    res = runner.invoke(
        cli, ["apply", "--storage", storage, "--rolling", "--dry-run", "--fleet", str(out / "fleet.toml")]
    )
    assert res.exit_code == 0 and "gpu6 (sglang.yaml): 0 flag(s) change" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trial", "42"], "trial 42"),
        (["--study", "missing"], "no study named 'missing'"),
        (["--gpus", "0-x"], "cannot read GPU list"),
    ],
)
def test_cli_bad_input_is_one_line_and_touches_nothing(storage, tmp_path, capsys, args, message):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        main(["apply", "--storage", storage, "--out", str(out), *args])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
    assert not out.exists()


def test_fleet_toml_is_valid_toml_with_quoted_values(storage, tmp_path):
    out = tmp_path / "deploy"
    write_artifacts(load_winner(storage), out, gpus=[0], model='we"ird\\path')
    raw = tomllib.loads((out / "fleet.toml").read_text())
    assert raw["model"] == 'we"ird\\path' and raw["servers"][0]["log"] == "logs/gpu0.log"


@pytest.mark.timeout(60)
def test_launch_script_starts_the_simulator_with_the_yaml(tmp_path, monkeypatch):
    """End to end: the generated script, SGLang's --config loading (as the simulator mirrors it), /server_info."""
    from autotune.launch.process import free_port
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model

    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    config = {
        "speculative_algorithm": "EAGLE",
        "max_mamba_cache_size": 200,
        "mem_fraction_static": 0.93,
        "max_running_requests": 64,
        "enable_metrics": True,
    }
    url = f"sqlite:///{tmp_path / 'study.db'}"
    make_study(url, trials=[(result(config, 3000.0), "search")])
    out, port = tmp_path / "deploy", free_port()
    write_artifacts(load_winner(url), out, gpus=[5], base_port=port, python=sys.executable)
    subprocess.run(["bash", str(out / "launch_fleet.sh")], check=True, timeout=20, capture_output=True)
    pid = int((out / "run/gpu5.pid").read_text())
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, (out / "logs/gpu5.log").read_text()[-2000:]
            time.sleep(0.1)
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
        assert (info["max_mamba_cache_size"], info["mem_fraction_static"], info["enable_metrics"]) == (200, 0.93, True)
        want = plan(load_model("qwen3.6-27b"), load_gpu("b200"), config)
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == want.max_running_requests
        assert info["max_total_num_tokens"] == want.kv_tokens
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_cli_reads_the_study_named_by_a_study_file(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    (tmp_path / "tuned.toml").write_text(
        '[study]\nstorage = "sqlite:///tuned.db"\n[workload]\nprompts = "prompts.jsonl"\n'
    )
    make_study(
        f"sqlite:///{tmp_path / 'tuned.db'}",
        name="tuned",
        trials=[(result(BASELINE, 2000.0), "baseline"), (result(WINNER, 3000.0), "search")],
    )
    res = CliRunner().invoke(cli, ["apply", "--config", str(tmp_path / "tuned.toml"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("study tuned, trial 1: 3000 tok/s") and "max_mamba_cache_size: 80 -> 200" in res.output


# -- a winner spanning two GPUs ------------------------------------------------------------------------
TP2 = {**WINNER, "tp_size": 2}


@pytest.fixture
def tp2_storage(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'tp2.db'}"
    make_study(url, trials=[(result(BASELINE, 2050.0), "baseline"), (result(TP2, 5000.0), "search")])
    return url


def test_gpus_0_7_for_a_tp2_winner_writes_four_servers_on_pairs(tp2_storage, tmp_path, fleet_base_port):
    out = tmp_path / "out"
    res = CliRunner().invoke(
        cli, ["apply", "--storage", tp2_storage, "--out", str(out), "--gpus", "0-7", "--allow-unstressed"]
    )
    assert res.exit_code == 0, res.output
    raw = tomllib.loads((out / "fleet.toml").read_text())
    base = fleet_base_port
    assert [(s["name"], s["gpus"], s["port"], s["log"]) for s in raw["servers"]] == [
        ("gpu0-1", [0, 1], base, "logs/gpu0-1.log"),
        ("gpu2-3", [2, 3], base + 1, "logs/gpu2-3.log"),
        ("gpu4-5", [4, 5], base + 2, "logs/gpu4-5.log"),
        ("gpu6-7", [6, 7], base + 3, "logs/gpu6-7.log"),
    ]
    assert [s.gpus for s in load_fleet(out / "fleet.toml").servers] == [[0, 1], [2, 3], [4, 5], [6, 7]]

    script = (out / "launch_fleet.sh").read_text()
    starts = [
        shlex.split(line)[1:]
        for line in script.splitlines()
        if line.startswith("start ") and "sglang_router" not in line
    ]
    assert [tuple(s[:3]) for s in starts] == [
        (f"logs/gpu{g}-{g + 1}.log", f"run/gpu{g}-{g + 1}.pid", f"{g},{g + 1}") for g in (0, 2, 4, 6)
    ]
    assert 'CUDA_VISIBLE_DEVICES="$gpus" setsid "$@"' in script
    subprocess.run(["bash", "-n", str(out / "launch_fleet.sh")], check=True, timeout=10)
    # .ci/run installs shellcheck; elsewhere it runs when present (a missing one fails under AUTOTUNE_REQUIRE_ALL)
    assert shutil.which("shellcheck") or os.environ.get("AUTOTUNE_REQUIRE_ALL") != "1", "shellcheck is missing"
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", str(out / "launch_fleet.sh")], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout

    document = yaml.safe_load((out / "sglang.yaml").read_text())
    assert document["tp-size"] == 2
    assert (
        "# each server spans 2 GPUs (tp_size 2 × pp_size 1 × dp_size 1): gpu0-1 on 0,1; gpu2-3 on 2,3;"
        in (out / "sglang.yaml").read_text()
    )
    assert json.loads((out / "provenance.json").read_text())["gpus_per_server"] == 2


def test_launch_script_gives_each_tp2_server_its_pair(tp2_storage, tmp_path):
    """The generated script with a stand-in interpreter that records the CUDA_VISIBLE_DEVICES it was given."""
    fake = tmp_path / "fakepython"
    fake.write_text('#!/usr/bin/env bash\necho "$@" > "argv-$CUDA_VISIBLE_DEVICES.txt"\nexec sleep 30\n')
    fake.chmod(0o755)
    out = tmp_path / "deploy"
    write_artifacts(load_winner(tp2_storage), out, gpus=[4, 5, 6, 7], python=str(fake))
    run = subprocess.run(["bash", str(out / "launch_fleet.sh")], check=True, timeout=20, capture_output=True, text=True)
    assert "started gpu 4,5: pid" in run.stdout and "started gpu 6,7: pid" in run.stdout
    pids = [int((out / f"run/{name}.pid").read_text()) for name in ("gpu4-5", "gpu6-7")]
    try:
        deadline = time.monotonic() + 10
        for pair in ("4,5", "6,7"):
            recorded = out / f"argv-{pair}.txt"
            while not (recorded.exists() and recorded.read_text().endswith("\n")):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert "--config sglang.yaml" in recorded.read_text()
        assert sorted(p.name for p in out.glob("argv-*.txt")) == ["argv-4,5.txt", "argv-6,7.txt"]
    finally:
        kill_started(out, pids)


def test_gpus_that_do_not_split_into_whole_servers_is_one_line_before_anything_is_written(
    tp2_storage, tmp_path, capsys
):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        main(["apply", "--storage", tp2_storage, "--out", str(out), "--gpus", "0-6", "--allow-unstressed"])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "Error: --gpus: 7 GPUs do not split into servers of 2 GPUs (the winner's tp_size 2 × pp_size 1 "
        "× dp_size 1) (give a multiple of 2 GPUs, e.g. 0-5, one server per 2)"
    ]
    assert not out.exists()


def test_reusing_a_fleet_of_single_gpu_servers_for_a_tp2_winner_is_refused(storage, tp2_storage, tmp_path):
    single = tmp_path / "single"
    write_artifacts(load_winner(storage), single, gpus=[0, 1])
    with pytest.raises(ConfigError, match=r"--fleet: server gpu0 has 1 GPU\(s\) \(0\), but the winner spans 2"):
        write_artifacts(load_winner(tp2_storage), tmp_path / "never", layout=load_fleet(single / "fleet.toml"))
    assert not (tmp_path / "never").exists()
    pairs = tmp_path / "pairs"
    write_artifacts(load_winner(tp2_storage), pairs, gpus=[0, 1, 2, 3])
    again = tmp_path / "again"
    write_artifacts(load_winner(tp2_storage), again, layout=load_fleet(pairs / "fleet.toml"))
    assert [s.gpus for s in load_fleet(again / "fleet.toml").servers] == [[0, 1], [2, 3]]
