# GPU path of the MXFP4 MoE ops for prefill-sized steps (issue 5): a
# grouped GEMM over experts on tensor cores (mma.sync m16n8k16, bf16 in,
# f32 accumulate), MXFP4 weights decoded in registers.
#
# Four launches per step, grids from shapes only (CUDA-graph safe):
#   route    (1 block)  count (token, k) pairs per expert, exclusive prefix,
#                       tile starts, scatter of pair ids into expert order;
#   gate_up  GEMM       h[pos] = swiglu(W_gu[e] x[t] + b)  for the pairs of
#                       expert e at sorted positions pos (A rows gathered);
#   down     GEMM       partial[p] = w[p] (W_dn[e] h[pos] + b)
#   combine             out[t] = sum_k partial[t * K + k]  (fixed k order)
#
# The GPU never reads a per-step count on the host: a GEMM block finds its
# (expert, m tile, n tile) in the route's tile table (one entry per m tile,
# read in one round trip); blocks past the last tile return. Output is
# deterministic: each row of a GEMM is independent of the rows it shares a
# tile with, and combine sums in k order.
#
# Buffers (the ops' h [T, K, I] f32 is opaque on the GPU):
#   h bytes [0, 2 P I)       sorted h, bf16 [P, I], natural order
#   h int32 words from P I/2 (meta):
#     [0, E]                 expert offsets into the sorted order
#     [E + 1, 2E + 1]        tile starts (BM-row tiles) per expert
#     [2E + 2, 2E + 2 + P)   sorted position -> pair index t * K + k
#     [2E + 2 + P, 3E + 3 + P)  count, then ids of the experts with an
#                            absorbed tile (c10; count 0 otherwise)
#     [3E + 3 + P, + 2 M)    tile table: per m tile g (expert-major, as the
#                            tile starts number them) its expert + 256 x
#                            the expert's tiles, and the expert's tile
#                            start; M = max_m_tiles at the smallest BM
#   partial [P, H] bf16      in the down op's f32 scratch (its first half),
#                            indexed by pair.
#
# Inner product (per 32-element MXFP4 block, two k16 mma): lane (g, q)
# decodes word q of its weight row's 16-byte block (the layout's word repack:
# slots c = 0..3 hold elements 8c + 2q, + 1) into four bf16 pair words; the
# k order inside a dot product is free, so A follows: each lane reads the
# activation pair words 4c + q (x for gate_up, h in natural order for down;
# four 4-byte loads, 4-way bank conflicts: p1 runs only where K is not in
# whole 64-element stages).
#
# Shared memory per stage, all filled by cp.async: A [BM][32] bf16 (64-byte
# rows: a quarter warp's 16-byte loads cover two whole rows, no bank
# conflicts), B [BN][16] bytes, and per weight row the 4-byte aligned window
# of its scale row that holds this block's E8M0 byte (rows are K/32 = 90
# bytes, so only 2-byte aligned).

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, barrier, lane_id, warp_id
from max.gpu.compute.mma import (
    WGMMADescriptor,
    mma,
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.intrinsics import byte_permute
from max.gpu.memory import (
    AddressSpace,
    async_copy,
    async_copy_commit_group,
    async_copy_wait_group,
    external_memory,
    fence_async_view_proxy,
)
from max.gpu.primitives.warp import shuffle_idx, vote
from std.atomic import Atomic, Ordering
from std.collections import Array
from std.memory import bitcast, stack_allocation
from std.os import getenv
from std.sys import _RegisterPackType, is_gpu
from std.sys._assembly import inlined_assembly
from std.utils import StaticTuple

from .moe_common import decode_slot, gptoss_swiglu, scale_mult, scaled_pair
from .mxfp4 import TILE_ROWS, tiled_block_offset, tiled_scale_offset

comptime ROUTE_THREADS = 1024
comptime ROUTE_BATCH = 8  # id loads a route thread has in flight
comptime PREFILL_MAX_EXPERTS = 256
# Prefill takes over from the decode kernel at this many routed pairs per
# expert (T * K / E) and this many pairs in all; measured by bench/moe.py
# --prefill on an H100 (bench/NOTES.md): 120b (E=128) loses at 2 pairs per
# expert (256 pairs), wins from 3 (384; since the word repack, p8), 20b
# (E=32) loses at 6 (192 pairs), wins from 8 (256).
comptime PREFILL_MIN_PAIRS_PER_EXPERT = 3
comptime PREFILL_MIN_PAIRS = 256

# Tile configurations (compile-time). c0..c4 (p1, mma.sync): BM token rows
# x BN weight rows per block, WARPS_M x WARPS_N warps, STAGES-deep cp.async
# pipeline. c5.. (p2, wgmma; see "p2" below): BM = the block's token tile
# (the wgmma N), BN = 64 weight rows per warpgroup (the wgmma M), 128 * BN / 64
# threads, STAGES smem stages. c9: BM = 160 tokens, run as wgmma N = 128 + 32
# with the same A fragment (Mojo's wgmma_async takes power-of-two N only), so
# an expert of 129..160 routed pairs is one tile, one decode of its weights.
# c10: c5's 128-token tiles, except that an expert's last <= ABSORB pairs join
# its last full tile as one 129..160-row tile of c9's two-part kind, run by a
# second launch (p2_absorbed_kernel) over the list of such experts.
comptime N_CONFIGS = 11
comptime ABSORB = 32
comptime P1_CONFIGS = 5


@always_inline
def cfg_wgmma(c: Int) -> Bool:
    return c >= P1_CONFIGS


@always_inline
def cfg_bm(c: Int) -> Int:
    return [128, 64, 128, 64, 32, 128, 256, 64, 128, 160, 128][c]


@always_inline
def cfg_bn(c: Int) -> Int:
    return [128, 128, 64, 64, 128, 128, 128, 128, 192, 128, 128][c]


@always_inline
def cfg_warps_m(c: Int) -> Int:
    return [2, 2, 4, 2, 1, 1, 1, 1, 1, 1, 1][c]


@always_inline
def cfg_warps_n(c: Int) -> Int:
    return [4, 4, 2, 2, 4, 8, 8, 8, 12, 8, 8][c]


@always_inline
def cfg_absorb(c: Int) -> Int:
    """Pairs an expert's last tile may absorb into a two-part tile (c10), else 0."""
    return ABSORB if c == 10 else 0


@always_inline
def expert_tiles(count: Int, bm: Int, absorb: Int) -> SIMD[DType.int32, 2]:
    """(regular tiles, 1 if the expert also has an absorbed tile) for `count`
    routed pairs: ceil(count / bm) tiles, except that when there are at least
    two and the last holds <= absorb pairs, the last two become one absorbed
    tile of bm + that many rows (its rows start at bm * regular tiles)."""
    var m = (count + bm - 1) // bm
    if absorb > 0 and m >= 2 and count - bm * (m - 1) <= absorb:
        return SIMD[DType.int32, 2](Int32(m - 2), 1)
    return SIMD[DType.int32, 2](Int32(m), 0)


@always_inline
def cfg_stages(c: Int) -> Int:
    return [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4][c]


# Mean routed pairs per expert for which auto_config takes c9 or c10 (measured band),
# the expert count from which c10 beats c9 in the band, and the load from which c10
# beats c5 again above it (where counts pass 256, 384, ... by a few pairs).
comptime C9_MIN_PAIRS = 120
comptime C9_MAX_PAIRS = 160
comptime C10_MIN_EXPERTS = 64
comptime C10_MIN_PAIRS_ABOVE = 240
# Mean routed pairs per expert from which c5 (128-token tiles) beats c7 (64-token tiles, unrolled
# with its first stages peeled since 2026-12-01): H200, 120b c7 1.647 / c5 1.695 ms at 72 pairs,
# c5 1.763 / 1.885 at 80; 20b c7 ahead through 88, c5 at 96 (0.441 / 0.474)
# (moe_prefill_h200_20261201_s28_c7_threshold_*.json, _c5_c7_c9_c10_mid.json).
comptime C7_MAX_PAIRS = 80


def auto_config(pairs_per_expert: Int, n_experts: Int) -> Int:
    """Tile configuration for a mean load of routed pairs per expert: the
    H100 sweeps' best. p2 64-token tiles (c7) below 32 pairs per expert (120b
    T = 512: 76 TFLOP/s, bench/results/moe_prefill_h100_20261121_p2.json);
    p2 128 x 128 (c5) from 32: since the tile-wide scale scan (2026-11-22) it
    beats 256 x 128 (c6) at every measured load, 120b T = 8192 / 16384 351 /
    368 against 308 / 347, 20b 385 / 398 against 361 / 382 TFLOP/s
    (moe_prefill_h100_20261122_scales_sweep.json). c9 (160-token tiles) from
    120 to 160 pairs per expert, where c5 gives about half the experts a
    second, nearly empty tile: 120b T = 4096 / 4608 / 5120 (128 / 144 / 160
    pairs) 332 / 336 / 321 against c5's 317 / 300 / 311 TFLOP/s, 20b T = 1024
    / 1152 332 / 329 against 307 / 287; c5 is ahead at 112 and 176
    (moe_prefill_h100_20261122_c9_band.json). c10 (c5's tiles with the last <= 32
    pairs absorbed into a two-part tile, a second launch) in that band when
    there are many experts, and above it: 120b T = 4096 / 4608 / 8192 / 8704 /
    16384 357.5 / 366.2 / 370.7 / 368.2 / 385.5 TFLOP/s against c5's 326.3 /
    296.6 / 362.0 / 352.3 / 381.3 and c9's 347.2 / 335.5 (same run), 20b T =
    2048 / 4096 / 8192 356.8 / 395.0 / 402.6 against 354.8 / 390.0 / 389.6;
    at 20b T = 1024 (128 pairs, 32 experts: each launch holds half as many
    blocks) c9 330.7, c5 313.1, c10 304.1 (moe_prefill_h100_20261122_c10.json).
    Between the band and 240 pairs almost no count ends <= 32 pairs past a
    multiple of 128, so c10 is c5 plus a second launch: at 176 / 192 pairs
    c5 329.8 / 336.4 against c10 321.5 / 334.4 (120b), 314.1 / 326.3 against
    292.9 / 316.9 (20b); at 384 / 400 c10 390.3 / 387.9 against 372.2 /
    371.0 (moe_prefill_h100_20261122_c10_edges.json).
    c6 and the p1 configs (c0..c4) stay selectable by path.
    Since c7's loop is unrolled with its first stages peeled (v49, H200
    2026-12-01), c7 beats c5 up to C7_MAX_PAIRS (80) pairs per expert, not 32:
    120b T = 1024 / 2048 (32 / 64 pairs) 0.897 / 1.407 ms against c5's 1.002 /
    1.443, 20b T = 512 (64) 0.358 against 0.418."""
    if pairs_per_expert >= C9_MIN_PAIRS and pairs_per_expert <= C9_MAX_PAIRS:
        return 10 if n_experts >= C10_MIN_EXPERTS else 9
    if pairs_per_expert >= C10_MIN_PAIRS_ABOVE:
        return 10
    if pairs_per_expert >= C7_MAX_PAIRS:
        return 5
    return 7


@always_inline
def meta_sorted(n_experts: Int) -> Int:
    """Word offset of the sorted pair ids in meta (after the offsets and tile starts)."""
    return 2 * n_experts + 2


@always_inline
def meta_absorbed(n_experts: Int, n_pairs: Int) -> Int:
    """Word offset of the absorbed-expert list in meta (after the sorted ids)."""
    return meta_sorted(n_experts) + n_pairs


@always_inline
def meta_tiles(n_experts: Int, n_pairs: Int) -> Int:
    """Word offset of the tile table in meta (after the absorbed-expert list)."""
    return meta_absorbed(n_experts, n_pairs) + n_experts + 1


comptime MIN_BM = 32  # the smallest token tile of any config (c4)


@always_inline
def max_m_tiles(n_pairs: Int, n_experts: Int, bm: Int) -> Int:
    """Upper bound on m tiles from shapes: sum_e ceil(n_e / BM) <= ceil(P / BM) + min(E, P)."""
    return (n_pairs + bm - 1) // bm + min(n_experts, n_pairs)


def meta_words(n_pairs: Int, n_experts: Int) -> Int:
    """offsets [E + 1], tile starts [E + 1], sorted pair ids [P], absorbed
    experts: a count and up to E ids (c10), the tile table (2 words per m
    tile, as many as the smallest BM can have)."""
    return meta_tiles(n_experts, n_pairs) + 2 * max_m_tiles(n_pairs, n_experts, MIN_BM)


def prefill_feasible(tokens: Int, top_k: Int, n_experts: Int, hidden: Int, inter: Int) -> Bool:
    """Shapes the prefill kernels handle: 32-element K blocks, 8-row N
    tiles, the routing metadata fitting h's unused half."""
    var n_pairs = tokens * top_k
    if n_pairs == 0 or n_experts > PREFILL_MAX_EXPERTS:
        return False
    if hidden % 32 != 0 or inter % 32 != 0:
        return False
    return meta_words(n_pairs, n_experts) <= n_pairs * inter // 2


def p2_feasible(hidden: Int, inter: Int) -> Bool:
    """The wgmma configs (c5..) also need K in whole 64-element stages (so a
    stage's two scale bytes share one aligned 4-byte window) on both GEMMs."""
    return hidden % P2_BK == 0 and inter % P2_BK == 0


def prefill_choice(tokens: Int, top_k: Int, n_experts: Int, hidden: Int, inter: Int, path: Int) raises -> Int:
    """Which kernel a step of the MXFP4 op pair runs on the GPU: -1 for the
    decode kernel (moe_gpu.mojo), else a prefill tile configuration. Both
    ops of a step call this with the same shapes, so they agree.
    path: 0 auto, 1 decode kernel, 2 + c prefill with configuration c."""
    if path == 1:
        return -1
    var ok = prefill_feasible(tokens, top_k, n_experts, hidden, inter)
    if path >= 2:
        if path - 2 >= N_CONFIGS:
            raise Error("gptoss MoE: no prefill tile configuration ", path - 2)
        if not ok or (cfg_wgmma(path - 2) and not p2_feasible(hidden, inter)):
            raise Error("gptoss MoE: prefill path forced on shapes it does not handle")
        return path - 2
    var n_pairs = tokens * top_k
    if not ok or n_pairs < PREFILL_MIN_PAIRS_PER_EXPERT * n_experts or n_pairs < PREFILL_MIN_PAIRS:
        return -1
    var c = auto_config(tokens * top_k // n_experts, n_experts)
    if cfg_wgmma(c) and not p2_feasible(hidden, inter):
        # K not in whole 64-element stages: p1's best at that load
        return 0 if tokens * top_k // n_experts >= 512 else 4
    return c


@always_inline
def decode_word(w: UInt32, s: UInt32) -> SIMD[DType.uint32, 4]:
    """The four pairs of a repacked MXFP4 word (slots 0..3: elements 8c + 2q,
    + 1 of word q's block), scale byte s. Two multiplies when s > 128."""
    var out = SIMD[DType.uint32, 4](0)
    var m = p2_mults(s)
    var mult1 = bitcast[DType.bfloat16, 2](m[0])
    comptime for c in range(4):
        out[c] = decode_slot[c](w, mult1)
    if s > 128:
        var mult2 = bitcast[DType.bfloat16, 2](m[1])
        comptime for c in range(4):
            out[c] = scaled_pair(out[c], mult2)
    return out


@always_inline
def write_expert_tiles(tab: Pointer[Int32, MutAnyOrigin], e: Int, t0: Int, t1: Int):
    """The route's tile-table entries of expert e: its m tiles t0 .. t1 - 1
    (tile starts), each (e + 256 * its tile count, t0); e < 256 =
    PREFILL_MAX_EXPERTS."""
    for g in range(t0, t1):
        tab[unsafe_offset=2 * g] = Int32(e + PREFILL_MAX_EXPERTS * (t1 - t0))
        tab[unsafe_offset=2 * g + 1] = Int32(t0)


@always_inline
def find_tile(
    meta: Pointer[Int32, _], n_experts: Int, n_pairs: Int, n_tiles_n: Int, b: Int
) -> SIMD[DType.int32, 4]:
    """Block b of a GEMM grid -> (expert, m tile within it, n tile, ok).
    Blocks are expert-major, then n tile, then m tile (m fastest, so the m
    tiles of one expert share its weight tile in L2): block b lies in global
    m tile g = b // NT (ts[e] * NT <= b < ts[e + 1] * NT), whose entry in
    the route's tile table holds e, its tile count and ts[e]. The entry and
    the tile count are loaded together: one round trip, where a binary search
    over the tile starts took seven dependent ones. The grid never passes the
    table (_grid), so the entry load stays inside meta. 32-bit arithmetic: a
    64-bit division is a long subroutine. (The kernel then reads the expert's
    rows from the offsets; taking them from the table too made ptxas spill in
    the p2 k loops at the 128-register cap.)"""
    var res = SIMD[DType.int32, 4](0)
    var nt_n = UInt32(n_tiles_n)
    var g = UInt32(b) // nt_n
    var ent = meta.unsafe_offset(meta_tiles(n_experts, n_pairs) + 2 * Int(g))
    var total = UInt32(meta[unsafe_offset=2 * n_experts + 1])
    var w0 = UInt32(ent[unsafe_offset=0])
    var t0 = UInt32(ent[unsafe_offset=1])
    if g >= total:
        return res
    var mt_e = w0 // UInt32(PREFILL_MAX_EXPERTS)
    var local = UInt32(b) - t0 * nt_n
    res[0] = Int32(w0 % UInt32(PREFILL_MAX_EXPERTS))
    res[1] = Int32(local % mt_e)
    res[2] = Int32(local // mt_e)
    res[3] = 1
    return res


@always_inline
def _route_batch(ids: Pointer[Int32, ImmutAnyOrigin], n_pairs: Int, p0: Int) -> SIMD[DType.int32, ROUTE_BATCH]:
    """Expert ids of pairs p0 + i * ROUTE_THREADS (i < ROUTE_BATCH), -1 past
    the end: all loads issued before any use, so a thread waits one round
    trip per batch, not per pair."""
    var e = SIMD[DType.int32, ROUTE_BATCH](-1)
    comptime for i in range(ROUTE_BATCH):
        var p = p0 + i * ROUTE_THREADS
        if p < n_pairs:
            e[i] = ids[unsafe_offset=p]
    return e


@always_inline
def _scatter_stable(
    sorted: Pointer[Int32, MutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    n_pairs: Int,
    n_experts: Int,
    cur: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
):
    """route_kernel's scatter in ascending pair order within each expert (cur: each expert's
    first free sorted position). Rounds of ROUTE_THREADS consecutive pairs, thread tid taking
    pair round + tid: its rank among its warp's earlier lanes with the same expert (shuffles),
    plus the same expert's count in earlier warps of the round (a [warp][expert] table in shared
    memory), plus cur; then cur moves past the round's pairs. Block-uniform loop; three barriers
    a round."""
    var wcnt = stack_allocation[
        ROUTE_WARPS * PREFILL_MAX_EXPERTS, Int32, address_space=AddressSpace.SHARED
    ]()
    var tid = Int(thread_idx.x)
    var lane = tid & 31
    var w = tid >> 5
    for i in range(tid, ROUTE_WARPS * PREFILL_MAX_EXPERTS, ROUTE_THREADS):
        wcnt[unsafe_offset=i] = 0
    barrier()
    for r0 in range(0, n_pairs, ROUTE_THREADS):
        var p = r0 + tid
        var e = Int32(-1)
        if p < n_pairs:
            e = ids[unsafe_offset=p]
        var valid = e >= 0 and Int(e) < n_experts
        var rank = 0
        var same = 0
        comptime for j in range(32):
            var ej = shuffle_idx(e, UInt32(j))
            if ej == e:
                same += 1
                if j < lane:
                    rank += 1
        if valid and rank == 0:  # the warp's first lane with this expert
            wcnt[unsafe_offset=w * PREFILL_MAX_EXPERTS + Int(e)] = Int32(same)
        barrier()
        if valid:
            var base = Int(cur[unsafe_offset=Int(e)]) + rank
            for v in range(w):
                base += Int(wcnt[unsafe_offset=v * PREFILL_MAX_EXPERTS + Int(e)])
            sorted[unsafe_offset=base] = Int32(p)
        barrier()
        if valid and rank == 0:
            _ = Atomic.fetch_add[ordering=Ordering.RELAXED](cur.unsafe_offset(Int(e)), Int32(same))
            wcnt[unsafe_offset=w * PREFILL_MAX_EXPERTS + Int(e)] = 0
        barrier()


# Route warps for the stable scatter's per-round, per-warp expert counts.
comptime ROUTE_WARPS = ROUTE_THREADS // 32


@always_inline
def route_order_stable() -> Bool:
    """`GPTOSS_MAX_ROUTE_ORDER=stable`: the route kernel orders each expert's pairs by pair index
    instead of by atomic arrival (read at launch; for checks, see route_kernel)."""
    return getenv("GPTOSS_MAX_ROUTE_ORDER", "arrival") == "stable"


def route_kernel(
    meta: Pointer[Int32, MutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    n_pairs_: Int64,
    n_experts_: Int64,
    bm_: Int64,
    absorb_: Int64,
    stable_: Int64,
):
    """One block: meta (layout above) from topk ids [P]. Ids outside [0, E)
    are left out. Order inside an expert is arrival order (any order gives
    the same results, see the header), or with `stable_` ascending pair index
    (_scatter_stable: the same order every run whatever the header's claim).
    The shared-memory counters take relaxed atomics: the barriers order the
    passes (a sequentially consistent one put a system-scope fence before
    every atomic)."""
    var n_pairs = Int(n_pairs_)
    var n_experts = Int(n_experts_)
    var bm = Int(bm_)
    var absorb = Int(absorb_)
    var cnt = stack_allocation[PREFILL_MAX_EXPERTS, Int32, address_space=AddressSpace.SHARED]()
    var cur = stack_allocation[PREFILL_MAX_EXPERTS, Int32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    for i in range(tid, n_experts, ROUTE_THREADS):
        cnt[unsafe_offset=i] = 0
    barrier()
    for p0 in range(tid, n_pairs, ROUTE_THREADS * ROUTE_BATCH):
        var eb = _route_batch(ids, n_pairs, p0)
        comptime for i in range(ROUTE_BATCH):
            var e = Int(eb[i])
            if e >= 0 and e < n_experts:
                _ = Atomic.fetch_add[ordering=Ordering.RELAXED](cnt.unsafe_offset(e), 1)
    barrier()
    # Offsets, tile starts and the absorbed list: a thread per expert, its count's tiles, then
    # inclusive scans of (pairs, tiles, absorbed) over the experts in shared memory (Hillis-Steele,
    # log2 E rounds). One thread walking the experts in turn took most of the route's ~40 us at
    # 120b T = 4096 (ncu, 2026-11-30): a dependent chain with a 64-bit division per expert.
    var scan = stack_allocation[3 * PREFILL_MAX_EXPERTS, Int32, address_space=AddressSpace.SHARED]()
    var mine = SIMD[DType.int32, 4](0)  # this thread's expert: pairs, regular tiles, absorbed (0 / 1)
    if tid < n_experts:
        var c = Int(cnt[unsafe_offset=tid])
        var et = expert_tiles(c, bm, absorb)
        mine = SIMD[DType.int32, 4](Int32(c), et[0], et[1], 0)
    if tid < PREFILL_MAX_EXPERTS:
        comptime for j in range(3):
            scan[unsafe_offset=j * PREFILL_MAX_EXPERTS + tid] = mine[j]
    barrier()
    var d = 1
    while d < n_experts:  # block-uniform
        var add = SIMD[DType.int32, 4](0)
        if tid < n_experts and tid >= d:
            comptime for j in range(3):
                add[j] = scan[unsafe_offset=j * PREFILL_MAX_EXPERTS + tid - d]
        barrier()
        if tid < n_experts and tid >= d:
            comptime for j in range(3):
                scan[unsafe_offset=j * PREFILL_MAX_EXPERTS + tid] += add[j]
        barrier()
        d *= 2
    var abs_list = meta.unsafe_offset(meta_absorbed(n_experts, n_pairs))
    if tid < n_experts:
        var o = Int(scan[unsafe_offset=tid]) - Int(mine[0])
        var t = Int(scan[unsafe_offset=PREFILL_MAX_EXPERTS + tid]) - Int(mine[1])
        meta[unsafe_offset=tid] = Int32(o)
        meta[unsafe_offset=n_experts + 1 + tid] = Int32(t)
        cur[unsafe_offset=tid] = Int32(o)
        if mine[2] != 0:
            var before = Int(scan[unsafe_offset=2 * PREFILL_MAX_EXPERTS + tid]) - 1
            abs_list[unsafe_offset=1 + before] = Int32(tid)
        write_expert_tiles(meta.unsafe_offset(meta_tiles(n_experts, n_pairs)), tid, t, t + Int(mine[1]))
    if tid == n_experts - 1:  # the totals
        meta[unsafe_offset=n_experts] = scan[unsafe_offset=tid]
        meta[unsafe_offset=2 * n_experts + 1] = scan[unsafe_offset=PREFILL_MAX_EXPERTS + tid]
        abs_list[unsafe_offset=0] = scan[unsafe_offset=2 * PREFILL_MAX_EXPERTS + tid]
    barrier()  # cur before the scatter
    var sorted = meta.unsafe_offset(meta_sorted(n_experts))
    if stable_ != 0:
        _scatter_stable(sorted, ids, n_pairs, n_experts, cur)
        return
    for p0 in range(tid, n_pairs, ROUTE_THREADS * ROUTE_BATCH):
        var eb = _route_batch(ids, n_pairs, p0)
        comptime for i in range(ROUTE_BATCH):
            var e = Int(eb[i])
            if e >= 0 and e < n_experts:
                var pos = Atomic.fetch_add[ordering=Ordering.RELAXED](cur.unsafe_offset(e), 1)
                sorted[unsafe_offset=Int(pos)] = Int32(p0 + i * ROUTE_THREADS)


@always_inline
def _issue[
    BM: Int, BN: Int, THREADS: Int, A_PER_T: Int
](
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    a_off: Array[Int, A_PER_T],
    b_off: Int,
    scales: Pointer[UInt8, ImmutAnyOrigin],
    s_off: Int,
    a_sm: Pointer[BFloat16, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    b_sm: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    s_sm: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    tid: Int,
    stage: Int,
    kb: Int,
):
    """cp.async of stage `stage` <- MXFP4 block kb: A [BM][32] bf16, B [BN][16]
    bytes, and per weight row the aligned 4 scale bytes holding block kb's
    (b_off / s_off: the row's block 0 and scale 0 in the tiled layout)."""
    comptime A_CHUNKS = BM * 4
    comptime for u in range(A_PER_T):
        var c = tid + u * THREADS
        if A_CHUNKS % THREADS == 0 or c < A_CHUNKS:
            async_copy[16](
                a_src.unsafe_offset(a_off[u] + kb * 32).unsafe_address_space_cast[AddressSpace.GLOBAL](),
                a_sm.unsafe_offset(stage * BM * 32 + c * 8),
            )
    if tid < BN:
        async_copy[16](
            blocks.unsafe_offset(b_off + tiled_block_offset(0, kb, 0)).unsafe_address_space_cast[
                AddressSpace.GLOBAL
            ](),
            b_sm.unsafe_offset(stage * BN * 16 + tid * 16),
        )
        async_copy[4](
            scales.unsafe_offset((s_off + tiled_scale_offset(0, kb, 0)) & ~3).unsafe_address_space_cast[
                AddressSpace.GLOBAL
            ](),
            s_sm.unsafe_offset(stage * BN * 4 + tid * 4),
        )


def gemm_kernel[
    down: Bool, BM: Int, BN: Int, WARPS_M: Int, WARPS_N: Int, STAGES: Int
](
    h_out: Pointer[BFloat16, MutAnyOrigin],
    partial: Pointer[BFloat16, MutAnyOrigin],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    meta: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    top_k_: Int64,
    n_experts_: Int64,
    n_pairs_: Int64,
    n_rows_: Int64,
    k_dim_: Int64,
):
    """The gate_up GEMM (down=False): A = x [T, H] gathered by pair, N = 2I rows,
    writes h_out. down: A = h_out's sorted rows [P, I], N = H, writes
    partial [P, H] by pair."""
    comptime WM = BM // WARPS_M
    comptime WN = BN // WARPS_N
    comptime MT = WM // 16
    comptime NT8 = WN // 8
    comptime THREADS = WARPS_M * WARPS_N * 32
    comptime A_CHUNKS = BM * 4  # 16-byte chunks of A per stage
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var n_rows = Int(n_rows_)
    var k_dim = Int(k_dim_)
    var nkb = k_dim // 32
    var n_tiles_n = (n_rows + BN - 1) // BN
    var sorted = meta.unsafe_offset(meta_sorted(n_experts))
    var tile = find_tile(meta, n_experts, Int(n_pairs_), n_tiles_n, Int(block_idx.x))
    if tile[3] == 0:
        return
    var e = Int(tile[0])
    var row0 = Int(meta[unsafe_offset=e]) + Int(tile[1]) * BM
    var rows_valid = min(BM, Int(meta[unsafe_offset=e + 1]) - row0)
    var n0 = Int(tile[2]) * BN

    var a_sm = stack_allocation[STAGES * BM * 32, BFloat16, alignment=16, address_space=AddressSpace.SHARED]()
    var b_sm = stack_allocation[STAGES * BN * 16, UInt8, alignment=16, address_space=AddressSpace.SHARED]()
    var s_sm = stack_allocation[STAGES * BN * 4, UInt8, alignment=16, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)

    # Each thread copies fixed chunks every stage: element offsets of its A
    # chunks (gathered rows) and, for tid < BN, one weight row's block.
    comptime A_PER_T = (A_CHUNKS + THREADS - 1) // THREADS
    var a_off = Array[Int, A_PER_T](fill=0)
    comptime for u in range(A_PER_T):
        var c = tid + u * THREADS
        var r = min(c >> 2, max(rows_valid - 1, 0))
        var src_row: Int
        comptime if down:
            src_row = row0 + r
        else:
            src_row = Int(sorted[unsafe_offset=row0 + r]) // top_k
        a_off[u] = src_row * k_dim + (c & 3) * 8
    # weight rows past N load row N - 1 (their results are not stored)
    var b_off = e * n_rows * (k_dim // 2) + tiled_block_offset(min(n0 + tid, n_rows - 1), 0, nkb)
    var s_off = e * n_rows * nkb + tiled_scale_offset(min(n0 + tid, n_rows - 1), 0, nkb)

    comptime for s in range(STAGES - 1):
        if s < nkb:
            _issue[BM, BN, THREADS, A_PER_T](
                a_src, blocks, a_off, b_off, scales, s_off, a_sm, b_sm, s_sm, tid, s, s
            )
        async_copy_commit_group()

    var lane = Int(lane_id())
    var g = lane >> 2
    var q = lane & 3
    var wm0 = (Int(warp_id()) // WARPS_N) * WM
    var wn0 = (Int(warp_id()) % WARPS_N) * WN
    var acc = Array[SIMD[DType.float32, 4], MT * NT8](fill=0)
    var a32 = a_sm.unsafe_bitcast[UInt32]()
    var b32 = b_sm.unsafe_bitcast[UInt32]()
    # scale byte of this lane's row j in its stage's 4-byte window: (off + kb's) & 3
    var s_row = Array[Int, NT8](fill=0)
    comptime for j in range(NT8):
        s_row[j] = e * n_rows * nkb + tiled_scale_offset(min(n0 + wn0 + j * 8 + g, n_rows - 1), 0, nkb)

    for kb in range(nkb):
        async_copy_wait_group(Int32(STAGES - 2))
        barrier()
        var nxt = kb + STAGES - 1
        if nxt < nkb:
            _issue[BM, BN, THREADS, A_PER_T](
                a_src, blocks, a_off, b_off, scales, s_off, a_sm, b_sm, s_sm, tid, nxt % STAGES, nxt
            )
        async_copy_commit_group()
        var stage = kb % STAGES
        # B: this lane's weight row of each n8 tile, decoded.
        var bw = Array[SIMD[DType.uint32, 4], NT8](fill=0)
        var big = False
        var sc = Array[UInt32, NT8](fill=0)
        comptime for j in range(NT8):
            var r = wn0 + j * 8 + g
            sc[j] = UInt32(s_sm[unsafe_offset=stage * BN * 4 + r * 4 + ((s_row[j] + tiled_scale_offset(0, kb, 0)) & 3)])
            big = big or sc[j] > 128
        var big_any = vote[DType.uint32](big) != 0
        comptime for j in range(NT8):
            var r = wn0 + j * 8 + g
            var w = b32[unsafe_offset=stage * BN * 4 + r * 4 + q]
            if not big_any:
                var mult = scale_mult(sc[j])
                comptime for s4 in range(4):
                    bw[j][s4] = decode_slot[s4](w, mult)
            else:
                bw[j] = decode_word(w, sc[j])
        # A: rows g and g + 8 of each m16 tile, pair words 4c + q (c = 0..3),
        # the pairs bw's slots c decode.
        comptime for i in range(MT):
            var r = wm0 + i * 16 + g
            var lo4 = SIMD[DType.uint32, 4](0)
            var hi4 = SIMD[DType.uint32, 4](0)
            comptime for c in range(4):
                lo4[c] = a32[unsafe_offset=stage * BM * 16 + r * 16 + 4 * c + q]
                hi4[c] = a32[unsafe_offset=stage * BM * 16 + (r + 8) * 16 + 4 * c + q]
            comptime for j in range(NT8):
                comptime for s in range(2):
                    var a = bitcast[DType.bfloat16, 8](
                        SIMD[DType.uint32, 4](lo4[2 * s], hi4[2 * s], lo4[2 * s + 1], hi4[2 * s + 1])
                    )
                    var b = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](bw[j][2 * s], bw[j][2 * s + 1]))
                    mma(acc[i * NT8 + j], a, b, acc[i * NT8 + j])

    # Epilogue. Lane holds (row g, cols 2q, 2q+1) and (row g + 8, same cols)
    # of each 16 x 8 tile.
    comptime for i in range(MT):
        comptime for j in range(NT8):
            var n = n0 + wn0 + j * 8 + 2 * q
            comptime for hf in range(2):
                var r = wm0 + i * 16 + g + 8 * hf
                var c0 = acc[i * NT8 + j][2 * hf]
                var c1 = acc[i * NT8 + j][2 * hf + 1]
                if r < rows_valid and n < n_rows:
                    comptime if down:
                        var p = Int(sorted[unsafe_offset=row0 + r])
                        var w = wts[unsafe_offset=p]
                        var v = SIMD[DType.float32, 2](
                            w * (c0 + bias[unsafe_offset=e * n_rows + n]),
                            w * (c1 + bias[unsafe_offset=e * n_rows + n + 1]),
                        )
                        partial.unsafe_store[alignment=4](p * n_rows + n, v.cast[DType.bfloat16]())
                    else:
                        var inter = n_rows // 2
                        var v = gptoss_swiglu(
                            c0 + bias[unsafe_offset=e * n_rows + n], c1 + bias[unsafe_offset=e * n_rows + n + 1]
                        )
                        h_out[unsafe_offset=(row0 + r) * inter + (n >> 1)] = v.cast[DType.bfloat16]()


# ---------------------------------------------------------------- p2: wgmma
#
# The same grouped GEMM on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a),
# configs c5.. . Roles are swapped against p1: the wgmma M (64 rows per
# warpgroup) is the WEIGHT rows, its N the block's token tile, so
#   D^T [weight rows x tokens] = W [rows x K] . X^T [K x tokens].
# A (weights) comes from registers: each thread decodes its own MXFP4 codes
# straight into the wgmma A fragment, once per block (every weight of the
# block's tile is decoded by exactly one thread, and each decoded weight
# feeds NT tokens). B (tokens: x rows gathered through the sorted pair ids
# for gate_up, sorted h rows for down) is staged by cp.async into shared
# memory as K-major bf16 with the 128-byte swizzle and read by the tensor
# cores through a matrix descriptor. Accumulators f32 in registers.
#
# Per stage (P2_BK = 64 k, one 128-byte swizzle row of bf16):
#   X tile   [BM tokens][64] bf16, 8-row atoms of 1024 B; 16-byte chunk cc
#            of row r at r * 128 + ((cc ^ (r & 7)) << 4)   (x_smem_offset)
#   packed   [BN rows][32 bytes] MXFP4 codes, in 16-byte units u = 2 * row +
#            blk, stored at unit packed_unit(u) (bank-conflict-free reads)
#   scales   [BN rows] the aligned 4-byte window of each row's scale row that
#            holds this stage's two E8M0 bytes.
# STAGES buffers, loads issued STAGES - 2 stages ahead; one wgmma group per
# k16 step, at most two in flight (wait_group 1), so the tensor pipe is fed
# across the per-stage barrier.
#
# Fragment mapping (PTX ISA, wgmma .m64nNk16 register fragments; the same
# per-warp layout as mma.sync m16n8k16): warp w of a warpgroup owns M rows
# 16w..16w+15; lane (g = lane / 4, q = lane % 4) holds A (row g, k 2q, 2q+1),
# (g + 8, same k), (g, k 2q+8, 2q+9), (g + 8, k 2q+8, 2q+9) and D (row g,
# cols 8i + 2q, +1), (row g + 8, same cols) for each 8-column chunk i. M row
# g of warp w is weight row 16w + 2g and M row g + 8 is 16w + 2g + 1: a
# thread holds a gate row and its up row (gate_up: rows interleaved), so
# SwiGLU and the down epilogue's f32 pair stores need no shuffle. Thread q's
# A pairs of a k16 step are slots 2 s2, 2 s2 + 1 of word q of its rows'
# 32-k block (the layout's word repack), i.e. K in natural order, so gate_up
# writes h unpermuted and down reads it as is.

comptime P2_BK = 64


@always_inline
def cfg_min_blocks(c: Int) -> Int:
    """Blocks per SM a p2 config is built for (ptxas caps registers at
    65536 / (threads * this)). c7 (64-token tiles, taken below C7_MAX_PAIRS pairs per
    expert) at 3 (54 KB of shared memory each; 80 registers against 90 at
    2): its small tiles leave the tensor cores idle and are bound by the
    decode's instruction issue, so a third block's warps help where a deeper
    ring did not (bench/NOTES.md, "Twenty-sixth session"): H200 2026-12-01,
    120b T = 128 / 256 / 512 0.770 / 0.781 / 0.816 ms against 0.865 / 0.864 /
    0.915, 20b T = 32 / 128 0.215 / 0.238 against 0.280 / 0.280
    (bench/results/moe_prefill_h200_20261201_s26_v45*.json; c7 with 8 stages
    instead: 2-16 % behind this)."""
    return [1, 1, 1, 1, 1, 2, 1, 3, 1, 2, 2][c]


@always_inline
def p2_threads(c: Int) -> Int:
    return 128 * (cfg_bn(c) // 64)


@always_inline
def p2_stage_bytes(bm: Int, bn: Int) -> Int:
    """One stage: X tile, packed codes, scale windows; 1024-aligned."""
    return (bm * 128 + bn * 32 + bn * 4 + 1023) // 1024 * 1024


@always_inline
def p2_smem_bytes(c: Int) -> Int:
    """Dynamic shared memory of config c (+1 KB to align the base)."""
    return cfg_stages(c) * p2_stage_bytes(cfg_bm(c), cfg_bn(c)) + 1024


@always_inline
def x_smem_offset(r: Int, cc: Int) -> Int:
    """Byte offset of 16-byte chunk cc (k = 8cc..8cc+7) of token row r in a
    stage's X tile: K-major, 128-byte swizzle (chunk XOR row mod 8)."""
    return r * 128 + ((cc ^ (r & 7)) << 4)


@always_inline
def wgmma_desc_sw128(addr: Int) -> Int64:
    """wgmma shared-memory descriptor of a K-major bf16 tile with the 128-byte
    swizzle at shared address addr (1024-aligned tile, plus 32 bytes per k16
    step): start address >> 4 (bits 0-13), leading byte offset 16 >> 4 = 1
    (bits 16-29, unused by swizzled K-major), stride byte offset 1024 >> 4 =
    64 (bits 32-45: the next 8-row atom), base offset 0, swizzle mode 1 =
    128B (bits 62-63)."""
    var lo = ((UInt32(addr) & 0x3FFFF) >> 4) | (UInt32(1) << 16)  # 32-bit math: the high word is constant
    return Int64(lo) | (Int64(64) << 32) | (Int64(1) << 62)


@always_inline
def p2_part_desc(desc: Int64, t0: Int) -> Int64:
    """The descriptor of a tile's token rows t0.. (t0 a multiple of 8) from
    the one of row 0: t0 128-byte rows later, whole 1024-byte swizzle atoms,
    so only the start-address field moves (by t0 * 128 >> 4; no carry, shared
    addresses are below 2^18)."""
    return desc + Int64(t0 * 128 // 16)


@always_inline
def packed_unit(u: Int) -> Int:
    """Physical 16-byte unit of packed unit u = 2 * row + blk: inside each row
    pair j = u >> 2, the low two bits XOR (j >> 1) & 3, so the 8 row pairs a
    warp reads at once sit in 8 different bank groups."""
    return (u & ~3) | ((u & 3) ^ ((u >> 3) & 3))


@always_inline
def prmt(a: UInt32, b: UInt32, sel: UInt32) -> UInt32:
    """PTX prmt (default mode): result byte i = byte (sel >> 4i) & 7 of b:a."""
    comptime if is_gpu():
        return byte_permute(a, b, sel)
    else:
        var r: UInt32 = 0
        comptime for i in range(4):
            var idx = (sel >> UInt32(4 * i)) & 7
            var byte = (a >> (8 * idx)) & 0xFF if idx < 4 else (b >> (8 * (idx - 4))) & 0xFF
            r |= byte << UInt32(8 * i)
        return r


@always_inline
def p2_mults(s: UInt32) -> SIMD[DType.uint32, 2]:
    """(first, second) bf16x2 multipliers for E8M0 scale byte s: 2^(s-1) and
    none when s <= 128 (slot_bits' 2^-126 times 2^(s-1)); else 2^126 then
    2^(s-127)."""
    if s <= 128:
        var m = (s + 126) << 7
        return SIMD[DType.uint32, 2](m | (m << 16), 0x3F803F80)
    var m2 = s << 7
    return SIMD[DType.uint32, 2](UInt32(0x7E807E80), m2 | (m2 << 16))


@always_inline
def p2_frag[
    big: Bool, s2: Int
](wa: UInt32, wb: UInt32, m0: SIMD[DType.uint32, 2], m1: SIMD[DType.uint32, 2]) -> SIMD[DType.bfloat16, 8]:
    """A fragment of k16 step s2 (0, 1) of a 32-k block: slots 2 s2 (k 2q,
    2q + 1) and 2 s2 + 1 (k 2q + 8, 2q + 9) of word q of rows R0 (wa) and R1
    (wb); m0 / m1 the multipliers of rows R0 / R1 for the block."""
    var f0 = bitcast[DType.bfloat16, 2](m0[0])
    var f1 = bitcast[DType.bfloat16, 2](m1[0])
    var p = SIMD[DType.uint32, 4](
        decode_slot[2 * s2](wa, f0),
        decode_slot[2 * s2](wb, f1),
        decode_slot[2 * s2 + 1](wa, f0),
        decode_slot[2 * s2 + 1](wb, f1),
    )
    comptime if big:
        var g0 = bitcast[DType.bfloat16, 2](m0[1])
        var g1 = bitcast[DType.bfloat16, 2](m1[1])
        p[0] = scaled_pair(p[0], g0)
        p[1] = scaled_pair(p[1], g1)
        p[2] = scaled_pair(p[2], g0)
        p[3] = scaled_pair(p[3], g1)
    return bitcast[DType.bfloat16, 8](p)


@always_inline
def p2_base_n(bm: Int) -> Int:
    """The largest power of two <= bm: a tile's main wgmma N; a BM above it
    (c9's 160 = 128 + 32) runs the rest as a second wgmma part."""
    var b = 1
    while b * 2 <= bm:
        b *= 2
    return b


@always_inline
def p2_nt_variant(rows_valid: Int, bm: Int) -> Int:
    """Token-tile variant of a block: 0 runs wgmma N = BM / 4, 1 BM / 2, 2 BM
    (the smallest that covers its rows; N is compile-time per variant)."""
    if rows_valid <= bm // 4:
        return 0
    if rows_valid <= bm // 2:
        return 1
    return 2


@always_inline
def p2_x_row(tid: Int, u: Int, threads: Int) -> Int:
    """Token row of thread tid's X chunk u (its chunk index is tid & 7)."""
    return (tid + u * threads) >> 3


@always_inline
def p2_x_dst(tid: Int, u: Int, threads: Int) -> Int:
    """Byte offset in the X tile where thread tid's chunk u goes (threads / 8
    is a multiple of 8 rows, so every chunk of a thread has its row mod 8)."""
    return x_smem_offset(tid >> 3, tid & 7) + u * threads * 16


@always_inline
def p2_b_src(e: Int, n_rows: Int, n0: Int, tid: Int, k_dim: Int) -> Int:
    """Byte offset in the code blocks (tiled layout) of thread tid's packed
    unit at k block 0 (row tid >> 1 of the tile, clamped to the last row;
    16-byte half tid & 1 of its 32 bytes per stage); + P2_B_STRIDE per stage."""
    var row = min(n0 + (tid >> 1), n_rows - 1)
    return e * n_rows * (k_dim // 2) + tiled_block_offset(row, 0, k_dim // 32) + (tid & 1) * 16


# A stage's 64 k of a row are block pair kb: pairs are 512 bytes apart in the tiled layout.
comptime P2_B_STRIDE = 512
comptime P2_S_STRIDE = 32


@always_inline
def p2_s_row(e: Int, n_rows: Int, n0: Int, r: Int, k_dim: Int) -> Int:
    """Byte offset of tile row r's scale 0 (tiled layout; clamped to the last row)."""
    return e * n_rows * (k_dim // 32) + tiled_scale_offset(min(n0 + r, n_rows - 1), 0, k_dim // 32)


@always_inline
def p2_scale_window(s_row: Int, kb: Int) -> Int:
    """The aligned 4-byte window holding scale bytes 2kb, 2kb + 1 of a row
    (adjacent in the tiled layout)."""
    return (s_row + P2_S_STRIDE * kb) & ~3


@always_inline
def p2_row0(tid: Int) -> Int:
    """Tile row (even: gate) whose A fragment thread tid decodes: warpgroup
    tid >> 7, warp (tid >> 5) & 3 in it, g = lane >> 2; its M rows g, g + 8
    are tile rows p2_row0, p2_row0 + 1."""
    return 64 * (tid >> 7) + 16 * ((tid >> 5) & 3) + 2 * ((tid & 31) >> 2)


@always_inline
def p2_acc_gate(i: Int, b: Int) -> Int:
    """Accumulator index of (M row g = tile row R0, token 8i + 2q + b)."""
    return 4 * i + b


@always_inline
def p2_acc_up(i: Int, b: Int) -> Int:
    """Accumulator index of (M row g + 8 = tile row R0 + 1, token 8i + 2q + b)."""
    return 4 * i + 2 + b


@always_inline
def _p2_issue[
    BM: Int, NT: Int, BN: Int, THREADS: Int, CPT: Int
](
    smem: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    x_off: Array[Int, CPT],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    b_off: Int,
    scales: Pointer[UInt8, ImmutAnyOrigin],
    s_off: Int,
    tid: Int,
    stage: Int,
    kb: Int,
):
    """cp.async of stage `stage` <- k block kb (64 k): the first NT token rows
    of X, every weight row's 32 code bytes, and its scale window."""
    comptime STAGE = p2_stage_bytes(BM, BN)
    var base = smem.unsafe_offset(stage * STAGE)
    comptime for u in range(CPT):
        if p2_x_row(tid, u, THREADS) < NT:
            async_copy[16](
                a_src.unsafe_offset(x_off[u] + kb * P2_BK).unsafe_address_space_cast[AddressSpace.GLOBAL](),
                base.unsafe_offset(p2_x_dst(tid, u, THREADS)).unsafe_bitcast[BFloat16](),
            )
    async_copy[16](
        blocks.unsafe_offset(b_off + kb * P2_B_STRIDE).unsafe_address_space_cast[AddressSpace.GLOBAL](),
        base.unsafe_offset(BM * 128 + packed_unit(tid) * 16),
    )
    if tid < BN:
        async_copy[4](
            scales.unsafe_offset(p2_scale_window(s_off, kb)).unsafe_address_space_cast[AddressSpace.GLOBAL](),
            base.unsafe_offset(BM * 128 + BN * 32 + tid * 4),
        )


# The MoE ops' `big` input holds, per expert, one byte per 16-row group of weight rows
# (mxfp4.big_scale_groups, the tiled layout's TILE_ROWS): 1 when a scale byte of those rows is
# above 128.


@always_inline
def big_groups(n_rows: Int) -> Int:
    """Flags per expert in the `big` input: n_rows / TILE_ROWS (n_rows % TILE_ROWS == 0)."""
    return n_rows // TILE_ROWS


@always_inline
def p2_rows_big(big_flags: Pointer[UInt8, ImmutAnyOrigin], e: Int, n_rows: Int, row: Int) -> Bool:
    """Whether any of the four 16-row groups from `row` (a multiple of 64) has a
    scale byte above 128, from the `big` input: the same four loads in every
    thread that asks for the same rows, so a warpgroup's answer is uniform."""
    var groups = big_groups(n_rows)
    var g0 = e * groups + row // TILE_ROWS
    var any = UInt8(0)
    comptime for j in range(4):
        if row + TILE_ROWS * j < n_rows:
            any |= big_flags[unsafe_offset=g0 + j]
    return any != 0


@always_inline
def p2_mult(win: UInt32, j: Int) -> UInt32:
    """bf16x2 multiplier 2^(s-1) (decode_slot's scale) for scale byte j of the
    window, s <= 128: (s + 126) << 7 in both halves, one prmt (the byte,
    zero-extended) and one multiply-add."""
    return prmt(win, 0, UInt32(0x4440 | j)) * 0x00800080 + 0x3F003F00


@always_inline
def p2_row_mults[BIG: Bool](win: UInt32, j: Int) -> SIMD[DType.uint32, 2]:
    """(first, second) multipliers of scale byte j of a stage's window (bytes
    0, 1: row r0's blocks 0, 1; bytes 2, 3: row r0 + 1's), as p2_frag takes
    them; the second only on the BIG path (p2_mults)."""
    comptime if BIG:
        return p2_mults((win >> UInt32(8 * j)) & 0xFF)
    else:
        return SIMD[DType.uint32, 2](p2_mult(win, j), 0)


@always_inline
def _p2_stage_at[STAGES: Int, STAGE: Int, J: Int](kb: Int) -> Int:
    """Byte offset of stage kb's shared buffer (J's, a compile-time constant, when J >= 0)."""
    var st = (kb % STAGES) * STAGE
    comptime if J >= 0:
        st = J * STAGE
    return st


@always_inline
def _p2_window[
    BM: Int, BN: Int
](smem: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED], st: Int, r0: Int) -> UInt32:
    """The scale window of rows r0, r0 + 1 in the stage at byte st."""
    return smem.unsafe_offset(st + BM * 128 + BN * 32 + r0 * 4).unsafe_bitcast[UInt32]()[0]


@always_inline
def _p2_words[
    BM: Int
](
    smem: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED], st: Int, r0: Int, q: Int, blk: Int
) -> Tuple[UInt32, UInt32]:
    """This thread's code words of block blk in the stage at byte st: rows r0 and r0 + 2."""
    var pk = smem.unsafe_offset(st + BM * 128).unsafe_bitcast[UInt32]()
    var wa = pk[unsafe_offset=packed_unit(2 * r0 + blk) * 4 + q]
    return (wa, pk[unsafe_offset=packed_unit(2 * r0 + 2 + blk) * 4 + q])


@always_inline
def _p2_stage[
    BM: Int, NT: Int, NT2: Int, NWG: Int, STAGES: Int, CPT: Int, BIG: Bool, J: Int, FIRST: Bool = False
](
    smem: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    mut acc: SIMD[DType.float32, NT // 2],
    mut acc2: SIMD[DType.float32, p2_acc2_width(NT2)],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    x_off: Array[Int, CPT],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    b_off: Int,
    scales: Pointer[UInt8, ImmutAnyOrigin],
    s_off: Int,
    tid: Int,
    r0: Int,
    q: Int,
    wg_active: Bool,
    nkb: Int,
    kb: Int,
):
    """Stage kb of the tile's k loop, kept in shared-memory stage kb mod
    STAGES: J when J >= 0 (compile-time, so every shared address of the stage
    is a constant offset), else computed at run time; FIRST: the tile's first
    stage, whose first k16 step writes the accumulators (wgmma_first). Wait for its copies,
    issue the copies STAGES - 2 stages ahead, decode the A fragments of rows
    r0, r0 + 1 and run four wgmma k16 steps (one group each, at most two in
    flight); with NT2 > 0 each step also multiplies the same A fragment by
    token rows NT..NT + NT2 - 1 into acc2, in the same group. BIG: the warp's
    rows have a scale above 128 somewhere (two multiplies per pair). Rows r0
    (even) and r0 + 1 share one aligned scale window: bytes 0, 1 are r0's
    blocks 0, 1 and bytes 2, 3 are r0 + 1's."""
    comptime BN = 64 * NWG
    comptime THREADS = 128 * NWG
    comptime STAGE = p2_stage_bytes(BM, BN)
    async_copy_wait_group(Int32(STAGES - 3))
    fence_async_view_proxy()
    barrier()
    # The stage's scale window and code words first: their shared loads are then in flight while
    # this thread issues the copies of stage kb + STAGES - 2 (p14).
    var win = UInt32(0)
    var words = SIMD[DType.uint32, 4](0)
    # Not in two-part tiles, nor in c9's 160-token kernel: held across the copies, they spill there;
    # nor in c7's 64-token kernel (80 registers at 3 blocks per SM: held across the copies, they
    # add local loads to its unrolled loops, which are issue-bound).
    comptime EARLY = NT2 == 0 and p2_base_n(BM) == BM and BM >= 128
    comptime if EARLY:
        if wg_active:
            var st = _p2_stage_at[STAGES, STAGE, J](kb)
            win = _p2_window[BM, BN](smem, st, r0)
            comptime for blk in range(2):
                words[2 * blk], words[2 * blk + 1] = _p2_words[BM](smem, st, r0, q, blk)
    var nxt = kb + STAGES - 2
    if nxt < nkb:
        var ahead = nxt % STAGES
        comptime if J >= 0:
            ahead = (J + STAGES - 2) % STAGES
        _p2_issue[BM, NT + NT2, BN, THREADS, CPT](smem, a_src, x_off, blocks, b_off, scales, s_off, tid, ahead, nxt)
    async_copy_commit_group()
    if wg_active:
        var st = _p2_stage_at[STAGES, STAGE, J](kb)
        comptime if not EARLY:
            win = _p2_window[BM, BN](smem, st, r0)
        var desc0 = wgmma_desc_sw128(Int(smem) + st)
        comptime for blk in range(2):
            var m0 = p2_row_mults[BIG](win, blk)
            var m1 = p2_row_mults[BIG](win, 2 + blk)
            var wa = words[2 * blk]
            var wb = words[2 * blk + 1]
            comptime if not EARLY:  # each block's words just before its wgmmas (as before p14)
                wa, wb = _p2_words[BM](smem, st, r0, q, blk)
            comptime for s2 in range(2):
                var frag = p2_frag[BIG, s2](wa, wb, m0, m1)
                wgmma_fence_aligned()
                # + 32 bytes per k16 step: + 2 in the start-address field (no carry:
                # shared addresses are below 2^18, the field holds addr >> 4 in 14 bits)
                var desc = desc0 + Int64(2 * (2 * blk + s2))
                comptime if FIRST and blk == 0 and s2 == 0:
                    acc = wgmma_first[NT](frag, desc)
                else:
                    acc = wgmma_async[64, NT, 16, a_type=DType.bfloat16, b_type=DType.bfloat16](
                        frag, WGMMADescriptor[DType.bfloat16](desc), acc
                    )
                comptime if NT2 > 0:
                    acc2 = wgmma_async[64, NT2, 16, a_type=DType.bfloat16, b_type=DType.bfloat16](
                        frag, WGMMADescriptor[DType.bfloat16](p2_part_desc(desc, NT)), acc2
                    )
                wgmma_commit_group_sync()
                wgmma_wait_group_sync[1]()


@always_inline
def p2_first_peeled(bm: Int, nt: Int) -> Bool:
    """Whether a tile's unrolled k loop runs its first STAGES stages peeled,
    the first k16 step writing the accumulators (wgmma_first): c7's N = 16
    tiles (_p2_loop). Stage 0 runs unconditionally (p2_feasible: K >= 64)."""
    return bm == 64 and nt == 16


@always_inline
def wgmma_first[NT: Int](frag: SIMD[DType.bfloat16, 8], desc: Int64) -> SIMD[DType.float32, NT // 2]:
    """wgmma m64n16k16 bf16 with A from registers and scale-d 0 (D = A B), its
    accumulators outputs only, so that no instruction defines them before a
    tile's first k16 step (Mojo's wgmma_async takes them as inputs as well).
    The caller fences before and commits after, as for wgmma_async."""
    comptime assert NT == 16, "c7's N = 16 tiles only (p2_first_peeled)"
    var a = bitcast[DType.uint32, 4](frag)
    var r = inlined_assembly[
        (
            "{ .reg .pred p; setp.ne.b32 p, 0, 0; wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
            "{$0, $1, $2, $3, $4, $5, $6, $7}, {$8, $9, $10, $11}, $12, p, 1, 1, 0; }"
        ),
        _RegisterPackType[Float32, Float32, Float32, Float32, Float32, Float32, Float32, Float32],
        constraints="=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,l",
        has_side_effect=True,
    ](a[0], a[1], a[2], a[3], desc)
    var d = SIMD[DType.float32, NT // 2](0)
    comptime for i in range(NT // 2):
        d[i] = r[i]
    return d


@always_inline
def _p2_loop[
    BM: Int, NT: Int, NT2: Int, NWG: Int, STAGES: Int, CPT: Int, BIG: Bool
](
    smem: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    mut acc: SIMD[DType.float32, NT // 2],
    mut acc2: SIMD[DType.float32, p2_acc2_width(NT2)],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    x_off: Array[Int, CPT],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    b_off: Int,
    scales: Pointer[UInt8, ImmutAnyOrigin],
    s_off: Int,
    tid: Int,
    r0: Int,
    q: Int,
    wg_active: Bool,
    nkb: Int,
):
    """The tile's k loop (_p2_stage per 64-k stage). Tiles of one wgmma part
    and a power-of-two BM run it unrolled by STAGES, so that each copy of
    the body has its stage's shared addresses as constants and the global
    addresses step once per STAGES stages (the last nkb mod STAGES stages run
    the same bodies, each behind its bound check): c7's loops 168-179 ->
    125.5-129.5 instructions a stage. The others keep one body with the
    stage picked at run time: c9's 160-token kernel and the two-part tiles
    would spill (ptxas at the 128-register cap). c7's N = 16 tiles run their
    first STAGES stages peeled, the first k16 step by wgmma_first: with the
    accumulators zeroed before the loop instead, ptxas kept the zeros in
    uniform registers, copied them into the accumulators at the loop's entry
    and serialized the kernel's wgmmas (C7515)."""
    comptime if NT2 > 0 or p2_base_n(BM) != BM:
        for kb in range(nkb):
            _p2_stage[BM, NT, NT2, NWG, STAGES, CPT, BIG, -1](
                smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb, kb
            )
        wgmma_wait_group_sync[0]()
        return
    var kb = 0
    comptime if p2_first_peeled(BM, NT):
        _p2_stage[BM, NT, NT2, NWG, STAGES, CPT, BIG, 0, True](
            smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb, 0
        )
        comptime for j in range(1, STAGES):
            if j < nkb:
                _p2_stage[BM, NT, NT2, NWG, STAGES, CPT, BIG, j](
                    smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb, j
                )
        kb = STAGES
    while kb + STAGES <= nkb:
        comptime for j in range(STAGES):
            _p2_stage[BM, NT, NT2, NWG, STAGES, CPT, BIG, j](
                smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb, kb + j
            )
        kb += STAGES
    comptime for j in range(STAGES - 1):
        if kb + j < nkb:
            _p2_stage[BM, NT, NT2, NWG, STAGES, CPT, BIG, j](
                smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb, kb + j
            )
    wgmma_wait_group_sync[0]()


@always_inline
def _p2_tile[
    down: Bool, BM: Int, NT: Int, NT2: Int, NWG: Int, STAGES: Int
](
    smem: Pointer[UInt8, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    h_out: Pointer[BFloat16, MutAnyOrigin],
    partial: Pointer[BFloat16, MutAnyOrigin],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    sorted: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    top_k: Int,
    n_rows: Int,
    k_dim: Int,
    e: Int,
    row0: Int,
    rows_valid: Int,
    n0: Int,
):
    """One block's tile with a wgmma N of NT tokens, + NT2 more by a second
    wgmma per step when NT2 > 0 (rows_valid <= NT + NT2)."""
    comptime BN = 64 * NWG
    comptime THREADS = 128 * NWG
    comptime STAGE = p2_stage_bytes(BM, BN)
    comptime CPT = (BM * 8 + THREADS - 1) // THREADS  # X chunks per thread per stage
    comptime assert STAGES >= 3, "loads run STAGES - 2 stages ahead of a 2-deep wgmma queue"
    comptime assert (THREADS // 8) % 8 == 0, "a thread's X chunks must share its row mod 8"
    var nkb = k_dim // P2_BK
    var tid = Int(thread_idx.x)

    # Copy roles. X: chunks tid + u * THREADS (row >> 3, chunk & 7);
    # rows past rows_valid load the last valid row (results not stored).
    var x_off = Array[Int, CPT](fill=0)
    comptime for u in range(CPT):
        var r = min(p2_x_row(tid, u, THREADS), max(rows_valid - 1, 0))
        var src_row: Int
        comptime if down:
            src_row = row0 + r
        else:
            src_row = Int(sorted[unsafe_offset=row0 + r]) // top_k
        x_off[u] = src_row * k_dim + (tid & 7) * 8
    # packed unit tid = (row tid >> 1, blk tid & 1); scale window of row tid
    var b_off = p2_b_src(e, n_rows, n0, tid, k_dim)
    var s_off = p2_s_row(e, n_rows, n0, tid, k_dim)

    comptime for s in range(STAGES - 2):
        if s < nkb:
            _p2_issue[BM, NT + NT2, BN, THREADS, CPT](
                smem, a_src, x_off, blocks, b_off, scales, s_off, tid, s, s
            )
        async_copy_commit_group()

    # Compute roles: warpgroup wg, warp w in it, lane (g, q); rows R0 = even
    # (M row g), R1 = R0 + 1 (M row g + 8) of the block's BN.
    var q = tid & 3
    var r0 = p2_row0(tid)
    var wg_active = n0 + 64 * (tid >> 7) < n_rows
    var acc = SIMD[DType.float32, NT // 2](0)
    var acc2 = SIMD[DType.float32, p2_acc2_width(NT2)](0)

    # Scales above 128 take a second multiply (the one multiplier 2^(s-1) of
    # the common path would overflow bf16's exponent); whether any block of
    # the warpgroup's 64 rows has one is one byte of the op's `big` input,
    # computed when the weights were loaded (it replaced a per-tile scan of
    # the rows' scale bytes, 2-3 % of the MoE call), so the common stage body
    # builds each multiplier with one prmt and one multiply-add. Per
    # warpgroup, not per warp: wgmma is warpgroup-collective (.aligned: every
    # thread of the warpgroup must execute the same instruction), so its four
    # warps must run the same loop variant: each reads the same four flags.
    var big = False
    if wg_active:
        big = p2_rows_big(big_flags, e, n_rows, n0 + (r0 & ~63))
    if big:
        _p2_loop[BM, NT, NT2, NWG, STAGES, CPT, True](
            smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb
        )
    else:
        _p2_loop[BM, NT, NT2, NWG, STAGES, CPT, False](
            smem, acc, acc2, a_src, x_off, blocks, b_off, scales, s_off, tid, r0, q, wg_active, nkb
        )

    # Epilogue: D^T element (M row g | g + 8, token 8i + 2q + b) =
    # acc[4i + b | 4i + 2 + b] -> weight rows n0 + r0 (gate / even), + 1.
    var n = n0 + r0
    if not wg_active or n >= n_rows:
        return
    var b0 = bias[unsafe_offset=e * n_rows + n]
    var b1 = bias[unsafe_offset=e * n_rows + n + 1]
    var lim = rows_valid - 2 * q  # token 8i + 2q + b is valid iff 8i + b < lim
    _p2_store[down, NT](acc, 0, lim, h_out, partial, sorted, wts, row0, q, n, n_rows, b0, b1)
    comptime if NT2 > 0:
        var acc2_part = rebind[SIMD[DType.float32, NT2 // 2]](acc2)
        _p2_store[down, NT2](acc2_part, NT, lim, h_out, partial, sorted, wts, row0, q, n, n_rows, b0, b1)


@always_inline
def p2_acc2_width(nt2: Int) -> Int:
    """Accumulators of a tile's second wgmma part (1 unused when there is none)."""
    return nt2 // 2 if nt2 > 0 else 1


comptime P2_STORE_GROUPS = 4  # token groups of 8 whose ids and weights the down epilogue loads at once


@always_inline
def _p2_store[
    down: Bool, NP: Int
](
    acc: SIMD[DType.float32, NP // 2],
    t0: Int,
    lim: Int,
    h_out: Pointer[BFloat16, MutAnyOrigin],
    partial: Pointer[BFloat16, MutAnyOrigin],
    sorted: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    row0: Int,
    q: Int,
    n: Int,
    n_rows: Int,
    b0: Float32,
    b1: Float32,
):
    """Epilogue of one wgmma part of NP tokens starting at tile token t0:
    D^T element (M row g | g + 8, token t0 + 8i + 2q + b) = acc[4i + b |
    4i + 2 + b] -> weight rows n (gate / even), n + 1; tokens valid iff
    t0 + 8i + b < lim."""
    comptime if down:
        # Rounds of P2_STORE_GROUPS token groups: all their pair ids are loaded, then all their
        # routing weights, then the stores (each id -> weight -> store in turn left a thread
        # waiting two dependent loads per token: ncu put ~40 % of the down kernel's stall
        # samples outside its k loop, mostly there). An invalid token's id stays 0, so its
        # weight load reads a valid address; it is not stored.
        comptime CH = min(P2_STORE_GROUPS, NP // 8)
        var sp = sorted.unsafe_offset(row0 + t0 + 2 * q)
        comptime for i0 in range(0, NP // 8, CH):
            var ps = SIMD[DType.int32, 2 * CH](0)
            comptime for j in range(2 * CH):
                if t0 + 8 * (i0 + j // 2) + j % 2 < lim:
                    ps[j] = sp[unsafe_offset=8 * (i0 + j // 2) + j % 2]
            var ws = SIMD[DType.float32, 2 * CH](0)
            comptime for j in range(2 * CH):
                ws[j] = wts[unsafe_offset=Int(ps[j])]
            comptime for j in range(2 * CH):
                comptime i = i0 + j // 2
                comptime b = j % 2
                if t0 + 8 * i + b < lim:
                    var y = SIMD[DType.float32, 2](acc[p2_acc_gate(i, b)] + b0, acc[p2_acc_up(i, b)] + b1)
                    partial.unsafe_store[alignment=4](Int(ps[j]) * n_rows + n, (ws[j] * y).cast[DType.bfloat16]())
    else:
        var inter = n_rows // 2
        var hp = h_out.unsafe_offset((row0 + t0 + 2 * q) * inter + (n >> 1))
        comptime for i in range(NP // 8):
            comptime for b in range(2):
                if t0 + 8 * i + b < lim:
                    var v = gptoss_swiglu(acc[p2_acc_gate(i, b)] + b0, acc[p2_acc_up(i, b)] + b1)
                    hp[unsafe_offset=(8 * i + b) * inter] = v.cast[DType.bfloat16]()


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(128 * NWG)),
    `nvvm.minctasm`=SIMDLength(MIN_BLOCKS),
)
def p2_gemm_kernel[
    down: Bool, BM: Int, NWG: Int, STAGES: Int, MIN_BLOCKS: Int
](
    h_out: Pointer[BFloat16, MutAnyOrigin],
    partial: Pointer[BFloat16, MutAnyOrigin],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    meta: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    top_k_: Int64,
    n_experts_: Int64,
    n_pairs_: Int64,
    n_rows_: Int64,
    k_dim_: Int64,
):
    """gemm_kernel's contract (gate_up: A = x gathered by pair, N = 2I rows,
    writes h_out in natural k order; down: A = sorted h, N = H, writes partial
    by pair) on wgmma; big_flags: the op's `big` input (_p2_tile). BM tokens x
    64 * NWG weight rows per block, 128 * NWG threads, dynamic shared memory
    p2_smem_bytes."""
    comptime BN = 64 * NWG
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var n_rows = Int(n_rows_)
    var k_dim = Int(k_dim_)
    var n_tiles_n = (n_rows + BN - 1) // BN
    var sorted = meta.unsafe_offset(meta_sorted(n_experts))
    var tile = find_tile(meta, n_experts, Int(n_pairs_), n_tiles_n, Int(block_idx.x))
    if tile[3] == 0:
        return
    var e = Int(tile[0])
    var row0 = Int(meta[unsafe_offset=e]) + Int(tile[1]) * BM
    var rows_valid = min(BM, Int(meta[unsafe_offset=e + 1]) - row0)
    var n0 = Int(tile[2]) * BN
    var raw = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024]()
    var smem = raw.unsafe_offset((1024 - (Int(raw) & 1023)) & 1023)
    comptime BASE = p2_base_n(BM)
    comptime EXTRA = BM - BASE
    comptime assert EXTRA == 0 or (p2_base_n(EXTRA) == EXTRA and EXTRA >= 8), "BM: a power of two (+ a smaller one)"
    var v = p2_nt_variant(rows_valid, BASE)
    comptime for vi in range(3):
        comptime NT = BASE >> (2 - vi)
        if v == vi and (EXTRA == 0 or rows_valid <= BASE):
            _p2_tile[down, BM, NT, 0, NWG, STAGES](
                smem, h_out, partial, a_src, sorted, wts, blocks, scales, bias, big_flags, top_k, n_rows, k_dim, e,
                row0, rows_valid, n0,
            )
    comptime if EXTRA > 0:
        if rows_valid > BASE:
            _p2_tile[down, BM, BASE, EXTRA, NWG, STAGES](
                smem, h_out, partial, a_src, sorted, wts, blocks, scales, bias, big_flags, top_k, n_rows, k_dim, e,
                row0, rows_valid, n0,
            )


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(128 * NWG)),
    `nvvm.minctasm`=SIMDLength(MIN_BLOCKS),
)
def p2_absorbed_kernel[
    down: Bool, BASE: Int, NWG: Int, STAGES: Int, MIN_BLOCKS: Int
](
    h_out: Pointer[BFloat16, MutAnyOrigin],
    partial: Pointer[BFloat16, MutAnyOrigin],
    a_src: Pointer[BFloat16, ImmutAnyOrigin],
    meta: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    top_k_: Int64,
    n_experts_: Int64,
    n_pairs_: Int64,
    n_rows_: Int64,
    k_dim_: Int64,
):
    """c10's second launch: the absorbed tiles (the route's list, meta after
    the sorted ids), one per listed expert and n tile: BASE (the route's
    tile) + up to ABSORB rows from BASE * (its regular tiles), as c9's
    two-part tile. Grid: E * n tiles (blocks past the list return)."""
    comptime BM = BASE + ABSORB
    comptime BN = 64 * NWG
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var n_rows = Int(n_rows_)
    var k_dim = Int(k_dim_)
    var n_tiles_n = (n_rows + BN - 1) // BN
    var lst = meta.unsafe_offset(meta_absorbed(n_experts, Int(n_pairs_)))
    var j = Int(block_idx.x) // n_tiles_n
    if j >= Int(lst[unsafe_offset=0]):
        return
    var e = Int(lst[unsafe_offset=1 + j])
    var first = Int(meta[unsafe_offset=e])
    var count = Int(meta[unsafe_offset=e + 1]) - first
    var regular = Int(expert_tiles(count, BASE, ABSORB)[0])
    var row0 = first + BASE * regular
    var rows_valid = count - BASE * regular  # BASE + 1 .. BASE + ABSORB
    var n0 = (Int(block_idx.x) - j * n_tiles_n) * BN
    var sorted = meta.unsafe_offset(meta_sorted(n_experts))
    var raw = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024]()
    var smem = raw.unsafe_offset((1024 - (Int(raw) & 1023)) & 1023)
    _p2_tile[down, BM, BASE, ABSORB, NWG, STAGES](
        smem, h_out, partial, a_src, sorted, wts, blocks, scales, bias, big_flags, top_k, n_rows, k_dim, e, row0,
        rows_valid, n0,
    )


def p2_absorbed_smem_bytes(c: Int) -> Int:
    """Dynamic shared memory of c10's absorbed launch (+1 KB to align the base)."""
    return cfg_stages(c) * p2_stage_bytes(cfg_bm(c) + ABSORB, cfg_bn(c)) + 1024


def combine_kernel[
    out_dtype: DType
](
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    tokens_: Int64,
    top_k_: Int64,
    n_experts_: Int64,
    hidden_: Int64,
):
    """Output[t, 4c..4c+3] = sum over valid k of partial[t K + k, ...]."""
    var tokens = Int(tokens_)
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var hidden = Int(hidden_)
    var quads = hidden // 4
    var idx = Int(block_idx.x) * 256 + Int(thread_idx.x)
    if idx >= tokens * quads:
        return
    var t = idx // quads
    var c = (idx - t * quads) * 4
    var s = SIMD[DType.float32, 4](0)
    for k in range(top_k):
        var e = Int(ids[unsafe_offset=t * top_k + k])
        if e >= 0 and e < n_experts:
            s += partial.unsafe_load[width=4, alignment=8]((t * top_k + k) * hidden + c).cast[DType.float32]()
    output.unsafe_store[alignment=4](t * hidden + c, s.cast[out_dtype]())


def _meta_ptr(h: Pointer[Float32, _], n_pairs: Int, inter: Int) -> Pointer[Int32, MutAnyOrigin]:
    return rebind[Pointer[Int32, MutAnyOrigin]](h.unsafe_bitcast[Int32]().unsafe_offset(n_pairs * inter // 2))


def _grid(n_pairs: Int, n_experts: Int, n_rows: Int, bm: Int, bn: Int) -> Int:
    """Upper bound on GEMM blocks from shapes: max_m_tiles times the n tiles
    (so find_tile's table rows stay inside meta, bm >= MIN_BM)."""
    return max_m_tiles(n_pairs, n_experts, bm) * ((n_rows + bn - 1) // bn)


def _gate_up_cfg[
    c: Int
](
    ctx: DeviceContext,
    h: Pointer[Float32, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
) raises:
    comptime BM = cfg_bm(c)
    comptime BN = cfg_bn(c)
    comptime WARPS = cfg_warps_m(c) * cfg_warps_n(c)
    var n_pairs = tokens * top_k
    var meta = _meta_ptr(h, n_pairs, rows // 2)
    ctx.enqueue_function[route_kernel](
        meta, ids, Int64(n_pairs), Int64(n_experts), Int64(BM), Int64(cfg_absorb(c)),
        Int64(1 if route_order_stable() else 0), grid_dim=1, block_dim=ROUTE_THREADS
    )
    comptime if cfg_wgmma(c):
        comptime kernel = p2_gemm_kernel[False, BM, BN // 64, cfg_stages(c), cfg_min_blocks(c)]
        comptime SMEM = p2_smem_bytes(c)
        ctx.enqueue_function[kernel](
            h.unsafe_bitcast[BFloat16](),
            h.unsafe_bitcast[BFloat16](),  # partial: unused by gate_up
            x,
            rebind[Pointer[Int32, ImmutAnyOrigin]](meta),
            bias,
            blocks,
            scales,
            bias,
            big_flags,
            Int64(top_k),
            Int64(n_experts),
            Int64(n_pairs),
            Int64(rows),
            Int64(hidden),
            grid_dim=_grid(n_pairs, n_experts, rows, BM, BN),
            block_dim=p2_threads(c),
            shared_mem_bytes=SMEM,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(SMEM)),
        )
        comptime if cfg_absorb(c) > 0:
            comptime absorbed = p2_absorbed_kernel[False, BM, BN // 64, cfg_stages(c), cfg_min_blocks(c)]
            comptime ASMEM = p2_absorbed_smem_bytes(c)
            ctx.enqueue_function[absorbed](
                h.unsafe_bitcast[BFloat16](),
                h.unsafe_bitcast[BFloat16](),  # partial: unused by gate_up
                x,
                rebind[Pointer[Int32, ImmutAnyOrigin]](meta),
                bias,
                blocks,
                scales,
                bias,
                big_flags,
                Int64(top_k),
                Int64(n_experts),
                Int64(n_pairs),
                Int64(rows),
                Int64(hidden),
                grid_dim=n_experts * ((rows + BN - 1) // BN),
                block_dim=p2_threads(c),
                shared_mem_bytes=ASMEM,
                func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(ASMEM)),
            )
    else:
        comptime kernel = gemm_kernel[False, BM, BN, cfg_warps_m(c), cfg_warps_n(c), cfg_stages(c)]
        ctx.enqueue_function[kernel](
            h.unsafe_bitcast[BFloat16](),
            h.unsafe_bitcast[BFloat16](),  # partial: unused by gate_up
            x,
            rebind[Pointer[Int32, ImmutAnyOrigin]](meta),
            bias,
            blocks,
            scales,
            bias,
            Int64(top_k),
            Int64(n_experts),
            Int64(n_pairs),
            Int64(rows),
            Int64(hidden),
            grid_dim=_grid(n_pairs, n_experts, rows, BM, BN),
            block_dim=WARPS * 32,
        )


def _down_cfg[
    c: Int, out_dtype: DType
](
    ctx: DeviceContext,
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[Float32, MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    inter: Int,
) raises:
    comptime BM = cfg_bm(c)
    comptime BN = cfg_bn(c)
    comptime WARPS = cfg_warps_m(c) * cfg_warps_n(c)
    var n_pairs = tokens * top_k
    var meta = _meta_ptr(h, n_pairs, inter)
    var hb = rebind[Pointer[BFloat16, ImmutAnyOrigin]](h.unsafe_bitcast[BFloat16]())
    # the weighted expert outputs go to the first half of the f32 scratch as bf16 (as the
    # reference rounds each expert's output): half the bytes for the GEMM to store and the
    # combine to read
    var pb = partial.unsafe_bitcast[BFloat16]()
    comptime if cfg_wgmma(c):
        comptime kernel = p2_gemm_kernel[True, BM, BN // 64, cfg_stages(c), cfg_min_blocks(c)]
        comptime SMEM = p2_smem_bytes(c)
        ctx.enqueue_function[kernel](
            rebind[Pointer[BFloat16, MutAnyOrigin]](hb),
            pb,
            hb,
            rebind[Pointer[Int32, ImmutAnyOrigin]](meta),
            wts,
            blocks,
            scales,
            bias,
            big_flags,
            Int64(top_k),
            Int64(n_experts),
            Int64(n_pairs),
            Int64(hidden),
            Int64(inter),
            grid_dim=_grid(n_pairs, n_experts, hidden, BM, BN),
            block_dim=p2_threads(c),
            shared_mem_bytes=SMEM,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(SMEM)),
        )
        comptime if cfg_absorb(c) > 0:
            comptime absorbed = p2_absorbed_kernel[True, BM, BN // 64, cfg_stages(c), cfg_min_blocks(c)]
            comptime ASMEM = p2_absorbed_smem_bytes(c)
            ctx.enqueue_function[absorbed](
                rebind[Pointer[BFloat16, MutAnyOrigin]](hb),
                pb,
                hb,
                rebind[Pointer[Int32, ImmutAnyOrigin]](meta),
                wts,
                blocks,
                scales,
                bias,
                big_flags,
                Int64(top_k),
                Int64(n_experts),
                Int64(n_pairs),
                Int64(hidden),
                Int64(inter),
                grid_dim=n_experts * ((hidden + BN - 1) // BN),
                block_dim=p2_threads(c),
                shared_mem_bytes=ASMEM,
                func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(ASMEM)),
            )
    else:
        comptime kernel = gemm_kernel[True, BM, BN, cfg_warps_m(c), cfg_warps_n(c), cfg_stages(c)]
        ctx.enqueue_function[kernel](
            rebind[Pointer[BFloat16, MutAnyOrigin]](hb),
            pb,
            hb,
            rebind[Pointer[Int32, ImmutAnyOrigin]](meta),
            wts,
            blocks,
            scales,
            bias,
            Int64(top_k),
            Int64(n_experts),
            Int64(n_pairs),
            Int64(hidden),
            Int64(inter),
            grid_dim=_grid(n_pairs, n_experts, hidden, BM, BN),
            block_dim=WARPS * 32,
        )
    ctx.enqueue_function[combine_kernel[out_dtype]](
        output,
        rebind[Pointer[BFloat16, ImmutAnyOrigin]](pb),
        ids,
        Int64(tokens),
        Int64(top_k),
        Int64(n_experts),
        Int64(hidden),
        grid_dim=(tokens * (hidden // 4) + 255) // 256,
        block_dim=256,
    )


def launch_prefill_gate_up(
    ctx: DeviceContext,
    cfg: Int,
    h: Pointer[Float32, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    rows: Int,
    hidden: Int,
) raises:
    """Route + gate_up GEMM for a whole step (cfg from prefill_choice);
    big_flags: the op's `big` input ([E, rows / 16] u8)."""
    comptime for c in range(N_CONFIGS):
        if cfg == c:
            _gate_up_cfg[c](ctx, h, x, ids, blocks, scales, bias, big_flags, tokens, top_k, n_experts, rows, hidden)


def launch_prefill_down[
    out_dtype: DType
](
    ctx: DeviceContext,
    cfg: Int,
    output: Pointer[Scalar[out_dtype], MutAnyOrigin],
    partial: Pointer[Float32, MutAnyOrigin],
    h: Pointer[Float32, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    blocks: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    bias: Pointer[Float32, ImmutAnyOrigin],
    big_flags: Pointer[UInt8, ImmutAnyOrigin],
    tokens: Int,
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    inter: Int,
) raises:
    """The down GEMM + top-k combine, reading the route gate_up left in h;
    big_flags: the op's `big` input ([E, hidden / 16] u8)."""
    comptime for c in range(N_CONFIGS):
        if cfg == c:
            _down_cfg[c, out_dtype](
                ctx, output, partial, h, ids, wts, blocks, scales, bias, big_flags, tokens, top_k, n_experts, hidden,
                inter,
            )
