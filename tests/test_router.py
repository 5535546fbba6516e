"""SGLang's router (the real ``sglang-router``) in front of a fleet of simulated servers: ``fleet up|status|down``,
a job client that knows one URL, and rollouts under a closed-loop load through the router that fail no request.

The unit tests at the top need neither the router nor a server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from test_fleet import OLD, make_fleet, teardown
from test_rollout import CANARY, NEW, predicted, prompts, stub_server

from autotune.cli import cli
from autotune.deploy import drain, rollout, router, routerview
from autotune.deploy.fleet import Fleet, FleetServer, load_fleet, server_config, write_fleet
from autotune.deploy.fleetfile import RouterSection
from autotune.deploy.inflight import ClientAdvice
from autotune.deploy.sglang_yaml import deployed_config, split_config, yaml_text
from autotune.errors import FleetError
from autotune.launch.process import free_port, port_is_free

ROOT = Path(__file__).resolve().parent.parent
LOADER = ROOT / "benchmarks" / "closed_loop.py"
REQUIRE_ALL = os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1"
needs_router = pytest.mark.skipif(
    not router.installed() and not REQUIRE_ALL, reason="sglang-router is not installed (pip install 'autotune[router]')"
)


@pytest.fixture(autouse=True)
def sim_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))


# -- no server ------------------------------------------------------------------------------------------
def two_servers(**router_fields) -> dict:
    servers = [FleetServer(name=f"s{i}", gpus=[i], port=31000 + i, config="a.yaml", log="l", pid="p") for i in range(2)]
    return {"engine": "sim", "model": "m", "servers": servers, **router_fields}


def test_router_section_refuses_a_server_port_and_flags_it_sets_itself():
    with pytest.raises(ValueError, match="router.port: 31001 .* collides with port 31001"):
        Fleet(**two_servers(router=RouterSection(port=31001)))
    with pytest.raises(ValueError, match="--worker-urls is set by the fleet file itself"):
        RouterSection(port=32000, extra_args=["--worker-urls", "http://x"])
    fleet = Fleet(**two_servers(router=RouterSection(port=32000)))
    assert router.section(fleet).prometheus_port == 32001
    assert router.wanted(Fleet(**two_servers())) == (
        "the fleet file has no [router] section (autotune apply --out writes one)"
    )
    named = two_servers(router=RouterSection(port=32000))
    named["servers"][1] = named["servers"][1].model_copy(update={"name": "router", "pid": "run/router.pid"})
    with pytest.raises(ValueError, match="server router: its pid file or log is the router's"):
        Fleet(**named)  # the launch script's router.pid would otherwise name the server's and the router's process
    off = Fleet(**two_servers(router=RouterSection(router=False, port=31000)))  # off: its ports are not checked
    assert router.wanted(off) == "[router] says router = false"


def test_a_new_fleets_router_takes_free_ports_after_its_servers_never_one_in_use():
    """The router's ports come from the same free-port logic as the servers': a port another process listens on
    right after the servers' is skipped (the router could not bind it, and its fleet would look half-up)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        servers = [
            FleetServer(name=f"s{i}", gpus=[i], port=taken - 2 + i, config="a.yaml", log="l", pid="p") for i in range(2)
        ]
        section = router.for_servers(servers)
        assert section is not None
        ports = (section.port, section.prometheus_port)
        assert taken not in ports and len(set(ports)) == 2 and min(ports) > taken
        assert all(port_is_free("127.0.0.1", p) for p in ports)
        Fleet(engine="sim", model="m", servers=servers, router=section)  # the fleet file's own check agrees
    assert router.for_servers(servers[:1]) is None  # one server needs no router


