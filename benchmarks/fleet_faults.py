"""A fleet's faults between rollouts, under a job's load, with the keeper ``fleet up`` leaves beside the fleet.

Three simulated servers behind sglang-router, a closed loop of ``--concurrency`` requests through the router's one
URL (``closed_loop.py``). Three cases, each on a fresh fleet:

- ``kill``: SIGKILL one server. Printed: failed requests (the streams the killed server was sending, which no router
  can retry once their first bytes reached the job, apart from every other failure), the time from the kill to the
  server back in the router, completions per 10 s before, while it was out and after.
- ``loop``: SIGKILL the same server each time it is back, five times. Printed: the restarts the keeper made, its
  line when it stopped, failed requests.
- ``foreign``: SIGKILL one server, then bind another process's HTTP server on its port once the keeper has taken it
  out of the router. Printed: requests that reached the foreign server (counted there), the keeper's line.
- ``swap``: the fleet's servers on HTTPS with the fleet's own CA (``tls = true``, as ``apply`` writes a routed
  fleet) and no keeper: SIGKILL one server and bind another process's HTTPS server (another CA's certificate) on
  its port at once, before anything noticed. Printed: requests that reached it, failed requests.

The servers are the simulator (``autotune.sim``): their startup, step times and deaths stand for SGLang's only as
far as the simulator is true; the router is the real ``sglang-router``; the keeper is autotune's own.

    python benchmarks/fleet_faults.py                    # all three cases, 64 in flight
    python benchmarks/fleet_faults.py --cases kill --concurrency 48
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rollout_under_load import autotune, buckets, routed_load, setup  # noqa: E402

from autotune.deploy import fleettls, router  # noqa: E402
from autotune.deploy.fleet import Fleet, FleetServer, load_fleet, write_fleet  # noqa: E402
from autotune.deploy.fleetfile import KeeperSection  # noqa: E402
from autotune.deploy.fleetlog import FleetLog  # noqa: E402
from autotune.launch.process import port_is_free  # noqa: E402
from autotune.launch.stopping import wait_until  # noqa: E402

# Backoffs short enough for five deaths in about a minute; every other figure is the fleet file's default.
KEEPER = KeeperSection(backoff_s=[1.0, 2.0, 4.0])


class Foreign:
    """Another process's server: answers everything with 200 and counts the requests it was sent; with ``tls``
    (certificate and key files) it speaks HTTPS with a certificate that is not the fleet's."""

    def __init__(self, port: int, tls: tuple[Path, Path] | None = None):
        counts = self.counts = {"requests": 0}

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                if not self.path.startswith("/health"):
                    counts["requests"] += 1
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def events(path: Path, kind: str, server: str) -> list[dict[str, Any]]:
    return [e for e in FleetLog.of(load_fleet(path)).events() if e["event"] == kind and e.get("server") == server]


