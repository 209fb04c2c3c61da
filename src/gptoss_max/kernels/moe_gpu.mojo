# GPU path of the MXFP4 MoE ops for decode-sized steps (issue 4).
#
# Two launches per step (per chunk of at most CHUNK_TOKENS tokens):
#   gate_up: h[t, k, :] = swiglu(W_gu[e] x[t] + b_gu[e])      e = ids[t, k]
#   down:    out[t, :]  = sum_k w[t, k] (W_dn[e] h[t, k] + b_dn[e])
#
# Grid: x = row tiles of 8 rows per warp, y = expert slot (at most
# min(E, tokens * top_k), a bound known from shapes; no host sync). Each
# block finds the slot-th routed expert and its (token, k) pairs from the
# ids itself, so only routed experts are read, each byte once per step:
# every token routed to an expert is served from the same load.
#
# Inner product on tensor cores (mma.sync m16n8k16, bf16 in, f32 acc):
#   B (k x n) = 8 weight rows x 16 elements, one warp lane group per row:
#       lane (g, q) = (lane / 4, lane % 4) loads the 16-byte MXFP4 block
#       4 * it + q of row r0 + g (so a warp reads 8 rows x 64 contiguous
#       bytes per step), decodes it in registers to bf16 pairs with the
#       E8M0 scale applied by a bf16 multiply with a power of two (exact).
#   A (m x k) = the routed tokens' activations, lane (g, q) serving token g
#       of the pass (up to 8 per pass; rows 8..15 zero), read straight from
#       global memory (L1/L2-resident: every warp of an SM reads the same
#       rows) in the decode order of B: x is permuted in registers, and
#       gate_up writes h already in that order as bf16 (hi, plus a lo
#       remainder for float32 graphs, which then take two mma).
#   The k order inside a block is irrelevant to a dot product, so the
#   decode order is used as is and the activations follow it.
#
# On the GPU, h ([T, K, I] f32 in the graph) is opaque to everything but
# the two kernels: row t*K + k holds I bf16 in decode order (_h_slot), then
# I bf16 remainders when the graph is float32.
#
# down writes per-(t, k) partials; the last block to finish a row tile
# (global counter, zeroed by gate_up of the same step, reset by that last
# block for the next chunk) sums them over k in a fixed order and writes the
# output: deterministic, no float atomics.

from max.gpu import thread_idx, block_idx, barrier, lane_id, warp_id
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext
from max.gpu.intrinsics import byte_permute, threadfence
from max.gpu.memory import AddressSpace
from max.gpu.primitives.warp import vote
from std.atomic import Atomic
from std.bit import pop_count, count_trailing_zeros
from std.collections import Array
from std.memory import bitcast, stack_allocation

from .moe_common import gptoss_swiglu

# Warps per block (one row tile of 8 rows per warp). For 1-2 tokens, small
# blocks keep the bytes per SM even; with more, blocks share the routing.
comptime FEW_TOKENS = 2
comptime GATE_UP_WARPS_FEW = 2
comptime DOWN_WARPS_FEW = 1
comptime WARPS_MANY = 4
# Counters are sized for the smallest down tile (8 rows).
comptime COUNTER_TILE_ROWS = 8
comptime TOK_PASS = 8
comptime UNROLL = 6
comptime CHUNK_TOKENS = 64
comptime MAX_TOPK = 4
comptime MAX_PAIRS = CHUNK_TOKENS * MAX_TOPK
comptime MAX_EXPERTS = 256


@always_inline
def _h_slot(i: Int) -> Int:
    """bf16 index of h element i in the decode-ordered layout the GPU
    gate_up writes and down reads: block c = i / 32 holds 16 pair words in
    decode order, pair p = 4w + s being elements (8w + 3 - s, 8w + 7 - s)
    (see _decode_pair), low half first."""
    var c = i >> 5
    var e = i & 31
    var w = e >> 3
    var r = e & 7
    var s = 3 - r if r < 4 else 7 - r
    var half = 0 if r < 4 else 1
    return 2 * (c * 16 + 4 * w + s) + half


@always_inline
def _decode_pair(v: UInt32, mult: SIMD[DType.bfloat16, 2]) -> UInt32:
    """Nibbles 3 and 7 of v (low, high half) as bf16 times `mult`: sign to
    bit 15, e2m1 magnitude bits (e1 e0 m) to bf16 bits 8..6, which is the
    value times 2^-126 (code 1 lands on the bf16 subnormal 2^-127); then
    one multiply by 2^(s-1) gives value * 2^(s-127) exactly (s <= 128)."""
    var bits = (v & 0x80008000) | ((v >> 6) & 0x01C001C0)
    return bitcast[DType.uint32, 1](bitcast[DType.bfloat16, 2](bits) * mult)


