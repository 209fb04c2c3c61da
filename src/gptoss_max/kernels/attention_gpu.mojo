# GPU path of gptoss_attention_with_sinks (flash-decoding style, CUDA cores).
#
# Grid (T, S, n_heads / HPB): one block per (query token, key split, group
# of HPB query heads sharing one KV head); one warp per query head. A split
# is a contiguous stripe of the token's key range [first, pos], cut into S
# equal parts on the device (the range is data; S comes from shapes only, so
# the launch is the same for every step of a shape: CUDA-graph safe). Lanes
# take the stripe's keys j = j0 + lane, j0 + lane + 32, ...: each lane keeps
# its own online softmax (max m, sum l, acc[D] in f32 registers), reading
# the whole K and V rows of its key as 16-byte vector loads; the HPB warps of
# a block read the same rows, so they come from L1 after the first.
# The warp then merges its lanes (max and sum by butterfly shuffles).
#
#   S == 1: the block finishes the softmax with the sink and writes out.
#   S  > 1: it writes (acc[D], m, l) to scratch[t * S + s, h]; a second
#           launch (grid T x n_heads, one warp each) merges the S partials
#           with the sink. S = max(1, SPLIT_TOKENS // T), so T * S <= 16
#           rows of scratch whenever S > 1.
#
# Scores are kept in base 2 (q is pre-scaled by scale * log2(e), sinks by
# log2(e)), so every exponential is one exp2.

from max.gpu import block_idx, lane_id, warp_id
from max.gpu.host import DeviceContext
from max.gpu.primitives.warp import shuffle_xor
from std.math import exp2

comptime SPLIT_TOKENS = 16
comptime LOG2E: Float32 = 1.4426950408889634
# A finite "minus infinity": exp2 of it, or of it minus a score, is 0, and
# it minus itself is 0 (no NaN when a lane or a split saw no key).
comptime NEG_BIG: Float32 = -1.0e30


