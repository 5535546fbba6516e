"""Fleet files, `autotune fleet up|status|down` on simulated servers, and the remote (SSH) command lines.

``make_fleet`` and ``teardown`` are shared with the rollout tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from click.testing import CliRunner

from autotune.cli import cli
from autotune.deploy.fleet import Fleet, FleetServer, down, drift, load_fleet, status, up, write_fleet
from autotune.deploy.sglang_yaml import split_config
from autotune.errors import FleetError
from autotune.launch.process import free_port
from autotune.launch.ssh import SshLauncher, split_host, start_command

FAST = {"startup_s": 0.1, "warmup_s": 0.05, "release_s": 0.2}
OLD = {"speculative_algorithm": "EAGLE", "max_mamba_cache_size": 120}


def write_yaml(path: Path, config: dict[str, Any]) -> str:
    document, cli = split_config(config)
    assert not cli
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path.name


def make_fleet(
    tmp_path: Path,
    n: int,
    *,
    config: dict[str, Any] = OLD,
    sim_options: dict[int, dict[str, Any]] | None = None,
    group: int = 1,
) -> Path:
    """``n`` simulated servers, server i on GPUs ``i*group … i*group+group-1`` (``group`` GPUs each, as its config
    must span), all on ``config``; ``sim_options[i]`` adds to server i's."""
    name = write_yaml(tmp_path / "old.yaml", config)
    servers = [
        FleetServer(
            name=f"s{i}",
            gpus=list(range(i * group, (i + 1) * group)),
            port=free_port(),
            config=name,
            log=f"logs/s{i}.log",
            pid=f"run/s{i}.pid",
            sim_options={**FAST, **(sim_options or {}).get(i, {})},
        )
        for i in range(n)
    ]
    fleet = Fleet(engine="sim", model="qwen3.6-27b", sim_gpu="b200", servers=servers)
    return write_fleet(fleet, tmp_path / "fleet.toml")


def teardown(path: Path) -> None:
    """Stop every server of the fleet, and SIGKILL anything a pid file still names (nothing outlives a test)."""
    with contextlib.suppress(Exception):
        down(load_fleet(path), grace_s=2.0)
    for pid_file in path.parent.glob("run/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)


GOOD = """
engine = "sim"
model = "qwen3.6-27b"
[[servers]]
name = "a"
gpu = 0
port = 30000
config = "sglang.yaml"
log = "logs/a.log"
pid = "run/a.pid"
"""


@pytest.fixture(autouse=True)
def sim_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("engine = 'sim'\nmodel = [", "not valid TOML"),
        (GOOD + "colour = 'red'\n", "servers.0.colour: unknown key"),
        (GOOD.replace("port = 30000", "port = 70000"), "servers.0.port"),
        (GOOD + GOOD.split("[[servers]]")[1].join(["[[servers]]", ""]).replace('"a"', '"b"'), "same port"),
        (
            GOOD.replace('engine = "sim"', 'engine = "vllm"'),
            r"engine: unknown engine 'vllm' \(use one of: sglang, sim\)",
        ),
        (GOOD + 'password = "hunter2"\n', "servers.0.password: passwords and secrets are not allowed"),
        (GOOD.replace('name = "a"', 'name = "a"\nhost = "ops@gpu-box"'), "cannot be polled from here"),
    ],
)
def test_malformed_fleet_files(tmp_path, text, message):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(FleetError, match=message) as info:
        load_fleet(path)
    assert str(path) in str(info.value)


