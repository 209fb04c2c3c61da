"""NumPy references for the kernels in this package (float64 math)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from gptoss_max import mxfp4
from gptoss_max.checkpoint import from_bf16_bits, to_bf16_bits

SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702


def round_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    return from_bf16_bits(to_bf16_bits(a)).reshape(np.shape(a))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    gate = np.minimum(gate, SWIGLU_LIMIT)
    up = np.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1.0) * gate / (1.0 + np.exp(-SWIGLU_ALPHA * gate))


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`blocks [..., n/2]`, `scales [..., n/32]` u8 -> float32 `[..., n]`."""
    nb = scales.shape[-1]
    return mxfp4.decode(blocks.reshape(*blocks.shape[:-1], nb, 16), scales)


def router_head(
    attn: np.ndarray,  # [T, H] bf16 values
    residual: np.ndarray,  # [T, H] bf16 values
    gamma: np.ndarray,  # [H] bf16 values: the post-attention norm's weight
    weight: np.ndarray,  # [E, H] bf16 values: the router
    bias: np.ndarray,  # [E]
    eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A MoE block's head as HF's gpt-oss computes it, float64 between its bf16 roundings:
    h = bf16(residual + attn), xn = bf16(h / rms(h) * gamma), and the router's logits
    xn W^T + b (unrounded; the model's bf16 Linear rounds them). Returns (h, xn, logits)."""
    h = round_to_bf16((attn + residual).astype(np.float32)).astype(np.float64)
    inv = 1.0 / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps)
    xn = round_to_bf16((h * inv * gamma).astype(np.float32)).astype(np.float64)
    return h, xn, xn @ weight.astype(np.float64).T + bias


def moe(
    x: np.ndarray,  # [T, H]
    topk_ids: np.ndarray,  # [T, K]
    topk_weights: np.ndarray,  # [T, K]
    gate_up: np.ndarray,  # [E, 2I, H], rows interleaved gate/up
    gate_up_bias: np.ndarray,  # [E, 2I]
    down: np.ndarray,  # [E, H, I]
    down_bias: np.ndarray,  # [E, H]
) -> np.ndarray:  # [T, H] float64
    x = x.astype(np.float64)
    out = np.zeros(x.shape, dtype=np.float64)
    for t, k in np.ndindex(*topk_ids.shape):
        e = int(topk_ids[t, k])
        if not 0 <= e < gate_up.shape[0]:  # as the kernels: contributes nothing
            continue
        gu = gate_up[e].astype(np.float64) @ x[t] + gate_up_bias[e]
        h = swiglu(gu[0::2], gu[1::2])
        y = down[e].astype(np.float64) @ h + down_bias[e]
        out[t] += float(topk_weights[t, k]) * y
    return out


def moe_mxfp4(
    x: np.ndarray,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray,
    gate_up_blocks: np.ndarray,  # [E, 2I, H/2]
    gate_up_scales: np.ndarray,  # [E, 2I, H/32]
    gate_up_bias: np.ndarray,
    down_blocks: np.ndarray,  # [E, H, I/2]
    down_scales: np.ndarray,  # [E, H, I/32]
    down_bias: np.ndarray,
) -> np.ndarray:
    """Like `moe`, decoding only the experts that are routed to."""
    n_experts = gate_up_blocks.shape[0]
    gate_up = np.zeros((n_experts, gate_up_blocks.shape[1], x.shape[1]), np.float32)
    down = np.zeros((n_experts, x.shape[1], down_blocks.shape[2] * 2), np.float32)
    for e in np.unique(topk_ids[(topk_ids >= 0) & (topk_ids < n_experts)]):
        gate_up[e] = mxfp4_rows(gate_up_blocks[e], gate_up_scales[e])
        down[e] = mxfp4_rows(down_blocks[e], down_scales[e])
    return moe(x, topk_ids, topk_weights, gate_up, gate_up_bias, down, down_bias)


def rope(x: np.ndarray, table: np.ndarray, positions: Iterable[int]) -> np.ndarray:
    """Rotate-half RoPE (transformers' `rotate_half`, gpt-oss's): x [n, heads, d] at `positions`,
    with frequency i's (cos, sin) at table[p, 2 i], table[p, 2 i + 1] (MAX's freqs_cis layout);
    dims i and i + d / 2 turn together. float64."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    rows = np.asarray(table, np.float64)[list(positions)]  # [n, d]
    cos, sin = rows[:, None, 0::2], rows[:, None, 1::2]
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def attention_with_sinks(
    q: np.ndarray,  # [n, n_heads, head_dim], rows of one sequence
    keys: np.ndarray,  # [length, n_kv_heads, head_dim], the whole sequence
    values: np.ndarray,  # [length, n_kv_heads, head_dim]
    sinks: np.ndarray,  # [n_heads]
    positions: Iterable[int],  # absolute position of each q row
    scale: float,
    window: int | None,
) -> np.ndarray:  # [n, n_heads, head_dim] float64
    """Causal attention, optionally windowed to [p - window + 1, p], with one
    sink logit per head that takes probability mass but adds no value."""
    n_heads, group = q.shape[1], q.shape[1] // keys.shape[1]
    out = np.zeros(q.shape)
    for row, p in enumerate(positions):
        first = max(p - window + 1, 0) if window else 0
        for h in range(n_heads):
            k = keys[first : p + 1, h // group].astype(np.float64)
            v = values[first : p + 1, h // group].astype(np.float64)
            logits = scale * (k @ q[row, h].astype(np.float64))
            m = max(logits.max(), float(sinks[h]))
            w = np.exp(logits - m)
            out[row, h] = (w @ v) / (w.sum() + np.exp(float(sinks[h]) - m))
    return out
