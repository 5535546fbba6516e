"""Hybrid families as SGLang 0.5.23's config classes shape them, and plans for the shipped example models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import ProfileError
from autotune.sglang.families import LinearState
from autotune.sglang.memory import plan
from autotune.sglang.profiles import GIB, MIB, from_hf_config, load_gpu, load_model

MODELS = Path(__file__).parent.parent / "examples" / "models"


def test_mamba2_state_widens_groups_that_do_not_divide_tp():
    # mamba_utils.py Mamba2StateShape.create: n_groups % tp != 0 → n_groups += tp - n_groups.
    s = LinearState(kind="mamba2", intermediate=8192, groups=1, heads=128, head_dim=64, state=128, conv_kernel=4)
    assert s.conv_dim(1) == 8192 + 2 * 128
    assert s.conv_dim(4) == (8192 + 2 * 4 * 128) // 4
    assert s.ssm_elems(4) == 32 * 64 * 128
    assert s.conv_elems(2) == (8192 + 2 * 2 * 128) // 2 * 3


def test_kda_state_matches_kimi_linear_shape():
    # KimiLinearStateShape.create: conv (K-1, proj/tp + 2·proj_k/tp); temporal (heads/tp, head_dim, head_dim).
    s = LinearState(kind="kda", intermediate=32 * 128, groups=32, heads=32, head_dim=128, state=128, conv_kernel=4)
    assert s.conv_elems(2) == 3 * (32 * 128 // 2 * 3)
    assert s.ssm_elems(2) == 16 * 128 * 128


def test_nemotron_h_layers_and_slot():
    m = load_model(MODELS / "nemotron-h-8b")
    assert m.family_name == "nemotron_h" and m.num_layers == 52
    assert (m.full_layers, m.linear_layers) == (4, 24)  # '*' and 'M' of hybrid_override_pattern
    conv = (128 * 64 + 2 * 8 * 128) * 3 * 2  # bf16 conv state, kernel 4
    ssm = 128 * 64 * 128 * 4  # fp32 temporal state
    assert m.mamba_slot_bytes() == 24 * (conv + ssm)
    assert m.kv_cell_bytes() == 4 * 8 * 256 * 2
    assert m.target_weights_gib == pytest.approx(8.1e9 * 2 / GIB, rel=0.1)  # an 8B model in bf16


def test_qwen35_moe_is_planned_with_active_experts_streamed():
    m = load_model(MODELS / "qwen3.5-35b-a3b")
    assert m.model_type == "qwen3_5_moe_text" and m.family_name == "qwen3_5"
    assert (m.full_layers, m.linear_layers) == (10, 30)
    assert m.mamba_slot_bytes() == 30 * ((32 * 128 + 2 * 16 * 128) * 3 * 2 + 32 * 128 * 128 * 4)
    assert m.target_weights_gib == pytest.approx(35e9 * 2 / GIB, rel=0.08)
    assert m.streamed_weight_bytes == pytest.approx(3e9 * 2, rel=0.2)  # ~3B parameters read a token


def _config(model_type: str, **fields) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 65536,
        "intermediate_size": 4096,
        **fields,
    }


def test_falcon_h1_runs_attention_and_mamba_in_every_layer():
    m = from_hf_config(
        _config(
            "falcon_h1",
            num_hidden_layers=24,
            mamba_d_ssm=1536,
            mamba_n_heads=24,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_d_conv=4,
        ),
        name="falcon",
    )
    assert (m.full_layers, m.linear_layers) == (24, 24)
    assert m.linear is not None and m.linear.head_dim == 1536 // 24  # mamba_d_head "auto"
    assert m.mamba_ssm_bytes() == 24 * 24 * 64 * 128 * 4


def test_lfm2_short_conv_holds_no_temporal_state():
    types = ["conv", "conv", "full_attention"] * 4
    m = from_hf_config(_config("lfm2", num_hidden_layers=12, layer_types=types, conv_L_cache=3), name="lfm2")
    assert (m.full_layers, m.linear_layers) == (4, 8)
    assert m.mamba_ssm_bytes() == 0
    assert m.mamba_conv_bytes() == 8 * 1024 * 2 * 2  # hidden × (L_cache − 1) × bf16
    assert not m.extra_buffer_arch  # LFM2 is not in SGLang's extra-buffer architectures


def test_granite_hybrid_and_kimi_linear():
    granite = from_hf_config(
        _config(
            "granitemoehybrid",
            num_hidden_layers=8,
            mamba_n_heads=32,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_expand=2,
            mamba_n_groups=1,
            layer_types=["mamba"] * 7 + ["attention"],
        ),
        name="granite",
    )
    assert (granite.full_layers, granite.linear_layers) == (1, 7)
    kimi = from_hf_config(
        _config(
            "kimi_linear",
            num_hidden_layers=4,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            linear_attn_config={
                "kda_layers": [1, 2, 3],
                "full_attn_layers": [4],
                "num_heads": 16,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
            },
        ),
        name="kimi",
    )
    assert (kimi.full_layers, kimi.linear_layers) == (1, 3)
    assert kimi.mamba_ssm_bytes() == 3 * 16 * 128 * 128 * 4
    assert kimi.kv_cell_bytes(tp=4) == (512 + 64) * 2  # MLA: one latent, not split over TP


def test_a_family_sglang_does_not_serve_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config("jamba", num_hidden_layers=4)))
    with pytest.raises(ProfileError, match="no Jamba model") as err:
        load_model(path)
    assert str(path) in str(err.value) and "model_type" in str(err.value)


def test_quantized_checkpoints_are_planned_by_bytes_per_weight():
    bf16 = load_model("qwen3.6-27b")
    fp8, nvfp4 = load_model(MODELS / "qwen3.6-27b-fp8"), load_model(MODELS / "qwen3.6-27b-nvfp4")
    assert (fp8.quant_method, nvfp4.quant_method) == ("fp8-block", "nvfp4")
    assert fp8.weights_source == "arithmetic"  # no index beside these configs: an estimate, said so
    assert 0.5 < fp8.target_weights_gib / bf16.target_weights_gib < 0.6  # embeddings and lm_head stay bf16
    assert nvfp4.target_weights_gib < 0.4 * bf16.target_weights_gib
    assert fp8.mamba_slot_bytes() == bf16.mamba_slot_bytes()  # the state does not follow the weights
    assert fp8.streamed_weight_bytes < 0.6 * bf16.streamed_weight_bytes


def test_unknown_quantization_names_the_field(tmp_path):
    cfg = _config("qwen3", num_hidden_layers=2, quantization_config={"quant_method": "bitsandbytes"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ProfileError, match="quantization_config.quant_method") as err:
        load_model(tmp_path)
    assert "model.safetensors.index.json" in str(err.value)


@pytest.mark.parametrize(
    "model, gpu, flags",
    [
        ("qwen3.6-27b-fp8", "h100", {}),
        ("qwen3.6-27b-nvfp4", "b200", {"speculative_algorithm": "EAGLE"}),
        ("qwen3.5-35b-a3b", "h200", {"tp_size": 2}),
        ("qwen3.5-397b-a17b", "h200", {"tp_size": 8}),
        ("nemotron-h-8b", "h100", {}),
    ],
)
def test_shipped_models_are_planned_not_refused(model, gpu, flags):
    p = plan(load_model(MODELS / model), load_gpu(gpu), flags)
    assert p.fits, p.message
    assert p.max_mamba_cache_size and p.max_running_requests > 0 and p.kv_tokens > 0
    assert p.extra["binding"] in ("mamba", "kv", "spec_default", "est")


def test_qwen3_next_on_b300_takes_the_sm100_override():
    # model_overrides/qwen3_5.py L17-50 registers Qwen3NextForCausalLM too; B300 is capability 10.3 (is_sm100).
    p = plan(load_model("qwen3-next-80b-a3b"), load_gpu("b300"), {})
    assert p.fits and (p.extra["attention_backend"], p.extra["page_size"]) == ("trtllm_mha", 64)
    assert p.kv_tokens > plan(load_model("qwen3-next-80b-a3b"), load_gpu("b200"), {}).kv_tokens


def test_slot_charge_shards_over_attention_tp():
    m = load_model(MODELS / "nemotron-h-8b")
    assert m.mamba_slot_bytes(tp=2) == m.mamba_slot_bytes() // 2
    assert m.mamba_slot_bytes(tp=2) / MIB == pytest.approx(97.4 / 2, abs=0.1)