@always_inline
def _route[
    threads: Int
](
    ids: Pointer[Int32, _],
    n_pairs: Int,
    n_experts: Int,
    slot: Int,
    flags: Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    plist: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    meta: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
):
    """Block-wide: meta[0] = the slot-th routed expert (ascending id) or -1,
    meta[1] = routed experts in all, meta[2] = its pairs; plist = the pair
    indices t * K + k routed to it, ascending."""
    var tid = Int(thread_idx.x)
    for i in range(tid, n_experts, threads):
        flags[i] = 0
    barrier()
    for p in range(tid, n_pairs, threads):
        var e = Int(ids[unsafe_offset=p])
        if e >= 0 and e < n_experts:
            flags[e] = 1
    barrier()
    if warp_id() == 0:
        var lane = Int(lane_id())
        var below = (UInt32(1) << UInt32(lane)) - 1
        var count = 0
        var found = -1
        for base in range(0, n_experts, 32):
            var i = base + lane
            var f = i < n_experts and flags[i] != 0
            var m = vote[DType.uint32](f)
            var pc = Int(pop_count(m))
            if found < 0 and slot < count + pc:
                var hit = f and Int(pop_count(m & below)) == slot - count
                var mh = vote[DType.uint32](hit)
                found = base + Int(count_trailing_zeros(mh))
            count += pc
        var n = 0
        if found >= 0:
            for base in range(0, n_pairs, 32):
                var p = base + lane
                var hit_p = p < n_pairs and Int(ids[unsafe_offset=p]) == found
                var m = vote[DType.uint32](hit_p)
                if hit_p:
                    plist[n + Int(pop_count(m & below))] = Int32(p)
                n += Int(pop_count(m))
        if lane == 0:
            meta[0] = Int32(found)
            meta[1] = Int32(count)
            meta[2] = Int32(n)
    barrier()


# How a lane gets its A fragment (activations of one token, one 32-element
# block, as 16 bf16 pair words in decode order):
comptime A_BF16 = 0  # x bf16 in natural order: 4 x 16-byte loads + permute
comptime A_F32 = 1  # x f32 in natural order: 8 loads, split into hi + lo
comptime A_WORDS = 2  # h as decode-ordered bf16 pair words (hi only)
comptime A_WORDS_SPLIT = 3  # h as decode-ordered hi words, then lo words


@always_inline
def _load_a[
    mode: Int
](arow: Pointer[UInt32, _], lo_off: Int, c: Int) -> Tuple[SIMD[DType.uint32, 16], SIMD[DType.uint32, 16]]:
    var hi = SIMD[DType.uint32, 16](0)
    var lo = SIMD[DType.uint32, 16](0)
    comptime if mode == A_BF16:
        comptime for w in range(4):
            # words (e0,e1) (e2,e3) (e4,e5) (e6,e7) of elements 32c + 8w ...
            var v = arow.unsafe_load[width=4, alignment=16](c * 16 + w * 4)
            hi[4 * w + 0] = byte_permute(v[1], v[3], 0x7632)  # (e3, e7)
            hi[4 * w + 1] = byte_permute(v[1], v[3], 0x5410)  # (e2, e6)
            hi[4 * w + 2] = byte_permute(v[0], v[2], 0x7632)  # (e1, e5)
            hi[4 * w + 3] = byte_permute(v[0], v[2], 0x5410)  # (e0, e4)
    elif mode == A_F32:
        comptime for w in range(4):
            var v0 = bitcast[DType.float32, 4](arow.unsafe_load[width=4, alignment=16](c * 32 + w * 8))
            var v1 = bitcast[DType.float32, 4](arow.unsafe_load[width=4, alignment=16](c * 32 + w * 8 + 4))
            comptime for s in range(4):
                var ab = SIMD[DType.float32, 2](v0[3 - s], v1[3 - s])
                var h2 = ab.cast[DType.bfloat16]()
                hi[4 * w + s] = bitcast[DType.uint32, 1](h2)
                lo[4 * w + s] = bitcast[DType.uint32, 1]((ab - h2.cast[DType.float32]()).cast[DType.bfloat16]())
    else:
        comptime for v4 in range(4):
            var x4 = arow.unsafe_load[width=4, alignment=16](c * 16 + v4 * 4)
            comptime for z in range(4):
                hi[4 * v4 + z] = x4[z]
            comptime if mode == A_WORDS_SPLIT:
                var y4 = arow.unsafe_load[width=4, alignment=16](lo_off + c * 16 + v4 * 4)
                comptime for z in range(4):
                    lo[4 * v4 + z] = y4[z]
    return (hi, lo)


