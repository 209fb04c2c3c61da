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
#           rows of scratch whenever S > 1; a sliding-window layer takes at
#           most ceil(window / WINDOW_KEYS_PER_SPLIT) (one split, no merge
#           launch, for gpt-oss's window of 128). Both are host-side facts of
#           the layer and the step's shape, so the launches stay graph-safe.
#
# Scores are kept in base 2 (q is pre-scaled by scale * log2(e), sinks by
# log2(e)), so every exponential is one exp2.

from max.gpu import barrier, block_idx, lane_id, thread_idx, warp_id
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext
from max.gpu.intrinsics import byte_permute
from max.gpu.memory import AddressSpace
from max.gpu.primitives.warp import shuffle_idx, shuffle_xor
from std.collections import Array
from std.math import exp2
from std.os import getenv
from std.memory import bitcast, stack_allocation

from .pdl import pdl_attributes, pdl_enter

comptime SPLIT_TOKENS = 16
# Keys a split of a sliding-window layer covers at least: 128 is two 16-key
# chunks per warp of the tensor-core kernel, cheaper than a merge launch.
comptime WINDOW_KEYS_PER_SPLIT = 128
comptime LOG2E: Float32 = 1.4426950408889634
# A finite "minus infinity": exp2 of it, or of it minus a score, is 0, and
# it minus itself is 0 (no NaN when a lane or a split saw no key).
comptime NEG_BIG: Float32 = -1.0e30


