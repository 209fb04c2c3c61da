import extensibility
from extensibility import InputTensor, OutputTensor
from layout import coord_to_index_list
from max.algorithm import elementwise
from max.gpu.host import DeviceContext
from std.utils.coord import Coord

from .moe_common import gptoss_swiglu
from .moe_gpu import CHUNK_TOKENS, launch_gate_up, n_counters
from .moe_prefill_gpu import big_groups, launch_prefill_gate_up, prefill_choice
from .mxfp4 import MXFP4_BLOCK, TILE_ROWS, mxfp4_tiled_row_dot
from .poison import poison


def gate_up_cpu[
    target: StaticString, x_dtype: DType
](
    ctx: DeviceContext,
    hp: Pointer[Float32, MutAnyOrigin],
    cp: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    xp: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    bp: Pointer[UInt8, ImmutAnyOrigin],
    sp: Pointer[UInt8, ImmutAnyOrigin],
    biasp: Pointer[Float32, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
) raises:
    """CPU path: counters zeroed, h[t, k, i] by one task per element (0 for an
    id outside [0, E))."""
    for i in range(n_count):
        cp[unsafe_offset=i] = 0
    var inter = rows // 2

    def h_elem[
        width: Int, alignment: Int = 1
    ](idx: Coord) {
        var hp, var xp, var ids, var bp, var sp, var biasp, var n_experts, var rows, var hidden, var top_k, var inter,
    }:
        var i3 = coord_to_index_list(idx)
        var t = i3[0]
        var k = i3[1]
        var i = i3[2]
        var out = hp.unsafe_offset((t * top_k + k) * inter + i)
        var e = Int(ids[unsafe_offset=t * top_k + k])
        if e < 0 or e >= n_experts:
            out[] = 0
            return
        var xrow = xp.unsafe_offset(t * hidden)
        var r = 2 * i
        var gate_row = e * rows + r
        var eb = bp.unsafe_offset(e * rows * (hidden // 2))
        var es = sp.unsafe_offset(e * rows * (hidden // MXFP4_BLOCK))
        var gate = mxfp4_tiled_row_dot(eb, es, r, xrow, hidden)
        var up = mxfp4_tiled_row_dot(eb, es, r + 1, xrow, hidden)
        out[] = gptoss_swiglu(gate + biasp[unsafe_offset=gate_row], up + biasp[unsafe_offset=gate_row + 1])

    elementwise[simd_width=1, target=target](h_elem, Coord(tokens, top_k, inter), ctx)


def gate_up_gpu[
    x_dtype: DType
](
    ctx: DeviceContext,
    hp: Pointer[Float32, MutAnyOrigin],
    cp: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    xp: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    bp: Pointer[UInt8, ImmutAnyOrigin],
    sp: Pointer[UInt8, ImmutAnyOrigin],
    biasp: Pointer[Float32, ImmutAnyOrigin],
    bigp: Pointer[UInt8, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
    path: Int,
) raises:
    """GPU path: the prefill grouped GEMM or the decode kernel (moe_gpu.mojo,
    in chunks of CHUNK_TOKENS tokens), as `path` and the shapes choose."""
    comptime if x_dtype == DType.bfloat16:
        var cfg = prefill_choice(tokens, top_k, n_experts, hidden, rows // 2, path)
        if cfg >= 0:
            launch_prefill_gate_up(
                ctx, cfg, hp, rebind[Pointer[BFloat16, ImmutAnyOrigin]](xp),
                ids, bp, sp, biasp, bigp, tokens, top_k, n_experts, rows, hidden,
            )
            return
    var t0 = 0
    while t0 < tokens:
        var tc = min(CHUNK_TOKENS, tokens - t0)
        launch_gate_up[x_dtype](
            ctx,
            hp.unsafe_offset(t0 * top_k * (rows // 2)),
            cp,
            n_count,
            xp.unsafe_offset(t0 * hidden),
            ids.unsafe_offset(t0 * top_k),
            bp,
            sp,
            biasp,
            tc,
            top_k,
            n_experts,
            rows,
            hidden,
        )
        t0 += tc


def check_big(groups: Int, experts: Int, n_experts: Int, rows: Int, who: StaticString) raises:
    """The `big` input's shape: [E, rows / 16] (moe_prefill_gpu.big_groups)."""
    if experts != n_experts or groups != big_groups(rows):
        raise Error(String(who) + ": big must be [E, rows / 16] (mxfp4.big_scale_groups of the scales)")


def check_gate_up(n_count: Int, rows: Int, hidden: Int, who: StaticString) raises:
    if n_count != n_counters(hidden):
        raise Error(String(who) + ": counters must be ceil(H / 8) long")
    if rows % TILE_ROWS != 0 or hidden % (2 * MXFP4_BLOCK) != 0:
        raise Error(String(who) + ": the tiled layout needs 2I % 16 == 0 and H % 64 == 0")


@extensibility.register("gptoss_moe_gate_up_mxfp4")
struct MoeGateUpMxfp4:
    """SwiGLU intermediate of each token's routed experts, MXFP4 weights.

    Boundary (all contiguous, row-major):
      output   [T, K, I] f32   h[t, k] for expert topk_ids[t, k]
      x        [T, H]    bf16 | f32
      topk_ids [T, K]    int32 (ids outside [0, E) give h = 0)
      blocks   [E, 2I, H/2]  u8   rows interleaved: gate = 2i, up = 2i + 1;
                                  bytes in the tiled order (mxfp4.mojo,
                                  tiled_block_offset): 2I % 16 == 0, H % 64 == 0
      scales   [E, 2I, H/32] u8   tiled order (tiled_scale_offset)
      bias     [E, 2I]   f32
      big      [E, 2I / 16] u8   1 where a scale byte of rows 16g .. 16g + 15
                                  is above 128 (mxfp4.big_scale_groups);
                                  read by the GPU prefill GEMM only
      counters [ceil(H / 8)] u32   zeroed here for gptoss_moe_down_mxfp4
                                    of the same step (GPU path's tile
                                    counters; the CPU path just zeroes it)
      path     CPU int32 scalar: 0 auto, 1 decode kernel, 2 + c prefill
               tile configuration c (moe_prefill_gpu.prefill_choice); GPU only

    GPU: moe_gpu.mojo (routed experts only, tensor cores), in chunks of
    CHUNK_TOKENS tokens. CPU: one element per task, below.
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.float32, rank=3, ...],
        counters: OutputTensor[dtype=DType.uint32, rank=1, ...],
        x: InputTensor[rank=2, ...],
        topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
        blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        bias: InputTensor[dtype=DType.float32, rank=2, ...],
        big: InputTensor[dtype=DType.uint8, rank=2, ...],
        path: Int32,
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
        var n_count = counters.dim_size[0]()
        check_gate_up(n_count, rows, hidden, "gptoss_moe_gate_up_mxfp4")
        check_big(big.dim_size[1](), big.dim_size[0](), n_experts, rows, "gptoss_moe_gate_up_mxfp4")
        poison[target](ctx, output.unsafe_ptr(), output.size())
        poison[target](ctx, counters.unsafe_ptr(), n_count)

        comptime if target == "gpu":
            gate_up_gpu[x.dtype](
                ctx, output.unsafe_ptr(), counters.unsafe_ptr(), n_count, xp, ids, bp, sp, biasp, big.unsafe_ptr(),
                x.dim_size[0](), top_k, n_experts, rows, hidden, Int(path),
            )
            return

        gate_up_cpu[target, x.dtype](
            ctx, output.unsafe_ptr(), counters.unsafe_ptr(), n_count, xp, ids, bp, sp, biasp,
            x.dim_size[0](), top_k, n_experts, rows, hidden,
        )
