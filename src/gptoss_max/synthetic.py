"""Random gpt-oss weights with realistic magnitudes, in the Hugging Face layout."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gptoss_max import mxfp4
from gptoss_max.checkpoint import BF16, U8, save_safetensors
from gptoss_max.config import ModelSpec
from gptoss_max.hf_tokenizer import write_tokenizer

GENERATION_CONFIG = {
    "bos_token_id": 199998,
    "eos_token_id": [200002, 199999, 200012],
    "pad_token_id": 199999,
    "do_sample": True,
}


def _layer(spec: ModelSpec, n: int, rng: np.random.Generator, mxfp4_experts: bool):
    h, i, e = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
    p = f"model.layers.{n}."

    def normal(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    # Stds scale with 1/sqrt(fan-in) so any width sees the same activations: q/k give
    # attention logits of several units, router logits spread tokens over experts.
    fan_h, fan_i = 1.0 / np.sqrt(h), 1.0 / np.sqrt(i)
    yield p + "input_layernorm.weight", (normal((h,), 0.1, 1.0), BF16)
    yield p + "post_attention_layernorm.weight", (normal((h,), 0.1, 1.0), BF16)
    projections = [("q", spec.q_dim, 2.3 * fan_h), ("k", spec.kv_dim, 2.3 * fan_h), ("v", spec.kv_dim, 1.1 * fan_h)]
    for name, rows, std in projections:
        yield p + f"self_attn.{name}_proj.weight", (normal((rows, h), std), BF16)
        yield p + f"self_attn.{name}_proj.bias", (normal((rows,), 0.1), BF16)
    yield p + "self_attn.o_proj.weight", (normal((h, spec.q_dim), 1.0 / np.sqrt(spec.q_dim)), BF16)
    yield p + "self_attn.o_proj.bias", (normal((h,), 0.05), BF16)
    # Sinks of several units, both above and below typical attention logits.
    yield p + "self_attn.sinks", (normal((spec.num_attention_heads,), 2.0, 3.0), BF16)
    yield p + "mlp.router.weight", (normal((e, h), 1.7 * fan_h), BF16)
    yield p + "mlp.router.bias", (normal((e,), 0.2), BF16)
    gate_up = normal((e, 2 * i, h), 1.1 * fan_h)
    down = normal((e, h, i), 1.1 * fan_i)
    yield p + "mlp.experts.gate_up_proj_bias", (normal((e, 2 * i), 0.1), BF16)
    yield p + "mlp.experts.down_proj_bias", (normal((e, h), 0.05), BF16)
    if mxfp4_experts:
        for name, w in [("gate_up_proj", gate_up), ("down_proj", down)]:
            blocks, scales = mxfp4.encode(w)
            yield p + f"mlp.experts.{name}_blocks", (blocks, U8)
            yield p + f"mlp.experts.{name}_scales", (scales, U8)
    else:
        yield p + "mlp.experts.gate_up_proj", (gate_up.transpose(0, 2, 1).copy(), BF16)
        yield p + "mlp.experts.down_proj", (down.transpose(0, 2, 1).copy(), BF16)


def random_tensors(spec: ModelSpec, seed: int, mxfp4_experts: bool) -> Iterator[tuple[str, tuple]]:
    rng = np.random.default_rng(seed)
    h, v = spec.hidden_size, spec.vocab_size
    yield "model.embed_tokens.weight", (rng.standard_normal((v, h), dtype=np.float32), BF16)
    for n in range(spec.num_hidden_layers):
        yield from _layer(spec, n, rng, mxfp4_experts)
    yield "model.norm.weight", ((1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32), BF16)
    yield "lm_head.weight", ((3.4 / np.sqrt(h) * rng.standard_normal((v, h))).astype(np.float32), BF16)


def write_checkpoint(out: Path, spec: ModelSpec, seed: int = 0, mxfp4_experts: bool = True) -> Path:
    """A complete HF gpt-oss model directory: config, generation config, weights, tokenizer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec.to_hf(mxfp4_experts), indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    save_safetensors(out / "model.safetensors", dict(random_tensors(spec, seed, mxfp4_experts)))
    write_tokenizer(out)
    return out
