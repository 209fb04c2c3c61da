"""The bf16 GEMV op (kernels/gemv.mojo) against a float64 NumPy reference of the same bf16
inputs, on the CPU (and on a GPU where one is present, within its T <= 2 bound)."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.kernels import reference
from op_graphs import load_op_graph, op_devices, skip_past_gpu_bound


@pytest.fixture(scope="module", params=op_devices())
def gemv_model(request):
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    def forward(x, w, b):
        bf = DType.bfloat16
        args = (gops.cast(x, bf), gops.cast(w, bf), gops.cast(b, bf))
        return [gops.cast(ops.gemv(*args, staged=s), DType.float32) for s in (True, False)]

    def types(ref):
        return [TensorType(DType.float32, dims, ref) for dims in (["T", "K"], ["N", "K"], ["N"])]

    return request.param, *load_op_graph(request.param, "gemv", forward, types)


@pytest.mark.parametrize(
    "tokens, n, k",
    [(1, 40, 256), (2, 33, 2880 // 8), (1, 7, 8), (2, 64, 4096 // 4), (3, 5, 72)],
    ids=lambda v: str(v),
)
def test_gemv_matches_float64(gemv_model, tokens, n, k) -> None:
    from max.driver import CPU, Buffer

    kind, device, model = gemv_model
    skip_past_gpu_bound(kind, tokens, 2)
    rng = np.random.default_rng(tokens * 7919 + n * 31 + k)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    args = [Buffer.from_numpy(a).to(device) for a in (x, w, b)]
    xb, wb, bb = (reference.round_to_bf16(a).astype(np.float64) for a in (x, w, b))
    want = xb @ wb.T + bb
    for y in model.execute(*args):  # staged, then registers (the same on the CPU)
        got = y.to(CPU()).to_numpy()
        assert got.shape == (tokens, n)
        assert np.all(np.isfinite(got))
        # the output is rounded to bf16 (relative 2^-9) after an f32 sum
        np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


def test_gemv_refuses_wrong_dtype_and_odd_k() -> None:
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from gptoss_max.kernels import ops

    cpu = DeviceRef.CPU()

    def build(dtype, k):
        types = [TensorType(dtype, d, cpu) for d in ([1, k], [4, k], [4])]
        Graph("gemv_bad", forward=lambda x, w, b: ops.gemv(x, w, b), input_types=types)

    with pytest.raises(TypeError, match="bfloat16"):
        build(DType.float32, 8)
    with pytest.raises(ValueError, match="K % 8"):
        build(DType.bfloat16, 12)