def test_the_router_and_the_rollouts_gate_take_only_the_fleets_own_servers(tmp_path, monkeypatch):
    """A server answering on a fleet port that no record proves the fleet's (``foreign``) never joins the router:
    neither when ``fleet up`` starts it nor when a rollout puts every healthy server back."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from autotune.deploy import fleet as fleet_module

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    answering = [ThreadingHTTPServer(("127.0.0.1", 0), Health) for _ in range(2)]
    threads = [threading.Thread(target=h.serve_forever, daemon=True) for h in answering]
    for thread in threads:
        thread.start()
    try:
        servers = [
            FleetServer(name=f"s{i}", gpus=[i], port=h.server_address[1], config="a.yaml", log="l", pid=f"p{i}")
            for i, h in enumerate(answering)
        ]
        fleet = Fleet(
            engine="sim",
            model="m",
            servers=servers,
            path=tmp_path / "fleet.toml",
            router=RouterSection(port=free_port(), metrics_port=free_port()),
        )
        assert all(fleet_module.healthy(s) for s in servers)  # both answer /health; only s1 is proven the fleet's
        monkeypatch.setattr(fleet_module, "ours", lambda _fleet, server: object() if server.name == "s1" else None)
        assert fleet_module.foreign_note(fleet, servers[0]) is not None and fleet_module.serving(fleet, servers[1])

        started, added = [], []
        monkeypatch.setattr(router, "wanted", lambda _fleet: None)
        monkeypatch.setattr(router, "start", lambda _fleet, urls, timeout_s: started.append(urls))
        fleet_module.router_up(fleet)
        assert started == [[servers[1].url]]
        monkeypatch.setattr(router, "add_worker", lambda _record, url: added.append(url))
        record = router.Record(
            pid=0,
            started=0.0,
            url="http://127.0.0.1:9",
            host="127.0.0.1",
            port=9,
            metrics_port=10,
            log="l",
            worker_urls=[],
            argv=[],
        )
        drain.Gate(record=record).admit_all(fleet)
        assert added == [servers[1].url]
    finally:
        for h in answering:
            h.shutdown()
            h.server_close()


def test_router_command_is_an_argv_on_loopback_with_the_workers():
    fleet = Fleet(
        **two_servers(router=RouterSection(port=32000, policy="round_robin", extra_args=["--log-level", "warn"]))
    )
    argv = router.argv(fleet, [s.url for s in fleet.servers])
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    workers = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    assert workers == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"] and argv[-2:] == ["--log-level", "warn"]


def test_advice_points_the_job_at_the_router_or_says_what_it_would_give(monkeypatch):
    client = ClientAdvice(
        trial=3,
        servers=2,
        running_cap=24,
        queue=4,
        per_server=28,
        fleet=56,
        measured_concurrency=48,
        measured_generating=23.0,
        completions_s=5.0,
        refill_s=0.1,
    )
    section = RouterSection(port=30002)
    monkeypatch.setattr(router, "installed", lambda: True)
    first = router.advise(client, section).lines()[0]
    assert first == (
        "client: point the job at http://127.0.0.1:30002; keep 56 requests in flight (sglang-router "
        "spreads them over the 2 servers)"
    )
    monkeypatch.setattr(router, "installed", lambda: False)
    note = router.advise(client, section).lines()
    assert not note[0].startswith("client: point") and any(
        "no router (sglang-router is not installed" in ln and "http://127.0.0.1:30002" in ln for ln in note
    )
    assert router.advise(client, None) == client


def test_a_rolled_out_config_carries_the_header_and_enable_metrics(tmp_path):
    fleet = Fleet(**two_servers())
    fleet.path = tmp_path / "fleet.toml"
    relative = rollout.stage_config(fleet, NEW, header="autotune: study s, trial 7\nclient: keep 9")
    text = (tmp_path / relative).read_text()
    assert text.startswith("# autotune: study s, trial 7\n# client: keep 9\n") and "enable-metrics: true" in text
    body = yaml_text(split_config(deployed_config(NEW))[0])
    assert text.endswith(body)


def test_rates_count_a_restarted_workers_tokens_from_zero():
    old = {"t": 100.0, "completions": 10.0, "tokens": {"a": 500.0, "b": 900.0}}
    new = {"t": 130.0, "completions": 40.0, "tokens": {"a": 800.0, "b": 60.0}}  # b restarted: its counter fell
    per_min, tok_s, span = routerview._rates(old, new)
    assert (per_min, tok_s, span) == (60.0, (300.0 + 60.0) / 30.0, 30.0)


def test_without_a_router_the_gate_warns_and_counts_what_a_stopped_server_had(monkeypatch):
    fleet = Fleet(**two_servers())
    gate = drain.Gate(record=None)
    assert "no router in front of the fleet" in (gate.warning(fleet) or "")
    monkeypatch.setattr(drain, "in_flight", lambda server, record=None: {"s0": 5, "s1": 0}[server.name])
    for server in fleet.servers:
        gate.take_out(server)
    assert gate.summary() == "the stopped servers had 5 request(s) in flight when they stopped (s0 5)"


# -- the real router ------------------------------------------------------------------------------------
def routed_fleet(tmp_path: Path, n: int = 3, **kwargs) -> Path:
    """``n`` simulated servers on OLD with --enable-metrics (as apply writes it), a [router] on free ports."""
    path = make_fleet(tmp_path, n, config=deployed_config(OLD), **kwargs)
    fleet = load_fleet(path)
    write_fleet(fleet.model_copy(update={"router": RouterSection(port=free_port(), metrics_port=free_port())}), path)
    return path


def stop_all(path: Path) -> None:
    teardown(path)
    router.stop(load_fleet(path), grace_s=2.0)


@contextmanager
def up_behind_router(tmp_path: Path, **kwargs) -> Iterator[tuple[Path, router.Record, str]]:
    """``routed_fleet`` brought up by ``fleet up``: its path, the router's record and what ``fleet up`` said;
    every server and the router stopped after."""
    path = routed_fleet(tmp_path, **kwargs)
    try:
        out = run_cli("fleet", "up", "--fleet", str(path), "--timeout", "60")
        record = router.running(load_fleet(path))
        assert record is not None
        yield path, record, out
    finally:
        stop_all(path)


class Load:
    """``benchmarks/closed_loop.py`` in its own process (not this one's GIL): ``concurrency`` requests in flight.
    Bounded twice: it stops issuing after ``LOAD_BOUND_S`` by itself, and ``no_load_outlives_its_test`` ends one a
    failed test left running."""

    running: list[Load] = []

    def __init__(self, urls: list[str], out: Path, *, concurrency: int = 64, max_tokens: int = 24):
        self.out = out
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(LOADER),
                *[a for u in urls for a in ("--url", u)],
                "--concurrency",
                str(concurrency),
                "--max-tokens",
                str(max_tokens),
                "--seconds",
                str(LOAD_BOUND_S),
                "--out",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        Load.running.append(self)

    def records(self) -> list[dict]:
        text = self.out.read_text() if self.out.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.records()) < count:
            assert self.proc.poll() is None, self.proc.stderr.read().decode() if self.proc.stderr else ""
            assert time.monotonic() < deadline, f"only {len(self.records())} requests done in {timeout_s} s"
            time.sleep(0.2)

    def stop(self) -> list[dict]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        return self.records()


LOAD_BOUND_S = 300  # longer than any test here runs (their timeouts), so only a leaked load ever reaches it


@pytest.fixture(autouse=True)
def no_load_outlives_its_test():
    yield
    while Load.running:
        load = Load.running.pop()
        if load.proc.poll() is None:
            load.proc.kill()
            load.proc.wait(timeout=30)


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fleet_up_status_down_with_the_router_and_a_one_url_client(tmp_path):
    with up_behind_router(tmp_path) as (path, record, out):
        assert f"router: point the job at {record.url}" in out
        urls = sorted(s.url for s in load_fleet(path).servers)
        assert sorted(w["url"] for w in router.workers(record) if w["is_healthy"]) == urls == sorted(record.worker_urls)
        load = Load([record.url], tmp_path / "client.jsonl", concurrency=12, max_tokens=16)
        load.wait_for(24)
        shown = json.loads(run_cli("fleet", "status", "--fleet", str(path), "--json"))
        seen = shown[-1]["router"]
        assert seen["healthy"] and seen["completions"] > 0 and seen["output_tok_s"] > 0
        assert sorted(w["url"] for w in seen["workers"] if w["in_router"]) == urls
        assert any(w["running"] for w in seen["workers"])  # the servers' own gauges, under the client's load
        done = load.stop()
        # the one-URL client: SGLang's and OpenAI's endpoints, streamed and not, all through the router
        kinds = {r["endpoint"] for r in done}
        assert len(kinds) == 6 and all(r["ok"] for r in done), [r for r in done if not r["ok"]][:3]
        text = run_cli("fleet", "status", "--fleet", str(path))
        assert f"router {record.url} (pid {record.pid}): healthy, 3 worker(s)" in text and "in the router" in text
        assert "stopped" in run_cli("fleet", "down", "--fleet", str(path))
        assert not psutil.pid_exists(record.pid) or psutil.Process(record.pid).status() == psutil.STATUS_ZOMBIE
        assert port_is_free("127.0.0.1", record.port) and port_is_free("127.0.0.1", record.metrics_port)
        assert router.read_record(load_fleet(path)) is None and not list((tmp_path / "run").glob("router*"))
        # a fleet up killed once the router's record is written leaves nothing the next one trips on
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        killed = subprocess.Popen(
            [sys.executable, "-m", "autotune", "fleet", "up", "--fleet", str(path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not router.record_path(load_fleet(path)).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        first = router.read_record(load_fleet(path))
        assert first is not None
        run_cli("fleet", "up", "--fleet", str(path), "--timeout", "60")
        again = router.running(load_fleet(path))
        assert again is not None and len([w for w in router.workers(again) if w["is_healthy"]]) == 3
        assert again.pid == first.pid or not first.alive()  # reused, or the half-started one is gone
        run_cli("fleet", "down", "--fleet", str(path))
        assert not again.alive() and port_is_free("127.0.0.1", again.port)


def write_winner(directory: Path, config: dict, *, tok_s: float | None = None) -> Path:
    """An sglang.yaml with the provenance.json apply writes beside it (capacity, workload, figures)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sglang.yaml").write_text(yaml_text(split_config(deployed_config(config))[0]))
    workload = {"prompts": str(prompts(directory)), "sample_size": 16, "max_tokens": 64}
    (directory / "provenance.json").write_text(
        json.dumps(
            {
                "study": "tuned",
                "trial": 4,
                "engine": "sim",
                "model_path": "qwen3.6-27b",
                "sim_gpu": "b200",
                "capacity": predicted(config).to_dict(),
                "config": config,
                "workload": workload,
                "output_tok_s": tok_s,
            }
        )
    )
    return directory / "sglang.yaml"


ROLL = [
    "--canary-s",
    "0.6",
    "--canary-warmup-s",
    "0.2",
    "--canary-concurrency",
    "4",
    "--grace",
    "5",
    "--startup-timeout",
    "30",
    "--drain-timeout",
    "30",
]


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rolling_apply_under_load_through_the_router_fails_no_request(tmp_path):
    with up_behind_router(tmp_path) as (path, record, _):
        winner = write_winner(tmp_path / "new", NEW)
        load = Load([record.url], tmp_path / "load.jsonl")
        load.wait_for(64)
        before = len(load.records())
        out = run_cli("apply", "--config", str(winner), "--fleet", str(path), "--rolling", *ROLL)
        during = len(load.records()) - before
        done = load.stop()
        assert during > 0 and len(done) >= 128
        assert [r for r in done if not r["ok"]] == []
        assert out.count("out of the router and drained") == 3 and out.count("back in the router") == 3
        fleet = load_fleet(path)
        assert len({s.config for s in fleet.servers}) == 1 and fleet.servers[0].config.startswith("configs/")
        assert all(server_config(fleet, s)["max_mamba_cache_size"] == 200 for s in fleet.servers)
        text = fleet.resolve(fleet.servers[0].config).read_text()
        assert text.startswith("# autotune: study tuned, trial 4") and "enable-metrics: true" in text
        assert sorted(w["url"] for w in router.workers(record) if w["is_healthy"]) == sorted(
            s.url for s in fleet.servers
        )
        watched = CliRunner().invoke(cli, ["watch", "--once", "--fleet", str(path)])
        assert watched.exit_code == 0, watched.output
        assert f"router {record.url} (pid {record.pid}): healthy, 3 worker(s)" in watched.output  # watch reads it


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_canary_failure_on_the_second_server_then_rollback_under_load_fails_no_request(tmp_path):
    slow_s1 = {1: {"decode_efficiency": 0.03}}  # s1 decodes ~30x slower
    with up_behind_router(tmp_path, sim_options=slow_s1) as (path, record, _):
        fleet = load_fleet(path)
        canary = rollout.Canary(prompts=str(prompts(tmp_path)), **{**CANARY, "concurrency": 4})
        tok_s = rollout.run_canary(stub_server(fleet.servers[0].port), canary, None).output_tok_s  # an idle s0
        winner = write_winner(tmp_path / "new", NEW, tok_s=tok_s)
        load = Load([record.url], tmp_path / "load.jsonl")
        load.wait_for(64)
        failed = CliRunner().invoke(
            cli,
            [
                "apply",
                "--config",
                str(winner),
                "--fleet",
                str(path),
                "--rolling",
                "--keep-partial",
                "--tolerance",
                "0.75",
                *ROLL,
            ],
        )
        assert isinstance(failed.exception, FleetError), failed.output
        assert "server s1 failed" in str(failed.exception) and "canary" in str(failed.exception)
        configs = [s.config for s in load_fleet(path).servers]
        assert configs[0].startswith("configs/") and configs[1:] == ["old.yaml", "old.yaml"]
        out = run_cli("apply", "--rollback", "--fleet", str(path), "--grace", "5", "--startup-timeout", "30")
        done = load.stop()
        assert [r for r in done if not r["ok"]] == [] and len(done) >= 128
        assert "rolled back: s0" in out
        fleet = load_fleet(path)
        assert [s.config for s in fleet.servers] == ["old.yaml"] * 3
        assert sorted(w["url"] for w in router.workers(record) if w["is_healthy"]) == sorted(
            s.url for s in fleet.servers
        )


def test_a_router_that_cannot_start_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    fleet = Fleet(**two_servers(router=RouterSection(port=free_port(), extra_args=["--no-such-flag"])))
    fleet.path = tmp_path / "fleet.toml"
    if not router.installed():
        pytest.skip("sglang-router is not installed")
    with pytest.raises(FleetError, match="the router exited with code"):
        router.start(fleet, ["http://127.0.0.1:9"], timeout_s=30)
    assert router.read_record(fleet) is None and port_is_free("127.0.0.1", router.section(fleet).port)


@pytest.mark.parametrize("with_router", [True, False])
def test_apply_writes_the_router_into_the_fleet_file_client_json_and_the_launch_script(
    tmp_path, monkeypatch, with_router, fleet_base_port
):
    from test_apply import BASELINE, WINNER, make_study, result

    url = f"sqlite:///{tmp_path / 'study.db'}"
    make_study(
        url,
        trials=[(result(BASELINE, 2050.0, mrr=16, slots=80), "baseline"), (result(WINNER, 3000.0), "search")],
        confirm=1,
    )
    monkeypatch.setattr(router, "installed", lambda: with_router)
    out = tmp_path / "deploy"
    printed = run_cli("apply", "--storage", url, "--out", str(out), "--gpus", "0-1")
    fleet = load_fleet(out / "fleet.toml")
    base = fleet_base_port  # the servers take base and base + 1, the router the two free ports after them
    assert fleet.router is not None and (fleet.router.port, fleet.router.prometheus_port) == (base + 2, base + 3)
    client = json.loads((out / "client.json").read_text())
    script = (out / "launch_fleet.sh").read_text()
    routed = [ln for ln in script.splitlines() if ln.startswith("start ") and "sglang_router" in ln]
    if with_router:
        assert client["router_url"] == f"http://127.0.0.1:{base + 2}"
        assert f"client: point the job at http://127.0.0.1:{base + 2}; keep" in printed
        assert f"# client: point the job at http://127.0.0.1:{base + 2}" in script
        # the servers prove themselves with the fleet's own CA, which the router verifies them against
        assert len(routed) == 1 and f"https://127.0.0.1:{base} https://127.0.0.1:{base + 1} --policy" in routed[0]
        assert routed[0].endswith("--ca-cert-paths tls/ca.pem")
        assert all(s.tls for s in fleet.servers)
        servers = [ln for ln in script.splitlines() if ln.startswith("start ") and "sglang_router" not in ln]
        assert [
            f"--ssl-certfile tls/{s.name}.pem --ssl-keyfile tls/{s.name}.key --ssl-ca-certs tls/ca.pem" in ln
            for s, ln in zip(fleet.servers, servers, strict=True)
        ] == [True, True]
        for name in ("ca", *(s.name for s in fleet.servers)):
            assert (out / "tls" / f"{name}.pem").is_file() and (out / "tls" / f"{name}.key").stat().st_mode & 0o077 == 0
    else:
        assert client["router_url"] is None and routed == [] and not any(s.tls for s in fleet.servers)
        assert "no router (sglang-router is not installed" in printed and f"http://127.0.0.1:{base + 2}" in printed


def test_the_benchmark_buckets_completions_before_during_and_after_a_rollout():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollout_under_load as bench

    # load from t=0 to t=80, rollout from 40 to 55: 10 completions a second, 5 a second during, one failure
    records = [{"end": t / 10, "ok": True} for t in range(0, 800) if not (400 <= t < 550 and t % 2)]
    records.append({"end": 45.0, "ok": False})
    f = bench.phases(records, 0.0, 40.0, 55.0, 80.0)
    assert f["failed"] == 1 and f["before"] == [100, 100, 100] and f["during"] == [50, 75]
    assert f["after"] == [100, 100] and f["lowest_share"] == 0.5 and f["spread_before"] == 0.0
