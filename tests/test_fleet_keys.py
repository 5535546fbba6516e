"""A fleet past loopback runs with keys: ``apply`` writes them (user-only files) for a fleet that binds beyond
127.0.0.1 and refuses what it cannot key; servers and the router read them from their files (never on a command
line); the servers and the router refuse requests without them; autotune's own clients present them. The running
fleet here stays on loopback with ``keys = true`` (tests bind nothing else)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import psutil
import pytest
from test_router import needs_router, routed_fleet, run_cli, stop_all

from autotune import tls
from autotune.deploy import fleetkeys, rollout, router
from autotune.deploy.fleet import load_fleet, server_info, status, write_fleet

GENERATE = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
FAST = rollout.Timing(grace_s=5.0, startup_timeout_s=90.0, release_timeout_s=10.0)


@pytest.fixture(autouse=True)
def sim_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))


def every_file(directory: Path) -> str:
    """The text of every file under ``directory`` but the keys themselves (one that vanished meanwhile, e.g. a
    simulated GPU's record of an exited server, is skipped)."""
    texts = []
    for p in directory.rglob("*"):
        if p.parent.name != "keys" and p.is_file():
            try:
                texts.append(p.read_text(errors="replace"))
            except FileNotFoundError:
                pass
    return "".join(texts)


def test_apply_keys_a_fleet_that_binds_beyond_loopback_and_writes_no_key_elsewhere(tmp_path, monkeypatch):
    from test_apply import BASELINE, WINNER, make_study, result

    url = f"sqlite:///{tmp_path / 'study.db'}"
    make_study(
        url,
        trials=[(result(BASELINE, 2050.0, mrr=16, slots=80), "baseline"), (result(WINNER, 3000.0), "search")],
        confirm=1,
    )
    monkeypatch.setattr(router, "installed", lambda: True)
    out = tmp_path / "deploy"
    printed = run_cli("apply", "--storage", url, "--out", str(out), "--gpus", "0-1", "--host", "0.0.0.0")
    fleet = load_fleet(out / "fleet.toml")
    assert fleet.keys
    keys = out / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.iterdir())
    api = (keys / "api.key").read_text().strip()
    admin = (keys / "admin.key").read_text().strip()
    assert len(api) >= 40 and api != admin
    for text in (printed, every_file(out)):  # the script, fleet.toml, client.json, provenance.json, sglang.yaml
        assert api not in text and admin not in text
    client = json.loads((out / "client.json").read_text())
    assert client["api_key_file"] == "keys/api.key"
    assert "send Authorization: Bearer <the text of keys/api.key>" in printed
    script = (out / "launch_fleet.sh").read_text()
    assert script.count("secretargv.py --api-key=@keys/api.key -- -m autotune.sim") == 2
    assert "--api-key=@keys/api.key --control-plane-api-keys=@keys/router-admin.arg -- -m sglang_router" in script
    assert "\numask 077 " in script  # the logs it makes hold SGLang's arguments, the key among them


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_keyed_fleet_refuses_requests_without_its_keys_and_autotune_presents_them(tmp_path):
    path = routed_fleet(tmp_path, n=2)
    write_fleet(load_fleet(path).model_copy(update={"keys": True}), path)
    try:
        out = run_cli("fleet", "up", "--no-keeper", "--fleet", str(path), "--timeout", "60")
        assert "started: s0, s1" in out
        fleet = load_fleet(path)
        api = fleetkeys.api_file(fleet).read_text().strip()
        admin = fleetkeys.admin_file(fleet).read_text().strip()
        record = router.running(fleet)
        assert record is not None
        for s in fleet.servers:  # nobody reads a key off a command line
            cmdline = " ".join(psutil.Process(int(fleet.resolve(s.pid).read_text().split()[0])).cmdline())
            assert "--api-key=@" in cmdline
            assert api not in cmdline
        router_line = " ".join(psutil.Process(record.pid).cmdline())  # it renames itself: its title, padded
        assert api not in router_line and admin not in router_line
        assert "--control-plane-api-keys=@" in " ".join(record.argv) and admin not in " ".join(record.argv)
        for s in fleet.servers:
            log = fleet.resolve(s.log)
            assert stat.S_IMODE(log.stat().st_mode) == 0o600  # SGLang logs its arguments, the key among them
        s0 = fleet.servers[0].url
        plain = httpx.Client(timeout=10, trust_env=False)  # a client without the keys
        assert plain.get(f"{s0}/health").status_code == 200  # probes and Prometheus need none
        assert plain.post(f"{s0}/generate", json=GENERATE).status_code == 401
        assert plain.get(f"{s0}/server_info").status_code == 401
        assert plain.post(f"{record.url}/generate", json=GENERATE).status_code == 401
        assert plain.get(f"{record.url}/workers").status_code == 401
        bearer = {"Authorization": f"Bearer {api}"}
        assert plain.post(f"{record.url}/generate", json=GENERATE, headers=bearer).status_code == 200
        assert (
            plain.post(f"{record.url}/workers", json={"url": "http://127.0.0.1:9"}, headers=bearer).status_code == 401
        )  # the job's key is not the router's admin key
        # autotune's own clients present the keys: the router's workers, each server's /server_info, a rollout
        assert {w["url"] for w in router.workers(record)} == {s.url for s in fleet.servers}
        rows = status(fleet)
        assert all(r.healthy and r.capacity is not None for r in rows)
        info = httpx.get(f"{s0}/server_info", timeout=10, **tls.secured()).json()
        assert info["api_key"] == api  # SGLang echoes it: what autotune reads of a server is scrubbed
        assert server_info(fleet.servers[0])["api_key"] == "***"
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"Item {i} of a list."}) + "\n" for i in range(8)))
        canary = rollout.Canary(
            prompts=str(prompts), sample_size=8, concurrency=4, max_tokens=16, warmup_s=0.3, measure_s=1.0
        )  # its replay and /server_info reads carry the key
        report = rollout.start(
            path,
            {**fleet_config(path), "max_mamba_cache_size": 100},
            expect=rollout.Expectation(tok_s=1.0, tok_s_tolerance=0.99),
            canary=canary,
            timing=FAST,
        )
        assert report.verified == ["s0", "s1"] and report.failed is None
        assert all(r.healthy for r in status(load_fleet(path)))
        plain.close()
    finally:
        stop_all(path)
    # every log, record and file the fleet wrote (the servers print their arguments, the key among them: as ***)
    written = every_file(path.parent)
    assert api not in written and admin not in written
    assert "'api_key': '***'" in fleet.resolve(fleet.servers[0].log).read_text()


