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
#   A (m x k) = the routed tokens' activations (up to 8 per pass, the
#       other 8 rows zero) staged once per block in shared memory in the
#       same element order as the decoded pairs; float32 activations are
#       split into bf16 hi + lo (two mma), so h keeps ~16 bits.
#   The k order inside a block is irrelevant to a dot product, so the
#   decode order is used as is; only the staging follows it.
#
# down writes per-(t, k) partials; the last block to finish a row tile
# (global counter, zeroed by gate_up of the same step, reset by that last
# block for the next chunk) sums them over k in a fixed order and writes the
# output: deterministic, no float atomics.

from max.gpu import thread_idx, block_idx, barrier, lane_id, warp_id
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.intrinsics import threadfence
from max.gpu.memory import AddressSpace, external_memory
from max.gpu.primitives.warp import vote
from std.atomic import Atomic
from std.bit import pop_count, count_trailing_zeros
from std.collections import Array
from std.memory import bitcast, stack_allocation

from .moe_common import gptoss_swiglu

# Warps per block (one row tile of 8 rows per warp). For 1-2 tokens, small
# blocks keep every block of the step resident at once (no second wave) and
# the bytes per SM even; the activation staging, repeated per block, is
# cheap then. With more tokens the staging grows, so blocks share it.
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
# Shared-memory words per staged token: 16 pair-words per 32-element block,
# padded by one 16-byte vector against bank conflicts between tokens.
comptime PAD_WORDS = 4


@always_inline
def _tok_words(nchunks: Int) -> Int:
    return nchunks * 16 + PAD_WORDS


@always_inline
def _swz(c: Int, p: Int) -> Int:
    """Word offset of pair p (0..15) of block c inside a token's row: the
    four 16-byte vectors of a block are rotated by c so that the lanes of a
    quarter warp (consecutive c) hit different banks."""
    return c * 16 + (((p >> 2) + c) & 3) * 4 + (p & 3)


@always_inline
def _pair_elems(c: Int, p: Int) -> Tuple[Int, Int]:
    """Element indices (low, high half) of decoded pair p of block c."""
    var w = p >> 2
    var s = p & 3
    var lo = 32 * c + 8 * w + 3 - s
    return (lo, lo + 4)


@always_inline
def _scale_bits(s: UInt32) -> Tuple[UInt32, UInt32, Bool]:
    """bf16x2 multipliers taking a decoded placeholder to value * 2^(s-127).

    The placeholder (see _decode_pair) is value * 2^-126, so one multiply by
    2^(s-1) is exact when that power fits a normal bf16 (s <= 128); larger
    scales take 2^126 then 2^(s-127)."""
    if s <= 128:
        var m = (s + 126) << 7
        return (m | (m << 16), UInt32(0), False)
    var m1 = UInt32(253) << 7
    var m2 = s << 7
    return (m1 | (m1 << 16), m2 | (m2 << 16), True)


@always_inline
def _decode_pair(v: UInt32, m1: UInt32, m2: UInt32, two: Bool) -> SIMD[DType.bfloat16, 2]:
    """Nibbles 3 and 7 of v (low, high half) as scaled bf16: sign to bit 15,
    e2m1 magnitude bits (e1 e0 m) to bf16 bits 8..6, i.e. value * 2^-126
    (code 1 lands on the bf16 subnormal 2^-127), then the scale multiply."""
    var bits = (v & 0x80008000) | ((v >> 6) & 0x01C001C0)
    var x = bitcast[DType.bfloat16, 2](bits)
    x = x * bitcast[DType.bfloat16, 2](m1)
    if two:
        x = x * bitcast[DType.bfloat16, 2](m2)
    return x


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


