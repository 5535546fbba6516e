"""Study files: the shipped ones load; every kind of mistake is one ConfigError naming file, key and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.config import load_config
from autotune.config.pool import study_spans
from autotune.errors import ConfigError, WorkloadError

REPO = Path(__file__).resolve().parents[1]

GOOD = """
[study]
name = "demo"
trials = 4

[engine]
kind = "sim"
model = "qwen3.6-27b"

[engine.fixed]
speculative_algorithm = "EAGLE"

[space]
max_mamba_cache_size = { type = "int", low = 64, high = 512, step = 64 }
mem_fraction_static = { type = "float", low = 0.8, high = 0.94 }
mamba_ssm_dtype = { choices = ["unset", "bfloat16"] }

[workload]
prompts = "prompts.jsonl"

[baseline]
flags = { max_mamba_cache_size = 80 }
"""


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "name", ["example.toml", "qwen3.6-27b-b200.toml", "qwen3.6-27b-h200.toml", "qwen3-next-80b-a3b-h200.toml"]
)
def test_shipped_studies_load(name):
    cfg = load_config(REPO / "studies" / name)
    assert cfg.study.trials >= 1 and cfg.space
    assert cfg.workload.prompts.is_file()
    assert cfg.storage_url == f"sqlite:///{REPO / 'studies' / cfg.name}.db"
    assert cfg.derived["speculative_num_draft_tokens"] == "speculative_num_steps + 1"
    assert cfg.baseline.flags["max_mamba_cache_size"] == 80
    assert cfg.enqueue[0].flags["max_mamba_cache_size"] == 200
    if "80b" in name:  # the 80B model's weights need two H200s: every server spans a pair
        assert cfg.engine.fixed["tp_size"] == 2 and study_spans(cfg) == [2]


def test_defaults_and_relative_paths_resolve_against_the_toml(tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.name == "demo"
    assert cfg.storage_url == f"sqlite:///{tmp_path / 'demo.db'}"
    assert cfg.work_dir == tmp_path / "demo"
    assert cfg.workload.prompts == tmp_path / "prompts.jsonl"
    assert cfg.space["mamba_ssm_dtype"].choice_values == [None, "bfloat16"]
    rel = load_config(write(tmp_path, GOOD.replace('name = "demo"', 'name = "demo"\nstorage = "sqlite:///db/x.db"')))
    assert rel.storage_url == f"sqlite:///{tmp_path / 'db' / 'x.db'}"


def test_cli_overrides(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), name="other", trials=9, engine="sglang")
    assert (cfg.name, cfg.study.trials, cfg.engine.kind) == ("other", 9, "sglang")
    assert cfg.storage_url.endswith("/other.db")


def test_flag_spellings_normalise_to_dest(tmp_path):
    text = GOOD.replace(
        'speculative_algorithm = "EAGLE"', '"--speculative-algorithm" = "EAGLE"\n"mem-fraction-static" = "0.9"'
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.engine.fixed == {"speculative_algorithm": "EAGLE", "mem_fraction_static": 0.9}


@pytest.mark.parametrize(
    ("edit", "key", "words"),
    [
        (("[study]", "[study]\nbogus = 1"), "study.bogus", "unknown key"),
        (("trials = 4", 'trials = "many"'), "study.trials", "integer"),
        (("low = 64, high = 512", "low = 512, high = 64"), "space.max_mamba_cache_size", "empty range"),
        (('kind = "sim"', 'kind = "vllm"'), "engine.kind", "sim"),
        (("[baseline]", "[baseline]\nnope = 2"), "baseline.nope", "unknown key"),
        (("[baseline]", "[launcher.slurm]\nqueue = 'gpu'\n\n[baseline]"), "launcher.slurm.queue", "unknown key"),
        (("[baseline]", "[launcher.container]\nipc = 'shared'\n\n[baseline]"), "launcher.container.ipc", "host"),
        (
            ('speculative_algorithm = "EAGLE"', 'mamba_scheduler_strategy = "extra_buffer"'),
            "engine.fixed",
            "--mamba-radix-cache-strategy",
        ),
    ],
)
def test_bad_study_is_one_clear_error(tmp_path, edit, key, words):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "\n" not in text
    assert str(path) in text and key in text and words in text
    assert info.value.fix


def test_unknown_engine_kind_names_the_registered_ones(tmp_path):
    path = write(tmp_path, GOOD.replace('kind = "sim"', 'kind = "vllm"'))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: engine.kind: unknown engine 'vllm' (use one of: sglang, sim)"
    assert (info.value.key, info.value.fix) == ("engine.kind", "use one of: sglang, sim")
    with pytest.raises(ConfigError, match="engine.kind: unknown engine 'tgi'"):
        load_config(write(tmp_path, GOOD), engine="tgi")  # the CLI override is checked the same way


@pytest.mark.parametrize(
    ("edit", "text"),
    [
        (
            ("max_mamba_cache_size = {", "max_mamba_cache_sise = {"),
            "space.max_mamba_cache_sise: --max-mamba-cache-sise is not a flag of sglang 0.5.23 "
            "(did you mean --max-mamba-cache-size?)",
        ),
        (
            ('speculative_algorithm = "EAGLE"', 'mamba_scheduler_strategy = "extra_buffer"'),
            "engine.fixed.mamba_scheduler_strategy: --mamba-scheduler-strategy is not a flag of sglang 0.5.23 "
            "(it was renamed or removed; use --mamba-radix-cache-strategy)",
        ),
        (
            ("max_mamba_cache_size = 80 }", 'max_mamba_cache_size = "lots" }'),
            "baseline.flags.max_mamba_cache_size: --max-mamba-cache-size expects an integer, got 'lots'",
        ),
        (
            ('model = "qwen3.6-27b"', 'model = "qwen3.6-27b"\nsim_gpu = "t4"'),
            "engine.sim_gpu: unknown GPU 't4' (use one of b200, b300, gb200, h200, h100, h20, a100-80g, l40s, "
            "rtx-pro-6000, mi300x)",
        ),
        (
            ("low = 64, high = 512", "low = 512, high = 64"),
            "space.max_mamba_cache_size: empty range: low (512) must be below high (64) (see the study file reference)",
        ),
    ],
)
def test_errors_from_other_modules_are_anchored_at_the_study_key(tmp_path, edit, text):
    """The flag table's and profiles' errors, re-anchored at the study file's key from their fields: the text is
    the file, the key, the other module's own message and fix, once each."""
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {text}"


