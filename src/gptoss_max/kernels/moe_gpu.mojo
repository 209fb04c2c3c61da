# GPU path of the MXFP4 MoE ops for decode-sized steps (issue 4).
#
# Two launches per step (per chunk of at most CHUNK_TOKENS tokens):
#   gate_up: h[t, k, :] = swiglu(W_gu[e] x[t] + b_gu[e])      e = ids[t, k]
#   down:    out[t, :]  = sum_k w[t, k] (W_dn[e] h[t, k] + b_dn[e])
#
# Grid: x = row tiles of 16 rows per warp (few-token down: per 2 warps, each
# over half of I), y = expert slot (at most min(E, tokens * top_k), a bound
# known from shapes; no host sync). Each warp finds the slot-th routed expert
# and its (token, k) pairs from one load of the ids (_route_warp), so only
# routed experts are read, each byte once per step: every token routed to an
# expert is served from the same load.
#
# Inner product on tensor cores (mma.sync m16n8k16, bf16 in, f32 acc):
#   A (m x k) = 16 weight rows x 16 elements: lane (g, q) = (lane / 4,
#       lane % 4) loads the 16-byte MXFP4 blocks q, q + 4, ... of rows r0 + g
#       and r0 + g + 8 (a warp reads 8 rows x 64 contiguous bytes per load),
#       through a ring DEPTH - 1 blocks ahead with L1::no_allocate, and
#       decodes them in registers to bf16 pairs with the E8M0 scale applied
#       by a bf16 multiply with a power of two (exact; two multiplies in a
#       loop variant taken when a tile has a scale above 128).
#   B (k x n) = the routed tokens' activations, lane (g, q) serving token g
#       of the pass (up to 8 per pass), loaded one block ahead from global
#       memory (L1-resident: every warp of an SM reads the same rows) in the
#       decode order of A: pair (word q, slot c) of a block is activation
#       pair word 4c + q (the layout's word repack, mxfp4.slot_bits),
#       so the order is a transpose of register names, no permute; h is
#       bf16 in natural order (hi, plus a lo remainder for float32 graphs,
#       which then take two mma).
#   The k order inside a block is irrelevant to a dot product, so the
#   decode order is used as is and the activations follow it.
#
# On the GPU, h ([T, K, I] f32 in the graph) is opaque to everything but
# the two kernels: row t*K + k holds I bf16 in natural order, then I bf16
# remainders when the graph is float32.
#
# down writes per-(t, k) partials; the last block to finish a row tile
# (global counter, zeroed by gate_up of the same step, reset by that last
# block for the next chunk) sums them over k in a fixed order and writes the
# output: deterministic, no float atomics.
#
# A one-token step (batch-1 decode) takes two shortcuts (v12, bench/NOTES.md):
# gate_up's grid slot k serves pair k (expert ids[k]) with no warp-wide
# routing, and down_one_token_kernel holds a 16-row tile of all top_k experts
# in one block and sums them in shared memory, so no partials, counter or
# last-block pass. Both start a cp.async of the bias values (and down of the
# expert weights) they add at the end, so neither ends on a dependent global
# load (v12c). Each warp also copies its tile's scale bytes to shared memory
# once (with the scan for scales above 128) instead of loading two bytes from
# global memory per batch.
# With bf16 activations a one-token gate_up runs gate_up_lean_kernel instead:
# two warps per tile over halves of H, x staged in shared memory (v18). Its
# tile (_lean_tile) also serves the one-token down of a bf16 graph, and takes
# the block scale out of the decode (v25): B is block diagonal, so each mma
# column sums one block, scaled afterwards by an f32 multiply-add.
# Steps of a few tokens whose experts rarely repeat take the same two kernels,
# a slot per (token, expert) pair (as_slots below, v34): with bf16 activations
# that is every two-token step, so the few-token kernels below serve only f32
# activations (gate_up) and top_k above 4 (down) there.

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, barrier, lane_id, warp_id
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext
from max.gpu.intrinsics import threadfence
from max.gpu.memory import AddressSpace, CacheEviction, async_copy, async_copy_commit_group, async_copy_wait_group, load
from max.gpu.primitives.warp import shuffle_idx, shuffle_xor, vote
from max.gpu.sync import syncwarp
from std.atomic import Atomic, Ordering
from std.bit import pop_count, count_trailing_zeros
from std.collections import Array
from std.memory import bitcast, stack_allocation
from std.sys._assembly import inlined_assembly
from std.utils.static_tuple import StaticTuple

from .moe_common import decode_slot, gptoss_swiglu, scale_bytes_above_128, scale_mult, scaled_pair
from .mxfp4 import slot_bits, tiled_block_offset, tiled_scale_offset
from .pdl import pdl_attributes, pdl_enter
from .router_topk import warp_topk

# Warps per block (a 16-row tile per warp, or per ksplit warps in down). For
# 1-2 tokens, small blocks keep the bytes per SM even; with more, blocks share
# the launch.
comptime FEW_TOKENS = 2
# Steps of up to SLOT_TOKENS tokens run the one-token kernels with a slot per
# (token, expert) pair (gate_up_lean_kernel, down_one_token_kernel), and so pay
# their short ramp and tail once; a repeated expert is then read once per pair.
# Longer steps do too while their pairs are few beside the experts
# (tokens * top_k * SLOT_SPREAD <= n_experts), where repeats are rare. H200:
# T = 2 -24 % on both models; T = 4 -8 % with 128 experts, level with 32 (so
# 20b keeps the multi-token kernels there); T = 8 slower with slots on both
# (+2 % with 128 experts, +30 % with 32). bench/NOTES.md, "Nineteenth session".
comptime SLOT_TOKENS = 2
comptime SLOT_SPREAD = 8


def as_slots(tokens: Int, top_k: Int, n_experts: Int) -> Bool:
    """Whether a step of `tokens` tokens runs as (token, expert) slots."""
    return tokens <= SLOT_TOKENS or tokens * top_k * SLOT_SPREAD <= n_experts


comptime GATE_UP_WARPS_FEW = 2
comptime DOWN_WARPS_FEW = 2
comptime DOWN_KSPLIT_FEW = 2  # both warps of a few-token down block share one tile
comptime DOWN1_DEPTH = 2  # the one-token down's lean ring (batches; DEPTH elsewhere)
# warps per expert of a bf16 one-token down block (its lean tile's 78 registers
# hold 2 blocks of 12 warps per SM); a float32 one keeps DOWN_KSPLIT_FEW, since
# _tile16 on hi + lo spills at 12 warps
comptime DOWN1_KSPLIT = 3


def _down1_ksplit(out_dtype: DType) -> Int:
    """Warps per expert in down_one_token_kernel[out_dtype]."""
    return DOWN_KSPLIT_FEW if out_dtype != DType.bfloat16 else DOWN1_KSPLIT

comptime WARPS_MANY = 4
# Resident warps per SM the register budget is held to. Few-token blocks: 12
# (<= 168 registers): a one-token step's 1440 gate_up / down warps then run in
# one wave on 132 SMs. Many-token blocks: 16 (<= 128 registers), measured
# faster at T = 8 and 64 and slower at T = 1 (bench/NOTES.md, v7d).
comptime MIN_WARPS_PER_SM_FEW = 12
comptime MIN_WARPS_PER_SM_MANY = 16


def _min_blocks_per_sm(warps: Int) -> Int:
    return (MIN_WARPS_PER_SM_MANY if warps >= WARPS_MANY else MIN_WARPS_PER_SM_FEW) // warps

# Counters: one per 8 output rows (the op's counters tensor, ops.py), at least
# one per down tile (16 rows or more).
comptime COUNTER_TILE_ROWS = 8
comptime TOK_PASS = 8
# A batch is one 16-byte block per lane and row (rows g and g + 8). Fewer
# loads in flight per warp measured faster (DEPTH 2 < 4 < 6 in time; a
# shared-memory cp.async ring of 8 slowest: bench/NOTES.md, v7d/v8).
comptime DEPTH = 2  # batches in the ring: DEPTH - 1 in flight while one is decoded (even)
comptime RING = 2 * DEPTH
comptime CHUNK_TOKENS = 64
comptime MAX_TOPK = 4
comptime MAX_PAIRS = CHUNK_TOKENS * MAX_TOPK
comptime MAX_EXPERTS = 256
# A warp copies its 16-row tile's scale bytes (16 per block column) into shared
# memory once, with the scan for scales above 128, and the batches read them
# there: per-batch byte loads from global memory cost ~5 us of a 120b T = 1
# layer (bench/NOTES.md, v12). Sized for K <= 3072 (gpt-oss: 2880).
comptime MAX_K_BLOCKS = 96
comptime TILE_SCALES = 16 * MAX_K_BLOCKS
comptime SharedU8 = Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def _route_warp(
    ids: Pointer[Int32, _],
    n_pairs: Int,
    n_experts: Int,
    slot: Int,
    plist: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
) -> SIMD[DType.int32, 4]:
    """Warp-wide, from one load of the ids per lane and no block barrier:
    [the slot-th routed expert (ascending id) or -1, routed experts in all,
    its pairs, 0]; plist (this warp's own) = the pair indices t * K + k
    routed to it, ascending."""
    var lane = Int(lane_id())
    var below = (UInt32(1) << UInt32(lane)) - 1
    comptime NJ = MAX_PAIRS // 32
    comptime NW = MAX_EXPERTS // 32
    var mine = SIMD[DType.int32, NJ](-1)
    var words = SIMD[DType.uint32, NW](0)
    comptime for j in range(NJ):
        if 32 * j < n_pairs:
            var p = 32 * j + lane
            if p < n_pairs:
                var e = ids[unsafe_offset=p]
                if e >= 0 and Int(e) < n_experts:
                    mine[j] = e
                    var bit = UInt32(1) << UInt32(e & 31)
                    comptime for w in range(NW):
                        if Int(e >> 5) == w:
                            words[w] |= bit
    var nwords = (n_experts + 31) // 32
    var count = 0
    var found = -1
    comptime for w in range(NW):
        if w < nwords:
            var m = words[w]
            comptime for i in range(5):
                m |= shuffle_xor(m, UInt32(16 >> i))
            var pc = Int(pop_count(m))
            if found < 0 and slot < count + pc:
                var hit = ((m >> UInt32(lane)) & 1) != 0 and Int(pop_count(m & below)) == slot - count
                found = 32 * w + Int(count_trailing_zeros(vote[DType.uint32](hit)))
            count += pc
    var n = 0
    if found >= 0:
        comptime for j in range(NJ):
            if 32 * j < n_pairs:
                var hit_p = Int(mine[j]) == found
                var m = vote[DType.uint32](hit_p)
                if hit_p:
                    plist[n + Int(pop_count(m & below))] = Int32(32 * j + lane)
                n += Int(pop_count(m))
    syncwarp()
    return SIMD[DType.int32, 4](Int32(found), Int32(count), Int32(n), 0)


