"""``autotune inspect`` on recorded real SGLang 0.5.23 endpoints, fake servers, and the simulated server."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from simserver import sim_server as run_sim_server

from autotune.cli import main
from autotune.config import load_config
from autotune.inspect.diagnose import (
    InspectError,
    explain_capacity,
    fleet_differences,
    inspect_servers,
    pool_usage,
)
from autotune.inspect.probe import GpuMemory, Probe, ProbeFailure, parse_prometheus, probe
from autotune.inspect.state import ServerState, flags_from_command
from autotune.inspect.sweep_file import _dumps, sweep_toml

DATA = Path(__file__).parent / "data" / "inspect"
SERVER_INFO = json.loads((DATA / "server_info.json").read_text())
MODEL_INFO = json.loads((DATA / "model_info.json").read_text())
METRICS = (DATA / "metrics.prom").read_text()

pytestmark = pytest.mark.timeout(60)

Route = tuple[int, str, str]  # status, content type, body


def recorded_routes(server_info: dict | None = None, *, metrics: bool = True) -> dict[str, Route]:
    routes = {
        "/server_info": (200, "application/json", json.dumps(server_info or SERVER_INFO)),
        "/model_info": (200, "application/json", json.dumps(MODEL_INFO)),
    }
    if metrics:
        routes["/metrics"] = (200, "text/plain; version=0.0.4", METRICS)
    return routes


def mock_transport(routes_by_port: dict[int, dict[str, Route]]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        routes = routes_by_port.get(request.url.port)
        if routes is None:
            raise httpx.ConnectError("connection refused", request=request)
        status, ctype, body = routes.get(request.url.path, (404, "application/json", '{"detail":"Not Found"}'))
        return httpx.Response(status, headers={"content-type": ctype}, text=body)

    return httpx.MockTransport(handler)


class FakeServer:
    """A real HTTP server on loopback that answers fixed routes and records every request it gets."""

    def __init__(self, routes: dict[str, Route]):
        self.routes, self.requests = routes, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.requests.append((self.command, self.path))
                status, ctype, body = owner.routes.get(
                    self.path.split("?")[0], (404, "text/html", "<h1>Not Found</h1>")
                )
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server() -> Iterator[Callable[[dict[str, Route]], FakeServer]]:
    servers: list[FakeServer] = []

    def make(routes: dict[str, Route]) -> FakeServer:
        servers.append(FakeServer(routes))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probe_recorded(server_info: dict | None = None, *, metrics: bool = True) -> Probe | ProbeFailure:
    transport = mock_transport({30000: recorded_routes(server_info, metrics=metrics)})
    with httpx.Client(transport=transport) as client:
        return probe("127.0.0.1:30000", client=client, use_nvml=False)


# ---------------------------------------------------------------- parsing the recorded real endpoints


def test_prometheus_gauges_are_read_and_histograms_skipped():
    gauges = parse_prometheus(METRICS)
    assert gauges["sglang:num_running_reqs"] == 4.0
    assert gauges["sglang:num_queue_reqs"] == 2.0
    assert gauges["sglang:kv_used_tokens"] == 934.0
    assert gauges["sglang:mamba_used_tokens"] == 5.0
    # six graph phases, all 0 on the CPU backend, summed into one gauge
    assert gauges["sglang:graph_memory_usage_gb"] == 0.0
    assert not any(name.endswith(("_bucket", "_sum", "_count")) for name in gauges)
    text = 'sglang:num_running_reqs{tp_rank="0"} 3.0\nsglang:num_running_reqs{tp_rank="1"} 5.0\n# HELP x\n'
    text += 'sglang:token_usage{dp_rank="0"} 0.2\nsglang:token_usage{dp_rank="1"} 0.4\n'
    assert parse_prometheus(text) == {
        "sglang:num_running_reqs": 8.0,
        "sglang:token_usage": pytest.approx(0.3),
    }


def test_recorded_server_explains_its_capacity():
    p = probe_recorded()
    assert isinstance(p, Probe)
    state = ServerState.from_probe(p)
    assert state.version == "0.5.23"
    assert state.architectures == ["Qwen3NextForCausalLM"]
    assert (state.effective_mrr, state.mamba_slots, state.kv_tokens) == (1481, 4443, 1985628)
    assert state.context_len == 2048  # from max_req_input_len, as SGLang derives it
    cap = explain_capacity(state)
    # CPU backend: no_buffer → 3 slots per request; 4443 // 3 = 1481 is what the server reports
    assert (cap.binding, cap.ratio) == ("mamba", 3)
    assert "4,443 Mamba slots ÷ 3 per request" in cap.sentence
    assert {limit.name: limit.value for limit in cap.limits} == {"mamba": 1481, "est": 4096, "kv": 992814}


def test_recorded_metrics_give_pool_usage():
    usage = pool_usage(ServerState.from_probe(probe_recorded()))
    assert usage is not None
    assert (usage.running, usage.queued, usage.retracted) == (4, 2, 0)
    assert usage.kv_used_pct == pytest.approx(0.1064, abs=1e-3)
    assert usage.mamba_used_pct == pytest.approx(0.2547, abs=1e-3)
    assert usage.running_pct == pytest.approx(100 * 4 / 1481)


def test_metrics_disabled_is_a_note_not_a_failure():
    p = probe_recorded(metrics=False)
    assert isinstance(p, Probe) and p.metrics is None
    assert "--enable-metrics" in (p.metrics_note or "")
    assert pool_usage(ServerState.from_probe(p)) is None


def test_launch_command_becomes_dest_flags_without_placement():
    assert ServerState.from_probe(probe_recorded()).user_flags() == {
        "device": "cpu",
        "disable_overlap_schedule": True,
        "mem_fraction_static": 0.1,
    }
    flags = flags_from_command(
        "python -m sglang.launch_server --model-path m --port 1 --speculative-algo EAGLE --speculative-num-steps 3 "
        "--max-mamba-cache-size=80 --enable-metrics --cuda-graph-bs-decode 1 2 4"
    )
    assert flags == {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "max_mamba_cache_size": 80,
        "enable_metrics": True,
        "cuda_graph_bs_decode": [1, 2, 4],
    }
    # the simulator's own --sim-* knobs are not SGLang flags; an unknown flag makes the command unusable
    assert flags_from_command("--model-path m --sim-gpu b200 --sim-shm --max-mamba-cache-size 80") == {
        "max_mamba_cache_size": 80
    }
    assert flags_from_command("--model-path m --not-a-flag 3") is None
    # the flags live in a YAML file inspect cannot read: the resolved args stand in
    assert flags_from_command("--config sglang.yaml --port 30000") is None


def test_credentials_in_the_launch_command_are_never_repeated():
    key = "sk-" + "a1B2c3D4e5F6g7H8"
    command = f"--model-path m --api-key {key} --admin-api-key={key} --max-total-tokens 4096 --tokenizer-path t"
    assert flags_from_command(command) == {"max_total_tokens": 4096}
    info = copy.deepcopy(SERVER_INFO)
    info["launch_command"] += f" --api-key {key}"
    inspection = inspect_servers(
        ["127.0.0.1:30000"], transport=mock_transport({30000: recorded_routes(info)}), use_nvml=False
    )
    assert key not in json.dumps(inspection.to_dict())


def test_resolved_args_stand_in_when_there_is_no_launch_command():
    info = copy.deepcopy(SERVER_INFO)
    del info["launch_command"]
    flags = ServerState.from_probe(probe_recorded(info)).user_flags()
    assert flags["mem_fraction_static"] == 0.1 and flags["disable_overlap_schedule"] is True
    assert "mamba_full_memory_ratio" not in flags  # 0.9 is SGLang's fallback, not a choice


def test_unknown_model_still_reports_and_says_what_is_missing():
    inspection = inspect_servers(
        ["127.0.0.1:30000"], transport=mock_transport({30000: recorded_routes()}), use_nvml=False
    )
    (d,) = inspection.servers
    assert d.capacity.binding == "mamba"
    assert d.advice is not None and d.advice.suggestions == []
    text = " ".join(d.notes)
    assert "no model profile for /models/tiny-qwen3next (Qwen3NextForCausalLM)" in text
    assert "--model" in text and "--gpu" in text
    assert d.memory["weights"]["server"] == pytest.approx(0.017)


# ---------------------------------------------------------------- one clear line per server that cannot be inspected


def test_unreachable_server_is_one_line():
    port = closed_port()
    with httpx.Client(timeout=2.0) as client:
        result = probe(f"127.0.0.1:{port}", client=client, use_nvml=False)
    assert isinstance(result, ProbeFailure) and result.kind == "unreachable"
    assert result.message.startswith(f"http://127.0.0.1:{port}: unreachable")


def test_non_sglang_servers_are_named(fake_server):
    html404 = fake_server({})
    html200 = fake_server({"/server_info": (200, "text/html", "<html>hello</html>")})
    other_json = fake_server({"/server_info": (200, "application/json", '{"status": "ok"}')})
    inspection = inspect_servers([html404.url, html200.url, other_json.url], use_nvml=False)
    assert not inspection.ok
    kinds = [(f.kind, f.message) for f in inspection.failures]
    assert kinds[0] == (
        "not_sglang",
        f"{html404.url}: not an SGLang server (GET /server_info → HTTP 404 (text/html))",
    )
    assert kinds[1][0] == "not_sglang" and "not JSON" in kinds[1][1]
    assert kinds[2][0] == "not_sglang" and "no model_path" in kinds[2][1]


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        (("internal_states",), "internal_states[0]"),
        (
            ("internal_states", 0, "effective_max_running_requests_per_dp"),
            "internal_states[0].effective_max_running_requests_per_dp",
        ),
        (("max_total_num_tokens",), "max_total_num_tokens"),
    ],
)
def test_sglang_lacking_a_field_is_named(drop, named):
    info = copy.deepcopy(SERVER_INFO)
    info["version"] = "0.4.9"
    target = info
    for key in drop[:-1]:
        target = target[key]
    del target[drop[-1]]
    result = probe_recorded(info)
    assert isinstance(result, ProbeFailure) and result.kind == "missing_field"
    assert f"SGLang 0.4.9's /server_info lacks {named}" in result.message


def test_cli_reports_every_server_and_fails_only_when_none_answers(fake_server, capsys):
    good = fake_server(recorded_routes())
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(SystemExit) as exc:
        main(["inspect", good.url, dead, "--json"])
    assert exc.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["url"] for s in out["servers"]] == [good.url]
    assert out["servers"][0]["capacity"]["binding"] == "mamba"
    assert [f["kind"] for f in out["failures"]] == ["unreachable"]

    with pytest.raises(SystemExit) as exc:
        main(["inspect", dead])
    assert exc.value.code == 1
    captured = capsys.readouterr()
    assert f"{dead}: unreachable" in captured.out
    assert captured.err.strip().splitlines()[-1].startswith("Error: no server could be inspected")


def test_inspect_is_read_only(fake_server, capsys):
    server = fake_server(recorded_routes())
    with pytest.raises(SystemExit) as exc:
        main(["inspect", server.url])
    assert exc.value.code == 0
    assert "capped at 1481 running requests by the Mamba slots" in capsys.readouterr().out
    assert server.requests, "inspect made no request"
    assert {method for method, _ in server.requests} == {"GET"}
    assert {path for _, path in server.requests} <= {"/server_info", "/model_info", "/metrics", "/sim/gpu"}
    assert "/server_info" in {path for _, path in server.requests}


def test_no_gpu_reading_is_a_note_and_the_planner_estimate_stands_in(fake_server):
    cuda = copy.deepcopy(SERVER_INFO)  # the recorded server on a GPU (the recording itself is a CPU server)
    cuda["device"] = cuda["internal_states"][0]["device"] = "cuda"
    server = fake_server(recorded_routes(cuda))  # a real SGLang answers /sim/gpu with 404
    (d,) = inspect_servers([server.url], use_nvml=False).servers
    assert d.state.gpu is None and d.memory["free"]["server"] is None
    assert any(note.startswith("no GPU memory reading") for note in d.notes)
    assert ("GET", "/sim/gpu") in server.requests


# ---------------------------------------------------------------- fleets


def test_fleet_calls_out_the_odd_server():
    odd = copy.deepcopy(SERVER_INFO)
    odd["launch_command"] += " --max-mamba-cache-size 200"
    odd["internal_states"][0]["max_mamba_cache_size"] = 200
    odd["internal_states"][0]["effective_max_running_requests_per_dp"] = 66
    transport = mock_transport({1: recorded_routes(), 2: recorded_routes(odd), 3: recorded_routes()})
    inspection = inspect_servers(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], transport=transport, use_nvml=False)
    lines = inspection.differences
    assert "http://127.0.0.1:2: max running requests = 66 (the others: 1481)" in lines
    assert "http://127.0.0.1:2: Mamba slots = 200 (the others: 4443)" in lines
    assert "http://127.0.0.1:2: --max-mamba-cache-size = 200 (the others: unset)" in lines
    assert all(line.startswith("http://127.0.0.1:2") for line in lines)
    # two servers and no majority: both values are named on one line
    pair = fleet_differences(inspection.servers[:2])
    assert "servers differ on Mamba slots: http://127.0.0.1:1 4443, http://127.0.0.1:2 200" in pair
    assert fleet_differences(inspection.servers[:1]) == []


# ---------------------------------------------------------------- planner advice (a server shaped like the seed's)

SEED_COMMAND = (
    "python -m sglang.launch_server --model-path qwen3.6-27b --speculative-algorithm EAGLE "
    "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
    "--max-mamba-cache-size 80 --mamba-full-memory-ratio 0.4 --enable-metrics"
)


def seed_routes(*, kv_tokens: int | None = None) -> dict[str, Route]:
    """/server_info as SGLang 0.5.23 would report the seed's production config on a B200 (the planner's figures)."""
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model

    p = plan(load_model("qwen3.6-27b"), load_gpu("b200"), flags_from_command(SEED_COMMAND))
    info = copy.deepcopy(SERVER_INFO)
    info.update(
        model_path="qwen3.6-27b",
        launch_command=SEED_COMMAND,
        max_total_num_tokens=kv_tokens or p.kv_tokens,
        speculative_algorithm="EAGLE",
        max_running_requests=48,
        mamba_radix_cache_strategy="extra_buffer",
        disable_overlap_schedule=False,
        max_mamba_cache_size=80,
        mem_fraction_static=p.mem_fraction_static,
        context_length=None,
        max_req_input_len=262138,
    )
    info["internal_states"][0].update(effective_max_running_requests_per_dp=16, max_mamba_cache_size=80)
    model_info = dict(MODEL_INFO, model_path="qwen3.6-27b", architectures=["Qwen3_5ForConditionalGeneration"])
    return {
        "/server_info": (200, "application/json", json.dumps(info)),
        "/model_info": (200, "application/json", json.dumps(model_info)),
        "/sim/gpu": (200, "application/json", json.dumps({"used_mib": 155_000, "total_mib": 183_359})),
    }


def test_planner_reproduces_the_seed_server_and_lifts_the_mamba_cap():
    inspection = inspect_servers(["127.0.0.1:7"], transport=mock_transport({7: seed_routes()}), use_nvml=False)
    (d,) = inspection.servers
    assert d.capacity.binding == "mamba" and d.capacity.ratio == 5
    assert d.headline.startswith("capped at 16 running requests by the Mamba slots: 80 Mamba slots ÷ 5 per request")
    assert "27.7 GiB of GPU memory idle" in d.headline
    advice = d.advice
    assert (advice.model, advice.gpu, advice.confidence) == ("qwen3.6-27b", "b200", "high")
    assert "reproduces the server exactly: 16 running, 80 Mamba slots" in advice.reproduction
    assert any(line.startswith("--mamba-full-memory-ratio 0.4 changes nothing") for line in advice.inert)
    first = advice.suggestions[0]
    assert first.max_running_requests >= 40 and first.confidence == "high"
    assert first.mamba_slots >= 5 * first.max_running_requests
    assert first.headroom_gib >= 2.0 and first.kv_tokens >= first.max_running_requests * 4096
    # the single change that needs nothing else: more slots, up to the speculative default of 48
    single = next(s for s in advice.suggestions if list(s.changes) == ["max_mamba_cache_size"])
    assert (single.changes, single.max_running_requests, single.binding) == (
        {"max_mamba_cache_size": 240},
        48,
        "spec_default",
    )
    assert d.memory["mamba_states"]["planner"] == pytest.approx(11.39 + 0.22, abs=0.05)  # 80 (+1) slots
    assert d.memory["spec_intermediates"]["planner"] == pytest.approx(9.66, abs=0.05)  # 16 (+1) requests × D=4


def test_confidence_drops_and_says_by_how_much_when_the_planner_is_off():
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model

    kv = plan(load_model("qwen3.6-27b"), load_gpu("b200"), flags_from_command(SEED_COMMAND)).kv_tokens
    routes = seed_routes(kv_tokens=int(kv * 0.8))
    (d,) = inspect_servers(["127.0.0.1:7"], transport=mock_transport({7: routes}), use_nvml=False).servers
    assert d.advice.confidence == "low"
    assert "off by up to 25 %" in d.advice.reproduction


def test_sweep_file_is_a_valid_study_centred_on_the_first_suggestion(tmp_path):
    (d,) = inspect_servers(["127.0.0.1:7"], transport=mock_transport({7: seed_routes()}), use_nvml=False).servers
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    path = tmp_path / "sweep.toml"
    path.write_text(sweep_toml(d, prompts=str(prompts)))
    cfg = load_config(path)
    first = d.advice.suggestions[0]
    assert cfg.engine.kind == "sim" and cfg.engine.model == "qwen3.6-27b" and cfg.engine.sim_gpu == "b200"
    assert cfg.engine.fixed["speculative_algorithm"] == "EAGLE" and cfg.engine.fixed["mamba_full_memory_ratio"] == 0.4
    assert cfg.baseline.flags == {"max_mamba_cache_size": 80}
    assert cfg.enqueue[0].flags == {"max_mamba_cache_size": 80, **first.changes}
    for dest, value in first.changes.items():
        assert cfg.space[dest].low <= value <= cfg.space[dest].high
    assert cfg.space["max_mamba_cache_size"].step == 5  # one running request per step at 5 slots each


def test_cli_text_shows_the_next_step_and_writes_the_sweep_file(fake_server, tmp_path, capsys):
    server = fake_server(seed_routes())
    out = tmp_path / "next.toml"
    with pytest.raises(SystemExit) as exc:
        main(["inspect", server.url, "--sweep-out", str(out), "--prompts", "prompts.jsonl"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "capped at 16 running requests by the Mamba slots" in text
    assert "--max-mamba-cache-size 240" in text  # the single change, in the next-step table
    assert "confidence high" in text and f"Wrote {out}" in text
    assert tomllib.loads(out.read_text())["workload"]["prompts"] == "prompts.jsonl"


def test_cli_refuses_a_sweep_file_without_a_model_profile(fake_server, tmp_path, capsys):
    server = fake_server(recorded_routes())
    with pytest.raises(SystemExit) as exc:
        main(["inspect", server.url, "--sweep-out", str(tmp_path / "x.toml")])
    assert exc.value.code == 1
    assert "cannot write a sweep file without a model profile" in capsys.readouterr().err
    assert not (tmp_path / "x.toml").exists()


# ---------------------------------------------------------------- sweep file pieces


def test_toml_values_round_trip():
    value = {
        "a": 1,
        "b": 0.93,
        "c": "EAGLE",
        "d": True,
        "e": [1, 2],
        "f": {"type": "int", "low": 5},
        "g-h": 'x"y',
    }
    assert tomllib.loads(_dumps({"x": value}))["x"] == value  # written by tomli-w
    with pytest.raises(InspectError, match="cannot write a study file"):
        _dumps({"x": {"y": object()}})


# ---------------------------------------------------------------- end to end: the seed's production server on the sim

PRODUCTION = [
    "--speculative-algorithm",
    "EAGLE",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
    "--max-mamba-cache-size",
    "80",
    "--mamba-full-memory-ratio",
    "0.4",
]


@pytest.fixture
def sim_env(tmp_path, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture
def sim_server(tmp_path, sim_env) -> Iterator[str]:
    """The seed's production config on a simulated B200, with metrics; stopped (whole group) at the end."""
    with run_sim_server(tmp_path, [*PRODUCTION, "--enable-metrics"], sim_env) as url:
        yield url