def test_a_config_error_moves_by_its_fields_not_its_text():
    err = WorkloadError("ends like a fix (f)", file="a.toml", key="k", fix="f", note="bundled table")
    assert str(err) == "a.toml: k: ends like a fix (f) (f) [note: bundled table]"
    moved = err.at(file="b.toml", key="workload.k")
    assert type(moved) is WorkloadError
    assert str(moved) == "b.toml: workload.k: ends like a fix (f) (f) [note: bundled table]"
    assert (moved.message, moved.fix, moved.note) == ("ends like a fix (f)", "f", "bundled table")
    assert str(ConfigError("bare").at(file=None, key="x")) == "x: bare"


def test_unknown_flag_in_space_gets_did_you_mean(tmp_path):
    path = write(tmp_path, GOOD.replace("max_mamba_cache_size = {", "max_mamba_cache_sise = {"))
    with pytest.raises(ConfigError, match="did you mean --max-mamba-cache-size") as info:
        load_config(path)
    assert "space.max_mamba_cache_sise" in str(info.value)


def test_bad_choice_value_names_the_param(tmp_path):
    path = write(tmp_path, GOOD.replace('["unset", "bfloat16"]', '["unset", "bfloat8"]'))
    with pytest.raises(ConfigError, match="space.mamba_ssm_dtype"):
        load_config(path)