def n_splits(tokens: Int) -> Int:
    """Key splits per token for a step of `tokens` query rows."""
    return max(1, SPLIT_TOKENS // max(tokens, 1))


def heads_per_block(group: Int) -> Int:
    """Warps (query heads) per block: the largest of 8, 4, 2, 1 dividing
    the number of query heads per KV head, so a block reads one KV head."""
    var hpb = 8
    while hpb > 1 and group % hpb != 0:
        hpb //= 2
    return hpb


@always_inline
def _warp_max(v: Float32) -> Float32:
    var r = v
    comptime for i in range(5):
        r = max(r, shuffle_xor(r, UInt32(16 >> i)))
    return r


@always_inline
def _warp_sum(v: Float32) -> Float32:
    var r = v
    comptime for i in range(5):
        r += shuffle_xor(r, UInt32(16 >> i))
    return r


@always_inline
def _slot(trow: Pointer[UInt32, ImmutAnyOrigin], j: Int, page_size: Int, page_elems: Int, slot_elems: Int) -> Int:
    """Element offset of key position j's slot (K of layer 0, KV head 0)."""
    return Int(trow[unsafe_offset=j // page_size]) * page_elems + (j % page_size) * slot_elems


def attention_split_kernel[
    dtype: DType, sink_dtype: DType, head_dim: Int
](
    output: Pointer[Scalar[dtype], MutAnyOrigin],
    scratch: Pointer[Float32, MutAnyOrigin],
    q: Pointer[Scalar[dtype], ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    kv: Pointer[Scalar[dtype], MutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    batch_: Int64,
    max_pages_: Int64,
    n_heads_: Int64,
    page_size_: Int64,
    group_: Int64,
    hpb_: Int64,
    slot_elems_: Int64,
    page_elems_: Int64,
    k_base_: Int64,
    v_base_: Int64,
    window_: Int64,
    splits_: Int64,
    scale: Float32,
):
    comptime D = head_dim
    var batch = Int(batch_)
    var max_pages = Int(max_pages_)
    var n_heads = Int(n_heads_)
    var page_size = Int(page_size_)
    var splits = Int(splits_)
    var t = Int(block_idx.x)
    var s = Int(block_idx.y)
    var h = Int(block_idx.z) * Int(hpb_) + Int(warp_id())
    var lane = Int(lane_id())

    # The sequence of row t: the last b with offs[b] <= t.
    var lo = 0
    var hi = batch
    while hi - lo > 1:
        var mid = (lo + hi) >> 1
        if Int(offs[unsafe_offset=mid]) <= t:
            lo = mid
        else:
            hi = mid
    var b = lo
    var pos = Int(lens[unsafe_offset=b]) + t - Int(offs[unsafe_offset=b])
    var win = Int(window_)
    var first = max(pos - win + 1, 0) if win > 0 else 0
    var n_keys = pos + 1 - first
    var stripe = (n_keys + splits - 1) // splits
    var j0 = first + s * stripe
    var j1 = min(j0 + stripe, pos + 1)

    var qv = q.unsafe_offset((t * n_heads + h) * D).unsafe_load[width=D, alignment=16]().cast[
        DType.float32
    ]() * (scale * LOG2E)
    var head_off = (h // Int(group_)) * D
    var slot_elems = Int(slot_elems_)
    var page_elems = Int(page_elems_)
    var k_base = Int(k_base_)
    var v_base = Int(v_base_)
    var trow = table.unsafe_offset(b * max_pages)

    var m = NEG_BIG
    var l: Float32 = 0
    var acc = SIMD[DType.float32, D](0)
    # Two keys per trip (j and j + 32) so four row loads are in flight; the
    # accumulator is rescaled only when the running max moves.
    var j = j0 + lane
    while j < j1:
        var j2 = j + 32
        var has2 = j2 < j1
        var jb = j2 if has2 else j
        var sa = _slot(trow, j, page_size, page_elems, slot_elems) + head_off
        var sb = _slot(trow, jb, page_size, page_elems, slot_elems) + head_off
        var ka = kv.unsafe_offset(sa + k_base).unsafe_load[width=D, alignment=16]()
        var kb = kv.unsafe_offset(sb + k_base).unsafe_load[width=D, alignment=16]()
        var va = kv.unsafe_offset(sa + v_base).unsafe_load[width=D, alignment=16]()
        var vb = kv.unsafe_offset(sb + v_base).unsafe_load[width=D, alignment=16]()
        var score_a = (qv * ka.cast[DType.float32]()).reduce_add()
        var score_b = (qv * kb.cast[DType.float32]()).reduce_add() if has2 else NEG_BIG
        var m_new = max(m, max(score_a, score_b))
        if m_new > m:
            var corr = exp2(m - m_new)
            l *= corr
            acc *= corr
            m = m_new
        var pa = exp2(score_a - m)
        var pb = exp2(score_b - m)
        l += pa + pb
        acc += va.cast[DType.float32]() * pa + vb.cast[DType.float32]() * pb
        j += 64

    # Merge the warp's lanes.
    var mw = _warp_max(m)
    var c = exp2(m - mw)
    var lw = _warp_sum(l * c)
    acc *= c
    comptime for d in range(D):
        acc[d] = _warp_sum(acc[d])

    if splits == 1:
        var sink = sinks[unsafe_offset=h].cast[DType.float32]() * LOG2E
        var mg = max(mw, sink)
        var f = exp2(mw - mg)
        var inv = f / (lw * f + exp2(sink - mg))
        if lane == 0:
            output.unsafe_offset((t * n_heads + h) * D).unsafe_store[alignment=16](
                (acc * inv).cast[dtype]()
            )
        return
    if lane == 0:
        var row = scratch.unsafe_offset(((t * splits + s) * n_heads + h) * (D + 2))
        row.unsafe_store[alignment=8](acc)
        row[unsafe_offset=D] = mw
        row[unsafe_offset=D + 1] = lw


def attention_merge_kernel[
    dtype: DType, sink_dtype: DType, head_dim: Int
](
    output: Pointer[Scalar[dtype], MutAnyOrigin],
    scratch: Pointer[Float32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    n_heads_: Int64,
    splits_: Int64,
):
    """One warp per (t, h): lane handles dims lane, lane + 32, ..."""
    comptime D = head_dim
    var n_heads = Int(n_heads_)
    var splits = Int(splits_)
    var t = Int(block_idx.x)
    var h = Int(block_idx.y)
    var lane = Int(lane_id())
    var sink = sinks[unsafe_offset=h].cast[DType.float32]() * LOG2E
    var mg = sink
    for s in range(splits):
        mg = max(mg, scratch[unsafe_offset=((t * splits + s) * n_heads + h) * (D + 2) + D])
    var den = exp2(sink - mg)
    comptime per_lane = (D + 31) // 32
    var o = SIMD[DType.float32, per_lane](0)
    for s in range(splits):
        var row = scratch.unsafe_offset(((t * splits + s) * n_heads + h) * (D + 2))
        var w = exp2(row[unsafe_offset=D] - mg)
        den += row[unsafe_offset=D + 1] * w
        comptime for i in range(per_lane):
            var d = lane + 32 * i
            if d < D:
                o[i] += row[unsafe_offset=d] * w
    var orow = output.unsafe_offset((t * n_heads + h) * D)
    comptime for i in range(per_lane):
        var d = lane + 32 * i
        if d < D:
            orow[unsafe_offset=d] = (o[i] / den).cast[dtype]()


def launch_attention[
    dtype: DType, sink_dtype: DType, head_dim: Int
](
    ctx: DeviceContext,
    output: Pointer[Scalar[dtype], MutAnyOrigin],
    scratch: Pointer[Float32, MutAnyOrigin],
    scratch_rows: Int,
    q: Pointer[Scalar[dtype], ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    kv: Pointer[Scalar[dtype], MutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    tokens: Int,
    batch: Int,
    max_pages: Int,
    n_heads: Int,
    page_size: Int,
    group: Int,
    slot_elems: Int,
    page_elems: Int,
    k_base: Int,
    v_base: Int,
    window: Int,
    scale: Float32,
) raises:
    comptime if head_dim & (head_dim - 1) != 0 or head_dim % 8 != 0 or head_dim > 256:
        raise Error("gptoss_attention_with_sinks GPU path: head_dim must be a power of two in [8, 256]")
    if tokens == 0:
        return
    var splits = n_splits(tokens)
    if splits > 1 and tokens * splits > scratch_rows:
        raise Error("gptoss_attention_with_sinks: scratch too small for the key splits")
    var hpb = heads_per_block(group)
    ctx.enqueue_function[attention_split_kernel[dtype, sink_dtype, head_dim]](
        output, scratch, q, offs, kv, lens, table, sinks,
        Int64(batch), Int64(max_pages), Int64(n_heads), Int64(page_size), Int64(group),
        Int64(hpb), Int64(slot_elems), Int64(page_elems), Int64(k_base), Int64(v_base),
        Int64(window), Int64(splits), scale,
        grid_dim=(tokens, splits, n_heads // hpb),
        block_dim=hpb * 32,
    )
    if splits > 1:
        ctx.enqueue_function[attention_merge_kernel[dtype, sink_dtype, head_dim]](
            output, scratch, sinks, Int64(n_heads), Int64(splits),
            grid_dim=(tokens, n_heads),
            block_dim=32,
        )
