import extensibility
from extensibility import InputTensor, OutputTensor, foreach
from layout import coord_to_index_list
from max.gpu.host import DeviceContext
from std.utils.coord import Coord

from .moe_common import gptoss_swiglu
from .mxfp4 import MXFP4_BLOCK, mxfp4_row_dot


@extensibility.register("gptoss_moe_gate_up_mxfp4")
struct MoeGateUpMxfp4:
    """SwiGLU intermediate of each token's routed experts, MXFP4 weights.

    Boundary (all contiguous, row-major):
      output   [T, K, I] f32   h[t, k] for expert topk_ids[t, k]
      x        [T, H]    bf16 | f32
      topk_ids [T, K]    int32 (ids outside [0, E) give h = 0)
      blocks   [E, 2I, H/2]  u8   rows interleaved: gate = 2i, up = 2i + 1
      scales   [E, 2I, H/32] u8
      bias     [E, 2I]   f32
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.float32, rank=3, ...],
        x: InputTensor[rank=2, ...],
        topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
        blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        bias: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var xp = x.unsafe_ptr()
        var ids = topk_ids.unsafe_ptr()
        var bp = blocks.unsafe_ptr()
        var sp = scales.unsafe_ptr()
        var biasp = bias.unsafe_ptr()
        var n_experts = blocks.dim_size[0]()
        var rows = blocks.dim_size[1]()
        var hidden = x.dim_size[1]()
        var top_k = topk_ids.dim_size[1]()

        def h_elem[
            width: Int
        ](idx: Coord) {
            var xp,
            var ids,
            var bp,
            var sp,
            var biasp,
            var n_experts,
            var rows,
            var hidden,
            var top_k,
        } -> SIMD[DType.float32, width]:
            var i3 = coord_to_index_list(idx)
            var t = i3[0]
            var e = Int(ids[unsafe_offset=t * top_k + i3[1]])
            var res = SIMD[DType.float32, width](0)
            if e < 0 or e >= n_experts:
                return res
            var xrow = xp.unsafe_offset(t * hidden)
            comptime for w in range(width):
                var gate_row = e * rows + 2 * (i3[2] + w)
                var gate = mxfp4_row_dot(
                    bp.unsafe_offset(gate_row * (hidden // 2)),
                    sp.unsafe_offset(gate_row * (hidden // MXFP4_BLOCK)),
                    xrow,
                    hidden,
                )
                var up = mxfp4_row_dot(
                    bp.unsafe_offset((gate_row + 1) * (hidden // 2)),
                    sp.unsafe_offset((gate_row + 1) * (hidden // MXFP4_BLOCK)),
                    xrow,
                    hidden,
                )
                res[w] = gptoss_swiglu(
                    gate + biasp[unsafe_offset=gate_row],
                    up + biasp[unsafe_offset=gate_row + 1],
                )
            return res

        foreach[target=target, simd_width=1](h_elem, output, ctx)