@always_inline
def _row_tile_mma[
    amode: Int
](
    wrow: Pointer[UInt8, _],
    srow: Pointer[UInt8, _],
    row_ok: Bool,
    nchunks: Int,
    arow: Pointer[UInt32, _],
    lo_off: Int,
    has_tok: Bool,
) -> SIMD[DType.float32, 4]:
    """One warp: D[token, row] for 8 rows (this lane's row: wrow/srow) and
    up to 8 tokens (this lane's token row: arow, if has_tok). Returns this
    lane's accumulator fragment (c0, c1: token lane/4, rows 2*(lane%4) +
    {0, 1} of the 8)."""
    comptime split = amode == A_F32 or amode == A_WORDS_SPLIT
    var lane = Int(lane_id())
    var q = lane & 3
    var iters = (nchunks + 3) >> 2
    var acc = SIMD[DType.float32, 4](0)
    var wv = Array[SIMD[DType.uint32, 4], UNROLL](fill=0)
    var sv = Array[UInt32, UNROLL](fill=0)
    var wp32 = wrow.unsafe_bitcast[UInt32]()
    var it = 0
    while it < iters:
        comptime for u in range(UNROLL):
            var c = 4 * (it + u) + q
            if row_ok and c < nchunks:
                wv[u] = wp32.unsafe_load[width=4, alignment=16](c * 4)
                sv[u] = UInt32(srow[unsafe_offset=c])
            else:
                wv[u] = SIMD[DType.uint32, 4](0)
                sv[u] = 127
        comptime for u in range(UNROLL):
            if it + u < iters:
                var c = 4 * (it + u) + q
                var sc = sv[u]
                var pairs = SIMD[DType.uint32, 16](0)
                # Scales above 128 (weights of magnitude >= 12) need two
                # multiplies; the warp takes that path only if a lane needs it.
                if vote[DType.uint32](sc > 128) == 0:
                    var m = (sc + 126) << 7
                    var mult = bitcast[DType.bfloat16, 2](m | (m << 16))
                    comptime for w in range(4):
                        comptime for s4 in range(4):
                            pairs[4 * w + s4] = _decode_pair(wv[u][w] << UInt32(4 * s4), mult)
                else:
                    var m1 = UInt32(253) << 7
                    var m2 = sc << 7
                    var mult1 = bitcast[DType.bfloat16, 2](m1 | (m1 << 16))
                    var mult2 = bitcast[DType.bfloat16, 2](m2 | (m2 << 16))
                    comptime for w in range(4):
                        comptime for s4 in range(4):
                            var d = _decode_pair(wv[u][w] << UInt32(4 * s4), mult1)
                            pairs[4 * w + s4] = bitcast[DType.uint32, 1](
                                bitcast[DType.bfloat16, 2](d) * mult2
                            )
                var ahi = SIMD[DType.uint32, 16](0)
                var alo = SIMD[DType.uint32, 16](0)
                if has_tok and c < nchunks:
                    var a2 = _load_a[amode](arow, lo_off, c)
                    ahi = a2[0]
                    alo = a2[1]
                comptime for j in range(8):
                    var b = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](pairs[2 * j], pairs[2 * j + 1]))
                    var a = bitcast[DType.bfloat16, 8](SIMD[DType.uint32, 4](ahi[2 * j], 0, ahi[2 * j + 1], 0))
                    mma(acc, a, b, acc)
                    comptime if split:
                        var al = bitcast[DType.bfloat16, 8](
                            SIMD[DType.uint32, 4](alo[2 * j], 0, alo[2 * j + 1], 0)
                        )
                        mma(acc, al, b, acc)
        it += UNROLL
    return acc


