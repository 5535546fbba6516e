"""The sim's command line is SGLang 0.5.23's: same flags, prefixes, errors; plus the --sim-* knobs."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.sim import args


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        args.parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_given_flags_only_and_typed():
    a = args.parse(
        [
            "--model-path",
            "qwen3.6-27b",
            "--tp",
            "2",
            "--speculative-algorithm",
            "NEXTN",
            "--max-mamba-cache-size",
            "200",
            "--mem-fraction-static",
            "0.93",
            "--disable-radix-cache",
            "--cuda-graph-bs-decode",
            "1",
            "2",
            "4",
            "--context-length",
            "32K",
        ]
    )
    assert a.flags == {
        "model_path": "qwen3.6-27b",
        "tp_size": 2,
        "speculative_algorithm": "NEXTN",
        "max_mamba_cache_size": 200,
        "mem_fraction_static": 0.93,
        "disable_radix_cache": True,
        "cuda_graph_bs_decode": [1, 2, 4],
        "context_length": 32768,
    }
    # server_args carries every SGLang default for flags not given.
    assert a.server_args["chunked_prefill_size"] is None and a.server_args["schedule_policy"] == "fcfs"
    assert a.server_args["tp_size"] == 2 and "config" not in a.server_args


def test_aliases_and_boolean_optional():
    a = args.parse(["--model", "m", "--tensor-parallel-size", "4", "--no-enable-tf32-matmul"])
    assert a.flags["tp_size"] == 4 and a.server_args["enable_tf32_matmul"] is False


def test_sim_flags_defaults_and_env(monkeypatch):
    a = args.parse(["--model-path", "m"])
    assert a.sim.gpu == "b200" and a.sim.startup_s == 1.0 and a.sim.acceptance == 0.825
    assert a.sim.release_s == 1.0 and a.sim.shm is None
    assert not any(k.startswith("sim") for k in a.flags)
    monkeypatch.setenv("AUTOTUNE_SIM_GPU", "h200")
    args.build_parser.cache_clear()
    try:
        assert args.parse(["--model-path", "m", "--sim-shm"]).sim == dataclasses.replace(
            a.sim, gpu="h200", shm="/dev/shm"
        )
    finally:
        args.build_parser.cache_clear()


def test_removed_flag_is_unrecognized(capsys):
    err = parse_error(["--model-path", "m", "--mamba-scheduler-strategy", "extra_buffer"], capsys)
    assert "unrecognized arguments: --mamba-scheduler-strategy extra_buffer" in err


def test_renamed_prefix_is_ambiguous(capsys):
    err = parse_error(["--model-path", "m", "--cuda-graph-max-bs", "16"], capsys)
    assert (
        "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"
        in err
    )


def test_bad_choice_and_missing_model(capsys):
    assert "invalid choice" in parse_error(["--model-path", "m", "--mamba-ssm-dtype", "int4"], capsys)
    assert "--model-path" in parse_error(["--tp", "2"], capsys)


def test_yaml_config_is_merged_and_cli_wins(tmp_path):
    cfg = tmp_path / "sglang.yaml"
    cfg.write_text(
        "model-path: qwen3.6-27b\nmax-mamba-cache-size: 80\nenable-metrics: true\ndisable-radix-cache: false\n"
    )
    a = args.parse(["--config", str(cfg), "--max-mamba-cache-size", "200"])
    assert a.flags == {"model_path": "qwen3.6-27b", "max_mamba_cache_size": 200, "enable_metrics": True}


def test_yaml_config_underscore_key_is_rejected(tmp_path, capsys):
    cfg = tmp_path / "sglang.yaml"
    cfg.write_text("model-path: m\nmem_fraction_static: 0.8\n")
    assert "unrecognized arguments: --mem_fraction_static" in parse_error(["--config", str(cfg)], capsys)


@pytest.mark.parametrize(("text", "value"), [("128", 128), ("32k", 32_000), ("32K", 32_768), ("1M", 2**20)])
def test_human_readable_int(text, value):
    assert args.human_readable_int(text) == value
