"""Checkpoint layout: the writer's output validates; every kind of mismatch is named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gptoss_max import mxfp4
from gptoss_max.checkpoint import (
    BF16,
    F32,
    U8,
    CheckpointError,
    from_bf16_bits,
    load_tensor,
    read_index,
    to_bf16_bits,
    validate,
)
from gptoss_max.config import PRESETS, ModelSpec
from gptoss_max.hf_tokenizer import VOCAB_SIZE

SPEC = PRESETS["tiny"]


@pytest.fixture(scope="module", params=[True, False], ids=["mxfp4", "bf16"])
def written(request, tmp_path_factory):
    from gptoss_max.synthetic import write_checkpoint

    out = write_checkpoint(tmp_path_factory.mktemp("ckpt"), SPEC, seed=3, mxfp4_experts=request.param)
    return request.param, out


def test_written_checkpoint_is_hf_layout(written):
    mxfp4_experts, out = written
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"]
    assert cfg["rope_scaling"]["rope_type"] == "yarn"
    assert len(cfg["layer_types"]) == cfg["num_hidden_layers"]
    assert ("quantization_config" in cfg) == mxfp4_experts
    assert ModelSpec.from_dir(out) == SPEC
    assert validate(SPEC, read_index(out)) == mxfp4_experts
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()


def test_sinks_and_scales_are_realistic(written):
    mxfp4_experts, out = written
    sinks = load_tensor(out / "model.safetensors", "model.layers.0.self_attn.sinks")
    assert np.abs(sinks).max() > 3.0, "sinks must be several units, not ~0"
    if mxfp4_experts:
        scales = load_tensor(out / "model.safetensors", "model.layers.0.mlp.experts.gate_up_proj_scales")
        assert 110 <= np.median(scales) <= 126  # 2^-17 .. 2^-1: trained-weight magnitudes


def _index(mxfp4_experts: bool) -> dict:
    from gptoss_max.checkpoint import expected_tensors

    return dict(expected_tensors(SPEC, mxfp4_experts))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("model.layers.1.self_attn.sinks"), "missing tensor model.layers.1.self_attn.sinks"),
        (lambda d: d.update({"model.layers.0.mlp.extra": ((1,), BF16)}), "unexpected tensor model.layers.0.mlp.extra"),
        (
            lambda d: d.update({"model.layers.0.mlp.experts.down_proj_scales": ((8, 128, 3), U8)}),
            "tensor model.layers.0.mlp.experts.down_proj_scales has shape (8, 128, 3), expected (8, 128, 4)",
        ),
        (
            lambda d: d.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": ((8, 256, 4, 16), F32)}),
            "tensor model.layers.0.mlp.experts.gate_up_proj_blocks has dtype F32, expected U8",
        ),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_validation_names_the_tensor(mutate, message):
    found = _index(True)
    mutate(found)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(SPEC, found)


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e-39], dtype=np.float32)
    back = from_bf16_bits(to_bf16_bits(x))
    assert back.tolist()[:4] == [1.0, 1.0, 1.015625, -2.5]


def test_mxfp4_encode_decode_roundtrip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 256)).astype(np.float32) * 0.02
    blocks, scales = mxfp4.encode(w)
    assert blocks.shape == (16, 8, 16) and scales.shape == (16, 8)
    again = mxfp4.decode(blocks, scales)
    assert np.array_equal(mxfp4.decode(*mxfp4.encode(again)), again)  # grid values re-encode exactly
    # worst case per block: half the top grid step (2 * 2^e), with 2^e < amax / 3
    err = np.abs(again - w).reshape(16, 8, 32).max(-1)
    assert (err <= np.abs(w).reshape(16, 8, 32).max(-1) / 3).all()
    # byte j = element 2j (low nibble) | element 2j+1 (high nibble)
    one = np.zeros((1, 32), np.float32)
    one[0, 0], one[0, 1] = 1.0, -6.0
    b, s = mxfp4.encode(one)
    assert b[0, 0, 0] == (0x2 | (0xF << 4)) and s[0, 0] == 127


def test_tokenizer_matches_harmony(tmp_path):
    from transformers import AutoTokenizer

    from gptoss_max.hf_tokenizer import write_tokenizer
    from gptoss_max.tokenizer import harmony_encoding

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    enc = harmony_encoding()
    assert len(tok) == VOCAB_SIZE
    for text in ["hello world", "Héllo, wörld! 12345\n\n  x", "<|start|>user<|message|>hi<|end|>", "日本語 \t end"]:
        assert tok.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all")


def test_tokenizer_cache_survives_a_concurrent_builder(tmp_path, monkeypatch):
    """Another builder of the cached tokenizer that starts and finishes while this one builds
    (parallel tests, two servers starting) must neither remove this one's half-built files nor
    make it fail; the first finished copy is the cache, and this one's own is discarded."""
    from gptoss_max import hf_tokenizer

    monkeypatch.setenv("GPTOSS_MAX_CACHE", str(tmp_path / "cache"))
    builds = []

    def fake_build(out):
        builds.append(out.name)
        (out / "tokenizer_config.json").write_text("{}")
        if len(builds) == 1:  # the other builder runs to the end meanwhile
            (tmp_path / "other").mkdir()
            hf_tokenizer.write_tokenizer(tmp_path / "other")
        (out / "tokenizer.json").write_text(out.name)

    monkeypatch.setattr(hf_tokenizer, "_build", fake_build)
    (tmp_path / "mine").mkdir()
    hf_tokenizer.write_tokenizer(tmp_path / "mine")
    assert len(builds) == 2 and builds[0] != builds[1]
    for model_dir in ("other", "mine"):
        assert (tmp_path / model_dir / "tokenizer.json").read_text() == builds[1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["o200k_harmony_hf"]
