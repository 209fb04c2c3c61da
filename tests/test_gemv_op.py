"""The bf16 GEMV op (kernels/gemv.mojo) against a float64 NumPy reference of the same bf16
inputs, on the CPU (and on a GPU where one is present, within its bounds: T <= 2 for the
warp-per-row kernels, T <= 64 for the tensor-core one)."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.kernels import reference
from op_graphs import load_op_graph, op_devices, poisons_that_differ, repeats_that_differ, skip_past_gpu_bound
from reporting import report


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
        _check(y.to(CPU()).to_numpy(), want)


def _check(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    # the output is rounded to bf16 (relative 2^-9) after an f32 sum
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


@pytest.fixture(scope="module", params=op_devices())
def gemv_tc_model(request):
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    def forward(x, w, b):
        bf = DType.bfloat16
        return gops.cast(ops.gemv(gops.cast(x, bf), gops.cast(w, bf), gops.cast(b, bf), tc=True), DType.float32)

    def types(ref):
        return [TensorType(DType.float32, dims, ref) for dims in (["T", "K"], ["N", "K"], ["N"])]

    return request.param, *load_op_graph(request.param, "gemv_tc", forward, types)


# tokens, n, k: every n-tile width the GPU path instantiates (T <= 8, 16, 32, 64), rows not a
# multiple of 16, K of 1..128 chunks of 32 (chunks not a multiple of the warps over K), and row
# counts on each side of the warps-per-block choice (8 warps from 264 row blocks, else 16 for one
# n tile), and fewer chunks than warps
TC_CASES = [(1, 40, 256), (3, 33, 352), (8, 64, 2880), (9, 17, 96), (16, 1030, 64), (20, 7, 32),
            (33, 48, 1024), (64, 5, 4096), (2, 4240, 128), (64, 4230, 64)]  # fmt: skip


@pytest.mark.parametrize("tokens, n, k", TC_CASES, ids=lambda v: str(v))
def test_gemv_tensor_cores_match_float64(gemv_tc_model, tokens, n, k) -> None:
    from max.driver import CPU, Buffer

    kind, device, model = gemv_tc_model
    rng = np.random.default_rng(tokens * 7919 + n * 31 + k)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    (y,) = model.execute(*[Buffer.from_numpy(a).to(device) for a in (x, w, b)])
    xb, wb, bb = (reference.round_to_bf16(a).astype(np.float64) for a in (x, w, b))
    _check(y.to(CPU()).to_numpy(), xb @ wb.T + bb)


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
    with pytest.raises(ValueError, match="K % 32"):
        types = [TensorType(DType.bfloat16, d, cpu) for d in ([1, 48], [4, 48], [4])]
        Graph("gemv_bad_tc", forward=lambda x, w, b: ops.gemv(x, w, b, tc=True), input_types=types)


@pytest.mark.parametrize("tokens, n, k", [(1, 5120, 2880), (8, 2880, 4096), (33, 5120, 2880), (64, 128, 2880)])
def test_gemv_tensor_cores_repeat_bitwise(gemv_tc_model, tokens, n, k) -> None:
    """The model's dense projections of small steps (qkv, o_proj, router): the same inputs again and
    again (others between every other repeat) give the first result bit for bit."""
    from max.driver import Buffer

    kind, device, model = gemv_tc_model

    def inputs(seed):
        rng = np.random.default_rng(seed)
        arrays = (rng.standard_normal((tokens, k)), rng.standard_normal((n, k)) / np.sqrt(k), rng.standard_normal(n))
        return [Buffer.from_numpy(a.astype(np.float32)).to(device) for a in arrays]

    same, other = inputs(1), inputs(2)
    repeats = 8 if kind == "gpu" else 2
    _, differ = repeats_that_differ(model, same, other, repeats)
    assert differ == 0, f"{differ} of {repeats} repeats differ"
    # nor on what the outputs' memory held before (GPTOSS_MAX_POISON)
    assert poisons_that_differ(model, same) == []


@pytest.fixture(scope="module", params=op_devices())
def max_linear_model(request):
    """MAX's own bf16 x @ W^T (as its Linear runs the model's projections and LM head)."""
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    def forward(x, w):
        bf = DType.bfloat16
        return gops.cast(gops.matmul(gops.cast(x, bf), gops.transpose(gops.cast(w, bf), 0, 1)), DType.float32)

    def types(ref):
        return [TensorType(DType.float32, dims, ref) for dims in (["T", "K"], ["N", "K"])]

    return request.param, *load_op_graph(request.param, "max_linear", forward, types)


# (tokens, n, k) of the model's projections that MAX runs: one-token o_proj (its split-K GEMV) and
# LM head, a prompt step's qkv / o_proj / router; small ones on the CPU.
MAX_LINEAR_SHAPES = {
    "cpu": [(1, 40, 256), (69, 48, 128)],
    "gpu": [(1, 2880, 4096), (1, 201088, 2880), (69, 5120, 2880), (69, 2880, 4096), (101, 32, 2880),
            (1024, 5120, 2880)],
}  # fmt: skip


def test_max_linear_repeats_bitwise(max_linear_model) -> None:
    """MAX's matmul at the model's shapes, the same inputs again and again (others between every
    other repeat): the first result bit for bit. Not ours, but a whole-model GPU run was not
    repeatable (bench/results/repeat_h200_20261129.json) and this is where MAX would add to it."""
    from max.driver import Buffer

    kind, device, model = max_linear_model
    repeats = 8 if kind == "gpu" else 2
    failures = []
    for tokens, n, k in MAX_LINEAR_SHAPES[kind]:
        rng = np.random.default_rng(tokens + n)
        x = [rng.standard_normal((t, k)).astype(np.float32) for t in (tokens, max(tokens // 2, 1))]
        w = [(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32) for _ in range(2)]
        same = [Buffer.from_numpy(a).to(device) for a in (x[0], w[0])]
        other = [Buffer.from_numpy(a).to(device) for a in (x[1], w[1])]
        _, differ = repeats_that_differ(model, same, other, repeats)
        report("max linear repeats", f"{kind} T={tokens} N={n} K={k}: {differ} of {repeats} differ")
        if differ:
            failures.append((tokens, n, k, differ))
    assert not failures, f"(tokens, n, k, repeats that differ): {failures}"


# (tokens, n, k) of a prompt step's projections as the model builds them: a weight and a bias that
# are constants of the graph (load-time data, as MAX's Linear has them), the bias added after the
# matmul where MAX may fuse it; small ones on the CPU.
MAX_LINEAR_BIAS_SHAPES = {"cpu": [(69, 48, 128)], "gpu": [(69, 2880, 4096), (69, 32, 2880), (69, 5120, 2880)]}


@pytest.mark.parametrize("kind", op_devices())
def test_max_linear_with_constant_weight_and_bias_repeats_bitwise(kind: str) -> None:
    """MAX's matmul + bias as the model's Linear runs it. Inside the 24-layer model on an H200, layer
    0's o_proj at 69 tokens gave other bits from the same input, weight and bias on every pass
    (bench/results/repeat_h200_20261129b.json), where test_max_linear_repeats_bitwise (weight an
    input, no bias) repeats: does the Linear alone repeat too?"""
    from max.driver import Buffer
    from max.dtype import DType
    from max.graph import DeviceRef, TensorType, ops

    repeats = 8 if kind == "gpu" else 2
    failures = []
    for tokens, n, k in MAX_LINEAR_BIAS_SHAPES[kind]:
        rng = np.random.default_rng(tokens + n + k)
        w = reference.round_to_bf16(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
        b = reference.round_to_bf16(rng.standard_normal(n).astype(np.float32))

        def forward(x, w=w, b=b):
            # bf16 on a GPU, as the model there; float32 on the CPU, as the CPU model (MAX 26.7's CPU
            # bf16 matmul against a constant weight is wrong: bench/NOTES.md)
            dt, f32 = (DType.bfloat16 if kind == "gpu" else DType.float32), DType.float32
            wc = ops.cast(ops.constant(w, f32, device=DeviceRef.CPU()), dt).to(x.device)  # exact: bf16 values
            bc = ops.cast(ops.constant(b, f32, device=DeviceRef.CPU()), dt).to(x.device)
            y = ops.matmul(ops.cast(x, dt), ops.transpose(wc, 0, 1)) + bc
            return ops.cast(y, f32)

        device, model = load_op_graph(kind, f"max_linear_bias_{n}_{k}", forward,
                                      lambda ref, k=k: [TensorType(DType.float32, ["T", k], ref)])  # fmt: skip
        x = [rng.standard_normal((t, k)).astype(np.float32) for t in (tokens, tokens - 1)]
        same, other = [Buffer.from_numpy(x[0]).to(device)], [Buffer.from_numpy(x[1]).to(device)]
        first, differ = repeats_that_differ(model, same, other, repeats)
        xr = reference.round_to_bf16(x[0]) if kind == "gpu" else x[0]
        want = xr.astype(np.float64) @ w.T.astype(np.float64) + b
        err = float(np.abs(first[0] - want).max() / np.abs(want).max())
        report("max linear bias repeats", f"{kind} T={tokens} N={n} K={k}: {differ} of {repeats} differ, err {err:.1e}")
        assert err < (2e-2 if kind == "gpu" else 1e-5), (tokens, n, k, err)
        if differ:
            failures.append((tokens, n, k, differ))
    assert not failures, f"(tokens, n, k, repeats that differ): {failures}"
