"""Model and GPU profiles: bundled figures (docs/sglang-memory.md), HF config.json loading, and its errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.errors import AutotuneError, ProfileError
from autotune.sglang.profiles import GIB, MIB, load_gpu, load_model, vit_factor

CONFIGS = Path(__file__).parent / "data" / "configs"


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen3.6-27b")


def test_qwen36_layers_and_state_sizes(qwen):
    assert (qwen.num_layers, qwen.full_layers, qwen.linear_layers) == (64, 16, 48)
    assert qwen.mamba_slot_bytes() == 153_944_064  # srt/configs/mamba_utils.py: ≈146.8 MiB per slot at TP1
    assert qwen.mamba_slot_bytes(ssm_dtype="bfloat16") / MIB == pytest.approx(74.8, abs=0.05)
    assert qwen.mamba_slot_bytes(tp=2) == qwen.mamba_slot_bytes() // 2
    assert qwen.mamba_conv_bytes() == 48 * 10240 * 3 * 2
    assert qwen.mamba_ssm_bytes() == 48 * 48 * 128 * 128 * 4


def test_qwen36_kv_cell_c6(qwen):
    assert qwen.kv_cell_bytes() == 64 * 1024  # C6
    assert qwen.kv_cell_bytes(with_draft=True) == 68 * 1024
    assert qwen.draft_kv_cell_bytes == 4 * 1024
    assert qwen.kv_cell_bytes(kv_dtype="fp8_e4m3") == 32 * 1024
    assert qwen.kv_cell_bytes(tp=2) == 32 * 1024
    assert qwen.kv_cell_bytes(tp=8) == 16 * 1024  # 4 kv heads: replicated beyond tp 4, one head per rank


def test_qwen36_weights_speed_figures_and_vlm(qwen):
    assert (qwen.target_weights_gib, qwen.draft_weights_gib) == (51.05, 5.53)
    assert qwen.weights_gib(with_draft=True) == pytest.approx(56.58)
    assert qwen.weights_gib(with_draft=False, tp=2) == pytest.approx(25.525)
    assert qwen.streamed_weight_bytes == pytest.approx(51.25e9)
    assert qwen.flops_per_token == pytest.approx(52e9)
    assert qwen.multimodal and qwen.mtp_layers == 1 and qwen.context_len == 262144
    assert vit_factor(qwen) == pytest.approx(0.925, abs=0.001)  # srt/arg_groups/memory_hook.py
    assert qwen.spec_defaults == (3, 1, 4)


def test_activation_model_is_well_below_sglangs_reserve(qwen):
    peak = qwen.activation_bytes(16384) / GIB
    assert 6.0 < peak < 24.0 * 0.5  # SGLang reserves 1.5 MiB/token = 24 GiB; the real peak is a fraction
    assert qwen.activation_bytes(8192, tp=2) < qwen.activation_bytes(8192)


def test_hf_qwen3_5_nested_text_config_matches_the_bundled_profile(qwen):
    est = load_model(CONFIGS / "qwen3_5_27b.json")
    assert est.name == "qwen3_5_27b"
    assert (est.full_layers, est.linear_layers) == (16, 48)  # from layer_types
    assert est.mamba_slot_bytes() == qwen.mamba_slot_bytes()
    assert est.kv_cell_bytes(with_draft=True) == qwen.kv_cell_bytes(with_draft=True)
    assert est.target_weights_gib == pytest.approx(51.05, rel=0.02)  # parameter count × 2 B
    assert est.draft_weights_gib == pytest.approx(5.53, rel=0.02)
    assert est.streamed_weight_bytes == pytest.approx(51.25e9, rel=0.02)
    assert est.flops_per_token == pytest.approx(52e9, rel=0.05)
    assert est.multimodal and est.vit_hidden == 1152


def test_hf_qwen3_next_moe(tmp_path):
    model_dir = tmp_path / "Qwen3-Next"
    model_dir.mkdir()
    shutil.copy(CONFIGS / "qwen3_next_80b.json", model_dir / "config.json")
    m = load_model(model_dir)  # a model directory works too
    assert m.name == "Qwen3-Next"
    assert (m.full_layers, m.linear_layers) == (12, 36)
    assert m.mamba_slot_bytes() == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert m.kv_cell_bytes() == 2 * 512 * 12 * 2
    assert 140 < m.target_weights_gib < 155  # 80B parameters in bf16
    assert m.streamed_weight_bytes < 0.1 * m.target_weights_gib * GIB  # only ~3B active per token
    assert not m.multimodal and m.mtp_layers == 0


def test_hf_llama_dense():
    m = load_model(str(CONFIGS / "llama_8b.json"))
    assert not m.has_mamba and m.mamba_slot_bytes() == 0
    assert m.kv_cell_bytes() == 8 * 256 * 32 * 2
    assert m.target_weights_gib == pytest.approx(14.96, rel=0.01)  # 8.03B parameters
    assert m.spec_defaults == (5, 4, 8)


@pytest.mark.parametrize(
    "fixture, phrases",
    [
        ("malformed.json", ["malformed.json", "cannot read it as JSON"]),
        ("unsupported.json", ["unsupported.json", "model_type", "deepseek_v3"]),
        ("missing_field.json", ["missing_field.json", "linear_num_value_heads"]),
    ],
)
def test_bad_config_json_names_file_and_field(fixture, phrases):
    with pytest.raises(ProfileError) as err:
        load_model(CONFIGS / fixture)
    assert isinstance(err.value, AutotuneError)
    for phrase in phrases:
        assert phrase in str(err.value)


@pytest.mark.parametrize("name", ["Qwen/Qwen3.6-27B", "QWEN3.6-27B", "qwen3.6-27b"])
def test_bundled_profile_by_huggingface_id(name):
    assert load_model(name).name == "qwen3.6-27b"
    assert load_model("Qwen/Qwen3-Next-80B-A3B-Instruct").name == "qwen3-next-80b-a3b"


def test_unknown_model_name_lists_the_bundled_ones(tmp_path):
    with pytest.raises(ProfileError, match="qwen3.6-27b"):
        load_model("gpt-17")
    with pytest.raises(ProfileError, match="no config.json"):
        load_model(tmp_path)  # a directory without config.json


def test_non_positive_dimension_is_rejected(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        '{"model_type": "llama", "hidden_size": 0, "num_hidden_layers": 2, '
        '"num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8}'
    )
    with pytest.raises(ProfileError, match="hidden_size must be a positive integer"):
        load_model(path)


def test_gpus_and_memory_override():
    b200, h200, h100 = load_gpu("b200"), load_gpu("H200"), load_gpu("h100")
    assert b200.memory_mib == 183_359 and b200.arch == "sm100"
    assert b200.memory_gib == pytest.approx(179.06, abs=0.01)
    assert h200.memory_mib == 143_771 and h200.arch == "sm90"
    assert h100.bandwidth == pytest.approx(3.35e12)
    assert b200.peak_flops > h200.peak_flops
    assert load_gpu("b200", memory_mib=100_000).memory_mib == 100_000
    with pytest.raises(ProfileError, match="unknown GPU 't4'"):
        load_gpu("t4")
    with pytest.raises(ProfileError, match="positive"):
        load_gpu("b200", memory_mib=0)