@always_inline
def _stage[
    src_dtype: DType, split: Bool, by_token: Bool, threads: Int
](
    src: Pointer[Scalar[src_dtype], _],
    row_len: Int,
    top_k: Int,
    plist: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    first: Int,
    ntok: Int,
    nchunks: Int,
    hi: Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    lo: Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
):
    """Stages ntok activation rows (pairs plist[first:first+ntok]) into
    shared memory as bf16 pairs in decode order (hi, and lo = rest when
    `split`). Row of pair p: token p // top_k if by_token, else p."""
    var tid = Int(thread_idx.x)
    var per_tok = nchunks * 16
    var tw = _tok_words(nchunks)
    for idx in range(tid, ntok * per_tok, threads):
        var tok = idx // per_tok
        var rem = idx - tok * per_tok
        var c = rem >> 4
        var p = rem & 15
        var pair = Int(plist[first + tok])
        var row = pair // top_k if by_token else pair
        var el = _pair_elems(c, p)
        var base = src.unsafe_offset(row * row_len)
        var a = base[unsafe_offset=el[0]].cast[DType.float32]()
        var b = base[unsafe_offset=el[1]].cast[DType.float32]()
        var h2 = SIMD[DType.float32, 2](a, b).cast[DType.bfloat16]()
        var at = tok * tw + _swz(c, p)
        hi[at] = bitcast[DType.uint32, 1](h2)
        comptime if split:
            var r = SIMD[DType.float32, 2](a, b) - h2.cast[DType.float32]()
            lo[at] = bitcast[DType.uint32, 1](r.cast[DType.bfloat16]())


