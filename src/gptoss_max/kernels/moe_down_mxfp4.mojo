import extensibility
from extensibility import InputTensor, OutputTensor, foreach
from layout import coord_to_index_list
from max.gpu.host import DeviceContext
from std.utils.coord import Coord

from .moe_gpu import CHUNK_TOKENS, launch_down, n_counters
from .moe_gate_up_mxfp4 import check_big
from .moe_prefill_gpu import launch_prefill_down, prefill_choice
from .mxfp4 import MXFP4_BLOCK, TILE_ROWS, mxfp4_tiled_row_dot
from .poison import poison, scrub


@extensibility.register("gptoss_moe_down_mxfp4")
struct MoeDownMxfp4:
    """Down projection of each routed expert, weighted sum over top-k.

    Boundary (all contiguous, row-major):
      output       [T, H]  bf16 | f32   sum_k w[t,k] * (W_down[e] h[t,k] + b[e])
      h            [T, K, I] f32        from gptoss_moe_gate_up_*
      topk_ids     [T, K]  int32 (ids outside [0, E) contribute nothing)
      topk_weights [T, K]  f32
      blocks       [E, H, I/2]  u8   tiled order (mxfp4.mojo, tiled_block_offset):
                                     H % 16 == 0, I % 64 == 0
      scales       [E, H, I/32] u8   tiled order (tiled_scale_offset)
      bias         [E, H]  f32
      big          [E, H / 16] u8   as gptoss_moe_gate_up_mxfp4's, for these rows
      counters     [ceil(H / 8)] u32   from gptoss_moe_gate_up_mxfp4 (zeroed)
      partial      [T, K, H] f32        scratch output of the GPU path
                                        (per-pair products before the sum; the
                                        prefill path keeps them as bf16 in its
                                        first half)
      path         CPU int32 scalar, as gptoss_moe_gate_up_mxfp4's (both ops
                   of a step must get the same)

    GPU: moe_gpu.mojo, in chunks of CHUNK_TOKENS tokens. CPU: one output
    element per task, below (partial and counters unused).
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[rank=2, ...],
        partial: OutputTensor[dtype=DType.float32, rank=3, ...],
        h: InputTensor[dtype=DType.float32, rank=3, ...],
        topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
        topk_weights: InputTensor[dtype=DType.float32, rank=2, ...],
        blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        bias: InputTensor[dtype=DType.float32, rank=2, ...],
        big: InputTensor[dtype=DType.uint8, rank=2, ...],
        counters: InputTensor[dtype=DType.uint32, rank=1, ...],
        path: Int32,
        ctx: DeviceContext,
    ) raises:
        var no_logits = h.unsafe_ptr().unsafe_bitcast[BFloat16]()  # not read (routed False)
        down_mxfp4[target](
            output, partial, h, topk_ids, topk_weights, blocks, scales, bias, big, counters, path, no_logits, False, ctx
        )


def down_mxfp4[
    target: StaticString,
](
    output: OutputTensor[rank=2, ...],
    partial: OutputTensor[dtype=DType.float32, rank=3, ...],
    h: InputTensor[dtype=DType.float32, rank=3, ...],
    topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
    topk_weights: InputTensor[dtype=DType.float32, rank=2, ...],
    blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
    scales: InputTensor[dtype=DType.uint8, rank=3, ...],
    bias: InputTensor[dtype=DType.float32, rank=2, ...],
    big: InputTensor[dtype=DType.uint8, rank=2, ...],
    counters: InputTensor[dtype=DType.uint32, rank=1, ...],
    path: Int32,
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    routed: Bool,
    ctx: DeviceContext,
) raises:
    """gptoss_moe_down_mxfp4's work (its boundary). routed: topk_ids and
    topk_weights are the top-k of the router's bf16 logits (gptoss_moe_route_down_mxfp4),
    which a one-token step on the GPU may take itself (moe_gpu.launch_down)."""
    var hp = h.unsafe_ptr()
    var ids = topk_ids.unsafe_ptr()
    var wp = topk_weights.unsafe_ptr()
    var bp = blocks.unsafe_ptr()
    var sp = scales.unsafe_ptr()
    var biasp = bias.unsafe_ptr()
    var n_experts = blocks.dim_size[0]()
    var hidden = blocks.dim_size[1]()
    var inter = h.dim_size[2]()
    var top_k = topk_ids.dim_size[1]()
    if counters.dim_size[0]() != n_counters(hidden):
        raise Error("gptoss_moe_down_mxfp4: counters must be ceil(H / 8) long")
    if hidden % TILE_ROWS != 0 or inter % (2 * MXFP4_BLOCK) != 0:
        raise Error("gptoss_moe_down_mxfp4: the tiled layout needs H % 16 == 0 and I % 64 == 0")
    check_big(big.dim_size[1](), big.dim_size[0](), n_experts, hidden, "gptoss_moe_down_mxfp4")
    poison[target](ctx, output.unsafe_ptr(), output.size())
    poison[target](ctx, partial.unsafe_ptr(), partial.size())

    comptime if target == "gpu":
        var tokens = output.dim_size[0]()
        comptime if output.dtype == DType.bfloat16:
            var cfg = prefill_choice(tokens, top_k, n_experts, hidden, inter, Int(path))
            if cfg >= 0:
                launch_prefill_down[output.dtype](
                    ctx, cfg, output.unsafe_ptr(), partial.unsafe_ptr(), hp, ids, wp, bp, sp, biasp,
                    big.unsafe_ptr(), tokens, top_k, n_experts, hidden, inter,
                )
                _scrub_leftovers[target](ctx, h, partial, counters)
                return
        var t0 = 0
        # The counters are written here although they arrive as an input:
        # they are this op pair's private scratch (see the gate_up op).
        var cnt = counters.unsafe_ptr().unsafe_mut_cast[True]()
        while t0 < tokens:
            var tc = min(CHUNK_TOKENS, tokens - t0)
            launch_down[output.dtype](
                ctx,
                output.unsafe_ptr().unsafe_offset(t0 * hidden),
                partial.unsafe_ptr().unsafe_offset(t0 * top_k * hidden),
                cnt,
                hp.unsafe_offset(t0 * top_k * inter),
                ids.unsafe_offset(t0 * top_k),
                wp.unsafe_offset(t0 * top_k),
                bp,
                sp,
                biasp,
                tc,
                top_k,
                n_experts,
                hidden,
                inter,
                logits,
                routed,
            )
            t0 += tc
        _scrub_leftovers[target](ctx, h, partial, counters)
        return

    def out_elem[
        width: Int
    ](idx: Coord) {
        var hp,
        var ids,
        var wp,
        var bp,
        var sp,
        var biasp,
        var n_experts,
        var hidden,
        var inter,
        var top_k,
    } -> SIMD[output.dtype, width]:
        var i2 = coord_to_index_list(idx)
        var t = i2[0]
        var acc = SIMD[DType.float32, width](0)
        for k in range(top_k):
            var e = Int(ids[unsafe_offset=t * top_k + k])
            if e < 0 or e >= n_experts:
                continue
            var weight = wp[unsafe_offset=t * top_k + k]
            var hrow = hp.unsafe_offset((t * top_k + k) * inter)
            comptime for w in range(width):
                var row = e * hidden + i2[1] + w
                var y = mxfp4_tiled_row_dot(
                    bp.unsafe_offset(e * hidden * (inter // 2)),
                    sp.unsafe_offset(e * hidden * (inter // MXFP4_BLOCK)),
                    i2[1] + w,
                    hrow,
                    inter,
                )
                acc[w] += weight * (y + biasp[unsafe_offset=row])
        return acc.cast[output.dtype]()

    foreach[target=target, simd_width=1](out_elem, output, ctx)
    _scrub_leftovers[target](ctx, h, partial, counters)


def _scrub_leftovers[
    target: StaticString
](
    ctx: DeviceContext,
    h: InputTensor[dtype=DType.float32, rank=3, ...],
    partial: OutputTensor[dtype=DType.float32, rank=3, ...],
    counters: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """GPTOSS_MAX_SCRUB (poison.mojo): h (whose GPU prefill path holds the
    routed rows and the route's tables in arrival order), the partial scratch
    and the counters are this op pair's leftovers; in a model nothing reads
    them after this op (h and the counters come only from the gate_up op)."""
    scrub[target](ctx, h.unsafe_ptr().unsafe_mut_cast[True](), h.size())
    scrub[target](ctx, partial.unsafe_ptr(), partial.size())
    scrub[target](ctx, counters.unsafe_ptr().unsafe_mut_cast[True](), counters.size())
