"""An engine that exists only in the tests (``relabelled_engine``), registered the documented way
(``harness.engines.register``): the engine contract suite, then sweep → report → apply → fleet with it. Nothing in
the package names it; every question the code asks of an engine's kind goes to its class's traits."""

from __future__ import annotations

import json
import tomllib

import httpx
import pytest
import yaml
from inprocess import run_cli
from relabelled_engine import RelabelledEngine
from test_engines import (  # noqa: F401 - the contract suite's engine tests, collected here on this engine
    meets_the_contract,
    test_argv_is_a_list_with_harness_flags,
    test_check_rejects_renamed_flag_with_did_you_mean,
    test_engine_env_is_its_own_extras_and_no_device_selection,
)
from tinystudy import write_tiny_study

from autotune.config.sections import ENGINE_KINDS, EngineKind
from autotune.harness.engines import ENGINES, Engine, make_engine, register
from autotune.harness.engines.base import Predictor


@pytest.fixture
def registered(monkeypatch):
    # monkeypatch forgets both entries after the test; ``register`` is what makes them
    monkeypatch.setitem(ENGINES, "relabelled", RelabelledEngine)
    monkeypatch.setitem(ENGINE_KINDS, "relabelled", EngineKind("relabelled", simulated=True))
    register(RelabelledEngine)
    return "relabelled"


@pytest.fixture
def engine(registered, tmp_path, monkeypatch) -> Engine:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    return make_engine(registered, model_path="qwen3.6-27b")


def test_it_meets_the_contract_and_offers_no_prediction(engine):
    meets_the_contract("relabelled")
    assert ENGINE_KINDS["relabelled"].simulated and not isinstance(engine, Predictor)
    assert engine.argv({}, port=1)[1:4] == ["-m", "autotune", "sim"]


def test_its_stored_studies_and_study_files_are_read_as_a_simulated_engines(registered):
    """What the views ask of a stored study's engine goes to its kind's traits, not to the name "sim"."""
    from autotune.config.sections import EngineSection
    from autotune.search.views.settings import device_name, simulated

    stored = {"engine": {"kind": "relabelled", "sim_gpu": "h200"}}
    assert simulated(stored) and device_name(stored) == "h200"
    assert not simulated({"engine": {"kind": "gone"}})  # an engine this process does not know: not a model
    real = {"engine": {"kind": "sglang", "sim_gpu": "h200"}}
    assert not simulated(real) and device_name(real) == "GPU (planner profile h200)"
    assert EngineSection(kind="relabelled", model="qwen3.6-27b").sim_gpu == "b200"  # a simulated kind's default


@pytest.mark.slow
def test_sweep_report_apply_and_fleet_run_it(registered, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.chdir(tmp_path)
    study = write_tiny_study(tmp_path, name="third", trials=2, top_k=0)
    study.write_text(study.read_text().replace('kind = "sim"', 'kind = "relabelled"', 1))

    swept = run_cli(capsys, "sweep", "--config", str(study), "--json")
    assert swept.returncode == 0, swept.stdout[-2000:] + swept.stderr[-2000:]
    assert json.loads(swept.stdout)["best"]["output_tok_s"] > 0
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "third" / "trials").glob("*/result.json"))]
    assert results and {r["engine"] for r in results} == {"relabelled"}
    assert any(r["status"] == "ok" for r in results)

    reported = run_cli(capsys, "report", "--config", str(study), "--out", str(tmp_path / "report.html"))
    assert reported.returncode == 0, reported.stderr[-2000:]
    assert "relabelled" in (tmp_path / "report.html").read_text()

    out = tmp_path / "deploy"
    applied = run_cli(capsys, "apply", "--config", str(study), "--out", str(out), "--gpus", "0", "--allow-unstressed")
    assert applied.returncode == 0, applied.stdout[-2000:] + applied.stderr[-2000:]
    fleet = tomllib.loads((out / "fleet.toml").read_text())
    assert fleet["engine"] == "relabelled" and fleet["sim_gpu"] == "b200"
    assert "-m autotune sim --config sglang.yaml --model-path" in (out / "launch_fleet.sh").read_text()

    fleet_file = str(out / "fleet.toml")
    try:  # the keeper is a process of its own, where this test's registration does not reach
        up = run_cli(capsys, "fleet", "up", "--fleet", fleet_file, "--timeout", "60", "--no-keeper")
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        server = fleet["servers"][0]
        info = httpx.get(f"http://127.0.0.1:{server['port']}/server_info", timeout=5).json()
        deployed = yaml.safe_load((out / "sglang.yaml").read_text())
        assert info["max_mamba_cache_size"] == deployed["max-mamba-cache-size"]  # the winner's config
        status = run_cli(capsys, "fleet", "status", "--fleet", fleet_file)
        assert status.returncode == 0 and "healthy" in status.stdout, status.stdout
    finally:
        down = run_cli(capsys, "fleet", "down", "--fleet", fleet_file, "--grace", "5")
    assert down.returncode == 0, down.stdout + down.stderr