# How a lane gets its activation fragment (mma's B: one token, one 32-element
# block, as 16 bf16 pair words in decode order):
comptime A_BF16 = 0  # x bf16 in natural order: 4 x 16-byte loads
comptime A_F32 = 1  # x f32 in natural order: 8 loads, split into hi + lo
comptime A_WORDS = 2  # h as bf16 pair words (hi only)
comptime A_WORDS_SPLIT = 3  # h as hi words, then lo words


@always_inline
def _load_a[
    mode: Int, volatile: Bool = False
](arow: Pointer[UInt32, _], lo_off: Int, c: Int) -> Tuple[SIMD[DType.uint32, 16], SIMD[DType.uint32, 16]]:
    """volatile (A_BF16 only): loads that see what other blocks of the same
    launch wrote (after their fence and counter)."""
    var hi = SIMD[DType.uint32, 16](0)
    var lo = SIMD[DType.uint32, 16](0)
    comptime if mode == A_BF16:
        comptime for w in range(4):
            # pair words j of elements 32c + 8w ...: decode index 4j + w
            var v = arow.unsafe_load[width=4, alignment=16, volatile=volatile](c * 16 + w * 4)
            comptime for j in range(4):
                hi[4 * j + w] = v[j]
    elif mode == A_F32:
        comptime for w in range(4):
            var v0 = bitcast[DType.float32, 4](arow.unsafe_load[width=4, alignment=16](c * 32 + w * 8))
            var v1 = bitcast[DType.float32, 4](arow.unsafe_load[width=4, alignment=16](c * 32 + w * 8 + 4))
            comptime for j in range(4):
                var ab: SIMD[DType.float32, 2]
                comptime if j < 2:
                    ab = SIMD[DType.float32, 2](v0[2 * j], v0[2 * j + 1])
                else:
                    ab = SIMD[DType.float32, 2](v1[2 * j - 4], v1[2 * j - 3])
                var h2 = ab.cast[DType.bfloat16]()
                hi[4 * j + w] = bitcast[DType.uint32, 1](h2)
                lo[4 * j + w] = bitcast[DType.uint32, 1]((ab - h2.cast[DType.float32]()).cast[DType.bfloat16]())
    else:
        comptime for v4 in range(4):
            var x4 = arow.unsafe_load[width=4, alignment=16](c * 16 + v4 * 4)
            comptime for z in range(4):
                hi[4 * z + v4] = x4[z]
            comptime if mode == A_WORDS_SPLIT:
                var y4 = arow.unsafe_load[width=4, alignment=16](lo_off + c * 16 + v4 * 4)
                comptime for z in range(4):
                    lo[4 * z + v4] = y4[z]
    return (hi, lo)


@always_inline
def _decode_block[
    big: Bool
](w: SIMD[DType.uint32, 4], sc: UInt32) -> SIMD[DType.uint32, 16]:
    """One 16-byte MXFP4 block as 16 bf16 pair words in decode order (index
    4q + c: slot c of word q, elements 8c + 2q, + 1), scaled by 2^(sc-127).
    big: some scale of the batch is above 128, so the scale is two exact
    multiplies, 2^(min(s,128)-1) and 2^(max(s,128)-128)."""
    var pairs = SIMD[DType.uint32, 16](0)
    comptime for w4 in range(4):
        comptime for s4 in range(4):
            pairs[4 * w4 + s4] = _decode_scaled[big, s4](w[w4], sc)
    return pairs


@always_inline
def _decode_scaled[big: Bool, c: Int](w: UInt32, sc: UInt32) -> UInt32:
    """decode_slot of slot c of word w scaled by 2^(sc-127): one bf16
    multiply, or with big (a scale above 128 somewhere) two exact ones,
    2^(min(s,128)-1) and 2^(max(s,128)-128)."""
    comptime if big:
        var m2u = (max(sc, 128) - 1) << 7
        var mult2 = bitcast[DType.bfloat16, 2](m2u | (m2u << 16))
        return scaled_pair(decode_slot[c](w, scale_mult(min(sc, 128))), mult2)
    else:
        return decode_slot[c](w, scale_mult(sc))


@always_inline
def _load_batch[
    ring: Int, //, slot: Int
](
    mut wv: Array[SIMD[DType.uint32, 4], ring],
    w_g: Pointer[UInt32, _],
    w_g8: Pointer[UInt32, _],
    c0: Int,
    nchunks: Int,
    batch: Int,
    q: Int,
):
    """Issue the 16-byte weight loads of one batch (block 4 * batch + q of rows
    g and g + 8) into ring slot `slot`. Past the last block the index is
    clamped: those blocks meet zero activations (finite weights, so their
    products are exact zeros) and no predicate sits in the load path."""
    comptime i = 2 * slot
    var c = min(4 * batch + q, nchunks - 1)
    # Streamed once: kept out of L1, which holds the activations.
    comptime na = CacheEviction.NO_ALLOCATE
    wv[i] = load[width=4, read_only=True, eviction_policy=na, alignment=16](w_g + (tiled_block_offset(0, c0 + c, 0) >> 2))
    wv[i + 1] = load[width=4, read_only=True, eviction_policy=na, alignment=16](w_g8 + (tiled_block_offset(0, c0 + c, 0) >> 2))


@always_inline
def _read_scales[
    ring: Int, //, slot: Int
](mut sv: Array[UInt32, ring], s_g: SharedU8, s_g8: SharedU8, c0: Int, nchunks: Int, batch: Int, q: Int):
    """The scale bytes of the batch _load_batch put in ring slot `slot`, from
    the warp's shared copy of the tile's scales (s_g, s_g8: rows g and g + 8,
    scale 0)."""
    comptime i = 2 * slot
    var c = min(4 * batch + q, nchunks - 1)
    sv[i] = UInt32(s_g[tiled_scale_offset(0, c0 + c, 0)])
    sv[i + 1] = UInt32(s_g8[tiled_scale_offset(0, c0 + c, 0)])


@always_inline
def _mma_batch[
    amode: Int, big: Bool, slot: Int
](
    wv: Array[SIMD[DType.uint32, 4], RING],
    sv: Array[UInt32, RING],
    mut acc0: SIMD[DType.float32, 4],
    mut acc1: SIMD[DType.float32, 4],
    bfrag: Tuple[SIMD[DType.uint32, 16], SIMD[DType.uint32, 16]],
):
    """Multiply-accumulate the batch in ring slot `slot`: weights are mma's
    A (rows g and g + 8 of the 16-row tile), the token activations its B
    (bfrag, token g: see _load_b)."""
    comptime split = amode == A_F32 or amode == A_WORDS_SPLIT
    comptime i = 2 * slot
    var pg = _decode_block[big](wv[i], sv[i])
    var pg8 = _decode_block[big](wv[i + 1], sv[i + 1])
    var bhi = bfrag[0]
    var blo = bfrag[1]
    comptime for t in range(8):
        var a = bitcast[DType.bfloat16, 8](SIMD[DType.uint32, 4](pg[2 * t], pg8[2 * t], pg[2 * t + 1], pg8[2 * t + 1]))
        var b = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](bhi[2 * t], bhi[2 * t + 1]))
        comptime if t % 2 == 0:
            mma(acc0, a, b, acc0)
        else:
            mma(acc1, a, b, acc1)
        comptime if split:
            var bl = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](blo[2 * t], blo[2 * t + 1]))
            comptime if t % 2 == 0:
                mma(acc1, a, bl, acc1)
            else:
                mma(acc0, a, bl, acc0)


@always_inline
def _load_b[
    amode: Int
](brow: Pointer[UInt32, _], lo_off: Int, nchunks: Int, batch: Int, q: Int) -> Tuple[
    SIMD[DType.uint32, 16], SIMD[DType.uint32, 16]
]:
    """The B fragment of a batch: token g's activations of block 4 * batch + q
    in decode order (zero past the last block; a lane without a token reads
    some token's row: its D column is never stored)."""
    var c = 4 * batch + q
    if c < nchunks:
        return _load_a[amode](brow, lo_off, c)
    return (SIMD[DType.uint32, 16](0), SIMD[DType.uint32, 16](0))


@always_inline
def _stage_scales[
    limit: Int = 128
](s_tile: Pointer[UInt8, _], n_bytes: Int, sm: SharedU8) -> Bool:
    """Warp-wide: copy the n_bytes (<= TILE_SCALES) scale bytes at s_tile into
    this warp's shared sm, and tell whether any exceeds limit: 128 (weights
    of magnitude >= 12, which need the two-multiply decode) or 192 (what the
    lean tiles' fixed multiplier bias holds, LEAN_BIG_S)."""
    comptime assert limit == 128 or limit == 192, "the bytewise scan knows 128 and 192"
    var lane = Int(lane_id())
    var big = UInt32(0)
    comptime na = CacheEviction.NO_ALLOCATE
    if (Int(s_tile) & 15) == 0 and (n_bytes & 15) == 0:
        var v = s_tile.unsafe_bitcast[UInt32]()
        var d = sm.unsafe_bitcast[UInt32]()
        for i in range(lane, n_bytes >> 4, 32):
            var w = load[width=4, read_only=True, eviction_policy=na, alignment=16](v + 4 * i)
            d.unsafe_store[width=4, alignment=16](4 * i, w)
            comptime if limit == 128:
                big |= scale_bytes_above_128(w).reduce_or()
            else:
                # per byte: the two high bits set and some of the six low bits
                var low6 = ((w & 0x3F3F3F3F) + 0x3F3F3F3F) << 1
                big |= ((w & (w << 1)) & low6 & 0x80808080).reduce_or()
    else:
        for i in range(lane, n_bytes, 32):
            var b = s_tile[unsafe_offset=i]
            sm[i] = b
            if Int(b) > limit:
                big = 1
    syncwarp()
    return vote[DType.uint32](big != 0) != 0