class Load:
    """~40 streaming /generate requests kept in flight from a background thread until stopped."""

    def __init__(self, url: str, concurrency: int = 40):
        self.url, self.concurrency = url, concurrency
        self.stop = threading.Event()
        self.tokens = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {
            "text": f"Write a long essay about topic {i}. " * 20,
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        async with client.stream("POST", f"{self.url}/generate", json=body) as response:
            async for line in response.aiter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: {"):
                    self.tokens += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=100)) as client:
            tasks = [asyncio.create_task(self._one(client, i)) for i in range(self.concurrency)]
            while not self.stop.is_set():
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=15)


def wait_for_running(url: str, at_least: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gauges = parse_prometheus(httpx.get(f"{url}/metrics", timeout=2.0).text)
        if gauges.get("sglang:num_running_reqs", 0) >= at_least:
            return
        time.sleep(0.1)
    pytest.fail(f"the server never ran {at_least} requests")


def measure(flags: dict[str, object], env: dict[str, str], out: Path) -> float:
    """``autotune measure --engine sim`` on its own simulated GPU (the inspected server still holds the other)."""
    env = {**env, "AUTOTUNE_SIM_DEVICE_DIR": str(out.parent / "measure-devices")}
    sets = [f"--set={k}={v}" for k, v in flags.items()]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "measure",
            "--engine",
            "sim",
            "--model",
            "qwen3.6-27b",
            "--gpu",
            "b200",
            *sets,
            "--warmup",
            "2",
            "--window",
            "3",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout)
    assert data["status"] == "ok", data.get("reason")
    return float(data["metrics"]["output_tok_s"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_seed_production_server_diagnosis_and_first_suggestion_pays(sim_server, sim_env, tmp_path):
    with Load(sim_server):
        wait_for_running(sim_server, 16)
        inspection = inspect_servers([sim_server])
    assert inspection.failures == []
    (d,) = inspection.servers
    assert d.capacity.binding == "mamba" and d.capacity.effective == 16
    assert d.usage is not None and d.usage.running == 16 and d.usage.queued >= 20
    assert d.usage.kv_used_pct < 10.0
    assert d.advice.model == "qwen3.6-27b" and d.advice.gpu == "b200"
    assert d.advice.confidence == "high", d.advice.reproduction
    assert any("--mamba-full-memory-ratio" in line for line in d.advice.inert)
    first = d.advice.suggestions[0]
    assert first.max_running_requests >= 40 and first.headroom_gib > 0

    sweep = tmp_path / "sweep.toml"
    prompts = Path(__file__).parents[1] / "examples" / "prompts.jsonl"
    sweep.write_text(sweep_toml(d, prompts=str(prompts)))
    cfg = load_config(sweep)
    assert cfg.engine.kind == "sim" and cfg.engine.fixed["speculative_algorithm"] == "EAGLE"
    assert cfg.baseline.flags == {"max_mamba_cache_size": 80}
    for dest, value in first.changes.items():
        spec = cfg.space[dest]
        assert spec.low <= value <= spec.high

    production = dict(d.advice.config)
    production.pop("enable_metrics", None)
    base = measure(production, sim_env, tmp_path / "m-prod")
    better = measure({**production, **first.changes}, sim_env, tmp_path / "m-first")
    print(
        f"production {base:,.0f} tok/s; first suggestion {' '.join(first.argv)} {better:,.0f} tok/s "
        f"({better / base:.2f}x)"
    )
    assert better >= 1.5 * base


def test_a_malformed_field_fails_that_server_only():
    bad = copy.deepcopy(SERVER_INFO)
    bad["internal_states"][0]["effective_max_running_requests_per_dp"] = "many"
    transport = mock_transport({1: recorded_routes(bad), 2: recorded_routes()})
    inspection = inspect_servers(["127.0.0.1:1", "127.0.0.1:2"], transport=transport, use_nvml=False)
    assert [d.url for d in inspection.servers] == ["http://127.0.0.1:2"]
    (failure,) = inspection.failures
    assert failure.kind == "malformed" and failure.message.startswith(
        "http://127.0.0.1:1: /server_info has a malformed"
    )


@pytest.mark.parametrize("option", [["--gpu", "a100x"], ["--model", "no-such-model"]])
def test_a_bad_profile_option_is_one_line_before_any_request(option, fake_server, capsys):
    server = fake_server(recorded_routes())
    with pytest.raises(SystemExit) as exc:
        main(["inspect", server.url, *option])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error: ") and option[1] in err[0]
    assert server.requests == []


# ---------------------------------------------------------------- SGLang's memory split: KV pool, Mamba pools, device

RECORDED = Path(__file__).parent / "data" / "recorded"
STARTUP_LOG = RECORDED / "qwen3next-startup-serve-sigterm.log"  # the run /server_info was recorded from


def inspect_recorded(*, logs=(), server_info: dict | None = None, url: str = "127.0.0.1:30000", use_nvml=False):
    transport = mock_transport({30000: recorded_routes(server_info)})
    return inspect_servers([url], transport=transport, use_nvml=use_nvml, logs=logs)


def test_kvcache_is_the_kv_pool_and_the_mamba_pools_come_from_the_startup_log():
    (d,) = inspect_recorded(logs=[STARTUP_LOG]).servers
    # The log says "KV Cache is allocated … K size: 0.47 GB, V size: 0.47 GB": kvcache (0.947) is K + V only,
    # and "Mamba Cache is allocated … conv_state size: 0.04GB, ssm_state size: 0.81GB" is a separate pool.
    assert d.memory["kv"]["server"] == pytest.approx(0.947)
    assert d.memory["mamba_states"]["server"] == pytest.approx(0.04 + 0.81)
    assert d.memory["spec_intermediates"]["server"] == 0.0  # no speculative decoding: none allocated
    assert d.memory["pools"]["server"] == pytest.approx(0.947 + 0.85)
    assert any(str(STARTUP_LOG) in note and "Mamba Cache is allocated" in note for note in d.notes)


def test_without_the_log_the_mamba_pools_are_unknown_not_guessed(fake_server, capsys):
    (d,) = inspect_recorded().servers
    assert d.memory["kv"]["server"] == pytest.approx(0.947)  # still the KV pool, not "all pools"
    assert d.memory["mamba_states"]["server"] is None and d.memory["pools"]["server"] is None
    assert any(note.startswith("Mamba pool size unknown") and "--log" in note for note in d.notes)
    server = fake_server(recorded_routes())
    with pytest.raises(SystemExit) as exc:
        main(["inspect", server.url])
    assert exc.value.code == 0
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.count("│") == 4
    }
    assert rows["pools (KV + Mamba)"] == "unknown" and rows["Mamba states (ssm + conv)"] == "unknown"
    assert rows["KV cache (SGLang's kvcache)"] == "0.95"


def test_a_log_of_another_startup_is_not_used(tmp_path):
    (d,) = inspect_recorded(logs=[RECORDED / "qwen3next-mamba16-capped-to-5.log"]).servers
    assert d.memory["mamba_states"]["server"] is None
    assert any("describes another startup (16 Mamba slots there, 4,443 here" in note for note in d.notes)
    # A log appended across restarts: the latest startup is the one that counts.
    appended = tmp_path / "server.log"
    appended.write_text((RECORDED / "qwen3next-mamba16-capped-to-5.log").read_text() + STARTUP_LOG.read_text())
    (d,) = inspect_recorded(logs=[appended]).servers
    assert d.memory["mamba_states"]["server"] == pytest.approx(0.85)
    failed = tmp_path / "failed.log"  # a run that died before its pools: no Mamba line to read
    failed.write_text((RECORDED / "qwen3next-mamba2-too-small.exit137.log").read_text())
    (d,) = inspect_recorded(logs=[failed]).servers
    assert d.memory["mamba_states"]["server"] is None
    assert any("has no `Mamba Cache is allocated` line" in note for note in d.notes)


def test_the_log_of_the_simulated_server_matches_its_server_info(sim_server_with_log):
    url, log = sim_server_with_log
    (d,) = inspect_servers([url], logs=[log]).servers
    assert d.memory["mamba_states"]["server"] == pytest.approx(d.memory["mamba_states"]["planner"], abs=0.01)
    assert d.memory["spec_intermediates"]["server"] == pytest.approx(
        d.memory["spec_intermediates"]["planner"], abs=0.01
    )
    assert d.memory["kv"]["server"] == pytest.approx(d.memory["kv"]["planner"], abs=0.01)


def test_a_non_hybrid_server_has_no_mamba_pool():
    info = copy.deepcopy(SERVER_INFO)
    info["internal_states"][0]["max_mamba_cache_size"] = None
    (d,) = inspect_recorded(server_info=info).servers
    assert d.memory["mamba_states"]["server"] == 0.0 and d.memory["pools"]["server"] == pytest.approx(0.947)
    assert not any("Mamba pool" in note for note in d.notes)


def test_a_local_cpu_server_gets_no_nvml_reading_or_note(monkeypatch):
    calls: list[int] = []

    def fake_nvml(index: int) -> GpuMemory:
        calls.append(index)
        return GpuMemory(100.0, 140.4, f"NVML GPU {index}")

    monkeypatch.setattr("autotune.inspect.probe._nvml_gpu", fake_nvml)
    (d,) = inspect_recorded(use_nvml=True).servers  # local, device "cpu" in /server_info
    assert calls == [] and d.state.gpu is None and d.state.device == "cpu"
    assert not any("NVML" in note for note in d.notes)
    assert any(note.startswith("CPU server (device cpu)") for note in d.notes)
    assert any(note.startswith("CPU server: the planner models GPU memory") for note in d.notes)
    assert d.to_dict()["device"] == "cpu"
    cuda = copy.deepcopy(SERVER_INFO)  # the same server on a GPU: NVML is read, and said so
    cuda["device"] = "cuda"
    cuda["internal_states"][0]["device"] = "cuda"
    (d,) = inspect_recorded(server_info=cuda, use_nvml=True).servers
    assert calls == [0] and any("NVML GPU 0" in note for note in d.notes)


def test_a_cpu_server_is_drawn_without_gpu_columns_or_cuda_graphs():
    from rich.console import Console

    from autotune.inspect.render import render

    def drawn(inspection) -> str:
        console = Console(record=True, width=200)
        render(inspection, console)
        return console.export_text()

    cpu = drawn(inspect_recorded())  # the recorded server runs SGLang's CPU backend
    assert "GPU GiB" not in cpu and "CUDA graphs" not in cpu and "GPU used" not in cpu
    assert "KV cache" in cpu  # its pools are still drawn
    cuda_info = copy.deepcopy(SERVER_INFO)
    cuda_info["device"] = "cuda"
    cuda_info["internal_states"][0]["device"] = "cuda"
    cuda = drawn(inspect_recorded(server_info=cuda_info))
    assert "GPU GiB" in cuda and "CUDA graphs" in cuda


def test_log_option_errors_are_one_line_before_any_request(fake_server, tmp_path, capsys):
    server = fake_server(recorded_routes())
    for args, message in (
        ([str(tmp_path / "missing.log")], "cannot read the startup log"),
        ([str(STARTUP_LOG), str(STARTUP_LOG)], "2 startup logs for 1 server"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["inspect", server.url, *(a for path in args for a in ("--log", path))])
        assert exc.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
    assert server.requests == []
    with pytest.raises(SystemExit) as exc:
        main(["inspect", server.url, "--log", str(STARTUP_LOG), "--json"])
    assert exc.value.code == 0
    memory = json.loads(capsys.readouterr().out)["servers"][0]["memory_gib"]
    assert memory["mamba_states"]["server"] == pytest.approx(0.85)


@pytest.fixture
def sim_server_with_log(tmp_path, sim_env) -> Iterator[tuple[str, Path]]:
    """The seed's production config on a simulated B200; its log is where the server wrote it."""
    with run_sim_server(tmp_path, PRODUCTION, sim_env) as url:
        yield url, tmp_path / "sim.log"
