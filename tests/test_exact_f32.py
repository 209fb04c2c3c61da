"""The float32 projections of a GPU graph (arch/exact_f32.py): the hi/lo split is float32-accurate
under TF32 rounding (emulated in NumPy, as Hopper's tensor cores read float32 operands), and the
swapped MAX modules compute x W^T + b in a real MAX graph (on CPU, against float64)."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.kernels.reference import round_to_bf16 as bf16
from reporting import report


def tf32(a: np.ndarray) -> np.ndarray:
    """float32 -> TF32 as the tensor cores read it: the 13 low mantissa bits dropped."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def _case(seed: int, t: int = 64, k: int = 2880, n: int = 256):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    w = bf16(rng.standard_normal((n, k)).astype(np.float32) * k**-0.5)  # bf16 weights, as gpt-oss's
    return x, w


def test_split_is_float32_accurate_under_tf32():
    x, w = _case(0)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # error scale per output

    def err(y):
        return float(np.max(np.abs(y - exact) / scale))

    plain = tf32(x).astype(np.float64) @ tf32(w).astype(np.float64).T
    hi = bf16(x)
    lo = x - hi
    assert np.array_equal(tf32(hi), hi) and np.array_equal(tf32(w), w)  # both exact in TF32
    assert np.array_equal(hi.astype(np.float64) + lo, x.astype(np.float64))  # the split is exact
    split = hi.astype(np.float64) @ w.astype(np.float64).T + tf32(lo).astype(np.float64) @ w.astype(np.float64).T
    f32 = (x @ w.T).astype(np.float64)  # what a float32 matmul (transformers with TF32 off) gives
    report("exact f32", f"max rel err: plain TF32 {err(plain):.2e}, split {err(split):.2e}, float32 {err(f32):.2e}")
    assert err(plain) > 1e-5  # TF32 alone: ~2^-11 per operand, partly averaged out over K
    assert err(split) <= 2.0**-19  # the per-operand bound in exact_f32.py's docstring
    assert err(split) < min(err(plain) / 100, 4 * err(f32))  # TF32's error gone: float32's order


@pytest.mark.slow
def test_swapped_modules_compute_the_projection_on_cpu():
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType
    from max.nn.layer import Module
    from max.nn.linear import Linear

    from gptoss_max import maxapi
    from gptoss_max.arch.exact_f32 import ExactF32Linear, ExactF32StackedLinear, use_exact_f32_projections

    cpu = DeviceRef.CPU()
    k, outs = 96, [32, 16, 16]

    class Holder(Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = maxapi.StackedLinear(k, outs, ["q", "k", "v"], DType.float32, cpu, has_bias=True)
            self.shards = [Linear(k, 24, DType.float32, cpu, has_bias=True, name="shard")]  # reachable only via a list

        def __call__(self, x):
            return self.qkv(x), self.shards[0](x)

    holder = Holder()
    assert use_exact_f32_projections(holder) == 5  # the stack, its q/k/v children, the listed shard
    assert type(holder.qkv) is ExactF32StackedLinear and type(holder.shards[0]) is ExactF32Linear

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, k)).astype(np.float32)
    state = {}
    for name, n in zip(["q", "k", "v"], outs, strict=True):
        state[f"{name}.weight"] = bf16(rng.standard_normal((n, k)).astype(np.float32))
        state[f"{name}.bias"] = rng.standard_normal(n).astype(np.float32)
    w1, b1 = bf16(rng.standard_normal((24, k)).astype(np.float32)), rng.standard_normal(24).astype(np.float32)
    holder.load_state_dict(state, weight_alignment=1, strict=True)
    with Graph("exact_f32", input_types=[TensorType(DType.float32, ["T", k], cpu)]) as graph:
        graph.output(*holder(graph.inputs[0].tensor))
    weights = {**holder.state_dict(auto_initialize=False), "shard.weight": w1, "shard.bias": b1}
    model = InferenceSession(devices=[CPU()]).load(graph, weights_registry=weights)
    qkv, single = (r.to_numpy() for r in model.execute(Buffer.from_numpy(x)))

    x64 = x.astype(np.float64)
    w_stack = np.concatenate([state[f"{n}.weight"] for n in "qkv"]).astype(np.float64)
    b_stack = np.concatenate([state[f"{n}.bias"] for n in "qkv"]).astype(np.float64)
    np.testing.assert_allclose(qkv, x64 @ w_stack.T + b_stack, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(single, x64 @ w1.astype(np.float64).T + b1, rtol=1e-5, atol=1e-5)