def gate_up_kernel[
    x_dtype: DType, warps: Int
](
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_counters_: Int64,
    x: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    n_pairs_: Int64,
    top_k_: Int64,
    n_experts_: Int64,
    rows_: Int64,
    hidden_: Int64,
):
    """rows = 2I (gate/up interleaved), h [pairs, I] f32."""
    var n_counters = Int(n_counters_)
    var n_pairs = Int(n_pairs_)
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var rows = Int(rows_)
    var hidden = Int(hidden_)
    comptime split = x_dtype != DType.bfloat16
    comptime threads = warps * 32
    var flags = stack_allocation[MAX_EXPERTS, UInt32, address_space=AddressSpace.SHARED]()
    var plist = stack_allocation[MAX_PAIRS, Int32, address_space=AddressSpace.SHARED]()
    var meta = stack_allocation[4, Int32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    if block_idx.x == 0 and block_idx.y == 0:
        for i in range(tid, n_counters, threads):
            counters[unsafe_offset=i] = 0
    _route[threads](ids, n_pairs, n_experts, Int(block_idx.y), flags, plist, meta)
    var e = Int(meta[0])
    if e < 0:
        return
    var npairs_e = Int(meta[2])
    var nchunks = hidden // 32
    var inter = rows // 2
    var r0 = (Int(block_idx.x) * warps + Int(warp_id())) * 8
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var row = r0 + g
    var row_ok = row < rows
    var erow = e * rows + (row if row_ok else 0)
    var wrow = blocks.unsafe_offset(erow * (hidden // 2))
    var srow = scales.unsafe_offset(erow * nchunks)
    # h rows as bf16: hi pair words (decode order), then lo (f32 graphs).
    var hb = h.unsafe_bitcast[BFloat16]()
    var first = 0
    while first < npairs_e:
        var has_tok = first + g < npairs_e
        var p = Int(plist[first + g]) if has_tok else 0
        var xrow = x.unsafe_offset((p // top_k) * hidden).unsafe_bitcast[UInt32]()
        comptime amode = A_F32 if split else A_BF16
        var acc = _row_tile_mma[amode](wrow, srow, row_ok, nchunks, xrow, 0, has_tok)
        var gr = r0 + 2 * q
        if has_tok and gr + 1 < rows:
            var gate = acc[0] + bias[unsafe_offset=e * rows + gr]
            var up = acc[1] + bias[unsafe_offset=e * rows + gr + 1]
            var v = gptoss_swiglu(gate, up)
            var at = p * 2 * inter + _h_slot(gr >> 1)
            var vb = v.cast[DType.bfloat16]()
            hb[unsafe_offset=at] = vb
            comptime if split:
                hb[unsafe_offset=at + inter] = (v - vb.cast[DType.float32]()).cast[DType.bfloat16]()
        first += TOK_PASS


def down_kernel[
    out_dtype: DType, warps: Int
](
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    n_pairs_: Int64,
    top_k_: Int64,
    n_experts_: Int64,
    hidden_: Int64,
    inter_: Int64,
):
    """output [T, H], partial [pairs, H] f32 scratch, h [pairs, I] f32;
    counters: one per tile of warps * 8 rows."""
    var n_pairs = Int(n_pairs_)
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var hidden = Int(hidden_)
    var inter = Int(inter_)
    comptime threads = warps * 32
    comptime tile_rows = warps * 8
    comptime split = out_dtype != DType.bfloat16
    var flags = stack_allocation[MAX_EXPERTS, UInt32, address_space=AddressSpace.SHARED]()
    var plist = stack_allocation[MAX_PAIRS, Int32, address_space=AddressSpace.SHARED]()
    var meta = stack_allocation[4, Int32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var tokens = n_pairs // top_k
    var rbase = Int(block_idx.x) * tile_rows
    _route[threads](ids, n_pairs, n_experts, Int(block_idx.y), flags, plist, meta)
    var e = Int(meta[0])
    var n_active = Int(meta[1])
    if n_active == 0:
        # Nothing routed anywhere: the output is zero.
        if block_idx.y == 0:
            for idx in range(tid, tokens * tile_rows, threads):
                var t = idx // tile_rows
                var r = rbase + idx % tile_rows
                if r < hidden:
                    output[unsafe_offset=t * hidden + r] = 0
        return
    if e < 0:
        return
    var npairs_e = Int(meta[2])
    var nchunks = inter // 32
    var r0 = rbase + Int(warp_id()) * 8
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var row = r0 + g
    var row_ok = row < hidden
    var erow = e * hidden + (row if row_ok else 0)
    var wrow = blocks.unsafe_offset(erow * (inter // 2))
    var srow = scales.unsafe_offset(erow * nchunks)
    var hw = h.unsafe_bitcast[UInt32]()
    var first = 0
    while first < npairs_e:
        var has_tok = first + g < npairs_e
        var p = Int(plist[first + g]) if has_tok else 0
        # row p of h: I f32 = I/2 hi pair words, then I/2 lo pair words
        var hrow = hw.unsafe_offset(p * inter)
        comptime amode = A_WORDS_SPLIT if split else A_WORDS
        var acc = _row_tile_mma[amode](wrow, srow, row_ok, nchunks, hrow, inter // 2, has_tok)
        if has_tok:
            var wgt = wts[unsafe_offset=p]
            comptime for z in range(2):
                var r = r0 + 2 * q + z
                if r < hidden:
                    partial[unsafe_offset=p * hidden + r] = wgt * (
                        acc[z] + bias[unsafe_offset=e * hidden + r]
                    )
        first += TOK_PASS
    # The last block done with this row tile sums the partials over k.
    threadfence()
    barrier()
    if tid == 0:
        var old = Atomic.fetch_add(counters.unsafe_offset(Int(block_idx.x)), 1)
        meta[3] = 1 if Int(old) == n_active - 1 else 0
    barrier()
    if meta[3] == 0:
        return
    # Every block of this tile has counted: reset for the next chunk's launch
    # (gate_up zeroes the counters only once per step).
    if tid == 0:
        counters[unsafe_offset=Int(block_idx.x)] = 0
    threadfence()
    for idx in range(tid, tokens * tile_rows, threads):
        var t = idx // tile_rows
        var r = rbase + idx % tile_rows
        if r < hidden:
            var s: Float32 = 0
            for k in range(top_k):
                var ek = Int(ids[unsafe_offset=t * top_k + k])
                if ek >= 0 and ek < n_experts:
                    s += partial.unsafe_load[volatile=True]((t * top_k + k) * hidden + r)
            output[unsafe_offset=t * hidden + r] = s.cast[out_dtype]()


def n_counters(hidden: Int) -> Int:
    """Length of the counters tensor: one per down row tile (at most)."""
    return (hidden + COUNTER_TILE_ROWS - 1) // COUNTER_TILE_ROWS


def _launch_gate_up[
    x_dtype: DType, warps: Int
](
    ctx: DeviceContext,
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    x: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
) raises:
    var n_pairs = tokens * top_k
    ctx.enqueue_function[gate_up_kernel[x_dtype, warps]](
        h, counters, Int64(n_count), x, ids, blocks, scales, bias,
        Int64(n_pairs), Int64(top_k), Int64(n_experts), Int64(rows), Int64(hidden),
        grid_dim=((rows + warps * 8 - 1) // (warps * 8), min(n_experts, n_pairs)),
        block_dim=warps * 32,
    )


def launch_gate_up[
    x_dtype: DType
](
    ctx: DeviceContext,
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    x: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
) raises:
    """gate_up for at most CHUNK_TOKENS tokens; also zeroes the counters."""
    if tokens * top_k > MAX_PAIRS or n_experts > MAX_EXPERTS or hidden % 32 != 0:
        raise Error("gptoss MoE GPU path: needs tokens * top_k <= 256, E <= 256, H % 32 == 0")
    if tokens <= FEW_TOKENS:
        _launch_gate_up[x_dtype, GATE_UP_WARPS_FEW](
            ctx, h, counters, n_count, x, ids, blocks, scales, bias,
            tokens, top_k, n_experts, rows, hidden,
        )
    else:
        _launch_gate_up[x_dtype, WARPS_MANY](
            ctx, h, counters, n_count, x, ids, blocks, scales, bias,
            tokens, top_k, n_experts, rows, hidden,
        )


def _launch_down[
    out_dtype: DType, warps: Int
](
    ctx: DeviceContext,
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    inter: Int,
) raises:
    var n_pairs = tokens * top_k
    ctx.enqueue_function[down_kernel[out_dtype, warps]](
        output, partial, counters, h, ids, wts, blocks, scales, bias,
        Int64(n_pairs), Int64(top_k), Int64(n_experts), Int64(hidden), Int64(inter),
        grid_dim=((hidden + warps * 8 - 1) // (warps * 8), min(n_experts, n_pairs)),
        block_dim=warps * 32,
    )


def launch_down[
    out_dtype: DType
](
    ctx: DeviceContext,
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    inter: Int,
) raises:
    """down + top-k combine for at most CHUNK_TOKENS tokens. h is kept as
    bf16 hi + lo (two mma) only for a float32 output; a bf16 output takes
    h rounded to bf16, as the rest of a bf16 graph does."""
    if tokens * top_k > MAX_PAIRS or n_experts > MAX_EXPERTS or inter % 32 != 0:
        raise Error("gptoss MoE GPU path: needs tokens * top_k <= 256, E <= 256, I % 32 == 0")
    if tokens <= FEW_TOKENS:
        _launch_down[out_dtype, DOWN_WARPS_FEW](
            ctx, output, partial, counters, h, ids, wts, blocks, scales, bias,
            tokens, top_k, n_experts, hidden, inter,
        )
    else:
        _launch_down[out_dtype, WARPS_MANY](
            ctx, output, partial, counters, h, ids, wts, blocks, scales, bias,
            tokens, top_k, n_experts, hidden, inter,
        )