def wait_event(path: Path, kind: str, server: str, count: int = 1, timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while len(found := events(path, kind, server)) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"no {kind} event of {server} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return found[count - 1]


def kill(path: Path, name: str) -> tuple[float, float]:
    """SIGKILL the server's group: the times just before and just after."""
    fleet = load_fleet(path)
    pid = int(fleet.resolve(fleet.server(name).pid).read_text().split()[0])
    before = time.time()
    os.killpg(pid, signal.SIGKILL)
    return before, time.time()


def other_certificate(directory: Path, port: int) -> tuple[Path, Path]:
    """A valid certificate for 127.0.0.1 from another CA (another fleet's): HTTPS, but not this fleet's."""
    other = Fleet(
        engine="sim",
        model="qwen3.6-27b",
        path=directory / "other" / "fleet.toml",
        servers=[FleetServer(name="x", gpus=[7], port=port, config="x.yaml", log="x.log", pid="x.pid", tls=True)],
    )
    files = fleettls.server_files(other, other.servers[0])
    return files.cert, files.key


def cut_streams(records: list[dict[str, Any]], kills: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """The failed streams a kill cut: begun before it ended, ended after it began (a stream whose first bytes reached
    the job cannot be retried by the router; every other failure is the fleet's to keep)."""
    return [
        r
        for r in records
        if not r["ok"]
        and r["endpoint"].endswith(" stream")
        and any(r["start"] <= after and r["end"] >= before for before, after in kills)
    ]


def failures(records: list[dict[str, Any]], kills: list[tuple[float, float]]) -> tuple[int, int]:
    """(streams cut by a kill, every other failure)."""
    cut = cut_streams(records, kills)
    return len(cut), sum(not r["ok"] for r in records) - len(cut)


def run_case(base: Path, case: str, args: argparse.Namespace) -> list[str]:
    directory = base / case
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOTUNE_SIM_DEVICE_DIR": str(directory / "devices")}
    path = setup(directory, args.servers, True)
    fleet = load_fleet(path)
    if case == "swap":  # the fleet's own CA, and nothing that would take the dead server out of the router
        fleet = fleet.model_copy(
            update={
                "servers": [s.model_copy(update={"tls": True}) for s in fleet.servers],
                "keeper": KEEPER.model_copy(update={"keep": False}),
            }
        )
    write_fleet(fleet.model_copy(update={"keeper": fleet.keeper if case == "swap" else KEEPER}), path)
    os.environ["AUTOTUNE_SIM_DEVICE_DIR"] = env["AUTOTUNE_SIM_DEVICE_DIR"]
    load = None
    try:
        out = directory / "load.jsonl"
        fleet, load = routed_load(path, env, concurrency=args.concurrency, max_tokens=args.max_tokens, out=out)
        record = router.running(fleet)
        t0 = time.time()
        time.sleep(args.before_s)
        victim = fleet.servers[1]
        lines: list[str] = []
        kills = [kill(path, victim.name)]
        if case == "kill":
            back = wait_event(path, "restarted", victim.name)
            out_s = time.time() - kills[0][1]
            lines.append(f"  back in the router {back['seconds']} s after the kill: {back['line']}")
        elif case == "loop":
            for death in range(2, 6):
                wait_event(path, "exited", victim.name, count=death - 1)
                if events(path, "gave_up", victim.name):
                    break
                wait_event(path, "restarted", victim.name, count=death - 1)
                kills.append(kill(path, victim.name))
            gave_up = wait_event(path, "gave_up", victim.name, timeout_s=60.0)
            out_s = time.time() - kills[0][1]
            lines.append(
                f"  {len(kills)} kills in {kills[-1][1] - kills[0][1]:.0f} s, "
                f"{len(events(path, 'restarted', victim.name))} restarts; the keeper: {gave_up['line']}"
            )
        elif case == "swap":
            if not wait_until(lambda: port_is_free("127.0.0.1", victim.port), 30.0, poll_s=0.01):
                raise SystemExit(f"port {victim.port} still held 30 s after the kill")
            foreign = Foreign(victim.port, tls=other_certificate(directory, victim.port))
            bound_s = time.time() - kills[0][1]
            try:
                time.sleep(args.foreign_s)
                in_router = victim.url in {w.get("url") for w in router.workers(record)} if record else False
                lines.append(
                    f"  the other server bound the port {bound_s:.2f} s after the kill; requests that reached "
                    f"it in {args.foreign_s:.0f} s: {foreign.counts['requests']} (still in the router: "
                    f"{in_router})"
                )
            finally:
                foreign.close()
            out_s = args.foreign_s
        else:
            wait_event(path, "exited", victim.name)
            foreign = Foreign(victim.port)
            try:
                said = wait_event(path, "foreign", victim.name)
                time.sleep(args.foreign_s)
                in_router = victim.url in {w.get("url") for w in router.workers(record)} if record else False
                lines.append(
                    f"  requests that reached the foreign server in {args.foreign_s:.0f} s: "
                    f"{foreign.counts['requests']} (in the router: {in_router}); the keeper: {said['line']}"
                )
            finally:
                foreign.close()
            wait_event(path, "restarted", victim.name)
            out_s = time.time() - kills[0][1]
        time.sleep(args.after_s)
        t1 = time.time()
        load.send_signal(signal.SIGTERM)
        load.wait(timeout=180)
        records = [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
        ends = [r["end"] for r in records if r["ok"]]
        before = buckets(ends, t0 + 10.0, kills[0][1])
        during = buckets(ends, kills[0][1], kills[0][1] + max(out_s, 10.0))
        after = buckets(ends, t1 - args.after_s, t1)
        cut, other = failures(records, kills)
        share = f"{min(during) / mean(before):.2f}" if before and during else "-"
        return [
            f"{case}: {other} failed of {len(records)} requests besides {cut} streams cut by the kill(s)",
            *lines,
            f"  completions per 10 s  before {before}  after the kill {during}  after {after}; lowest after the "
            f"kill {share} of the mean before (target (N-1)/N = {(args.servers - 1) / args.servers:.2f})",
        ]
    finally:
        if load is not None and load.poll() is None:
            load.kill()
        autotune("fleet", "down", "--fleet", str(path), "--grace", "5", env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", choices=["kill", "loop", "foreign", "swap"], default=["kill", "loop", "foreign", "swap"]
    )
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--before-s", type=float, default=30.0)
    parser.add_argument("--after-s", type=float, default=20.0)
    parser.add_argument("--foreign-s", type=float, default=20.0)
    args = parser.parse_args()
    print(
        f"{args.servers} simulated servers (qwen3.6-27b on a simulated B200) behind sglang-router, closed loop of "
        f"{args.concurrency} in flight, {args.max_tokens} tokens each; keeper every {KEEPER.interval_s:g} s, "
        f"backoff {KEEPER.backoff_s} s, at most {KEEPER.crash_limit} deaths in {KEEPER.crash_window_s:g} s; "
        f"host: {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory(prefix="fleet-faults-") as tmp:
        for case in args.cases:
            for line in run_case(Path(tmp), case, args):
                print(line, flush=True)


if __name__ == "__main__":
    main()
