# Pieces shared by the MoE ops: gpt-oss's clamped SwiGLU and a dense row dot.

from std.math import exp

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
