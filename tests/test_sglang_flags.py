"""The sglang engine's flag table read from the installed SGLang's own argparse actions (a fake SGLang here),
its cache, the bundled fallback and its warning, and typed configs all the way into a stored trial."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from fakesglang import SUPPRESSED, bundled_rows, make_fake_sglang

from autotune.errors import ConfigError
from autotune.harness.engines import SGLangEngine
from autotune.harness.engines.sglang import _cache_dir, parse_dump
from autotune.sglang.flags import ROW_KEYS, FlagTable

# The --help text parse this replaces got each of these wrong: values were strings, the dest came from the
# first long option (--fp8-gemm-backend → fp8_gemm_backend) and suppressed flags were missing.
TYPED = {
    "mem_fraction_static": ("0.05", 0.05),
    "max_running_requests": ("48", 48),
    "max_total_tokens": ("32k", 32_000),
    "fp8_gemm_runner_backend": ("triton", "triton"),
    "cuda_graph_bs_decode": ("1,2,4", [1, 2, 4]),
    "enable_tf32_matmul": ("false", False),
    "disable_radix_cache": ("true", True),
    "disable_cuda_graph": ("true", True),  # deprecated and hidden from --help, still a flag
}


@pytest.fixture
def fake(tmp_path):
    return make_fake_sglang(tmp_path / "fake")


def engine_for(fake, tmp_path, **kw) -> SGLangEngine:
    return SGLangEngine(model_path="/m", python=str(fake.python), cache_dir=tmp_path / "cache", **kw)


def test_dump_agrees_exactly_with_the_bundled_table(fake, tmp_path):
    rows = engine_for(fake, tmp_path).dump_flags()
    assert [{k: row[k] for k in ROW_KEYS} for row in rows] == bundled_rows()  # same rows, same order
    dumped, bundled = FlagTable.from_json(rows, version="0.5.23"), FlagTable.bundled()
    assert dumped.specs == bundled.specs
    assert dumped.dests == bundled.dests
    # and what only a dump of the parser knows
    kinds = {row["dest"]: row["action"] for row in rows}
    assert kinds["help"] == "help" and kinds["disable_radix_cache"] == "store_true"
    assert kinds["enable_tf32_matmul"] == "boolean_optional" and kinds["mem_fraction_static"] == "store"
    assert {row["dest"] for row in rows if row["help_suppressed"]} == set(SUPPRESSED)


def test_installed_table_keeps_types_dests_and_suppressed_flags(fake, tmp_path, caplog):
    eng = engine_for(fake, tmp_path)
    with caplog.at_level(logging.WARNING):
        checked = eng.check({dest: raw for dest, (raw, _) in TYPED.items()})
    assert checked == {dest: value for dest, (_, value) in TYPED.items()}
    assert all(type(checked[dest]) is type(value) for dest, (_, value) in TYPED.items())
    assert eng.table_warning is None and not caplog.records  # no fallback
    table = eng.flag_table()
    assert table is not FlagTable.bundled() and table.version == "0.5.23"
    assert table.lookup("--fp8-gemm-backend").dest == "fp8_gemm_runner_backend"
    assert table.lookup("disable_cuda_graph").suppressed and not table.lookup("disable_radix_cache").suppressed
    argv = eng.argv(checked, port=1)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.05"
    assert argv[argv.index("--fp8-gemm-backend") + 1] == "triton"
    assert "--no-enable-tf32-matmul" in argv and "--disable-cuda-graph" in argv


def test_a_flag_the_installed_sglang_lacks_is_rejected(tmp_path):
    rows = [r for r in bundled_rows() if r["dest"] != "max_mamba_cache_size"]
    fake = make_fake_sglang(tmp_path / "fake", version="0.6.0", rows=rows)
    eng = engine_for(fake, tmp_path)
    with pytest.raises(ConfigError, match="not a flag of sglang 0.6.0"):
        eng.check({"max_mamba_cache_size": 200})


def test_the_dump_runs_once_per_interpreter_and_version(fake, tmp_path):
    eng = engine_for(fake, tmp_path)
    eng.check({"max_running_requests": "8"})
    eng.check({"max_running_requests": "9"})
    assert fake.dumps() == 1
    cached = json.loads(eng.cache_path().read_text())
    assert cached["version"] == "0.5.23" and cached["schema"] == 2 and len(cached["rows"]) == 532
    again = engine_for(fake, tmp_path)
    assert again.check({"max_running_requests": "8"}) == {"max_running_requests": 8}
    assert fake.dumps() == 1  # the second engine read the cache
    # the same interpreter with another SGLang version dumps again, into its own file
    dist = next(fake.root.glob("sglang-*.dist-info"))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n")
    newer = engine_for(fake, tmp_path)
    assert newer.flag_table().version == "0.5.24"
    assert fake.dumps() == 2
    assert newer.cache_path() != eng.cache_path()
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def test_a_cache_from_the_help_text_parser_is_rebuilt(fake, tmp_path):
    eng = engine_for(fake, tmp_path)
    path = eng.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([{"flags": ["--mem-fraction-static"], "dest": "mem_fraction_static", "type": None}]))
    assert eng.check({"mem_fraction_static": "0.5"}) == {"mem_fraction_static": 0.5}
    assert fake.dumps() == 1
    assert json.loads(path.read_text())["schema"] == 2


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOTUNE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache_dir() == tmp_path / "xdg" / "autotune" / "sglang-flags"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _cache_dir() == tmp_path / "home" / ".cache" / "autotune" / "sglang-flags"
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "mine"))
    assert _cache_dir() == tmp_path / "mine" / "sglang-flags"


def test_a_failed_dump_falls_back_to_the_bundled_table_with_a_warning(tmp_path, caplog):
    broken = "raise ImportError('No module named torch')\n"
    fake = make_fake_sglang(tmp_path / "fake", version="0.6.0", server_args=broken)
    eng = engine_for(fake, tmp_path)
    with caplog.at_level(logging.WARNING, logger="autotune.harness.engines.sglang"):
        assert eng.check({"mem_fraction_static": "0.05"}) == {"mem_fraction_static": 0.05}
    assert eng.flag_table() is FlagTable.bundled()
    assert "bundled sglang 0.5.23 table" in eng.table_warning and "No module named torch" in eng.table_warning
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert eng.table_warning in caplog.text
    # the check's own output says which table judged the config
    with pytest.raises(ConfigError, match="bundled sglang 0.5.23 table") as err:
        eng.check({"mamba_scheduler_strategy": "auto"})
    assert err.value.key == "mamba_scheduler_strategy" and "--mamba-radix-cache-strategy" in str(err.value)
    e = err.value
    assert str(e) == f"{e.key}: {e.message} ({e.fix}) [note: {eng.table_warning}]" and "note" not in e.message
    moved = str(e.at(file="s.toml", key="engine.fixed"))  # anchored elsewhere: message, fix and note once each
    assert moved == f"s.toml: engine.fixed: {e.message} ({e.fix}) [note: {eng.table_warning}]"
    assert not list((tmp_path / "cache").glob("*.json"))  # a failure is not cached: the next engine retries


def test_missing_sglang_falls_back_with_a_warning(tmp_path, caplog):
    eng = SGLangEngine(model_path="/m", python=sys.executable, cache_dir=tmp_path)
    if eng.sglang_version() is not None:
        pytest.skip("sglang is installed here")
    with caplog.at_level(logging.WARNING):
        assert eng.flag_table() is FlagTable.bundled()
    assert "sglang is not importable" in eng.table_warning and eng.table_warning in caplog.text


def test_parse_dump_finds_the_marked_line_among_other_output():
    out = 'INFO noise\nAUTOTUNE-SGLANG-FLAGS [{"flags": ["--x"], "dest": "x"}]\n'
    assert parse_dump(out) == [{"flags": ["--x"], "dest": "x"}]
    for bad in ("nothing here\n", "AUTOTUNE-SGLANG-FLAGS {}\n", "AUTOTUNE-SGLANG-FLAGS [1]\n"):
        with pytest.raises(ValueError):
            parse_dump(bad)


LAUNCH_SERVER = """import os, sys
print("fake launch_server argv:", " ".join(sys.argv[1:]))
print("CUDA_DEVICE_ORDER=" + os.environ.get("CUDA_DEVICE_ORDER", "unset"))
sys.exit(3)
"""


@pytest.mark.timeout(60)
def test_a_trial_stores_the_config_typed_and_a_cpu_server_gets_no_cuda_variables(fake, tmp_path):
    from autotune.config import Timeouts
    from autotune.harness.setup import TrialSetup
    from autotune.harness.trial import run_trial
    from autotune.harness.workload import PromptSample, WorkloadSpec
    from autotune.results import TrialResult

    (fake.root / "sglang" / "launch_server.py").write_text(LAUNCH_SERVER)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    workload = WorkloadSpec(prompts=prompts, sample_size=4, warmup_s=0.1, measure_s=0.1)
    eng = engine_for(fake, tmp_path, device="cpu")
    setup = TrialSetup(
        engine=eng,
        workload=workload,
        gpu_index=None,
        run_dir=tmp_path / "runs",
        sample=PromptSample.load(prompts, 4, 0),
        timeouts=Timeouts(startup_s=20, teardown_s=5, grace_s=1),
    )
    result = run_trial(
        setup,
        {"mem-fraction-static": "0.05", "fp8_gemm_runner_backend": "triton", "max_running_requests": "8"},
        trial_dir=tmp_path / "trial",
    )
    assert result.status == "crash" and result.exit_code == 3
    stored = json.loads((tmp_path / "trial" / "result.json").read_text())
    expected = {"mem_fraction_static": 0.05, "fp8_gemm_runner_backend": "triton", "max_running_requests": 8}
    assert stored["config"] == expected and TrialResult.from_dict(stored).config == expected
    log = Path(result.log_path).read_text()
    assert "--mem-fraction-static 0.05 --fp8-gemm-backend triton --max-running-requests 8" in log
    assert "CUDA_DEVICE_ORDER=unset" in log  # no GPUs: the local launcher sets no CUDA variable at all