@always_inline
def _row_tile_mma[
    split: Bool
](
    wrow: Pointer[UInt8, _],
    srow: Pointer[UInt8, _],
    row_ok: Bool,
    nchunks: Int,
    hi: Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    lo: Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    ntok: Int,
) -> SIMD[DType.float32, 4]:
    """One warp: D[token, row] for 8 rows (this lane's row: wrow/srow) and
    up to 8 staged tokens. Returns this lane's accumulator fragment
    (c0, c1: token lane/4, rows 2*(lane%4) + {0, 1} of the 8)."""
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var iters = (nchunks + 3) >> 2
    var tw = _tok_words(nchunks)
    var has_tok = g < ntok
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
                var sc = _scale_bits(sv[u])
                var pairs = SIMD[DType.bfloat16, 32](0)
                comptime for w in range(4):
                    var v = wv[u][w]
                    comptime for s in range(4):
                        var d = _decode_pair(v << UInt32(4 * s), sc[0], sc[1], sc[2])
                        pairs[2 * (4 * w + s)] = d[0]
                        pairs[2 * (4 * w + s) + 1] = d[1]
                var ahi = SIMD[DType.uint32, 16](0)
                var alo = SIMD[DType.uint32, 16](0)
                if has_tok and c < nchunks:
                    var base = g * tw + c * 16
                    comptime for v4 in range(4):
                        var off = base + (((v4 + c) & 3) * 4)
                        var x4 = hi.unsafe_load[width=4, alignment=16](off)
                        comptime for z in range(4):
                            ahi[4 * v4 + z] = x4[z]
                        comptime if split:
                            var y4 = lo.unsafe_load[width=4, alignment=16](off)
                            comptime for z in range(4):
                                alo[4 * v4 + z] = y4[z]
                comptime for j in range(8):
                    var b = SIMD[DType.bfloat16, 4](
                        pairs[4 * j], pairs[4 * j + 1], pairs[4 * j + 2], pairs[4 * j + 3]
                    )
                    var a01 = bitcast[DType.bfloat16, 2](ahi[2 * j])
                    var a45 = bitcast[DType.bfloat16, 2](ahi[2 * j + 1])
                    var a = SIMD[DType.bfloat16, 8](
                        a01[0], a01[1], 0, 0, a45[0], a45[1], 0, 0
                    )
                    mma(acc, a, b, acc)
                    comptime if split:
                        var l01 = bitcast[DType.bfloat16, 2](alo[2 * j])
                        var l45 = bitcast[DType.bfloat16, 2](alo[2 * j + 1])
                        var al = SIMD[DType.bfloat16, 8](
                            l01[0], l01[1], 0, 0, l45[0], l45[1], 0, 0
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
    var dyn = external_memory[UInt32, address_space=AddressSpace.SHARED, alignment=16]()
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
    var hi = dyn
    var lo = dyn.unsafe_offset(min(n_pairs // top_k, TOK_PASS) * _tok_words(nchunks))
    var r0 = (Int(block_idx.x) * warps + Int(warp_id())) * 8
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var row = r0 + g
    var row_ok = row < rows
    var erow = e * rows + (row if row_ok else 0)
    var wrow = blocks.unsafe_offset(erow * (hidden // 2))
    var srow = scales.unsafe_offset(erow * nchunks)
    var first = 0
    while first < npairs_e:
        var ntok = min(TOK_PASS, npairs_e - first)
        if first > 0:
            barrier()
        _stage[x_dtype, split, True, threads](x, hidden, top_k, plist, first, ntok, nchunks, hi, lo)
        barrier()
        var acc = _row_tile_mma[split](wrow, srow, row_ok, nchunks, hi, lo, ntok)
        var gr = r0 + 2 * q
        if g < ntok and gr + 1 < rows:
            var p = Int(plist[first + g])
            var gate = acc[0] + bias[unsafe_offset=e * rows + gr]
            var up = acc[1] + bias[unsafe_offset=e * rows + gr + 1]
            h[unsafe_offset=p * inter + (gr >> 1)] = gptoss_swiglu(gate, up)
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
    var dyn = external_memory[UInt32, address_space=AddressSpace.SHARED, alignment=16]()
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
    var hi = dyn
    var lo = dyn.unsafe_offset(min(n_pairs // top_k, TOK_PASS) * _tok_words(nchunks))
    var r0 = rbase + Int(warp_id()) * 8
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var row = r0 + g
    var row_ok = row < hidden
    var erow = e * hidden + (row if row_ok else 0)
    var wrow = blocks.unsafe_offset(erow * (inter // 2))
    var srow = scales.unsafe_offset(erow * nchunks)
    var first = 0
    while first < npairs_e:
        var ntok = min(TOK_PASS, npairs_e - first)
        if first > 0:
            barrier()
        _stage[DType.float32, split, False, threads](h, inter, top_k, plist, first, ntok, nchunks, hi, lo)
        barrier()
        var acc = _row_tile_mma[split](wrow, srow, row_ok, nchunks, hi, lo, ntok)
        if g < ntok:
            var p = Int(plist[first + g])
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


def _smem_bytes(nchunks: Int, tokens: Int, split: Bool) -> Int:
    return min(tokens, TOK_PASS) * _tok_words(nchunks) * 4 * (2 if split else 1)


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
    var smem = _smem_bytes(hidden // 32, tokens, x_dtype != DType.bfloat16)
    var n_pairs = tokens * top_k
    ctx.enqueue_function[gate_up_kernel[x_dtype, warps]](
        h, counters, Int64(n_count), x, ids, blocks, scales, bias,
        Int64(n_pairs), Int64(top_k), Int64(n_experts), Int64(rows), Int64(hidden),
        grid_dim=((rows + warps * 8 - 1) // (warps * 8), min(n_experts, n_pairs)),
        block_dim=warps * 32,
        shared_mem_bytes=smem,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
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
    var smem = _smem_bytes(inter // 32, tokens, out_dtype != DType.bfloat16)
    var n_pairs = tokens * top_k
    ctx.enqueue_function[down_kernel[out_dtype, warps]](
        output, partial, counters, h, ids, wts, blocks, scales, bias,
        Int64(n_pairs), Int64(top_k), Int64(n_experts), Int64(hidden), Int64(inter),
        grid_dim=((hidden + warps * 8 - 1) // (warps * 8), min(n_experts, n_pairs)),
        block_dim=warps * 32,
        shared_mem_bytes=smem,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
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
