# Pieces shared by the MoE ops: gpt-oss's clamped SwiGLU, a dense row dot, and
# the GPU kernels' MXFP4 -> bf16 pair decode and the decode order of h that
# gate_up writes and down reads (moe_gpu.mojo and moe_prefill_gpu.mojo alike).

from std.math import exp
from std.memory import bitcast

comptime SWIGLU_LIMIT: Float32 = 7.0
comptime SWIGLU_ALPHA: Float32 = 1.702


@always_inline
def gptoss_swiglu(gate_in: Float32, up_in: Float32) -> Float32:
    """(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g), with g = min(gate, 7)."""
    var gate = min(gate_in, SWIGLU_LIMIT)
    var up = max(min(up_in, SWIGLU_LIMIT), -SWIGLU_LIMIT)
    var glu = gate / (1 + exp(-SWIGLU_ALPHA * gate))
    return (up + 1) * glu


@always_inline
def dense_row_dot[
    wtype: DType, xtype: DType
](
    w: Pointer[Scalar[wtype], _],
    x: Pointer[Scalar[xtype], _],
    n: Int,
) -> Float32:
    """Dot product of a weight row `w` [n] with `x` [n], accumulated in f32."""
    var acc: Float32 = 0
    for j in range(n):
        acc += (
            w[unsafe_offset=j].cast[DType.float32]()
            * x[unsafe_offset=j].cast[DType.float32]()
        )
    return acc


@always_inline
def h_slot(i: Int) -> Int:
    """Position of h element i in a decode-ordered row: in each group of 8,
    elements (3, 7, 2, 6, 1, 5, 0, 4) in that order (the pair words
    decode_pair makes from nibbles (3, 7), (2, 6), ... of a u32)."""
    var r = i & 7
    var s = 3 - r if r < 4 else 7 - r
    return (i & ~7) + 2 * s + (0 if r < 4 else 1)


@always_inline
def scale_mult(s: UInt32) -> SIMD[DType.bfloat16, 2]:
    """2^(s-1) in both halves: decode_pair's multiplier for E8M0 scale byte
    s (exact for s <= 128)."""
    var m = (s + 126) << 7
    return bitcast[DType.bfloat16, 2](m | (m << 16))


@always_inline
def decode_pair(v: UInt32, mult: SIMD[DType.bfloat16, 2]) -> UInt32:
    """Nibbles 3 and 7 of v (low, high half) as bf16 times `mult`: sign to
    bit 15, e2m1 magnitude bits (e1 e0 m) to bf16 bits 8..6, which is the
    value times 2^-126 (code 1 lands on the bf16 subnormal 2^-127); then
    one multiply by 2^(s-1) (scale_mult) gives value * 2^(s-127) exactly
    (s <= 128)."""
    var bits = (v & 0x80008000) | ((v >> 6) & 0x01C001C0)
    return bitcast[DType.uint32, 1](bitcast[DType.bfloat16, 2](bits) * mult)