@always_inline
def _tile_loop[
    amode: Int, big: Bool
](
    mut wv: Array[SIMD[DType.uint32, 4], RING],
    mut sv: Array[UInt32, RING],
    w_g: Pointer[UInt32, _],
    w_g8: Pointer[UInt32, _],
    s_g: SharedU8,
    s_g8: SharedU8,
    c0: Int,
    nchunks: Int,
    brow: Pointer[UInt32, _],
    lo_off: Int,
) -> SIMD[DType.float32, 4]:
    """_tile16's batches through a ring of DEPTH slots, batches 0 .. DEPTH-2
    already in flight: each step issues the weight loads DEPTH - 1 batches
    ahead and the activations one batch ahead, then decodes and multiplies
    the oldest."""
    var q = Int(lane_id()) & 3
    var nb = (nchunks + 3) // 4
    var acc0 = SIMD[DType.float32, 4](0)
    var acc1 = SIMD[DType.float32, 4](0)
    # the activations one batch ahead (L1 hits mostly), in two slots
    # (DEPTH is even, so slot i % 2 holds batch bt + i)
    var bring = Array[Tuple[SIMD[DType.uint32, 16], SIMD[DType.uint32, 16]], 2](
        fill=(SIMD[DType.uint32, 16](0), SIMD[DType.uint32, 16](0))
    )
    bring[0] = _load_b[amode](brow, lo_off, nchunks, 0, q)
    var bt = 0
    while bt < nb:
        comptime for i in range(DEPTH):
            if bt + i < nb:
                if bt + i + DEPTH - 1 < nb:
                    comptime nxt = (i + DEPTH - 1) % DEPTH
                    _load_batch[nxt](wv, w_g, w_g8, c0, nchunks, bt + i + DEPTH - 1, q)
                    _read_scales[nxt](sv, s_g, s_g8, c0, nchunks, bt + i + DEPTH - 1, q)
                bring[(i + 1) % 2] = _load_b[amode](brow, lo_off, nchunks, bt + i + 1, q)
                _mma_batch[amode, big, i](wv, sv, acc0, acc1, bring[i % 2])
        bt += DEPTH
    return acc0 + acc1


@always_inline
def _tile16[
    amode: Int
](
    w_g: Pointer[UInt32, _],
    w_g8: Pointer[UInt32, _],
    s_g: Pointer[UInt8, _],
    s_g8: Pointer[UInt8, _],
    s_tile: Pointer[UInt8, _],
    tile_scale_bytes: Int,
    sm: SharedU8,
    mut big: Bool,
    first_pass: Bool,
    c0: Int,
    nchunks: Int,
    brow: Pointer[UInt32, _],
    lo_off: Int,
) -> SIMD[DType.float32, 4]:
    """One warp: D[row, token] for a 16-row tile (this lane's rows g and
    g + 8: w_g/s_g, w_g8/s_g8 at their block 0 in the tiled layout, clamped
    to a real row when out of range; its blocks c0 .. c0 + nchunks - 1; the
    tile's real scale rows at s_tile: tile_scale_bytes bytes, every block of
    those rows, wherever this warp's nchunks blocks start, copied to the
    warp's shared sm on the first token pass, which also sets `big`: some
    scale above 128) and up to 8 tokens (this lane serves token g: brow).
    Lane (g, q) reads the blocks q, q + 4, ... of its two rows, one per
    batch, DEPTH - 1 batches ahead. Returns
    this lane's fragment: rows g (c0, c1) and g + 8 (c2, c3), tokens 2q and
    2q + 1."""
    var q = Int(lane_id()) & 3
    var nb = (nchunks + 3) // 4
    var wv = Array[SIMD[DType.uint32, 4], RING](fill=0)
    var sv = Array[UInt32, RING](fill=0)
    # the rows' scale 0 in the shared copy, at the offsets they have in s_tile
    var ss_g = sm + (Int(s_g) - Int(s_tile))
    var ss_g8 = sm + (Int(s_g8) - Int(s_tile))
    comptime for i in range(DEPTH - 1):
        if i < nb:
            _load_batch[i](wv, w_g, w_g8, c0, nchunks, i, q)
    # The tile's scales are staged (first pass) while those loads fly, with
    # the check for scales above 128 (rare: then a loop specialised for them).
    if first_pass:
        big = _stage_scales(s_tile, tile_scale_bytes, sm)
    comptime for i in range(DEPTH - 1):
        if i < nb:
            _read_scales[i](sv, ss_g, ss_g8, c0, nchunks, i, q)
    if big:
        return _tile_loop[amode, True](wv, sv, w_g, w_g8, ss_g, ss_g8, c0, nchunks, brow, lo_off)
    return _tile_loop[amode, False](wv, sv, w_g, w_g8, ss_g, ss_g8, c0, nchunks, brow, lo_off)