def test_unreadable_prompts(tmp_path):
    path = write(tmp_path, GOOD.replace('prompts = "prompts.jsonl"', 'prompts = "missing.jsonl"'))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "workload.prompts" in str(info.value) and str(path) in str(info.value)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    path = write(tmp_path, GOOD.replace('prompts = "prompts.jsonl"', 'prompts = "bad.jsonl"'))
    with pytest.raises(ConfigError, match="not valid JSON") as info:  # the prompt file's own line, not the TOML's key
        load_config(path)
    assert str(info.value).startswith(f"{tmp_path / 'bad.jsonl'}:1: ")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[study\n"))


def test_bad_constraint_and_metric(tmp_path):
    with pytest.raises(ConfigError, match="objective.constraints"):
        load_config(write(tmp_path, GOOD + '\n[objective]\nconstraints = ["p99_ttft <= 5"]\n'))
    with pytest.raises(ConfigError, match="objective.second.metric"):
        load_config(write(tmp_path, GOOD + '\n[objective]\nsecond = { metric = "joy" }\n'))


def test_sampler_needing_a_missing_package_says_how_to_install(tmp_path):
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install torch"):
            load_config(write(tmp_path, GOOD.replace("trials = 4", 'trials = 4\nsampler = "gp"')))
    else:
        assert load_config(write(tmp_path, GOOD.replace("trials = 4", 'trials = 4\nsampler = "gp"')))


def test_unknown_timeout_and_model(tmp_path):
    with pytest.raises(ConfigError, match="engine.timeouts.boot_s"):
        load_config(write(tmp_path, GOOD.replace('kind = "sim"', 'kind = "sim"\ntimeouts = { boot_s = 3 }')))
    with pytest.raises(ConfigError, match="engine.model"):
        load_config(write(tmp_path, GOOD.replace('model = "qwen3.6-27b"', 'model = "gpt-9"')))


def test_launcher_tables_reach_the_launcher_the_engine_section_names(tmp_path):
    from autotune.launch.registry import make_launcher

    text = GOOD.replace('model = "qwen3.6-27b"', 'model = "qwen3.6-27b"\nlauncher = "slurm"').replace(
        "[baseline]",
        (
            "[launcher.slurm]\npartition = 'h200'\ntime = '02:00:00'\nextra_args = ['--constraint=nvlink']\n\n"
            "[launcher.container]\nruntime = 'podman'\n\n[baseline]"
        ),
    )
    cfg = load_config(write(tmp_path, text))
    slurm = make_launcher(cfg.engine.launcher, cfg.launcher.settings(cfg.engine.launcher))
    assert slurm.name == "slurm" and slurm.settings.partition == "h200" and slurm.settings.time == "02:00:00"
    assert slurm.settings.account is None and slurm.settings.extra_args == ("--constraint=nvlink",)
    container = make_launcher("container", cfg.launcher.settings("container"))
    assert container.runtime == "podman" and container.shm_size == "32g"  # what the table leaves out: defaults
    assert cfg.launcher.settings("local") == {} and make_launcher("local", {}).name == "local"


def test_the_ssh_launcher_takes_its_host_from_the_study_and_refuses_a_study_without_one(tmp_path):
    from autotune.launch.registry import make_launcher

    text = GOOD.replace('model = "qwen3.6-27b"', 'model = "qwen3.6-27b"\nlauncher = "ssh"')
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert "launcher.ssh.host" in str(info.value) and "user@name:port" in str(info.value)
    cfg = load_config(
        write(tmp_path, text.replace("[baseline]", "[launcher.ssh]\nhost = 'ops@gpu-box:2222'\n\n[baseline]"))
    )
    ssh = make_launcher(cfg.engine.launcher, cfg.launcher.settings("ssh"))
    assert ssh.name == "ssh" and ssh.host == "ops@gpu-box:2222" and ssh.host_name == "gpu-box"
    assert ssh.remote_dir == "autotune-fleet"
