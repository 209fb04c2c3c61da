"""The fused decode router op (kernels/router_decode.mojo: residual add + RMS norm + router
logits) against a float64 NumPy reference of the same bf16 inputs, with bf16 rounding where
HF's gpt-oss rounds (the residual sum, the norm's output, the router's logits). On the CPU, and
on a GPU where one is present, within its T <= 64 bound: one launch up to 4 tokens (4 warps per
block below 1,024 weight rows, 8 from there, as for qkv's 5,120), the norm and the tensor-core
projection past that."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.kernels import reference
from op_graphs import load_op_graph, op_devices, poisons_that_differ, repeats_that_differ, skip_past_gpu_bound

EPS = 1e-5


@pytest.fixture(scope="module", params=op_devices())
def router_model(request):
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    def forward(a, r, g, w, b):
        args = [gops.cast(v, DType.bfloat16) for v in (a, r, g, w, b)]
        h, xn, logits = ops.router_decode(args[0], args[1], args[2], EPS, args[3], args[4])
        return [gops.cast(v, DType.float32) for v in (h, xn, logits)]

    def types(ref):
        return [TensorType(DType.float32, d, ref) for d in (["T", "H"], ["T", "H"], ["H"], ["E", "H"], ["E"])]

    return request.param, *load_op_graph(request.param, "router_decode", forward, types)


@pytest.mark.parametrize(
    "tokens, experts, hidden",
    [
        (1, 128, 2880),
        (2, 32, 2880),
        (3, 9, 64),
        (4, 128, 4096),
        (1, 5, 8),
        (6, 16, 256),
        (1, 5120, 2880),
        (1, 1031, 2880),
        (1, 2053, 64),
        (3, 1030, 64),
        (2, 1030, 40),
        (8, 5120, 2880),
        (16, 128, 2880),
        (5, 33, 4096),
        (64, 24, 96),
        (65, 7, 32),
    ],
    ids=lambda v: str(v),
)
def test_router_decode_matches_float64(router_model, tokens, experts, hidden) -> None:
    from max.driver import CPU, Buffer

    from gptoss_max.kernels import ops

    kind, device, model = router_model
    skip_past_gpu_bound(kind, tokens, ops.ROUTER_DECODE_GPU_MAX_TOKENS)
    rng = np.random.default_rng(tokens * 7919 + experts * 31 + hidden)
    a = rng.standard_normal((tokens, hidden)).astype(np.float32)
    r = (3 * rng.standard_normal((tokens, hidden))).astype(np.float32)
    g = rng.uniform(0.5, 2.0, hidden).astype(np.float32)
    w = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b = rng.standard_normal(experts).astype(np.float32)
    inputs = [reference.round_to_bf16(v) for v in (a, r, g, w, b)]
    want_h, want_xn, want_logits = reference.router_head(*(v.astype(np.float64) for v in inputs), EPS)
    outputs = model.execute(*[Buffer.from_numpy(v).to(device) for v in inputs])
    got_h, got_xn, got_logits = (y.to(CPU()).to_numpy() for y in outputs)
    for got in (got_h, got_xn, got_logits):
        assert np.all(np.isfinite(got))
    # the residual sum of two bf16 is exact in f32, then rounded once: bit for bit
    np.testing.assert_array_equal(got_h, want_h)
    # the norm: f32 against float64 before one bf16 rounding, so at most one bf16 step apart
    np.testing.assert_allclose(got_xn, want_xn, rtol=2**-7, atol=0)
    assert np.mean(got_xn == want_xn) > 0.98
    # logits: an f32 sum, rounded to bf16 (relative 2^-9)
    np.testing.assert_allclose(got_logits, want_logits, rtol=2**-7, atol=2**-7 * np.abs(want_logits).max())


def test_router_decode_refuses_wrong_dtype_and_odd_hidden() -> None:
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from gptoss_max.kernels import ops

    cpu = DeviceRef.CPU()

    def build(dtype, hidden, eps=EPS):
        dims = ([1, hidden], [1, hidden], [hidden], [4, hidden], [4])
        types = [TensorType(dtype, d, cpu) for d in dims]
        Graph("router_bad", forward=lambda a, r, g, w, b: ops.router_decode(a, r, g, eps, w, b)[2], input_types=types)

    with pytest.raises(TypeError, match="bfloat16"):
        build(DType.float32, 8)
    with pytest.raises(ValueError, match="H % 8"):
        build(DType.bfloat16, 12)
    with pytest.raises(ValueError, match="eps"):
        build(DType.bfloat16, 8, eps=0.0)


@pytest.mark.parametrize("tokens, experts, hidden", [(1, 128, 2880), (1, 5120, 2880), (8, 5120, 2880), (16, 32, 2880)])
def test_router_decode_repeats_bitwise(router_model, tokens, experts, hidden) -> None:
    """The same inputs again and again (others between every other repeat): the first outputs bit
    for bit (a whole-model GPU run was not repeatable, bench/results/repeat_h200_20261129.json)."""
    from max.driver import Buffer

    from gptoss_max.kernels import ops

    kind, device, model = router_model
    skip_past_gpu_bound(kind, tokens, ops.ROUTER_DECODE_GPU_MAX_TOKENS)

    def inputs(seed):
        rng = np.random.default_rng(seed)
        shapes = ((tokens, hidden), (tokens, hidden), (hidden,), (experts, hidden), (experts,))
        arrays = [reference.round_to_bf16(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        return [Buffer.from_numpy(v).to(device) for v in arrays]

    same, other = inputs(1), inputs(2)
    repeats = 8 if kind == "gpu" else 2
    _, differ = repeats_that_differ(model, same, other, repeats)
    assert differ == 0, f"{differ} of {repeats} repeats differ"
    # nor on what the outputs' memory held before (GPTOSS_MAX_POISON)
    assert poisons_that_differ(model, same) == []
