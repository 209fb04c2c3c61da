"""Dense bf16 projections of small decode steps (qkv, o_proj, the router's logits) on our
tensor-core op instead of MAX's matmul.

Why: in a 120b batch-8 step MAX runs these with its sm90 matmul at 30.7 / 21.8 / 13.4 us per layer
(qkv / o_proj / router), about a third of the copy bandwidth; on one token its split-K GEMV is
faster than ours, and from ~32 tokens its matmul is (bench/gemv.py, bench/NOTES.md).
"""

from __future__ import annotations

from max.dtype import DType
from max.graph import StaticDim, TensorType, TensorValue, ops
from max.nn.layer import Module

from gptoss_max import maxapi, settings
from gptoss_max.kernels import ops as kernel_ops

# Steps of this many tokens take our op (kernels/gemv.mojo, tc=True); others MAX's Linear.
DENSE_MIN_TOKENS = 2
DENSE_MAX_TOKENS = 16


def project(linear: Module, x: TensorValue) -> TensorValue:
    """`linear(x)` for x [T, K] and a MAX Linear or StackedLinear: on bf16 graphs with
    `GPTOSS_MAX_DENSE` = tc (the default) and K % 32 == 0, steps of
    DENSE_MIN_TOKENS..DENSE_MAX_TOKENS tokens (`tc1`: from 1) run our op, chosen in the graph from the step's
    token count (the same choice on a CPU, whose path has no bound, so CPU tests run both
    branches). Same values up to f32 summation order. Not for use inside a branch of another
    ops.cond (arch/moe.py says why)."""
    weight, bias = maxapi.linear_weight_bias(linear)
    if settings.tap_weights() and bias is not None:
        return tapped_linear(x, TensorValue(weight), TensorValue(bias))
    k = x.shape[1]
    impl = settings.dense_impl()
    if (
        x.dtype != DType.bfloat16
        or impl == "max"
        or bias is None
        or weight.dtype != DType.bfloat16
        or not isinstance(k, StaticDim)
        or int(k) % 32
    ):
        return linear(x)
    # Materialized here, outside both branches of ops.cond: a weight first used inside one
    # branch is defined in that region and does not dominate its use in the other.
    w, b = TensorValue(weight), TensorValue(bias)

    def ours() -> TensorValue:
        return kernel_ops.gemv(x, w, b, tc=True)

    def theirs() -> TensorValue:
        return linear(x)

    out = TensorType(x.dtype, [x.shape[0], w.shape[0]], x.device)
    least = 1 if impl == "tc1" else DENSE_MIN_TOKENS
    return ops.cond(tokens_within(x, DENSE_MAX_TOKENS, least=least), [out], ours, theirs)[0]


def tapped_linear(x: TensorValue, weight: TensorValue, bias: TensorValue) -> TensorValue:
    """`x @ weight.T + bias` by MAX's matmul, weight and bias first through `gptoss_tap`
    (`GPTOSS_MAX_TAP=weights`): each run prints their hashes, so a stray write into a weight
    shows. A check, not for serving (the taps copy the weight at every step)."""
    n = weight.shape[0]
    w = kernel_ops.tap(weight, f"weight {n}x{weight.shape[1]}", after=x)
    b = ops.reshape(kernel_ops.tap(ops.reshape(bias, [1, n]), f"bias {n}", after=x), [n])
    return ops.matmul(x, ops.transpose(w, 0, 1)) + ops.cast(b, x.dtype)


def tokens_within(x: TensorValue, most: int, least: int | None = None) -> TensorValue:
    """A scalar bool for ops.cond: the step's token count (x's first dimension) is at most `most`
    (and at least `least`, when given)."""
    tokens = ops.reshape(ops.shape_to_tensor([x.shape[0]]), [])
    take = ops.greater_equal(ops.constant(most, tokens.dtype, device=tokens.device), tokens)
    if least is not None:
        take = ops.logical_and(ops.greater_equal(tokens, ops.constant(least, tokens.dtype, device=tokens.device)), take)
    return take
