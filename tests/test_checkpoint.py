"""Weights from the checkpoint's files: the safetensors index's total_size, or the shards' headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import httpx
import pytest

from autotune.errors import ProfileError
from autotune.sglang import hub
from autotune.sglang.checkpoint import INDEX_NAME, read_checkpoint
from autotune.sglang.profiles import GIB, load_model

MODELS = Path(__file__).parent.parent / "examples" / "models"


def write_shard(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> int:
    """A safetensors file whose header names ``tensors`` (name → dtype, shape, bytes); the data is zeros."""
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)  # sparse: the planner never reads the data
    return offset


def fp8_folder(tmp_path: Path, *, shards: bool) -> tuple[Path, int, int]:
    folder = tmp_path / "Qwen3.6-27B-FP8"
    folder.mkdir()
    (folder / "config.json").write_text((MODELS / "qwen3.6-27b-fp8" / "config.json").read_text())
    body = {
        "model.language_model.layers.0.mlp.up_proj.weight": ("F8_E4M3", [17408, 5120], 14_000_000_000),
        "model.language_model.embed_tokens.weight": ("BF16", [248320, 5120], 2_542_796_800),
        "lm_head.weight": ("BF16", [248320, 5120], 2_542_796_800),
        "model.visual.blocks.0.attn.qkv.weight": ("BF16", [3456, 1152], 900_000_000),
    }
    mtp = {"mtp.layers.0.mlp.up_proj.weight": ("F8_E4M3", [17408, 5120], 450_000_000)}
    total = sum(t[2] for t in (*body.values(), *mtp.values()))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in body}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in mtp})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    if shards:
        write_shard(folder / "model-00001-of-00002.safetensors", body)
        write_shard(folder / "model-00002-of-00002.safetensors", mtp)
    return folder, total, 450_000_000


def test_index_total_size_is_the_weights(tmp_path):
    folder, total, _ = fp8_folder(tmp_path, shards=False)
    m = load_model(folder)
    assert m.weights_source == "index" and m.quant_method == "fp8-block"
    draft_file = m.draft_weights_gib * GIB - 2 * 248320 * 5120 * 2  # the draft's own embedding + lm_head copy
    assert m.target_weights_gib * GIB + draft_file == pytest.approx(total, rel=1e-9)  # all of total_size, split
    assert 0 < draft_file < 0.05 * total  # the MTP layer's share, by arithmetic (the index has no sizes)


def test_shard_headers_split_target_and_mtp_exactly(tmp_path):
    folder, total, mtp = fp8_folder(tmp_path, shards=True)
    ck = read_checkpoint(folder)
    assert ck is not None and (ck.source, ck.total, ck.draft, ck.vision) == ("headers", total, mtp, 900_000_000)
    m = load_model(folder)
    assert m.weights_source == "headers"
    assert m.target_weights_gib * GIB == pytest.approx(total - mtp, abs=1)
    assert m.draft_weights_gib * GIB == pytest.approx(mtp + 2 * 248320 * 5120 * 2, abs=1)


def test_a_bare_config_is_an_estimate_and_a_bad_index_names_the_field(tmp_path):
    assert read_checkpoint(MODELS / "qwen3.6-27b-fp8") is None
    folder, _, _ = fp8_folder(tmp_path, shards=False)
    index = json.loads((folder / INDEX_NAME).read_text())
    index["metadata"] = {}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ProfileError, match="metadata.total_size") as err:
        load_model(folder)
    assert INDEX_NAME in str(err.value)
    (folder / INDEX_NAME).write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read it as JSON"):
        load_model(folder)


def test_a_truncated_shard_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text((MODELS / "nemotron-h-8b" / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ProfileError, match="not a safetensors file") as err:
        load_model(tmp_path)
    assert "model.safetensors" in str(err.value)


def test_a_model_id_is_found_in_the_huggingface_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snap = tmp_path / "models--acme--Hybrid-8B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((MODELS / "nemotron-h-8b" / "config.json").read_text())
    (tmp_path / "models--acme--Hybrid-8B" / "refs").mkdir()
    (tmp_path / "models--acme--Hybrid-8B" / "refs" / "main").write_text("abc123")
    m = load_model("acme/Hybrid-8B")
    assert m.name == "Hybrid-8B" and m.family_name == "nemotron_h"
    with pytest.raises(ProfileError, match="not in the HuggingFace cache"):
        load_model("acme/Other-8B")  # HF_HUB_OFFLINE is set for the whole suite: nothing is fetched


def test_the_hub_download_takes_config_and_index_only(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    config = (MODELS / "nemotron-h-8b" / "config.json").read_bytes()
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        assert request.headers["authorization"] == "Bearer hf_secret_value"
        if request.url.path.endswith("config.json"):
            return httpx.Response(200, content=config)
        return httpx.Response(200, json={"metadata": {"total_size": 16_000_000_000}, "weight_map": {"a": "x"}})

    folder = hub._download("acme/Hybrid-8B", transport=httpx.MockTransport(answer))
    assert folder is not None and sorted(p.name for p in folder.iterdir()) == ["config.json", INDEX_NAME]
    assert asked == ["/acme/Hybrid-8B/resolve/main/config.json", f"/acme/Hybrid-8B/resolve/main/{INDEX_NAME}"]
    assert load_model(folder).target_weights_gib * GIB == pytest.approx(16e9)
    assert "hf_secret_value" not in "".join(p.read_text() for p in folder.iterdir())
    with pytest.raises(ProfileError, match="HF_TOKEN"):
        hub._download("acme/Gated", transport=httpx.MockTransport(lambda r: httpx.Response(401)))