@always_inline
def _tile_rows(
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    e: Int,
    rows: Int,
    r0: Int,
    g: Int,
    ok_a: Bool,
    ok_b: Bool,
    nchunks: Int,
) -> Tuple[
    Pointer[UInt32, ImmutAnyOrigin],
    Pointer[UInt32, ImmutAnyOrigin],
    Pointer[UInt8, ImmutAnyOrigin],
    Pointer[UInt8, ImmutAnyOrigin],
    Pointer[UInt8, ImmutAnyOrigin],
]:
    """In expert e's tiled layout (rows % 16 == 0, 16-row tile at r0): block 0
    of this lane's rows g and g + 8 (row 0 of the tile where out of range:
    never stored), their scale 0, and the tile's scales (16 * nchunks
    contiguous bytes)."""
    var tile = e * (rows // 16) + r0 // 16
    var wb = blocks.unsafe_offset(tile * nchunks * 256)
    var sb = scales.unsafe_offset(tile * nchunks * 16)
    var ga = g if ok_a else 0
    var gb = g + 8 if ok_b else 0
    return (
        wb.unsafe_offset(ga * 32).unsafe_bitcast[UInt32](),
        wb.unsafe_offset(gb * 32).unsafe_bitcast[UInt32](),
        sb.unsafe_offset(ga * 2),
        sb.unsafe_offset(gb * 2),
        sb,
    )


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(warps * 32)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(_min_blocks_per_sm(warps)))
def gate_up_kernel[
    x_dtype: DType, warps: Int, one_token: Bool, route: Int = 0
](
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_counters_: Int64,
    x: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    logits: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    n_pairs_: Int64,
    top_k_: Int64,
    n_experts_: Int64,
    rows_: Int64,
    hidden_: Int64,
):
    """rows = 2I (gate/up interleaved), h [pairs, I] f32. one_token: the step
    has one token, so grid slot k serves pair k (expert ids[k]) without the
    warp-wide routing (a repeated expert is then read once per pair).
    route > 0 (one token only): the step's routing is not given; every warp
    takes the top_k of the router's logits [E] itself (router_topk.warp_topk,
    E <= 32 * route) and block (0, 0) writes them to ids_out / wts_out for
    down; `ids` is then unused."""
    pdl_enter()
    var n_counters = Int(n_counters_)
    var n_pairs = Int(n_pairs_)
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var rows = Int(rows_)
    var hidden = Int(hidden_)
    comptime split = x_dtype != DType.bfloat16
    comptime threads = warps * 32
    var plists = stack_allocation[warps * MAX_PAIRS, Int32, address_space=AddressSpace.SHARED]()
    var plist = plists + Int(warp_id()) * MAX_PAIRS
    var sms = stack_allocation[warps * TILE_SCALES, UInt8, alignment=16, address_space=AddressSpace.SHARED]()
    var sm = sms + Int(warp_id()) * TILE_SCALES
    var tid = Int(thread_idx.x)
    if block_idx.x == 0 and block_idx.y == 0:
        for i in range(tid, n_counters, threads):
            counters[unsafe_offset=i] = 0
    var e: Int
    var npairs_e: Int
    comptime if one_token:
        comptime if route > 0:
            var mine = warp_topk[x_dtype, route](logits, n_experts, top_k)
            if block_idx.x == 0 and block_idx.y == 0 and warp_id() == 0 and Int(lane_id()) < top_k:
                ids_out[unsafe_offset=Int(lane_id())] = mine[0]
                wts_out[unsafe_offset=Int(lane_id())] = mine[1]
            e = Int(shuffle_idx(mine[0], UInt32(block_idx.y)))
        else:
            e = Int(ids[unsafe_offset=Int(block_idx.y)])
        if e < 0 or e >= n_experts:
            return
        npairs_e = 1
        if lane_id() == 0:
            plist[0] = Int32(block_idx.y)
        syncwarp()
    else:
        var rt = _route_warp(ids, n_pairs, n_experts, Int(block_idx.y), plist)
        e = Int(rt[0])
        if e < 0:
            return
        npairs_e = Int(rt[2])
    var nchunks = hidden // 32
    var inter = rows // 2
    var r0 = (Int(block_idx.x) * warps + Int(warp_id())) * 16
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var ok_a = r0 + g < rows
    var ok_b = r0 + g + 8 < rows
    var rp = _tile_rows(blocks, scales, e, rows, r0, g, ok_a, ok_b, nchunks)
    var w_a = rp[0]
    var w_b = rp[1]
    var s_a = rp[2]
    var s_b = rp[3]
    var s_tile = rp[4]
    # One-token steps: the tile's 16 bias values go to shared memory by
    # cp.async now and are read after the loop, which then ends with no
    # dependent global load (T = 1 -1.1 us; with more tokens it measured
    # slower, so they load the bias after the loop: bench/NOTES.md, v12b).
    var bsm = stack_allocation[warps * 16, Float32, alignment=16, address_space=AddressSpace.SHARED]()
    var bw = bsm + Int(warp_id()) * 16
    comptime if one_token:
        if lane < 16 and r0 + lane < rows:
            async_copy[4](
                bias.unsafe_offset(e * rows + r0 + lane).unsafe_address_space_cast[AddressSpace.GLOBAL](), bw + lane
            )
        async_copy_commit_group()
    # h rows as bf16: hi pair words, then lo (f32 graphs).
    var hb = h.unsafe_bitcast[BFloat16]()
    var odd = (g & 1) != 0
    var big = False
    var first = 0
    # v29: an expert with at most LEAN_PAIRS pairs takes the lean two-token tile
    comptime lean_ok = not one_token and not split and LEAN_PAIRS > 0
    var xsb = stack_allocation[
        2 * LEAN_PAIR_X_WORDS if lean_ok else 4, UInt32, alignment=16, address_space=AddressSpace.SHARED
    ]()
    var lean = lean_ok and npairs_e <= LEAN_PAIRS
    while first < npairs_e:
        var has_tok = first + g < npairs_e
        var p = Int(plist[first + g]) if has_tok else 0
        var xrow = x.unsafe_offset((p // top_k) * hidden).unsafe_bitcast[UInt32]()
        comptime amode = A_F32 if split else A_BF16
        var acc = SIMD[DType.float32, 4](0)
        comptime if lean_ok:
            if lean:
                var x0 = x.unsafe_offset((Int(plist[0]) // top_k) * hidden).unsafe_bitcast[UInt32]()
                var x1 = x.unsafe_offset((Int(plist[min(1, npairs_e - 1)]) // top_k) * hidden).unsafe_bitcast[UInt32]()
                acc = _lean_pair_tile[threads](blocks, scales, e, rows, r0, nchunks, x0, x1, npairs_e > 1, sm, xsb)
        if not lean:
            acc = _tile16[amode](
                w_a, w_b, s_a, s_b, s_tile, min(16, rows - r0) * nchunks, sm, big, first == 0, 0, nchunks, xrow, 0
            )
        # Rows g (gate, g even) and g ^ 1 (up) sit in lanes l and l ^ 4: the
        # even lane keeps token 2q, the odd one token 2q + 1.
        var got0 = shuffle_xor(acc[0] if odd else acc[1], UInt32(4))
        var got1 = shuffle_xor(acc[2] if odd else acc[3], UInt32(4))
        comptime if one_token:
            async_copy_wait_group(0)
            syncwarp()
        var gates = SIMD[DType.float32, 2](got0, got1) if odd else SIMD[DType.float32, 2](acc[0], acc[2])
        var ups = SIMD[DType.float32, 2](acc[1], acc[3]) if odd else SIMD[DType.float32, 2](got0, got1)
        var slot_t = first + 2 * q + (g & 1)
        if slot_t < npairs_e:
            var pt = Int(plist[slot_t])
            comptime for hh in range(2):
                var gr = r0 + (g & ~1) + 8 * hh
                if gr + 1 < rows:
                    var gate: Float32
                    var up: Float32
                    comptime if one_token:
                        gate = gates[hh] + bw[gr - r0]
                        up = ups[hh] + bw[gr - r0 + 1]
                    else:
                        gate = gates[hh] + bias[unsafe_offset=e * rows + gr]
                        up = ups[hh] + bias[unsafe_offset=e * rows + gr + 1]
                    var v = gptoss_swiglu(gate, up)
                    var at = pt * 2 * inter + (gr >> 1)
                    var vb = v.cast[DType.bfloat16]()
                    hb[unsafe_offset=at] = vb
                    comptime if split:
                        hb[unsafe_offset=at + inter] = (v - vb.cast[DType.float32]()).cast[DType.bfloat16]()
        first += TOK_PASS


# ------------------------------------------------------------ lean one-token tiles (v18, v25)
#
# A one-token step's gate_up as more, shorter chains: LEAN_KS warps share each
# 16-row tile, each over its part of H, and sum their fragments in shared
# memory. The main kernel's warp holds a whole batch's decoded pairs and two
# batches of activation fragments in registers (121 registers: 12 warps per
# SM, so its 1,440 warps of 23 batches each are the most one wave holds). Here
# a batch is decoded just in time, one mma's four pair words at a time, and
# the activations come from a decode-ordered copy of x in shared memory (one
# 8-byte load per mma), so the registers fit LEAN_MIN_WARPS warps per SM:
# LEAN_KS * 1,440 warps of ~23 / LEAN_KS batches in one wave. The one-token
# down (bf16 output) runs the same tile on its part of h.
#
# v25, the block scale after the mma: with one token, seven of mma's eight B
# columns are spare. Lane (g, q) gives its activations (block 4b + q of the
# batch) only to column g = 2q and reads a zero block otherwise, so B is block
# diagonal and D's column 2q is block q's own sum. The weights go in as the
# bare placed bits (mxfp4.slot_bits: e2m1 x 2^-126; the tensor cores keep the
# subnormal ones exactly, bench/results/mma_subnormal_probe_h200_20261129.json)
# with no bf16 multiply, and each lane applies its block's scale to its column
# with one f32 multiply-add per row. The quad's four lanes then hold the four
# blocks' shares of each row, summed by two shuffles at the end.
# The staged activations carry 2^LEAN_X_POW (exact in bf16 for |x| < 2^(128 -
# LEAN_X_POW)), so the sums stay in f32's normal range, and scale byte s
# becomes the f32 multiplier with bits (s + LEAN_BIAS) << 23, 2^(s - 1 -
# LEAN_X_POW), exact for every s <= LEAN_BIG_S. A tile with a larger scale
# takes a bias from its largest one instead (_lean_bias) and multiplies the
# rest back at the end (_lean_rest).
comptime LEAN_KS = 2  # warps per tile (0: the one-token step keeps gate_up_kernel)
comptime LEAN_MIN_WARPS = 22  # resident warps per SM the registers are held to
# 16-row tiles per block of the lean gate_up (each LEAN_KS warps). 1: 1,440
# blocks of 2 warps for a 20b / 120b step, ~11 per SM. More tiles per block
# mean fewer, larger blocks for the block scheduler to place (the ramp of the
# PM series, bench/NOTES.md "Twelfth session"), at the same warps per SM; at
# most 4 (static shared memory: ~5.3 KB per warp, 48 KB per block).
comptime LEAN_TPB = 1
# u32 words per staged x block: 16 used; a stride of 20 puts the 4 quads' 8-byte
# loads of one mma in distinct banks
comptime LEAN_X_STRIDE = 20


def _lean_blocks(ks: Int) -> Int:
    """The most K blocks one warp takes when ks warps split K."""
    return (MAX_K_BLOCKS + ks - 1) // ks


def _lean_x_words(ks: Int) -> Int:
    """u32 words of a warp's staged x when ks warps split K: its blocks,
    rounded up to whole batches, then the zero block."""
    return ((_lean_blocks(ks) + 3) // 4 * 4 + 1) * LEAN_X_STRIDE


comptime LEAN_X_WORDS = _lean_x_words(max(LEAN_KS, 1))


def _lean_scale_bytes(ks: Int) -> Int:
    """Bytes of a warp's staged scales when ks warps split K: the 32-byte
    block pairs its blocks can touch."""
    return ((_lean_blocks(ks) + 1) // 2 + 1) * 32

# independent mma accumulator chains per batch (1, 2, 4 or 8: 8 mmas a batch)
comptime LEAN_CHAINS = 2
comptime LEAN_DEPTH = 2  # the one-token gate_up's ring (batches; loaded and decoded in halves)
comptime LEAN_X_POW = 64
comptime LEAN_BIAS = 126 - LEAN_X_POW
comptime LEAN_BIG_S = 128 + LEAN_X_POW
comptime SharedU32 = Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]
comptime SharedF32 = Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def _stage_x_words[volatile: Bool = False](xrow: Pointer[UInt32, _], c0: Int, nloc: Int, nslots: Int, xs: SharedU32):
    """Warp-wide: x blocks c0 .. c0 + nloc - 1 (bf16, natural order) times
    2^LEAN_X_POW into xs as decode-ordered pair words (LEAN_X_STRIDE per
    block), zero blocks after them up to nslots (the clamped weight blocks
    past the end meet these), and one more zero block (the B words of the
    lanes that do not feed B)."""
    comptime m = UInt32((LEAN_X_POW + 127) << 7)
    var mult = bitcast[DType.bfloat16, 2](m | (m << 16))
    for j in range(Int(lane_id()), nslots + 1, 32):
        var hi = SIMD[DType.uint32, 16](0)
        if j < nloc:
            hi = _load_a[A_BF16, volatile](xrow, 0, c0 + j)[0]
        var d = xs + j * LEAN_X_STRIDE
        comptime for v4 in range(4):
            var v = SIMD[DType.uint32, 4](0)
            comptime for z in range(4):
                v[z] = scaled_pair(hi[4 * v4 + z], mult)
            d.unsafe_store[width=4, alignment=16](4 * v4, v)
    syncwarp()


@always_inline
def _lean_mult[big: Bool](s: UInt32, bias: Int32) -> Float32:
    """Scale byte s as the f32 2^(s + bias - 127); big: a tile bias under
    LEAN_BIAS, where scales far below the tile's largest flush to zero."""
    comptime if big:
        return bitcast[DType.float32, 1](UInt32(max(Int32(s) + bias, 0)) << 23)
    else:
        return bitcast[DType.float32, 1](UInt32(Int32(s) + bias) << 23)


@always_inline
def _lean_bias(sm: SharedU8, n_bytes: Int) -> Int32:
    """Warp-wide, for a tile with a scale above LEAN_BIG_S (rare): the bias
    that takes its largest scale (of the n_bytes at sm) to the f32 2^127."""
    var top = UInt32(0)
    for i in range(Int(lane_id()), n_bytes, 32):
        top = max(top, UInt32(sm[i]))
    comptime for i in range(5):
        top = max(top, shuffle_xor(top, UInt32(16 >> i)))
    return Int32(254) - Int32(top)


@always_inline
def _lean_rest(bias: Int32) -> Float32:
    """What _lean_bias's bias left out of every multiplier: 2^(LEAN_BIAS -
    bias), at most 2^62."""
    return bitcast[DType.float32, 1](UInt32(Int32(LEAN_BIAS + 127) - bias) << 23)


@always_inline
def _lean_batch[
    ring: Int, n: Int, //, big: Bool, slot: Int
](
    wv: Array[SIMD[DType.uint32, 4], ring],
    sv: Array[UInt32, ring],
    mut part: SIMD[DType.float32, n],
    xb: SharedU32,
    bias: Int32,
):
    """One batch for one token (n = 2) or two (n = 4, v29): each mma's A
    words placed (no scale) just before it, its B words (this lane's x block,
    or the zero block) read from shared memory, LEAN_CHAINS chains from zero;
    then column 2q (block q's sums of rows g and g + 8; with two tokens also
    column 2q + 1, the second token's) times the block's scales, into part
    (rows g, g + 8 of the first token, then of the second)."""
    comptime i = 2 * slot
    var d = Array[SIMD[DType.float32, 4], LEAN_CHAINS](fill=0)
    comptime for t in range(8):
        comptime w4 = t // 2
        comptime s0 = 2 * (t % 2)
        var a = bitcast[DType.bfloat16, 8](
            SIMD[DType.uint32, 4](
                slot_bits[s0](wv[i][w4]),
                slot_bits[s0](wv[i + 1][w4]),
                slot_bits[s0 + 1](wv[i][w4]),
                slot_bits[s0 + 1](wv[i + 1][w4]),
            )
        )
        var b = bitcast[DType.bfloat16, 4](xb.unsafe_load[width=2, alignment=8](2 * t))
        comptime c = t % LEAN_CHAINS
        mma(d[c], a, b, d[c])
    comptime assert n == 2 or n == 4, "one token or two"
    comptime if n == 2:
        var col = SIMD[DType.float32, 2](d[0][0], d[0][2])
        comptime for c in range(1, LEAN_CHAINS):
            col += SIMD[DType.float32, 2](d[c][0], d[c][2])
        var sc = SIMD[DType.float32, 2](_lean_mult[big](sv[i], bias), _lean_mult[big](sv[i + 1], bias))
        part = rebind[SIMD[DType.float32, n]](col.fma(sc, rebind[SIMD[DType.float32, 2]](part)))
    else:
        var col = SIMD[DType.float32, 4](d[0][0], d[0][2], d[0][1], d[0][3])
        comptime for c in range(1, LEAN_CHAINS):
            col += SIMD[DType.float32, 4](d[c][0], d[c][2], d[c][1], d[c][3])
        var s_g = _lean_mult[big](sv[i], bias)
        var s_g8 = _lean_mult[big](sv[i + 1], bias)
        var sc = SIMD[DType.float32, 4](s_g, s_g8, s_g, s_g8)
        part = rebind[SIMD[DType.float32, n]](col.fma(sc, rebind[SIMD[DType.float32, 4]](part)))


@always_inline
def _lean_loop[
    ring: Int, //, big: Bool, n: Int = 2
](
    mut wv: Array[SIMD[DType.uint32, 4], ring],
    mut sv: Array[UInt32, ring],
    w_g: Pointer[UInt32, _],
    w_g8: Pointer[UInt32, _],
    s_g: SharedU8,
    s_g8: SharedU8,
    c0: Int,
    nchunks: Int,
    xb0: SharedU32,
    xstep: Int,
    bias: Int32,
) -> SIMD[DType.float32, n]:
    """_tile_loop with _lean_batch over a ring of ring / 2 batches, loaded
    and decoded in groups of half the ring (batches 0 .. ring / 4 - 1 already
    in flight; batch b's B words at xb0 + b * xstep): this lane's share of
    rows g and g + 8 (n = 4: of two tokens). ptxas counts every weight load
    on one scoreboard, so a wait for one batch is a wait for all in flight;
    a group is waited for together, then the next group is issued, and then
    the group decoded, with that next group in flight."""
    comptime depth = ring // 2
    comptime group = depth // 2
    comptime assert depth == 2 * group, "an even ring of batches"
    var q = Int(lane_id()) & 3
    var nb = (nchunks + 3) // 4
    var part = SIMD[DType.float32, n](0)
    var bt = 0
    while bt < nb:
        comptime for h in range(2):
            comptime cur = h * group
            comptime nxt = (1 - h) * group
            if bt + cur < nb:
                # the next group's loads after the wait for this one's: their
                # index depends on its last word through a zero ptxas cannot
                # fold (nb < 2^30), else it issues them first and then waits
                # for both groups together
                var nxt_bt = bt
                comptime if group > 1:
                    nxt_bt += Int(wv[2 * (cur + group - 1) + 1][3] & UInt32(nb >> 30))
                comptime for j in range(group):
                    if bt + cur + group + j < nb:
                        _load_batch[nxt + j](wv, w_g, w_g8, c0, nchunks, nxt_bt + cur + group + j, q)
                        _read_scales[nxt + j](sv, s_g, s_g8, c0, nchunks, bt + cur + group + j, q)
                _lean_batch[big, cur](wv, sv, part, xb0 + (bt + cur) * xstep, bias)
                comptime for j in range(1, group):
                    if bt + cur + j < nb:
                        _lean_batch[big, cur + j](wv, sv, part, xb0 + (bt + cur + j) * xstep, bias)
        bt += depth
    return part


comptime WAIT_NONE = 0
comptime WAIT_FLAG = 1  # spin until flag[0] >= target (moe_fused_gpu: h from other blocks)
comptime WAIT_FLAG_POLLS = 1 << 24
comptime WAIT_PDL = 2  # pdl_enter() just before x is staged (the v26 probe)


@always_inline
def _wait_flag(flag: Pointer[UInt32, MutAnyOrigin], target: UInt32):
    """Warp-wide: spin until flag[0] >= target, then a fence, so that what
    the blocks that counted wrote before their own fence is visible. After
    WAIT_FLAG_POLLS polls (over a second) the kernel traps: a launch that
    never counts up fails with an error instead of hanging the GPU."""
    var polls = 0
    while flag.unsafe_load[volatile=True](0) < target:
        # a short sleep between polls: spinning warps share their SM's issue
        # slots with the gate_up warps they wait for
        inlined_assembly["nanosleep.u32 64;", NoneType, constraints="~{memory}", has_side_effect=True]()
        polls += 1
        if polls > WAIT_FLAG_POLLS:
            inlined_assembly["trap;", NoneType, constraints="~{memory}", has_side_effect=True]()
    threadfence()


@always_inline
def _lean_tile[
    depth: Int = DEPTH, wait: Int = WAIT_NONE
](
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    e: Int,
    rows: Int,
    r0: Int,
    nchunks: Int,
    kc0: Int,
    nloc: Int,
    xrow: Pointer[UInt32, _],
    sm: SharedU8,
    xs: SharedU32,
    flag: Pointer[UInt32, MutAnyOrigin],
    target: UInt32,
) -> SIMD[DType.float32, 4]:
    """One warp, one token: rows r0 .. r0 + 15 of expert e's matrix [rows,
    32 * nchunks] over its blocks kc0 .. kc0 + nloc - 1, times the bf16
    activation row xrow (as pair words). sm (_lean_scale_bytes(ks) bytes,
    when ks warps split K) and xs (_lean_x_words(ks) words) are the warp's own
    shared memory; a ring of depth batches, loaded and decoded in halves
    (depth / 2 in flight while depth / 2 are decoded: _lean_loop). wait
    (flag, target): see the staging of x below; flag is not read with
    WAIT_NONE. WAIT_PDL: the warp waits for the previous grid
    only once its first weights and its scales are on their way, just
    before it stages x (which that grid wrote). Returns the fragment of rows
    g (c0, c1) and g + 8 (c2, c3), every column the token."""
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var nb = (nloc + 3) // 4
    var rp = _tile_rows(blocks, scales, e, rows, r0, g, r0 + g < rows, r0 + g + 8 < rows, nchunks)
    var wv = Array[SIMD[DType.uint32, 4], 2 * depth](fill=0)
    var sv = Array[UInt32, 2 * depth](fill=0)
    comptime for i in range(depth // 2):
        if i < nb:
            _load_batch[i](wv, rp[0], rp[1], kc0, nloc, i, q)
    # While those fly: this warp's part of the tile's scales (the 32-byte
    # block pairs its blocks kc0 .. kc0 + nloc - 1 lie in, with the scan for
    # scales above LEAN_BIG_S) and its part of x, both into shared memory.
    var s0 = (kc0 >> 1) * 32
    var s_bytes = min(((kc0 + nloc + 1) >> 1) * 32, 16 * nchunks) - s0
    var big = _stage_scales[LEAN_BIG_S](rp[4] + s0, s_bytes, sm)
    # wait: WAIT_FLAG (xrow written by other blocks of this launch): only now
    # wait for them (flag, target), then read xrow past L1; WAIT_PDL: only now
    # wait for the previous grid
    comptime if wait == WAIT_FLAG:
        _wait_flag(flag, target)
    comptime if wait == WAIT_PDL:
        pdl_enter()
    _stage_x_words[wait == WAIT_FLAG](xrow, kc0, nloc, 4 * nb, xs)
    var ss_g = sm + (Int(rp[2]) - Int(rp[4]) - s0)
    var ss_g8 = sm + (Int(rp[3]) - Int(rp[4]) - s0)
    comptime for i in range(depth // 2):
        if i < nb:
            _read_scales[i](sv, ss_g, ss_g8, kc0, nloc, i, q)
    # B is block diagonal: lane (g, q) feeds column g = 2q with its block's x,
    # the other lanes read the zero block after the staged ones
    var feeds = g == 2 * q
    var xb0 = xs + (q * LEAN_X_STRIDE if feeds else 4 * nb * LEAN_X_STRIDE)
    var xstep = 4 * LEAN_X_STRIDE if feeds else 0
    var part: SIMD[DType.float32, 2]
    if big:
        var bias = _lean_bias(sm, s_bytes)
        part = _lean_loop[True](wv, sv, rp[0], rp[1], ss_g, ss_g8, kc0, nloc, xb0, xstep, bias)
        part *= _lean_rest(bias)
    else:
        part = _lean_loop[False](wv, sv, rp[0], rp[1], ss_g, ss_g8, kc0, nloc, xb0, xstep, Int32(LEAN_BIAS))
    # the quad's four blocks of each batch
    comptime for m in range(2):
        part[0] += shuffle_xor(part[0], UInt32(1 << m))
        part[1] += shuffle_xor(part[1], UInt32(1 << m))
    return SIMD[DType.float32, 4](part[0], part[0], part[1], part[1])


# ------------------------------------------------------------ v29: lean tiles for two tokens
#
# v25's block-diagonal B feeds one token to mma's columns 2q; the odd columns
# 2q + 1 are spare, so a second token's activations there are summed by the
# same mma (D's registers 1 and 3). One decode then serves two tokens: an
# expert with at most LEAN_PAIRS routed pairs in a multi-token step runs the
# lean loop (no bf16 scale multiply, activations from shared memory) instead
# of the 8-token pass with its scaled decode. The activations are staged once
# per block (every warp of a block serves the same expert and pairs).
comptime LEAN_PAIRS = 2
# Their ring in the many-token kernels (batches; loaded and decoded in halves,
# half the ring in flight): 4 is 6-10 % faster than 2 on the H200 at T = 2..64;
# 8 spills at their 128-register cap and loses 12-13 % at T = 8, 64. The
# few-token kernels (T = 2: 12 warps per SM, up to 170 registers) take 8, no
# spill, 4 % faster than 4 at T = 2 (bench/NOTES.md, eighteenth session); since
# v34 a bf16 step of two tokens runs as slots (as_slots), so they take lean
# pairs only with SLOT_TOKENS set below 2 (the ablation of v34). The
# one-token kernels keep 2 (LEAN_DEPTH, DOWN1_DEPTH): at their 80-register cap
# depth 4 spills and is 3-6 % slower.
comptime LEAN_PAIR_DEPTH = 4
comptime LEAN_PAIR_DEPTH_FEW = 8
comptime LEAN_PAIR_X_WORDS = (MAX_K_BLOCKS + 1) * LEAN_X_STRIDE  # one token's staged row and its zero block


@always_inline
def _stage_x_block[threads: Int](xrow: Pointer[UInt32, _], nloc: Int, nslots: Int, xs: SharedU32):
    """Block-wide _stage_x_words for blocks 0 .. nloc - 1 of xrow (no
    barrier: the caller's)."""
    comptime m = UInt32((LEAN_X_POW + 127) << 7)
    var mult = bitcast[DType.bfloat16, 2](m | (m << 16))
    for j in range(Int(thread_idx.x), nslots + 1, threads):
        var hi = SIMD[DType.uint32, 16](0)
        if j < nloc:
            hi = _load_a[A_BF16](xrow, 0, j)[0]
        var d = xs + j * LEAN_X_STRIDE
        comptime for v4 in range(4):
            var v = SIMD[DType.uint32, 4](0)
            comptime for z in range(4):
                v[z] = scaled_pair(hi[4 * v4 + z], mult)
            d.unsafe_store[width=4, alignment=16](4 * v4, v)


@always_inline
def _lean_pair_tile[
    threads: Int
](
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    e: Int,
    rows: Int,
    r0: Int,
    nchunks: Int,
    xrow0: Pointer[UInt32, _],
    xrow1: Pointer[UInt32, _],
    two: Bool,
    sm: SharedU8,
    xs: SharedU32,
) -> SIMD[DType.float32, 4]:
    """Block-wide (every warp of the block, each on its own 16-row tile r0 of
    expert e, over all nchunks blocks of K): one or two tokens' rows (xrow0,
    and xrow1 when two) as bf16 pair words. sm is the warp's scale bytes (16
    * nchunks), xs the block's 2 * LEAN_PAIR_X_WORDS words. Returns, in every
    lane, rows g and g + 8 as gate_up_kernel's fragment of token pass columns
    0 and 1: (token 0 row g, token 1 row g, token 0 row g + 8, token 1 row g
    + 8)."""
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var nb = (nchunks + 3) // 4
    comptime depth = LEAN_PAIR_DEPTH if threads >= 32 * WARPS_MANY else LEAN_PAIR_DEPTH_FEW
    var rp = _tile_rows(blocks, scales, e, rows, r0, g, r0 + g < rows, r0 + g + 8 < rows, nchunks)
    var wv = Array[SIMD[DType.uint32, 4], 2 * depth](fill=0)
    var sv = Array[UInt32, 2 * depth](fill=0)
    comptime for i in range(depth // 2):
        if i < nb:
            _load_batch[i](wv, rp[0], rp[1], 0, nchunks, i, q)
    # While those fly: the tile's scales (this warp's) and the tokens' x (the block's).
    var big = _stage_scales[LEAN_BIG_S](rp[4], 16 * nchunks, sm)
    var xs1 = xs + LEAN_PAIR_X_WORDS
    _stage_x_block[threads](xrow0, nchunks, 4 * nb, xs)
    if two:
        _stage_x_block[threads](xrow1, nchunks, 4 * nb, xs1)
    barrier()
    var ss_g = sm + (Int(rp[2]) - Int(rp[4]))
    var ss_g8 = sm + (Int(rp[3]) - Int(rp[4]))
    comptime for i in range(depth // 2):
        if i < nb:
            _read_scales[i](sv, ss_g, ss_g8, 0, nchunks, i, q)
    # B block diagonal: lane (g, q) feeds column 2q with token 0's block q,
    # column 2q + 1 with token 1's (with one token, its zero block); the
    # other lanes read token 0's zero block
    var zero = xs + 4 * nb * LEAN_X_STRIDE
    var xb0 = zero
    var xstep = 0
    if g == 2 * q:
        xb0 = xs + q * LEAN_X_STRIDE
        xstep = 4 * LEAN_X_STRIDE
    elif g == 2 * q + 1 and two:
        xb0 = xs1 + q * LEAN_X_STRIDE
        xstep = 4 * LEAN_X_STRIDE
    var part: SIMD[DType.float32, 4]
    if big:
        var bias = _lean_bias(sm, 16 * nchunks)
        part = _lean_loop[True, 4](wv, sv, rp[0], rp[1], ss_g, ss_g8, 0, nchunks, xb0, xstep, bias)
        part *= _lean_rest(bias)
    else:
        part = _lean_loop[False, 4](wv, sv, rp[0], rp[1], ss_g, ss_g8, 0, nchunks, xb0, xstep, Int32(LEAN_BIAS))
    # the quad's four blocks of each batch
    comptime for m in range(2):
        comptime for j in range(4):
            part[j] += shuffle_xor(part[j], UInt32(1 << m))
    return SIMD[DType.float32, 4](part[0], part[2], part[1], part[3])


@always_inline
def _lean_swiglu_out(
    acc: SIMD[DType.float32, 4], bw: SharedF32, h: Pointer[Float32, MutAnyOrigin], pt: Int, r0: Int, rows: Int
):
    """Warp-wide, a one-token gate_up tile's epilogue (gate_up_kernel's for
    its one pair; token 0 = column 0 of the summed fragment acc of rows r0 ..
    r0 + 15): rows g (gate, g even) and g ^ 1 (up) sit in lanes l and l ^ 4;
    swiglu(gate + bias, up + bias) (bw: the tile's 16 biases) goes to pair
    row pt of h as bf16."""
    var lane = Int(lane_id())
    var g = lane >> 2
    var odd = (g & 1) != 0
    var got0 = shuffle_xor(acc[0] if odd else acc[1], UInt32(4))
    var got1 = shuffle_xor(acc[2] if odd else acc[3], UInt32(4))
    if (lane & 3) == 0 and not odd:
        var inter = rows // 2
        var hb = h.unsafe_bitcast[BFloat16]()
        comptime for hh in range(2):
            var gr = r0 + g + 8 * hh
            if gr + 1 < rows:
                var gate = acc[2 * hh] + bw[gr - r0]
                var up = (got0 if hh == 0 else got1) + bw[gr - r0 + 1]
                hb[unsafe_offset=pt * 2 * inter + (gr >> 1)] = gptoss_swiglu(gate, up).cast[DType.bfloat16]()


def _lean_block_warps(tpb: Int) -> Int:
    return max(LEAN_KS, 1) * tpb


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(_lean_block_warps(tpb) * 32)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength((LEAN_MIN_WARPS + _lean_block_warps(tpb) - 1) // _lean_block_warps(tpb)))
def gate_up_lean_kernel[
    route: Int, tpb: Int = LEAN_TPB
](
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_counters_: Int64,
    x: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    top_k_: Int64,
    n_experts_: Int64,
    rows_: Int64,
    hidden_: Int64,
):
    """gate_up_kernel[bf16, _, one_token=True, route] as LEAN_KS warps per
    16-row tile, tpb tiles per block (grid: row tiles / tpb x top_k
    pair slots): warp w serves tile w // KS of its block and takes blocks
    [kw * nb / KS, (kw + 1) * nb / KS) of H, kw = w % KS; each tile's first
    warp adds the others' fragments and writes h."""
    comptime assert tpb >= 1 and tpb <= 4, "1 to 4 tiles per block (static shared memory)"
    pdl_enter()
    comptime KS = max(LEAN_KS, 1)
    comptime NW = _lean_block_warps(tpb)
    var n_counters = Int(n_counters_)
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var rows = Int(rows_)
    var hidden = Int(hidden_)
    var w = Int(warp_id())
    var lane = Int(lane_id())
    var tid = Int(thread_idx.x)
    var t = w // KS
    var kw = w % KS
    # each warp stages only its part of the tile's scales (_lean_tile)
    comptime sm_bytes = _lean_scale_bytes(KS)
    var sms = stack_allocation[NW * sm_bytes, UInt8, alignment=16, address_space=AddressSpace.SHARED]()
    var sm = sms + w * sm_bytes
    var xss = stack_allocation[NW * LEAN_X_WORDS, UInt32, alignment=16, address_space=AddressSpace.SHARED]()
    var xs = xss + w * LEAN_X_WORDS
    var red = stack_allocation[NW * 128, Float32, alignment=16, address_space=AddressSpace.SHARED]()
    var bws = stack_allocation[16 * tpb, Float32, alignment=16, address_space=AddressSpace.SHARED]()
    var bw = bws + 16 * t
    if block_idx.x == 0 and block_idx.y == 0:
        for i in range(tid, n_counters, NW * 32):
            counters[unsafe_offset=i] = 0
    var e: Int
    comptime if route > 0:
        var mine = warp_topk[DType.bfloat16, route](logits, n_experts, top_k)
        if block_idx.x == 0 and block_idx.y == 0 and w == 0 and lane < top_k:
            ids_out[unsafe_offset=lane] = mine[0]
            wts_out[unsafe_offset=lane] = mine[1]
        e = Int(shuffle_idx(mine[0], UInt32(block_idx.y)))
    else:
        e = Int(ids[unsafe_offset=Int(block_idx.y)])
    if e < 0 or e >= n_experts:
        return  # the whole block: every warp finds the same e
    var nchunks = hidden // 32
    var kc0 = nchunks * kw // KS
    var nloc = nchunks * (kw + 1) // KS - kc0
    var r0 = (Int(block_idx.x) * tpb + t) * 16
    var live = True
    comptime if tpb > 1:
        live = r0 < rows  # the grid's last block may hold fewer tiles
    if kw == 0 and live:
        if lane < 16 and r0 + lane < rows:
            async_copy[4](
                bias.unsafe_offset(e * rows + r0 + lane).unsafe_address_space_cast[AddressSpace.GLOBAL](), bw + lane
            )
    async_copy_commit_group()
    var acc = SIMD[DType.float32, 4](0)
    if live:
        # route 0: slot block_idx.y is pair t * top_k + k of token t (route > 0: one token)
        var xrow = x.unsafe_offset((Int(block_idx.y) // top_k) * hidden if route == 0 else 0)
        acc = _lean_tile[LEAN_DEPTH](
            blocks, scales, e, rows, r0, nchunks, kc0, nloc, xrow.unsafe_bitcast[UInt32](), sm, xs, counters, 0
        )
    comptime if KS > 1:
        (red + (w * 32 + lane) * 4).unsafe_store[width=4, alignment=16](0, acc)
    async_copy_wait_group(0)
    barrier()
    if kw != 0 or not live:
        return
    comptime for j in range(1, KS):
        acc += (red + ((w + j) * 32 + lane) * 4).unsafe_load[width=4, alignment=16](0)
    _lean_swiglu_out(acc, bw, h, Int(block_idx.y), r0, rows)


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(warps * 32)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(_min_blocks_per_sm(warps)))
def down_kernel[
    out_dtype: DType, warps: Int, ksplit: Int
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
    counters: one per block's tile of warps / ksplit * 16 rows. ksplit warps
    share each 16-row tile, each over its part of I (more warps in flight
    for few tokens); the first adds the others' fragments."""
    pdl_enter()
    var n_pairs = Int(n_pairs_)
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var hidden = Int(hidden_)
    var inter = Int(inter_)
    comptime threads = warps * 32
    comptime tile_rows = warps // ksplit * 16
    comptime split = out_dtype != DType.bfloat16
    var red = stack_allocation[warps * 32 * 4, Float32, address_space=AddressSpace.SHARED]()
    var plists = stack_allocation[warps * MAX_PAIRS, Int32, address_space=AddressSpace.SHARED]()
    var plist = plists + Int(warp_id()) * MAX_PAIRS
    var sms = stack_allocation[warps * TILE_SCALES, UInt8, alignment=16, address_space=AddressSpace.SHARED]()
    var sm = sms + Int(warp_id()) * TILE_SCALES
    var last = stack_allocation[1, Int32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var tokens = n_pairs // top_k
    var rbase = Int(block_idx.x) * tile_rows
    var rt = _route_warp(ids, n_pairs, n_experts, Int(block_idx.y), plist)
    var e = Int(rt[0])
    var n_active = Int(rt[1])
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
    var npairs_e = Int(rt[2])
    var nchunks = inter // 32
    var kw = Int(warp_id()) % ksplit
    var kc0 = nchunks * kw // ksplit
    var nloc = nchunks * (kw + 1) // ksplit - kc0
    var r0 = rbase + Int(warp_id()) // ksplit * 16
    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var ok_a = r0 + g < hidden
    var ok_b = r0 + g + 8 < hidden
    var rp = _tile_rows(blocks, scales, e, hidden, r0, g, ok_a, ok_b, nchunks)
    var w_a = rp[0]
    var w_b = rp[1]
    var s_a = rp[2]
    var s_b = rp[3]
    var s_tile = rp[4]
    var hw = h.unsafe_bitcast[UInt32]()
    var big = False
    var first = 0
    # v29: an expert with at most LEAN_PAIRS pairs takes the lean two-token tile
    comptime lean_ok = ksplit == 1 and not split and LEAN_PAIRS > 0
    var xsb = stack_allocation[
        2 * LEAN_PAIR_X_WORDS if lean_ok else 4, UInt32, alignment=16, address_space=AddressSpace.SHARED
    ]()
    var lean = lean_ok and npairs_e <= LEAN_PAIRS
    while first < npairs_e:
        var has_tok = first + g < npairs_e
        var p = Int(plist[first + g]) if has_tok else 0
        # row p of h: I f32 = I/2 hi pair words, then I/2 lo pair words
        var hrow = hw.unsafe_offset(p * inter + kc0 * 16)
        comptime amode = A_WORDS_SPLIT if split else A_WORDS
        var acc = SIMD[DType.float32, 4](0)
        comptime if lean_ok:
            if lean:
                var h0 = hw.unsafe_offset(Int(plist[0]) * inter)
                var h1 = hw.unsafe_offset(Int(plist[min(1, npairs_e - 1)]) * inter)
                acc = _lean_pair_tile[threads](blocks, scales, e, hidden, r0, nchunks, h0, h1, npairs_e > 1, sm, xsb)
        if not lean:
            acc = _tile16[amode](
                w_a,
                w_b,
                s_a,
                s_b,
                s_tile,
                min(16, hidden - r0) * nchunks,  # all the tile's scales (one contiguous run)
                sm,
                big,
                first == 0,
                kc0,
                nloc,
                hrow,
                inter // 2,
            )
        comptime if ksplit > 1:
            var mine = red + (Int(warp_id()) * 32 + lane) * 4
            if kw != 0:
                mine.unsafe_store[width=4, alignment=16](0, acc)
            barrier()
            if kw == 0:
                comptime for j in range(1, ksplit):
                    acc += (mine + j * 128).unsafe_load[width=4, alignment=16](0)
            barrier()
        if kw != 0:
            first += TOK_PASS
            continue
        comptime for z in range(2):
            var slot_t = first + 2 * q + z
            if slot_t < npairs_e:
                var pt = Int(plist[slot_t])
                var wgt = wts[unsafe_offset=pt]
                comptime for hh in range(2):
                    var r = r0 + g + 8 * hh
                    if r < hidden:
                        partial[unsafe_offset=pt * hidden + r] = wgt * (
                            acc[2 * hh + z] + bias[unsafe_offset=e * hidden + r]
                        )
        first += TOK_PASS
    # The last block done with this row tile sums the partials over k.
    threadfence()
    barrier()
    if tid == 0:
        # relaxed: the threadfence above (every thread's partials, before the
        # barrier) and the one below order it; a sequentially consistent
        # atomic adds a system-scope fence
        var old = Atomic.fetch_add[ordering=Ordering.RELAXED](counters.unsafe_offset(Int(block_idx.x)), 1)
        last[0] = 1 if Int(old) == n_active - 1 else 0
    barrier()
    if last[0] == 0:
        return
    # Every block of this tile has counted: reset for the next chunk's launch
    # (gate_up zeroes the counters only once per step).
    if tid == 0:
        counters[unsafe_offset=Int(block_idx.x)] = 0
    threadfence()
    _combine_partials[out_dtype, tile_rows, threads](output, partial, ids, tokens, top_k, n_experts, hidden, rbase, tid)


# Outputs per thread per round of the last block's combine: every load of a
# round (ids and partials) is issued before any is used.
comptime COMBINE_ROUND = 8


@always_inline
def _combine_partials[
    out_dtype: DType, tile_rows: Int, threads: Int
](
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[Float32, MutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    rbase: Int,
    tid: Int,
):
    """out[t, r] = sum over k (in order) of partial[t * top_k + k, r] for the
    routed k, over the tile's rows r in rbase .. rbase + tile_rows and all
    tokens. Addresses are clamped so every load is in bounds: a pair that is
    not routed is loaded and dropped, so no load waits on another (waiting
    on one after another cost a 120b layer ~27 us at 64 tokens, bench/NOTES.md
    v19)."""
    var n_out = tokens * tile_rows
    var base = 0
    while base < n_out:
        var pv = SIMD[DType.float32, COMBINE_ROUND * MAX_TOPK]()
        var ev = SIMD[DType.int32, COMBINE_ROUND * MAX_TOPK]()
        comptime for u in range(COMBINE_ROUND):
            var idx = min(base + tid + u * threads, n_out - 1)
            var t = idx // tile_rows
            var r = min(rbase + idx % tile_rows, hidden - 1)
            comptime for k in range(MAX_TOPK):
                var pk = t * top_k + min(k, top_k - 1)
                ev[u * MAX_TOPK + k] = ids[unsafe_offset=pk]
                pv[u * MAX_TOPK + k] = partial.unsafe_load[volatile=True](pk * hidden + r)
        comptime for u in range(COMBINE_ROUND):
            var idx = base + tid + u * threads
            var t = idx // tile_rows
            var r = rbase + idx % tile_rows
            if idx < n_out and r < hidden:
                var s: Float32 = 0
                comptime for k in range(MAX_TOPK):
                    var ek = Int(ev[u * MAX_TOPK + k])
                    if k < top_k and ek >= 0 and ek < n_experts:
                        s += pv[u * MAX_TOPK + k]
                for k in range(MAX_TOPK, top_k):  # not gpt-oss (top-4): serial
                    var ek = Int(ids[unsafe_offset=t * top_k + k])
                    if ek >= 0 and ek < n_experts:
                        s += partial.unsafe_load[volatile=True]((t * top_k + k) * hidden + r)
                output[unsafe_offset=t * hidden + r] = s.cast[out_dtype]()
        base += COMBINE_ROUND * threads


@always_inline
def _down1_sum[
    out_dtype: DType, ksplit: Int
](
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    red: SharedF32,
    bsm: SharedF32,
    wsm: SharedF32,
    vsm: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    r0: Int,
    hidden: Int,
    top_k: Int,
):
    """A one-token down block's combine, after its barrier: thread t < 16 sums
    output row r0 + t over the experts that count (vsm), each its bias (bsm,
    16 per expert) plus its ksplit warps' fragments (red, 128 f32 per warp),
    times its weight (wsm), in a fixed order. Token 0 is column 0 of a
    fragment: lanes (g, q = 0) hold rows g (acc[0]) and g + 8 (acc[2])."""
    var t = Int(thread_idx.x)
    if t < 16:
        var r = r0 + t
        if r < hidden:
            var slot = ((t & 7) * 4) * 4 + (t >> 3) * 2
            var total: Float32 = 0
            for kk in range(top_k):
                if vsm[kk] != 0:
                    var v = bsm[kk * 16 + t]
                    comptime for j in range(ksplit):
                        v += red[(kk * ksplit + j) * 128 + slot]
                    total += wsm[kk] * v
            output[unsafe_offset=r] = total.cast[out_dtype]()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(MAX_TOPK * _down1_ksplit(out_dtype) * 32)))
# 2 blocks (24 warps for bf16, 16 for float32) per SM: the 180 tiles of gpt-oss
# then run in one wave.
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(2))
def down_one_token_kernel[
    out_dtype: DType, route: Int = 0
](
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    top_k_: Int64,
    n_experts_: Int64,
    hidden_: Int64,
    inter_: Int64,
):
    """down + combine for a one-token step: a block per 16-row tile holds all
    top_k experts (_down1_ksplit warps each, over parts of I) and sums them
    in shared memory in a fixed order (deterministic), so no partials reach
    global memory and no block waits on a counter. Warp w serves pair
    w // _down1_ksplit (expert ids[pair]; an invalid id adds nothing).

    A float32 output runs _tile16 on h's hi and lo words and waits for the
    previous grid (PDL) first. A bf16 one runs the lean tile (v25) and waits
    only inside it, once its first weights and its scales are on their way
    (v26): before that it reads nothing the previous grid (gate_up, which
    writes h) writes. Its routing comes from two or more grids back: route >
    0 takes the top-k of the router's bf16 logits itself (route lanes' worth
    per lane, as gate_up_lean_kernel[route] does, so the same experts and
    weights); route 0 reads ids and wts, which a gate_up without route only
    reads (the ops never pass ids that gate_up writes with route 0)."""
    comptime split = out_dtype != DType.bfloat16
    comptime assert route == 0 or not split, "the routed one-token down takes bf16 logits"
    comptime if split:
        pdl_enter()
    comptime ksplit = _down1_ksplit(out_dtype)
    comptime nw = MAX_TOPK * ksplit
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var hidden = Int(hidden_)
    var inter = Int(inter_)
    var red = stack_allocation[nw * 32 * 4, Float32, alignment=16, address_space=AddressSpace.SHARED]()
    # the warp's scales: the whole tile's for f32 (_tile16), its own part's for
    # bf16, which also stages its part of h (the lean tile)
    comptime sm_bytes = TILE_SCALES if split else _lean_scale_bytes(ksplit)
    var sms = stack_allocation[nw * sm_bytes, UInt8, alignment=16, address_space=AddressSpace.SHARED]()
    var xss = stack_allocation[0 if split else nw * _lean_x_words(ksplit), UInt32, alignment=16, address_space=AddressSpace.SHARED]()
    var w = Int(warp_id())
    var sm = sms + w * sm_bytes
    var lane = Int(lane_id())
    var k = w // ksplit
    var kw = w % ksplit
    var r0 = Int(block_idx.x) * 16
    # route 0: grid row block_idx.y is token tok, whose pairs are tok * top_k + k
    # (route > 0: one token)
    var tok = Int(block_idx.y) if route == 0 else 0
    var pair = tok * top_k + k
    var g = lane >> 2
    var e: Int
    var wt = Float32(0)
    comptime if route > 0:
        var mine = warp_topk[DType.bfloat16, route](logits, n_experts, top_k)
        e = Int(shuffle_idx(mine[0], UInt32(k)))  # lanes past top_k hold -1
        wt = shuffle_idx(mine[1], UInt32(k))
    else:
        e = Int(ids[unsafe_offset=pair]) if k < top_k else -1
    var valid = e >= 0 and e < n_experts
    # What the final sum needs besides the fragments (each expert's 16 bias
    # values, its weight, whether it counts) reaches shared memory while the
    # tile streams: cp.async, no dependent load after the barrier.
    var bsm = stack_allocation[MAX_TOPK * 16, Float32, alignment=16, address_space=AddressSpace.SHARED]()
    var wsm = stack_allocation[MAX_TOPK, Float32, address_space=AddressSpace.SHARED]()
    var vsm = stack_allocation[MAX_TOPK, Int32, address_space=AddressSpace.SHARED]()
    if kw == 0:
        if valid and lane < 16 and r0 + lane < hidden:
            async_copy[4](
                bias.unsafe_offset(e * hidden + r0 + lane).unsafe_address_space_cast[AddressSpace.GLOBAL](),
                bsm + k * 16 + lane,
            )
        if valid and lane == 16:
            comptime if route > 0:
                wsm[k] = wt
            else:
                async_copy[4](wts.unsafe_offset(pair).unsafe_address_space_cast[AddressSpace.GLOBAL](), wsm + k)
        if lane == 0:
            vsm[k] = 1 if valid else 0
    async_copy_commit_group()
    var acc = SIMD[DType.float32, 4](0)
    if valid:
        var nchunks = inter // 32
        var kc0 = nchunks * kw // ksplit
        var nloc = nchunks * (kw + 1) // ksplit - kc0
        comptime if split:
            var rp = _tile_rows(blocks, scales, e, hidden, r0, g, r0 + g < hidden, r0 + g + 8 < hidden, nchunks)
            var hrow = h.unsafe_bitcast[UInt32]().unsafe_offset(pair * inter + kc0 * 16)
            var big = False
            acc = _tile16[A_WORDS_SPLIT](
                rp[0], rp[1], rp[2], rp[3], rp[4], min(16, hidden - r0) * nchunks, sm, big, True, kc0, nloc, hrow, inter // 2
            )
        else:
            # h's row k as bf16 pair words, its blocks kc0 .. kc0 + nloc - 1
            # staged in the warp's xs
            var hrow = h.unsafe_bitcast[UInt32]().unsafe_offset(pair * inter)
            var unused = output.unsafe_bitcast[UInt32]()  # WAIT_PDL: not read
            acc = _lean_tile[DOWN1_DEPTH, WAIT_PDL](
                blocks, scales, e, hidden, r0, nchunks, kc0, nloc, hrow, sm, xss + w * _lean_x_words(ksplit), unused, 0
            )
    comptime if not split:
        if not valid:
            pdl_enter()  # the valid warps waited in _lean_tile
    (red + (w * 32 + lane) * 4).unsafe_store[width=4, alignment=16](0, acc)
    async_copy_wait_group(0)
    barrier()
    _down1_sum[out_dtype, ksplit](output.unsafe_offset(tok * hidden), red, bsm, wsm, vsm, r0, hidden, top_k)


def n_counters(hidden: Int) -> Int:
    """Length of the counters tensor: one per down row tile (at most)."""
    return (hidden + COUNTER_TILE_ROWS - 1) // COUNTER_TILE_ROWS


def _check_gate_up(n_pairs: Int, n_experts: Int, hidden: Int) raises:
    """The shapes both gate_up kernels take (pairs = tokens * top_k)."""
    if n_pairs > MAX_PAIRS or n_experts > MAX_EXPERTS or hidden % 32 != 0 or hidden > 32 * MAX_K_BLOCKS:
        raise Error("gptoss MoE GPU path: needs tokens * top_k <= 256, E <= 256, H % 32 == 0, H <= 3072")


def _launch_gate_up[
    x_dtype: DType, warps: Int, one_token: Bool, route: Int = 0
](
    ctx: DeviceContext,
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    x: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    logits: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
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
    _check_gate_up(n_pairs, n_experts, hidden)
    ctx.enqueue_function[gate_up_kernel[x_dtype, warps, one_token, route]](
        h, counters, Int64(n_count), x, ids, logits, ids_out, wts_out, blocks, scales, bias,
        Int64(n_pairs), Int64(top_k), Int64(n_experts), Int64(rows), Int64(hidden),
        grid_dim=((rows + warps * 16 - 1) // (warps * 16), n_pairs if one_token else min(n_experts, n_pairs)),
        block_dim=warps * 32,
        attributes=pdl_attributes(tokens == 1),
    )


def _launch_gate_up_lean[
    route: Int
](
    ctx: DeviceContext,
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    x: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
    tokens: Int = 1,
) raises:
    """A block row per (token, expert) pair slot: tokens > 1 only with route 0."""
    _check_gate_up(tokens * top_k, n_experts, hidden)
    ctx.enqueue_function[gate_up_lean_kernel[route]](
        h, counters, Int64(n_count), x, ids, logits, ids_out, wts_out, blocks, scales, bias,
        Int64(top_k), Int64(n_experts), Int64(rows), Int64(hidden),
        grid_dim=((rows + 16 * LEAN_TPB - 1) // (16 * LEAN_TPB), tokens * top_k),
        block_dim=_lean_block_warps(LEAN_TPB) * 32,
        attributes=pdl_attributes(True),
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
    comptime if x_dtype == DType.bfloat16 and LEAN_KS > 0:
        if as_slots(tokens, top_k, n_experts):
            var xb = x.unsafe_bitcast[BFloat16]()
            _launch_gate_up_lean[0](
                ctx, h, counters, n_count, xb, ids, xb, ids.unsafe_mut_cast[True](), h, blocks, scales, bias,
                top_k, n_experts, rows, hidden, tokens,
            )
            return
    if tokens == 1:
        _launch_gate_up[x_dtype, GATE_UP_WARPS_FEW, True](
            ctx, h, counters, n_count, x, ids, x, ids.unsafe_mut_cast[True](), h, blocks, scales, bias,
            tokens, top_k, n_experts, rows, hidden,
        )
    elif tokens <= FEW_TOKENS:
        _launch_gate_up[x_dtype, GATE_UP_WARPS_FEW, False](
            ctx, h, counters, n_count, x, ids, x, ids.unsafe_mut_cast[True](), h, blocks, scales, bias,
            tokens, top_k, n_experts, rows, hidden,
        )
    else:
        _launch_gate_up[x_dtype, WARPS_MANY, False](
            ctx, h, counters, n_count, x, ids, x, ids.unsafe_mut_cast[True](), h, blocks, scales, bias,
            tokens, top_k, n_experts, rows, hidden,
        )


def launch_route_gate_up[
    x_dtype: DType
](
    ctx: DeviceContext,
    h: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[UInt32, MutAnyOrigin],
    n_count: Int,
    x: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    logits: Pointer[Scalar[x_dtype], ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
) raises:
    """gate_up of a one-token step that also takes the router's top-k
    (E <= 256, K <= 32; writes ids_out [K], wts_out [K]); also zeroes the
    counters."""
    var ids = ids_out.unsafe_mut_cast[False]().unsafe_origin_cast[ImmutAnyOrigin]()
    comptime if x_dtype == DType.bfloat16 and LEAN_KS > 0:
        var xb = x.unsafe_bitcast[BFloat16]()
        var lb = logits.unsafe_bitcast[BFloat16]()
        if n_experts <= 128:
            _launch_gate_up_lean[4](
                ctx, h, counters, n_count, xb, ids, lb, ids_out, wts_out, blocks, scales, bias,
                top_k, n_experts, rows, hidden,
            )
        else:
            _launch_gate_up_lean[8](
                ctx, h, counters, n_count, xb, ids, lb, ids_out, wts_out, blocks, scales, bias,
                top_k, n_experts, rows, hidden,
            )
        return
    if n_experts <= 128:
        _launch_gate_up[x_dtype, GATE_UP_WARPS_FEW, True, 4](
            ctx, h, counters, n_count, x, ids, logits, ids_out, wts_out, blocks, scales, bias,
            1, top_k, n_experts, rows, hidden,
        )
    else:
        _launch_gate_up[x_dtype, GATE_UP_WARPS_FEW, True, 8](
            ctx, h, counters, n_count, x, ids, logits, ids_out, wts_out, blocks, scales, bias,
            1, top_k, n_experts, rows, hidden,
        )


def _launch_down[
    out_dtype: DType, warps: Int, ksplit: Int
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
    ctx.enqueue_function[down_kernel[out_dtype, warps, ksplit]](
        output, partial, counters, h, ids, wts, blocks, scales, bias,
        Int64(n_pairs), Int64(top_k), Int64(n_experts), Int64(hidden), Int64(inter),
        grid_dim=((hidden + warps // ksplit * 16 - 1) // (warps // ksplit * 16), min(n_experts, n_pairs)),
        block_dim=warps * 32,
        attributes=pdl_attributes(tokens == 1),
    )


def _launch_down_one_token[
    out_dtype: DType, route: Int
](
    ctx: DeviceContext,
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    inter: Int,
    tokens: Int = 1,
) raises:
    """A block per 16-row tile and token: tokens > 1 only with route 0."""
    ctx.enqueue_function[down_one_token_kernel[out_dtype, route]](
        output, h, ids, wts, logits, blocks, scales, bias,
        Int64(top_k), Int64(n_experts), Int64(hidden), Int64(inter),
        grid_dim=((hidden + 15) // 16, tokens),
        block_dim=MAX_TOPK * _down1_ksplit(out_dtype) * 32,
        attributes=pdl_attributes(True),
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
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    routed: Bool,
) raises:
    """down + top-k combine for at most CHUNK_TOKENS tokens. h is kept as
    bf16 hi + lo (two mma) only for a float32 output; a bf16 output takes
    h rounded to bf16, as the rest of a bf16 graph does. routed: ids and
    wts are the top-k of the router's bf16 logits [n_experts], which gate_up
    took itself and wrote; a bf16 output's one-token step then takes the
    same top-k of logits before it waits for gate_up (down_one_token_kernel;
    logits is not read otherwise)."""
    if tokens * top_k > MAX_PAIRS or n_experts > MAX_EXPERTS or inter % 32 != 0 or inter > 32 * MAX_K_BLOCKS:
        raise Error("gptoss MoE GPU path: needs tokens * top_k <= 256, E <= 256, I % 32 == 0, I <= 3072")
    if as_slots(tokens, top_k, n_experts) and top_k <= MAX_TOPK:
        comptime if out_dtype == DType.bfloat16:
            if routed and tokens == 1:
                if n_experts <= 128:
                    _launch_down_one_token[out_dtype, 4](
                        ctx, output, h, ids, wts, logits, blocks, scales, bias, top_k, n_experts, hidden, inter
                    )
                else:
                    _launch_down_one_token[out_dtype, 8](
                        ctx, output, h, ids, wts, logits, blocks, scales, bias, top_k, n_experts, hidden, inter
                    )
                return
        _launch_down_one_token[out_dtype, 0](
            ctx, output, h, ids, wts, logits, blocks, scales, bias, top_k, n_experts, hidden, inter, tokens
        )
    elif tokens <= FEW_TOKENS:
        _launch_down[out_dtype, DOWN_WARPS_FEW, DOWN_KSPLIT_FEW](
            ctx, output, partial, counters, h, ids, wts, blocks, scales, bias,
            tokens, top_k, n_experts, hidden, inter,
        )
    else:
        _launch_down[out_dtype, WARPS_MANY, 1](
            ctx, output, partial, counters, h, ids, wts, blocks, scales, bias,
            tokens, top_k, n_experts, hidden, inter,
        )