def test_cli_names_the_bad_field_in_one_line(tmp_path, capsys):
    from autotune.cli import main

    path = tmp_path / "fleet.toml"
    path.write_text(GOOD.replace("gpu = 0", "gpu = -1"))
    with pytest.raises(SystemExit) as info:
        main(["fleet", "up", "--fleet", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(err) == 1
    assert err[0].startswith(f"Error: {path}: servers.0.gpus: ") and not list(tmp_path.glob("run/*"))


def test_fleet_file_round_trips(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(GOOD)
    fleet = load_fleet(path)
    fleet.servers.append(
        FleetServer(
            name="r",
            host="ops@gpu-box:2222",
            gpu=1,
            port=30001,
            bind="0.0.0.0",
            config="c.yaml",
            log="l",
            pid="p",
            extra_args=["--x", 'a "b"'],
            sim_options={"gpu_memory_mib": 90000},
        )
    )
    write_fleet(fleet)
    again = load_fleet(path)
    assert again.model_dump() == fleet.model_dump()
    assert not again.servers[1].local and again.servers[1].url == "http://gpu-box:30001"


def test_split_host():
    assert split_host("ops@gpu-box:2222") == ("ops", "gpu-box", 2222)
    assert split_host("gpu-box") == (None, "gpu-box", None)
    with pytest.raises(FleetError):
        split_host("ops@box:ssh")


def test_remote_command_lines_start_and_stop_a_detached_group(tmp_path):
    """The exact lines sent over SSH, run here by a local shell (no other host is ever contacted)."""
    argv = ["sleep", "30"]
    line = start_command(
        argv,
        env={"CUDA_VISIBLE_DEVICES": "3", "ODD": "a b'c"},
        log="logs/x.log",
        pid="run/x.pid",
        remote_dir=str(tmp_path / "remote dir"),
    )
    assert "env CUDA_VISIBLE_DEVICES=3 'ODD=a b'\"'\"'c' setsid sleep 30" in line
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=10, check=True).stdout
    pid = int(out.strip())
    try:
        deadline = time.monotonic() + 5
        # `$!` is known before env has exec'd setsid, and setsid before it has exec'd sleep (mid-exec, the
        # process's environment reads empty): wait until the process is the command itself.
        while os.getpgid(pid) != pid or psutil.Process(pid).cmdline() != argv:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert psutil.Process(pid).environ()["ODD"] == "a b'c"
        assert (tmp_path / "remote dir/run/x.pid").read_text().strip() == str(pid)
        sent: list[str] = []

        def shell(host: str, command: str, timeout_s: float) -> tuple[int, str, str]:
            sent.append(command)
            done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout_s)
            return done.returncode, done.stdout, done.stderr

        stopper = SshLauncher(host="127.0.0.1", remote_dir=str(tmp_path / "remote dir"), transport=shell)
        assert stopper.stop_pid_file("run/x.pid", grace_s=1.0) == []  # stopped, nothing left over
        assert any(f"kill -TERM -{pid}" in line for line in sent)  # the group, as one line of its own
        deadline = time.monotonic() + 5
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not (tmp_path / "remote dir/run/x.pid").exists()
    finally:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass


def test_drift_compares_recorded_flags_with_server_info():
    assert (
        drift(
            {"max_mamba_cache_size": 120, "mem_fraction_static": 0.9},
            {"max_mamba_cache_size": 120, "mem_fraction_static": 0.9},
        )
        == []
    )
    assert drift({"max_mamba_cache_size": 120}, {"max_mamba_cache_size": 200}) == ["max_mamba_cache_size"]


@pytest.fixture
def fleet_of_two(tmp_path):
    path = make_fleet(tmp_path, 2)
    yield path
    teardown(path)


@pytest.mark.timeout(120)
def test_up_status_down(fleet_of_two):
    fleet = load_fleet(fleet_of_two)
    assert sorted(up(fleet, timeout_s=60)) == ["s0", "s1"]
    assert up(fleet, timeout_s=60) == []  # already running: nothing restarted
    rows = status(fleet)
    assert [r.state for r in rows] == ["healthy", "healthy"]
    for row, server in zip(rows, fleet.servers, strict=True):
        info = httpx.get(f"{server.url}/server_info", timeout=5).json()
        assert row.capacity.mamba_slots == info["internal_states"][0]["max_mamba_cache_size"]
        assert row.capacity.max_running_requests == info["internal_states"][0]["effective_max_running_requests_per_dp"]
        assert row.capacity.kv_tokens == info["max_total_num_tokens"] and row.drift == []
        assert row.pid == int(fleet.resolve(server.pid).read_text())

    runner = CliRunner()
    res = runner.invoke(cli, ["fleet", "status", "--fleet", str(fleet_of_two), "--json"])
    assert res.exit_code == 0, res.output
    assert [r["state"] for r in json.loads(res.output)] == ["healthy", "healthy"]
    res = runner.invoke(cli, ["fleet", "status", "--fleet", str(fleet_of_two)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "healthy" in res.output and "old.yaml" in res.output

    pids = [r.pid for r in rows]
    res = runner.invoke(cli, ["fleet", "down", "--fleet", str(fleet_of_two), "--grace", "5"])
    assert res.exit_code == 0 and "stopped: s0, s1" in res.output
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert [r.state for r in status(fleet)] == ["down", "down"]
    assert not list(Path(fleet_of_two).parent.glob("run/*.pid"))


@pytest.mark.timeout(60)
def test_busy_port_is_refused_before_anything_starts(fleet_of_two, capsys):
    from autotune.cli import main

    fleet = load_fleet(fleet_of_two)
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", fleet.servers[1].port))
            holder.listen()
        except OSError:  # a parallel test's process took the port first: busy all the same
            pass
        with pytest.raises(SystemExit) as info:
            main(["fleet", "up", "--fleet", str(fleet_of_two)])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port 127.0.0.1:{fleet.servers[1].port} of server s1 is in use" in err[0]
    assert [r.state for r in status(fleet)] == ["down", "down"]  # s0 was not started either


@contextlib.contextmanager
def outside_server(port: int, devices: Path):
    """A simulated server on ``port`` that no fleet command started (another user's, or a leftover)."""
    argv = [
        sys.executable,
        "-m",
        "autotune.sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model-path",
        "qwen3.6-27b",
        "--sim-gpu",
        "b200",
        "--sim-startup-s",
        "0.1",
        "--sim-warmup-s",
        "0",
    ]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(devices)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, "the outside server exited"
            time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_on_a_fleet_port_that_is_not_the_fleets_is_named_and_never_touched(fleet_of_two, tmp_path):
    """Before any ``fleet up``, another process's server answers on s0's port: status names it (never healthy as
    ours, however its record is forged), down leaves it running, a rolling apply refuses before stopping anything."""
    from test_rollout import NEW

    from autotune.deploy import rollout
    from autotune.deploy.fleet import record_path

    fleet = load_fleet(fleet_of_two)
    port = fleet.servers[0].port
    with outside_server(port, tmp_path / "outside-devices") as outsider:
        note = f"port {port}: a server that is not this fleet's"
        runner = CliRunner()
        rows = json.loads(runner.invoke(cli, ["fleet", "status", "--fleet", str(fleet_of_two), "--json"]).output)
        assert [(r["state"], r["pid"], r["capacity"]) for r in rows] == [("foreign", None, None), ("down", None, None)]
        assert rows[0]["note"].startswith(note)
        shown = runner.invoke(cli, ["fleet", "status", "--fleet", str(fleet_of_two)], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and note in shown.output and "healthy" not in shown.output

        # a record naming the outsider's pid with another start time proves nothing (a reused pid)
        forged = {
            "launcher": "local",
            "launch_id": "x",
            "host": "127.0.0.1",
            "port": port,
            "log_path": "l",
            "pid": outsider.pid,
            "create_time": psutil.Process(outsider.pid).create_time() - 100,
            "run_dir": str(tmp_path / "run"),
        }
        record_path(fleet, fleet.servers[0]).parent.mkdir(parents=True, exist_ok=True)
        record_path(fleet, fleet.servers[0]).write_text(json.dumps(forged))
        assert [r.state for r in status(fleet)] == ["foreign", "down"]

        stopped = runner.invoke(cli, ["fleet", "down", "--fleet", str(fleet_of_two), "--grace", "1"])
        assert stopped.exit_code == 0 and "no server was running" in stopped.output and note in stopped.output
        assert outsider.poll() is None and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200

        with pytest.raises(FleetError, match=f"port {port}: a server that is not this fleet's"):
            rollout.start(fleet_of_two, NEW, expect=rollout.Expectation(), canary=None)
        assert outsider.poll() is None and load_fleet(fleet_of_two).servers[0].config == fleet.servers[0].config


@pytest.mark.timeout(60)
def test_a_server_that_cannot_start_is_reported_with_the_logs_reason(tmp_path):
    path = make_fleet(tmp_path, 1, config={**OLD, "mem_fraction_static": 0.2})
    try:
        with pytest.raises(FleetError, match="server s0 .* did not start: .*mem-fraction-static"):
            up(load_fleet(path), timeout_s=30)
        assert status(load_fleet(path))[0].state == "down"
    finally:
        teardown(path)


def test_unreadable_config_stops_up_before_any_launch(tmp_path):
    path = make_fleet(tmp_path, 1)
    (tmp_path / "old.yaml").write_text("mem_fraction_static: 0.9\n")
    with pytest.raises(Exception, match="mem_fraction_static"):
        up(load_fleet(path), timeout_s=10)
    assert not list(tmp_path.glob("run/*.pid"))


def test_model_is_required(tmp_path):
    with pytest.raises(Exception, match="model"):
        Fleet.model_validate({"servers": []})


@pytest.mark.timeout(60)
def test_down_removes_the_shm_files_its_server_owned_and_nothing_else(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sglang_loads_0123456789ab_00000000.shm").write_bytes(b"before")  # there before the fleet: not its
    path = make_fleet(tmp_path, 1, sim_options={0: {"shm": str(shm)}})
    try:
        assert up(load_fleet(path), timeout_s=30) == ["s0"]
        made = sorted(p.name for p in shm.iterdir() if p.name != "sglang_loads_0123456789ab_00000000.shm")
        assert [n.split("_")[0] for n in made if not n.startswith("sem.")] == ["deepspeed", "sglang"]
        neighbour = shm / "sglang_loads_ba9876543210_11111111.shm"  # a neighbour's, made while ours runs
        neighbour.write_bytes(b"theirs")
        res = CliRunner().invoke(cli, ["fleet", "down", "--fleet", str(path), "--grace", "5"])
        assert res.exit_code == 0 and "stopped: s0" in res.output, res.output
        assert sorted(p.name for p in shm.iterdir()) == [
            "sglang_loads_0123456789ab_00000000.shm",
            neighbour.name,
        ]  # its load segment and buffer went
        assert not list((tmp_path / "run").glob("server-*.json"))
    finally:
        teardown(path)


@pytest.mark.timeout(60)
def test_a_sigkilled_servers_shm_files_go_with_fleet_down_and_a_neighbours_stay(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    path = make_fleet(tmp_path, 1, sim_options={0: {"shm": str(shm)}})
    try:
        assert up(load_fleet(path), timeout_s=30) == ["s0"]
        made = sorted(p.name for p in shm.iterdir() if not p.name.startswith("sem."))
        assert [n.split("_")[0] for n in made] == ["deepspeed", "sglang"]  # proven its own while it ran
        neighbour = shm / "sglang_loads_ba9876543210_11111111.shm"  # a neighbour's, made while ours runs
        neighbour.write_bytes(b"theirs")
        fleet = load_fleet(path)
        pid = int(fleet.resolve(fleet.servers[0].pid).read_text())
        os.killpg(pid, signal.SIGKILL)  # it can prove nothing now
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(timeout=10)
        assert all((shm / n).exists() for n in made)  # a SIGKILLed server removes nothing itself
        res = CliRunner().invoke(cli, ["fleet", "down", "--fleet", str(path), "--grace", "5"])
        assert res.exit_code == 0, res.output
        left = sorted(p.name for p in shm.iterdir() if not p.name.startswith("sem."))
        assert left == [neighbour.name]  # its buffer and load segment went; the neighbour's stayed
        assert not list((tmp_path / "run").glob("server-*.json"))
    finally:
        teardown(path)


@pytest.mark.timeout(120)
def test_a_fleet_server_starts_detached_through_the_launcher(tmp_path, monkeypatch):
    """The fleet builds no process itself: the launcher gets a detached spec with the server's GPU, the engine's
    own env (no CUDA_VISIBLE_DEVICES: that is the launcher's), and the fleet's run folder for its record."""
    from autotune.deploy.fleet import server_config, start_server, stop_server
    from autotune.launch.local import LocalLauncher
    from autotune.sim import device

    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    seen = []

    class Spy(LocalLauncher):
        def start(self, spec, *, gpu_reader=None):
            seen.append(spec)
            return super().start(spec, gpu_reader=gpu_reader)

    path = make_fleet(tmp_path, 2)
    fleet = load_fleet(path)
    server = fleet.servers[1]
    try:
        pid = start_server(fleet, server, server_config(fleet, server), timeout_s=60, launcher=Spy())
        (spec,) = seen
        assert spec.detach and spec.gpus == (1,) and spec.port == server.port
        assert "CUDA_VISIBLE_DEVICES" not in spec.env and spec.run_dir == fleet.resolve(server.pid).parent
        assert int(fleet.resolve(server.pid).read_text()) == pid
        assert device.read(1, tmp_path / "devices").used_mib > 1000  # the simulator took GPU 1 from the launcher
        assert stop_server(fleet, server, grace_s=5)
    finally:
        teardown(path)


# -- servers spanning several GPUs ---------------------------------------------------------------------
TP2 = {**OLD, "tp_size": 2}


def test_an_old_single_gpu_fleet_file_loads_as_a_group_of_one(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(GOOD.replace("gpu = 0", "gpu = 3"))
    fleet = load_fleet(path)
    assert fleet.servers[0].gpus == [3] and fleet.servers[0].gpu == 3
    write_fleet(fleet)
    raw = tomllib.loads(path.read_text())["servers"][0]
    assert raw["gpus"] == [3] and "gpu" not in raw  # written back in the new form
    assert load_fleet(path).servers[0].gpus == [3]


def two_servers(first: str, second: str, *, host: str = "") -> str:
    other = GOOD.split("[[servers]]")[1].replace('"a"', '"b"').replace("30000", "30001")
    other = other.replace('name = "b"', f'name = "b"\nhost = "{host}"\nbind = "0.0.0.0"' if host else 'name = "b"')
    return (GOOD + "[[servers]]" + other).replace("gpu = 0", first, 1).replace("gpu = 0", second, 1)


def test_two_servers_sharing_a_gpu_is_one_line_naming_both_and_the_gpu(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(two_servers("gpus = [0, 1]", "gpus = [1, 2]"))
    with pytest.raises(FleetError) as info:
        load_fleet(path)
    message = str(info.value)
    assert message == (f"{path}: servers a and b both use GPU 1 on localhost (give each GPU of a host to one server)")
    path.write_text(two_servers("gpus = [0, 1]", "gpu = 1"))  # an old-style entry inside a pair
    with pytest.raises(FleetError, match="servers a and b both use GPU 1 on localhost"):
        load_fleet(path)
    path.write_text(two_servers("gpus = [0, 1]", "gpus = [0, 1]", host="ops@gpu-box"))  # another host's GPUs
    assert [s.gpus for s in load_fleet(path).servers] == [[0, 1], [0, 1]]
    path.write_text(two_servers("gpus = [0, 1]\ngpu = 5", "gpus = [2, 3]"))
    with pytest.raises(FleetError, match="servers.0: give gpus .* or gpu, not both"):
        load_fleet(path)


def test_a_group_of_another_size_than_its_config_spans_is_refused_on_load(tmp_path):
    path = tmp_path / "fleet.toml"
    write_yaml(tmp_path / "sglang.yaml", TP2)
    path.write_text(GOOD)
    with pytest.raises(FleetError) as info:
        load_fleet(path)
    assert str(info.value) == (
        f"{path}: servers.a.gpus: [0] is 1 GPU(s), but its config spans 2 (tp_size 2 × pp_size 1 × dp_size 1) "
        "(give it 2 GPU(s), or lay the fleet out again with autotune apply --gpus ... --out DIR)"
    )
    path.write_text(GOOD.replace("gpu = 0", "gpus = [4, 5]"))
    server = load_fleet(path).servers[0]
    assert (server.gpus, server.gpu, server.where) == ([4, 5], 4, "gpus 4,5, port 30000")  # as messages name it
    write_yaml(tmp_path / "sglang.yaml", {**OLD, "tp_size": 2, "dp_size": 2})
    with pytest.raises(
        FleetError,
        match=r"\[4, 5\] is 2 GPU\(s\), but its config spans 4 \(tp_size 2 × pp_size 1 × "
        r"dp_size 2\)",
    ):
        load_fleet(path)


@pytest.fixture
def fleet_of_pairs(tmp_path):
    path = make_fleet(tmp_path, 2, config=TP2, group=2)
    yield path
    teardown(path)


def visible_devices(pid: int) -> str:
    return psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.timeout(120)
def test_up_status_down_with_two_tp2_servers_on_gpus_0_to_3(fleet_of_pairs, tmp_path):
    from autotune.sim import device

    devices = tmp_path / "devices"
    fleet = load_fleet(fleet_of_pairs)
    assert [s.gpus for s in fleet.servers] == [[0, 1], [2, 3]]
    assert sorted(up(fleet, timeout_s=60)) == ["s0", "s1"]
    rows = status(fleet)
    assert [(r.state, r.gpus) for r in rows] == [("healthy", [0, 1]), ("healthy", [2, 3])]
    assert [visible_devices(r.pid) for r in rows] == ["0,1", "2,3"]  # each server sees its pair
    for gpu in range(4):  # the simulator holds memory on both GPUs of each server
        reading = device.read(gpu, devices)
        assert reading.used_mib > 1000, gpu
        assert [p["pid"] for p in reading.processes] == [rows[gpu // 2].pid]

    runner = CliRunner()
    res = runner.invoke(cli, ["fleet", "status", "--fleet", str(fleet_of_pairs), "--json"])
    assert res.exit_code == 0, res.output
    assert [(r["gpus"], r["gpu"], r["state"]) for r in json.loads(res.output)] == [
        ([0, 1], 0, "healthy"),
        ([2, 3], 2, "healthy"),
    ]
    res = runner.invoke(cli, ["fleet", "status", "--fleet", str(fleet_of_pairs)], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    table = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
        for line in res.output.splitlines()
        if line.startswith("│ s")
    }
    assert table["s0"][2] == "0,1" and table["s1"][2] == "2,3"

    res = runner.invoke(cli, ["fleet", "down", "--fleet", str(fleet_of_pairs), "--grace", "5"])
    assert res.exit_code == 0 and "stopped: s0, s1" in res.output, res.output
    assert all(device.read(gpu, devices).used_mib == 0 for gpu in range(4))  # down waited for all four
    assert [r.state for r in status(fleet)] == ["down", "down"]


@pytest.mark.timeout(60)
def test_a_pair_server_starts_on_its_group_through_the_launcher_with_its_group_reader(tmp_path):
    from autotune.deploy.fleet import server_config, start_server
    from autotune.launch.local import LocalLauncher
    from autotune.launch.memory import GroupReader

    seen = []

    class Spy(LocalLauncher):
        def memory_reader(self, gpus, local):
            reader = super().memory_reader(gpus, local)
            seen.append((gpus, reader))
            return reader

        def start(self, spec, *, gpu_reader=None):
            seen.append(spec)
            return super().start(spec, gpu_reader=gpu_reader)

    path = make_fleet(tmp_path, 2, config=TP2, group=2)
    fleet = load_fleet(path)
    try:
        start_server(fleet, fleet.servers[1], server_config(fleet, fleet.servers[1]), timeout_s=60, launcher=Spy())
        (gpus, reader), spec = seen
        assert gpus == (2, 3) and spec.gpus == (2, 3)
        assert isinstance(reader, GroupReader) and reader.gpus == (2, 3)
    finally:
        teardown(path)


def test_a_remote_pair_server_goes_to_the_ssh_launcher_with_its_group(tmp_path):
    """No other host is contacted: the spec the ssh launcher gets, and the environment it would export there."""
    from autotune.deploy import remote
    from autotune.deploy.fleet import server_gpus

    path = tmp_path / "fleet.toml"
    path.write_text(
        GOOD.replace('name = "a"', 'name = "a"\nhost = "ops@gpu-box"\nbind = "0.0.0.0"').replace(
            "gpu = 0", "gpus = [2, 3]"
        )
    )
    fleet = load_fleet(path)
    server = fleet.servers[0]
    spec = remote.server_spec(server, ["python3", "-m", "autotune.sim"], env={}, gpus=server_gpus(fleet, server))
    assert spec.gpus == (2, 3)
    assert remote.launcher(fleet, server).device_env(spec.gpus)["CUDA_VISIBLE_DEVICES"] == "2,3"