def n_splits(tokens: Int, window: Int) -> Int:
    """Key splits per token for a step of `tokens` query rows of a layer
    whose window is `window` keys (0: none)."""
    var s = max(1, SPLIT_TOKENS // max(tokens, 1))
    if window > 0:
        s = min(s, (window + WINDOW_KEYS_PER_SPLIT - 1) // WINDOW_KEYS_PER_SPLIT)
    return s


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
def _row_pos(
    offs: Pointer[UInt32, ImmutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    batch: Int,
    t: Int,
) -> Tuple[Int, Int]:
    """(sequence b of row t, row t's position p = cache_lengths[b] + t - offs[b])."""
    var lo = 0
    var hi = batch
    while hi - lo > 1:
        var mid = (lo + hi) >> 1
        if Int(offs[unsafe_offset=mid]) <= t:
            lo = mid
        else:
            hi = mid
    return (lo, Int(lens[unsafe_offset=lo]) + t - Int(offs[unsafe_offset=lo]))


@always_inline
def _key_range(
    offs: Pointer[UInt32, ImmutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    batch: Int,
    t: Int,
    win: Int,
    splits: Int,
    s: Int,
) -> Tuple[Int, Int, Int, Int]:
    """(sequence b of row t, first key j0, end j1, row t's position) of split
    s of row t's key range [first, pos]: the range cut into `splits` equal
    stripes."""
    var bp = _row_pos(offs, lens, batch, t)
    var pos = bp[1]
    var first = max(pos - win + 1, 0) if win > 0 else 0
    var stripe = (pos + 1 - first + splits - 1) // splits
    var j0 = first + s * stripe
    return (bp[0], j0, min(j0 + stripe, pos + 1), pos)


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
    pdl_enter()
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

    var kr = _key_range(offs, lens, batch, t, Int(window_), splits, s)
    var b = kr[0]
    var j0 = kr[1]
    var j1 = kr[2]

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


# ---------------------------------------------------------------- tensor cores
#
# attention_tc_kernel (bf16, head_dim 64, 8 query heads per KV head): one
# block per (token, split, KV head), TC_WARPS warps taking 16-key chunks of the
# split in turn. Per chunk a warp runs mma.sync m16n8k16 with the 8 query
# heads as rows 0..7 of M (rows 8..15 zero):
#   S = Q K^T: 2 groups of 8 keys x 4 k-steps of 16 dims. Lane (g, q) feeds
#       B from key g's row and A from head g's row, both at dim pairs
#       8q .. 8q+7 (a consistent permutation of the dims: a dot product does
#       not care), so each lane reads 32 contiguous bytes per row.
#   P V: P (the C fragments of S, rescaled, as bf16) is A directly (the
#       C -> A layout identity of m16n8k16); B for n-tile j holds dim 8g + j
#       of V for keys 2q, 2q+1, 2q+8, 2q+9: each lane reads 16 contiguous
#       bytes of those 4 V rows and pairs them with prmt. The output's dims
#       come out in that order and are put back on the way out.
# The warps then merge through shared memory, and the block finishes the
# softmax with the sink (one split) or writes its partial for
# attention_merge_kernel, exactly as attention_split_kernel does.

# Decode steps of bf16 gpt-oss shapes (head_dim 64, 8 query heads per KV
# head) take the tensor-core kernel; others the CUDA-core one above.
comptime USE_TENSOR_CORES = True
# Warps per block: 8 for steps of 2 to 16 rows while they have few blocks
# (batch 8 at 1k: 13.4 us per layer against 18.9 with 4) and for one-token
# steps (20b batch 1, H100: a sliding-window layer 8.2 -> 6.9 us, a full one
# 6.9 -> 6.2; end to end 494 -> 505 tok/s; an older reading the other way,
# 120b 3.67 against 3.55 ms, was taken while nvidia-smi polled during the
# timed decode: bench/NOTES.md), else 4 (batch 64: 48 us against 53).
comptime TC_WARPS_FEW = 8
comptime TC_WARPS_MANY = 4
comptime TC_HEADS = 8
comptime TC_DIM = 64


@always_inline
def _quad_max(v: Float32) -> Float32:
    var r = max(v, shuffle_xor(v, UInt32(1)))
    return max(r, shuffle_xor(r, UInt32(2)))


@always_inline
def _quad_sum(v: Float32) -> Float32:
    var r = v + shuffle_xor(v, UInt32(1))
    return r + shuffle_xor(r, UInt32(2))


@always_inline
def _pack_bf16(a: Float32, b: Float32) -> UInt32:
    return bitcast[DType.uint32, 1](SIMD[DType.float32, 2](a, b).cast[DType.bfloat16]())


@always_inline
def _rope16[
    fdtype: DType
](own: SIMD[DType.uint32, 8], cs: SIMD[fdtype, 32], first_half: Bool) -> SIMD[DType.uint32, 8]:
    """RoPE (rotate-half pairing) of 16 contiguous bf16 dims of a 64-dim head
    row, whose partners (d + 32 or d - 32) are held by lane ^ 2; cs holds the
    (cos, sin) pairs of those 16 frequencies. Computed in f32, rounded once to
    bf16. Every lane of the warp must call it (it shuffles)."""
    var out = SIMD[DType.uint32, 8](0)
    comptime for i in range(8):  # dim pair 2 i, 2 i + 1: frequencies 2 i, 2 i + 1
        var x = bitcast[DType.bfloat16, 2](own[i]).cast[DType.float32]()
        var y = bitcast[DType.bfloat16, 2](shuffle_xor(own[i], UInt32(2))).cast[DType.float32]()
        var c = SIMD[fdtype, 2](cs[4 * i], cs[4 * i + 2]).cast[DType.float32]()
        var sn = SIMD[fdtype, 2](cs[4 * i + 1], cs[4 * i + 3]).cast[DType.float32]()
        var r = x * c - y * sn if first_half else x * c + y * sn
        out[i] = bitcast[DType.uint32, 1](r.cast[DType.bfloat16]())
    return out


def attention_tc_kernel[
    sink_dtype: DType, TC_WARPS: Int, ROPE: Bool = False, fdtype: DType = DType.bfloat16
](
    output: Pointer[BFloat16, MutAnyOrigin],
    scratch: Pointer[Float32, MutAnyOrigin],
    q: Pointer[BFloat16, ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    kv: Pointer[BFloat16, MutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    freqs: Pointer[Scalar[fdtype], ImmutAnyOrigin],
    batch_: Int64,
    max_pages_: Int64,
    n_heads_: Int64,
    page_size_: Int64,
    slot_elems_: Int64,
    page_elems_: Int64,
    k_base_: Int64,
    v_base_: Int64,
    window_: Int64,
    splits_: Int64,
    scale: Float32,
):
    """ROPE = False: q is [T, n_heads, 64], already roped, and this step's K/V
    are in the cache (freqs unused). ROPE = True (pure decode steps only: one
    new token per sequence): q is the qkv projection [T, (n_heads + 2 n_kv)
    * 64]; each block ropes its heads' q rows with freqs row p (rotate-half,
    MAX's (cos, sin)-interleaved table [positions, 64]), and the one block
    whose split holds the new key p ropes its K row, takes its V row, uses
    both for key p and writes them to the cache: this step's K/V are not in
    the cache before the launch, and no other block reads slot p."""
    pdl_enter()
    comptime D = TC_DIM
    var n_heads = Int(n_heads_)
    var page_size = Int(page_size_)
    var page_elems = Int(page_elems_)
    var slot_elems = Int(slot_elems_)
    var k_base = Int(k_base_)
    var v_base = Int(v_base_)
    var splits = Int(splits_)
    var t = Int(block_idx.x)
    var s = Int(block_idx.y)
    var kvh = Int(block_idx.z)
    var w = Int(warp_id())
    var lane = Int(lane_id())
    var g = lane >> 2
    var q4 = lane & 3
    var kr = _key_range(offs, lens, Int(batch_), t, Int(window_), splits, s)
    var j0 = kr[1]
    var j1 = kr[2]
    var pos = kr[3]
    var trow = table.unsafe_offset(kr[0] * Int(max_pages_))
    var head_off = kvh * D
    var h = kvh * TC_HEADS + g
    # qkv's row: n_heads q heads, then n_heads / 8 K heads, then as many V heads.
    var q_row = n_heads * D + (n_heads // 4) * D if ROPE else n_heads * D
    var k_new = q.unsafe_offset(t * q_row + n_heads * D + kvh * D)
    var v_new = k_new.unsafe_offset((n_heads // TC_HEADS) * D)

    # Q (head g), dim pairs 8 q4 .. 8 q4 + 7.
    var qw = q.unsafe_offset(t * q_row + h * D + 16 * q4).unsafe_bitcast[UInt32]()
    var qa = SIMD[DType.uint32, 8](0)
    qa = qa.insert[offset=0](qw.unsafe_load[width=4, alignment=16](0))
    qa = qa.insert[offset=4](qw.unsafe_load[width=4, alignment=16](4))
    # (cos, sin) of the 16 frequencies of the lane's dims at position pos, kept
    # in the table's dtype (16 registers for bf16) for the new key's RoPE.
    var cs = SIMD[fdtype, 32](0)
    comptime if ROPE:
        cs = freqs.unsafe_offset(pos * D + 32 * (q4 & 1)).unsafe_load[width=32, alignment=16]()
        qa = _rope16(qa, cs, q4 < 2)
    var sl = scale * LOG2E

    var m = NEG_BIG
    var l: Float32 = 0
    var acc = Array[SIMD[DType.float32, 4], 8](fill=SIMD[DType.float32, 4](0))
    # With ROPE the new key (always the last of the split holding it) is not
    # in the cache yet: the loop stops before it and one warp adds it after.
    var holds_new = ROPE and j0 <= pos and pos < j1
    var je = pos if holds_new else j1
    # The new key's K row (roped after the loop, lane: dims 16 q4 .. 16 q4 + 15,
    # as q) and V row, loaded now so their latency hides behind the loop.
    var kraw = SIMD[DType.uint32, 8](0)
    var vraw = SIMD[DType.uint32, 8](0)
    comptime if ROPE:
        if holds_new and w == TC_WARPS - 1:
            var knp = k_new.unsafe_offset(16 * q4).unsafe_bitcast[UInt32]()
            var vnp = v_new.unsafe_offset(16 * q4).unsafe_bitcast[UInt32]()
            kraw = kraw.insert[offset=0](knp.unsafe_load[width=4, alignment=16](0))
            kraw = kraw.insert[offset=4](knp.unsafe_load[width=4, alignment=16](4))
            vraw = vraw.insert[offset=0](vnp.unsafe_load[width=4, alignment=16](0))
            vraw = vraw.insert[offset=4](vnp.unsafe_load[width=4, alignment=16](4))
    var kbase = j0 + 16 * w
    while kbase < je:
        # V rows of keys 2 q4, 2 q4 + 1, 2 q4 + 8, 2 q4 + 9: dims 8 g .. 8 g + 7,
        # loaded first so they are in flight with K's.
        var vr = Array[SIMD[DType.uint32, 4], 4](fill=SIMD[DType.uint32, 4](0))
        comptime for i in range(4):
            var key = kbase + 2 * q4 + (i & 1) + 8 * (i >> 1)
            if key < je:
                var vp = kv.unsafe_offset(_slot(trow, key, page_size, page_elems, slot_elems) + head_off + v_base)
                vr[i] = vp.unsafe_offset(8 * g).unsafe_bitcast[UInt32]().unsafe_load[width=4, alignment=16](0)
        # K rows of keys kbase + 8 grp + g, dims 16 q4 .. 16 q4 + 15.
        var kw = Array[SIMD[DType.uint32, 8], 2](fill=SIMD[DType.uint32, 8](0))
        comptime for grp in range(2):
            var key = kbase + 8 * grp + g
            if key < je:
                var kp = kv.unsafe_offset(_slot(trow, key, page_size, page_elems, slot_elems) + head_off + k_base)
                var kwp = kp.unsafe_offset(16 * q4).unsafe_bitcast[UInt32]()
                kw[grp] = kw[grp].insert[offset=0](kwp.unsafe_load[width=4, alignment=16](0))
                kw[grp] = kw[grp].insert[offset=4](kwp.unsafe_load[width=4, alignment=16](4))
        # Scores of keys kbase + 8 grp + 2 q4 + {0, 1} for head g.
        var sc = SIMD[DType.float32, 4](NEG_BIG)
        comptime for grp in range(2):
            var sacc = SIMD[DType.float32, 4](0)
            comptime for ks in range(4):
                var a = bitcast[DType.bfloat16, 8](SIMD[DType.uint32, 4](qa[2 * ks], 0, qa[2 * ks + 1], 0))
                var bb = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](kw[grp][2 * ks], kw[grp][2 * ks + 1]))
                mma(sacc, a, bb, sacc)
            comptime for i in range(2):
                if kbase + 8 * grp + 2 * q4 + i < je:
                    sc[2 * grp + i] = sacc[i] * sl
        var m_new = max(m, _quad_max(sc.reduce_max()))
        var corr = exp2(m - m_new)
        m = m_new
        var p = SIMD[DType.float32, 4](0)
        comptime for i in range(4):
            p[i] = exp2(sc[i] - m)
        l = l * corr + p.reduce_add()
        # P as the A fragment: keys 2 q4, 2 q4 + 1 (group 0), 8 + 2 q4, 9 + 2 q4 (group 1).
        var pa = bitcast[DType.bfloat16, 8](
            SIMD[DType.uint32, 4](_pack_bf16(p[0], p[1]), 0, _pack_bf16(p[2], p[3]), 0)
        )
        comptime for j in range(8):
            comptime sel = UInt32(0x5410 if j % 2 == 0 else 0x7632)
            var b01 = byte_permute(vr[0][j // 2], vr[1][j // 2], sel)
            var b23 = byte_permute(vr[2][j // 2], vr[3][j // 2], sel)
            var bb = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](b01, b23))
            var cj = acc[j] * corr
            mma(cj, pa, bb, cj)
            acc[j] = cj
        kbase += 16 * TC_WARPS

    comptime if ROPE:
        if holds_new and w == TC_WARPS - 1:  # warp-uniform
            # The new key: K row roped, V row as is.
            var kn = _rope16(kraw, cs, q4 < 2)
            var slot = kv.unsafe_offset(_slot(trow, pos, page_size, page_elems, slot_elems) + head_off)
            if g < 2:  # lanes of g = 0 write the K row, of g = 1 the V row
                var row = slot.unsafe_offset((k_base if g == 0 else v_base) + 16 * q4).unsafe_bitcast[UInt32]()
                var src = kn if g == 0 else vraw
                row.unsafe_store[alignment=16](src.slice[4, offset=0]())
                row.unsafe_offset(4).unsafe_store[alignment=16](src.slice[4, offset=4]())
            # Its score for head g (the quad's four 16-dim parts), then one online-softmax step.
            var qf = bitcast[DType.bfloat16, 16](qa).cast[DType.float32]()
            var kf = bitcast[DType.bfloat16, 16](kn).cast[DType.float32]()
            var sp = _quad_sum((qf * kf).reduce_add()) * sl
            var m_new = max(m, sp)
            var corr = exp2(m - m_new)
            var p = exp2(sp - m_new)
            m = m_new
            l = l * corr + (p if q4 == 0 else 0)  # counted once per head by the quad sum below
            var vf = bitcast[DType.bfloat16, 16](vraw).cast[DType.float32]()
            comptime for j in range(8):
                comptime for i in range(2):  # acc[j][i] holds dim 8 (2 q4 + i) + j = 16 q4 + 8 i + j
                    acc[j][i] = acc[j][i] * corr + p * vf[8 * i + j]

    # Merge the warps: per head g, (m, l) and acc[j][0..1] = dims 8 (2 q4 + i) + j.
    var sm = stack_allocation[TC_WARPS * TC_HEADS * 2, Float32, address_space=AddressSpace.SHARED]()
    var so = stack_allocation[TC_WARPS * TC_HEADS * D, Float32, address_space=AddressSpace.SHARED]()
    var lq = _quad_sum(l)
    if q4 == 0:
        sm[unsafe_offset=(w * TC_HEADS + g) * 2] = m
        sm[unsafe_offset=(w * TC_HEADS + g) * 2 + 1] = lq
    comptime for j in range(8):
        comptime for i in range(2):
            so[unsafe_offset=(w * TC_HEADS + g) * D + 8 * (2 * q4 + i) + j] = acc[j][i]
    barrier()
    # Thread x of the block: one per (head, DPT dims), head x // (D / DPT).
    comptime DPT = TC_HEADS * D // (TC_WARPS * 32)
    var tid = Int(thread_idx.x)
    var hh = tid // (D // DPT)
    var d0 = (tid % (D // DPT)) * DPT
    var mg = NEG_BIG
    comptime for ww in range(TC_WARPS):
        mg = max(mg, sm[unsafe_offset=(ww * TC_HEADS + hh) * 2])
    var lsum: Float32 = 0
    var o = SIMD[DType.float32, DPT](0)
    comptime for ww in range(TC_WARPS):
        var f = exp2(sm[unsafe_offset=(ww * TC_HEADS + hh) * 2] - mg)
        lsum += sm[unsafe_offset=(ww * TC_HEADS + hh) * 2 + 1] * f
        comptime for i in range(DPT):
            o[i] += so[unsafe_offset=(ww * TC_HEADS + hh) * D + d0 + i] * f
    var head = kvh * TC_HEADS + hh
    if splits == 1:
        var sink = sinks[unsafe_offset=head].cast[DType.float32]() * LOG2E
        var mt = max(mg, sink)
        var f = exp2(mg - mt)
        var inv = f / (lsum * f + exp2(sink - mt))
        output.unsafe_offset((t * n_heads + head) * D + d0).unsafe_store[alignment = 2 * DPT](
            (o * inv).cast[DType.bfloat16]()
        )
        return
    var row = scratch.unsafe_offset(((t * splits + s) * n_heads + head) * (D + 2))
    comptime for i in range(DPT):
        row[unsafe_offset=d0 + i] = o[i]
    if d0 == 0:
        row[unsafe_offset=D] = mg
        row[unsafe_offset=D + 1] = lsum


def attention_merge_kernel[
    dtype: DType, sink_dtype: DType, head_dim: Int
](
    output: Pointer[Scalar[dtype], MutAnyOrigin],
    scratch: Pointer[Float32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    n_heads_: Int64,
    splits_: Int64,
):
    """One warp per (t, h). Lane s < S reads split s's (m, l); the warp
    reduces them by shuffles; then each lane sums its dims (lane, lane + 32,
    ...) over the splits with every load issued up front (the split index
    is clamped, the extra splits weigh 0), so the kernel is two dependent
    L2 round trips, not 2 S of them."""
    pdl_enter()
    comptime D = head_dim
    var n_heads = Int(n_heads_)
    var splits = Int(splits_)
    var t = Int(block_idx.x)
    var h = Int(block_idx.y)
    var lane = Int(lane_id())
    var stride = n_heads * (D + 2)
    var base = scratch.unsafe_offset((t * splits * n_heads + h) * (D + 2))
    var sink = sinks[unsafe_offset=h].cast[DType.float32]() * LOG2E
    var ms = NEG_BIG
    var ls: Float32 = 0
    if lane < splits:
        ms = base[unsafe_offset=lane * stride + D]
        ls = base[unsafe_offset=lane * stride + D + 1]
    var mg = max(_warp_max(ms), sink)
    var w = exp2(ms - mg)  # 0 on lanes past the splits
    var den = _warp_sum(ls * w) + exp2(sink - mg)
    comptime per_lane = (D + 31) // 32
    var o = SIMD[DType.float32, per_lane](0)
    comptime for sp in range(SPLIT_TOKENS):
        var ws = shuffle_idx(w, UInt32(sp))
        var row = base.unsafe_offset(min(sp, splits - 1) * stride)
        comptime for i in range(per_lane):
            var d = min(lane + 32 * i, D - 1)
            o[i] += row[unsafe_offset=d] * ws
    var orow = output.unsafe_offset((t * n_heads + h) * D)
    comptime for i in range(per_lane):
        var d = lane + 32 * i
        if d < D:
            orow[unsafe_offset=d] = (o[i] / den).cast[dtype]()


def _launch_tc[
    sink_dtype: DType, ROPE: Bool, fdtype: DType
](
    ctx: DeviceContext,
    output: Pointer[BFloat16, MutAnyOrigin],
    scratch: Pointer[Float32, MutAnyOrigin],
    q: Pointer[BFloat16, ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    kv: Pointer[BFloat16, MutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    freqs: Pointer[Scalar[fdtype], ImmutAnyOrigin],
    tokens: Int,
    batch: Int,
    max_pages: Int,
    n_heads: Int,
    page_size: Int,
    slot_elems: Int,
    page_elems: Int,
    k_base: Int,
    v_base: Int,
    window: Int,
    splits: Int,
    scale: Float32,
) raises:
    """attention_tc_kernel (+ the merge when the keys are split)."""
    var few = tokens > 1 and tokens * splits <= SPLIT_TOKENS
    if tokens == 1:
        # One-token steps: 8 warps too (GPTOSS_MAX_ATTN_ONE_WARPS: `8`, the
        # default; `window8`: only in sliding-window layers; `4`: none).
        var one = getenv("GPTOSS_MAX_ATTN_ONE_WARPS", "8")
        few = one != "4" and (one != "window8" or window > 0)
    comptime for wi in range(2):
        comptime warps = TC_WARPS_FEW if wi == 0 else TC_WARPS_MANY
        if few == (wi == 0):
            ctx.enqueue_function[attention_tc_kernel[sink_dtype, warps, ROPE, fdtype]](
                output, scratch, q, offs, kv, lens, table, sinks, freqs,
                Int64(batch), Int64(max_pages), Int64(n_heads), Int64(page_size), Int64(slot_elems),
                Int64(page_elems), Int64(k_base), Int64(v_base), Int64(window), Int64(splits), scale,
                grid_dim=(tokens, splits, n_heads // TC_HEADS),
                block_dim=warps * 32,
                attributes=pdl_attributes(tokens == 1),
            )
    if splits > 1:
        ctx.enqueue_function[attention_merge_kernel[DType.bfloat16, sink_dtype, TC_DIM]](
            output, scratch, sinks, Int64(n_heads), Int64(splits),
            grid_dim=(tokens, n_heads),
            block_dim=32,
            attributes=pdl_attributes(tokens == 1),
        )


def tc_eligible[dtype: DType, head_dim: Int](group: Int) -> Bool:
    """Whether a step of this shape takes the tensor-core kernel."""
    return USE_TENSOR_CORES and dtype == DType.bfloat16 and head_dim == TC_DIM and group == TC_HEADS


def _check_splits(tokens: Int, window: Int, scratch_rows: Int) raises -> Int:
    var splits = n_splits(tokens, window)
    if splits > 1 and tokens * splits > scratch_rows:
        raise Error("gptoss_attention_with_sinks: scratch too small for the key splits")
    return splits


def launch_attention_rope[
    sink_dtype: DType, fdtype: DType
](
    ctx: DeviceContext,
    output: Pointer[BFloat16, MutAnyOrigin],
    scratch: Pointer[Float32, MutAnyOrigin],
    scratch_rows: Int,
    qkv: Pointer[BFloat16, ImmutAnyOrigin],
    freqs: Pointer[Scalar[fdtype], ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    kv: Pointer[BFloat16, MutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    sinks: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    tokens: Int,
    batch: Int,
    max_pages: Int,
    n_heads: Int,
    page_size: Int,
    slot_elems: Int,
    page_elems: Int,
    k_base: Int,
    v_base: Int,
    window: Int,
    scale: Float32,
) raises:
    """RoPE + K/V store + attention in one launch (two with the merge), for a
    pure decode step (tokens == batch: one new token per sequence) of a
    tensor-core shape (tc_eligible)."""
    if tokens == 0:
        return
    if tokens != batch:
        raise Error("gptoss_attention_rope_sinks: the one-launch path takes one new token per sequence")
    var splits = _check_splits(tokens, window, scratch_rows)
    _launch_tc[sink_dtype, True, fdtype](
        ctx, output, scratch, qkv, offs, kv, lens, table, sinks, freqs,
        tokens, batch, max_pages, n_heads, page_size, slot_elems, page_elems, k_base, v_base, window, splits,
        scale,
    )


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
    var splits = _check_splits(tokens, window, scratch_rows)
    comptime if dtype == DType.bfloat16 and head_dim == TC_DIM:
        if tc_eligible[dtype, head_dim](group):
            var qb = q.unsafe_bitcast[BFloat16]()
            # freqs: unused without ROPE
            _launch_tc[sink_dtype, False, DType.bfloat16](
                ctx, output.unsafe_bitcast[BFloat16](), scratch, qb, offs, kv.unsafe_bitcast[BFloat16](), lens,
                table, sinks, qb, tokens, batch, max_pages, n_heads, page_size, slot_elems, page_elems, k_base,
                v_base, window, splits, scale,
            )
            return
    var hpb = heads_per_block(group)
    ctx.enqueue_function[attention_split_kernel[dtype, sink_dtype, head_dim]](
        output, scratch, q, offs, kv, lens, table, sinks,
        Int64(batch), Int64(max_pages), Int64(n_heads), Int64(page_size), Int64(group),
        Int64(hpb), Int64(slot_elems), Int64(page_elems), Int64(k_base), Int64(v_base),
        Int64(window), Int64(splits), scale,
        grid_dim=(tokens, splits, n_heads // hpb),
        block_dim=hpb * 32,
        attributes=pdl_attributes(tokens == 1),
    )
    if splits > 1:
        ctx.enqueue_function[attention_merge_kernel[dtype, sink_dtype, head_dim]](
            output, scratch, sinks, Int64(n_heads), Int64(splits),
            grid_dim=(tokens, n_heads),
            block_dim=32,
            attributes=pdl_attributes(tokens == 1),
        )
