"""YaRN RoPE as gpt-oss defines it.

Why: MAX 26.7's YarnRotaryEmbedding always floors/ceils YaRN's correction range;
gpt-oss configs say `truncate: false` (the openai/gpt-oss reference and transformers
use the exact range). The difference shifts a few frequencies and grows with position.
"""

from __future__ import annotations

import math

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops
from max.nn.rotary_embedding import YarnRotaryEmbedding


def yarn_inv_freq(head_dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float,
                  original_max_pos: int, truncate: bool) -> np.ndarray:  # fmt: skip
    """Inverse frequencies `[head_dim / 2]`, transformers' `_compute_yarn_parameters` formula."""

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32)


class GptOssYarnRope(YarnRotaryEmbedding):
    def _compute_yarn_freqs(self) -> TensorValue:
        p = self.scaling_params
        assert p is not None
        inv = yarn_inv_freq(self.head_dim, self.theta, p.factor, p.beta_fast, p.beta_slow,
                            p.original_max_position_embeddings, p.truncate)  # fmt: skip
        return ops.constant(inv, DType.float32, device=DeviceRef.CPU())


def use_gptoss_rope(attention_modules) -> None:
    for attn in attention_modules:
        attn.rope.__class__ = GptOssYarnRope