def fleet_config(path: Path) -> dict:
    from autotune.deploy.sglang_yaml import read_config_file

    fleet = load_fleet(path)
    return read_config_file(fleet.resolve(fleet.servers[0].config))


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_keeper_restarts_a_server_of_a_keyed_fleet_on_https(tmp_path):
    """The keeper is its own process: it reads the CA and the keys from the fleet file like any other client."""
    from test_keeper import FAST, kill, listed, wait_event

    path = routed_fleet(tmp_path, n=2)
    fleet = load_fleet(path)
    servers = [s.model_copy(update={"tls": True}) for s in fleet.servers]
    write_fleet(fleet.model_copy(update={"keeper": FAST, "keys": True, "servers": servers}), path)
    try:
        assert "keeper: pid" in run_cli("fleet", "up", "--fleet", str(path), "--timeout", "60")
        record = router.running(load_fleet(path))
        assert record is not None
        kill(path, "s1")
        wait_event(path, "exited", "s1")
        back = wait_event(path, "restarted", "s1")
        assert "back in the router" in back["line"] and load_fleet(path).server("s1").url in listed(record)
        assert [r.state for r in status(load_fleet(path))] == ["healthy", "healthy"]
    finally:
        stop_all(path)


def test_servers_starting_together_make_one_set_of_keys(tmp_path, monkeypatch):
    """``fleet up`` starts servers in parallel, each asking for the keys: one writer makes them, the others read."""
    import secrets
    import time
    from concurrent.futures import ThreadPoolExecutor

    token = secrets.token_urlsafe

    def slow_token(n: int) -> str:  # a key that takes a while to make: every starter arrives before it exists
        time.sleep(0.05)
        return token(n)

    monkeypatch.setattr(fleetkeys.secrets, "token_urlsafe", slow_token)
    path = routed_fleet(tmp_path, n=2)
    fleet = load_fleet(path).model_copy(update={"keys": True})
    with ThreadPoolExecutor(max_workers=8) as pool:
        argvs = list(pool.map(lambda _: fleetkeys.server_argv(fleet, ["python", "-m", "autotune.sim"]), range(8)))
    assert all(argv == argvs[0] for argv in argvs)
    api = fleetkeys.api_file(fleet).read_text()
    assert len(api.strip()) >= 40 and fleetkeys.admin_arg_file(fleet).read_text().strip().endswith(
        fleetkeys.admin_file(fleet).read_text().strip()
    )


def test_a_value_that_begins_with_a_dash_reaches_the_module_as_the_flags_value(tmp_path):
    """A key is one ``--flag=VALUE`` token: read as ``--flag VALUE``, a key that began with "-" (a bare
    ``token_urlsafe`` does one time in 64) was taken for a flag and the server refused to start."""
    import subprocess
    import sys

    (tmp_path / "echo_key.py").write_text(
        "import argparse\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--api-key')\n"
        "p.add_argument('--port')\n"
        "a = p.parse_args()\n"
        "print(len(a.api_key), a.api_key == open('key').read().strip(), a.port)\n"
    )
    (tmp_path / "key").write_text("-Xq_3-dash-first\n")
    script = Path(fleetkeys.__file__).with_name("secretargv.py")
    done = subprocess.run(
        [sys.executable, str(script), "--api-key=@key", "--", "-m", "echo_key", "--port", "30000"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["16", "True", "30000"]


def test_new_keys_never_begin_with_a_dash(tmp_path, monkeypatch):
    monkeypatch.setattr(fleetkeys.secrets, "token_urlsafe", lambda n: "-" + "a" * 42)
    fleet = load_fleet(routed_fleet(tmp_path, n=2)).model_copy(update={"keys": True})
    fleetkeys.ensure(fleet)
    assert not fleetkeys.api_file(fleet).read_text().startswith("-")
    assert not fleetkeys.admin_file(fleet).read_text().startswith("-")
