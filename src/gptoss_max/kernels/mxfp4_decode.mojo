import extensibility
from extensibility import InputTensor, OutputTensor, foreach
from layout import coord_to_index_list
from max.gpu.host import DeviceContext
from std.utils.coord import Coord

from .mxfp4 import mxfp4_element


@extensibility.register("gptoss_mxfp4_decode")
struct Mxfp4Decode:
    """Exposes the in-kernel MXFP4 decode (for exhaustive tests).

    Boundary: output [R, n] f32 <- blocks [R, n/2] u8, scales [R, n/32] u8.
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        blocks: InputTensor[dtype=DType.uint8, rank=2, ...],
        scales: InputTensor[dtype=DType.uint8, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var bp = blocks.unsafe_ptr()
        var sp = scales.unsafe_ptr()
        var row_bytes = blocks.dim_size[1]()
        var row_scales = scales.dim_size[1]()

        def decode_elem[
            width: Int
        ](idx: Coord) {var bp, var sp, var row_bytes, var row_scales} -> SIMD[
            DType.float32, width
        ]:
            var i2 = coord_to_index_list(idx)
            var r = i2[0]
            var res = SIMD[DType.float32, width](0)
            comptime for w in range(width):
                res[w] = mxfp4_element(
                    bp.unsafe_offset(r * row_bytes),
                    sp.unsafe_offset(r * row_scales),
                    i2[1] + w,
                )
            return res

        foreach[target=target, simd_width=1](decode_elem, output, ctx)
