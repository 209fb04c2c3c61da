import extensibility
from extensibility import InputTensor, OutputTensor, foreach
from layout import coord_to_index_list
from max.gpu.host import DeviceContext
from std.utils.coord import Coord

from .moe_common import dense_row_dot, gptoss_swiglu


@extensibility.register("gptoss_moe_gate_up_bf16")
struct MoeGateUpBf16:
    """SwiGLU intermediate of each token's routed experts, dense weights.

    Boundary (all contiguous, row-major):
      output   [T, K, I] f32   h[t, k] for expert topk_ids[t, k]
      x        [T, H]    bf16 | f32
      topk_ids [T, K]    int32 (ids outside [0, E) give h = 0)
      weight   [E, 2I, H] bf16 (or f32)  rows interleaved: gate 2i, up 2i + 1
      bias     [E, 2I]   f32
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.float32, rank=3, ...],
        x: InputTensor[rank=2, ...],
        topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
        weight: InputTensor[rank=3, ...],
        bias: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var xp = x.unsafe_ptr()
        var ids = topk_ids.unsafe_ptr()
        var wp = weight.unsafe_ptr()
        var biasp = bias.unsafe_ptr()
        var n_experts = weight.dim_size[0]()
        var rows = weight.dim_size[1]()
        var hidden = x.dim_size[1]()
        var top_k = topk_ids.dim_size[1]()

        def h_elem[
            width: Int
        ](idx: Coord) {
            var xp,
            var ids,
            var wp,
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
                var gate = dense_row_dot(
                    wp.unsafe_offset(gate_row * hidden), xrow, hidden
                )
                var up = dense_row_dot(
                    wp.unsafe_offset((gate_row + 1) * hidden), xrow, hidden
                )
                res[w] = gptoss_swiglu(
                    gate + biasp[unsafe_offset=gate_row],
                    up + biasp[unsafe_offset=gate_row + 1],
                )
            return res

        foreach[target=target, simd_width=1](h_elem, output, ctx)
