# Pieces shared by the MoE ops: gpt-oss's clamped SwiGLU, a dense row dot, and
# the GPU kernels' MXFP4 -> bf16 pair decode of the tiled layout's repacked
# words (moe_gpu.mojo and moe_prefill_gpu.mojo alike).

from std.math import exp
from std.memory import bitcast

from .mxfp4 import slot_bits

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
def scale_mult(s: UInt32) -> SIMD[DType.bfloat16, 2]:
    """2^(s-1) in both halves: decode_slot's multiplier for E8M0 scale byte
    s (exact for s <= 128)."""
    var m = (s + 126) << 7
    return bitcast[DType.bfloat16, 2](m | (m << 16))


@always_inline
def scaled_pair(bits: UInt32, mult: SIMD[DType.bfloat16, 2]) -> UInt32:
    """A bf16 pair word times mult (both halves)."""
    return bitcast[DType.uint32, 1](bitcast[DType.bfloat16, 2](bits) * mult)


@always_inline
def decode_slot[c: Int](w: UInt32, mult: SIMD[DType.bfloat16, 2]) -> UInt32:
    """Slot c's pair of a repacked word times mult: with scale_mult(s), the
    values times 2^(s-127), exactly (s <= 128)."""
    return scaled_pair(slot_bits[c](w), mult)


@always_inline
def scale_bytes_above_128(w: SIMD[DType.uint32, 4]) -> SIMD[DType.uint32, 4]:
    """16 E8M0 scale bytes, four to a word: bit 7 of each byte above 128
    (the scales that need the two-multiply decode), every other bit 0. A
    byte's low 7 bits plus 0x7F reach bit 7 unless they are 0, and never
    carry out of the byte (at most 0xFE)."""
    return (w & 0x80808080) & ((w & 0x7F7F7F7F) + 0x7F7F7F7F)
