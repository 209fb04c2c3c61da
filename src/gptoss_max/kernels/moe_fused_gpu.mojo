# A one-token step's MoE (bf16 graph) in one launch: gate_up and down in the
# same grid (v27; bench/NOTES.md). Each block takes a ticket from a counter as
# it starts. The first n_gu tickets run gate_up tiles (FUSED_GU_TILES tiles of
# FUSED_GU_KS warps each, gate_up_lean_kernel's work); the rest run a 16-row
# tile of down for every expert (down_one_token_kernel's work, FUSED_DOWN_KS
# warps per expert). A down warp takes its routing, issues its first weights
# and stages its scales, and only then waits for its expert's h: it spins on
# that pair slot's counter, which gate_up blocks bump once their tiles' h rows
# are written and fenced. A block waits only on tickets below its own, taken
# by blocks already running that never wait, so the grid cannot deadlock
# however many blocks fit the GPU at once. The last block to finish resets the
# counters for the next launch.
#
# What it is for: PM sampling (2026-11-29) put ~45 % of the two one-token
# kernels' time in ramps and tails; here the down's ramp runs in gate_up's
# tail, with no launch boundary between them (v26, on main, does the same by
# PDL). Measured on the H200 (2026-11-30): correct, and 1-2.5 µs per layer
# slower than the two kernels, so the model does not use it. Every gate_up
# block is resident from the start, so every slot's count completes only in
# gate_up's last tail, and the down warps wait for it (bench/NOTES.md,
# "Twelfth session").

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, barrier, lane_id, warp_id
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.intrinsics import threadfence
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group, async_copy_wait_group, external_memory
from max.gpu.primitives.warp import shuffle_idx
from std.atomic import Atomic, Ordering
from std.utils.static_tuple import StaticTuple

from .moe_gpu import (
    DOWN1_DEPTH,
    MAX_TOPK,
    WAIT_FLAG,
    _down1_sum,
    _lean_scale_bytes,
    _lean_swiglu_out,
    _lean_tile,
    _lean_x_words,
)
from .pdl import pdl_attributes, pdl_enter
from .router_topk import warp_topk

comptime FUSED_WARPS = 12
comptime FUSED_GU_KS = 2  # warps per gate_up tile, splitting K (as LEAN_KS)
comptime FUSED_GU_TILES = FUSED_WARPS // FUSED_GU_KS
comptime FUSED_DOWN_KS = FUSED_WARPS // MAX_TOPK  # warps per expert in a down block
# per warp: its scales and its staged activations, sized for the gate_up split
# (the down's 3-way split needs less of both)
comptime FUSED_SCALE_BYTES = _lean_scale_bytes(FUSED_GU_KS)
comptime FUSED_X_WORDS = _lean_x_words(FUSED_GU_KS)
# shared memory, in this order: the warps' fragments (f32), their scales (u8),
# their activations (u32), 96 f32 of bias, the experts' weights (f32), whether
# each counts (i32), the ticket (i32, padded)
comptime _RED = 0
comptime _SMS = _RED + FUSED_WARPS * 128 * 4
comptime _XSS = _SMS + FUSED_WARPS * FUSED_SCALE_BYTES
comptime _BIAS = _XSS + FUSED_WARPS * FUSED_X_WORDS * 4
comptime _WTS = _BIAS + max(FUSED_GU_TILES, MAX_TOPK) * 16 * 4
comptime _VALID = _WTS + MAX_TOPK * 4
comptime _TICKET = _VALID + MAX_TOPK * 4
comptime FUSED_SMEM = _TICKET + 16
# the counters (u32): the next ticket, blocks finished, then one per pair slot
# (its gate_up tiles done); zero before the first launch, reset by the last block
comptime SYNC_TICKET = 0
comptime SYNC_FINISHED = 1
comptime SYNC_DONE = 2
comptime SYNC_WORDS = SYNC_DONE + MAX_TOPK


def fused_blocks(top_k: Int, hidden: Int, inter: Int) -> Tuple[Int, Int]:
    """(gate_up blocks, all blocks) of moe_one_token_kernel's grid."""
    var n_gu = ((2 * inter // 16) * top_k + FUSED_GU_TILES - 1) // FUSED_GU_TILES
    return (n_gu, n_gu + hidden // 16)


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(FUSED_WARPS * 32)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(2))
def moe_one_token_kernel[
    route: Int
](
    output: Pointer[BFloat16, MutAnyOrigin],
    h: Pointer[Float32, MutAnyOrigin],
    sync: Pointer[UInt32, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
    gu_blocks: Pointer[UInt8, ImmutAnyOrigin],
    gu_scales: Pointer[UInt8, ImmutAnyOrigin],
    gu_bias: Pointer[Float32, ImmutAnyOrigin],
    d_blocks: Pointer[UInt8, ImmutAnyOrigin],
    d_scales: Pointer[UInt8, ImmutAnyOrigin],
    d_bias: Pointer[Float32, ImmutAnyOrigin],
    top_k_: Int64,
    n_experts_: Int64,
    hidden_: Int64,
    inter_: Int64,
):
    """One token's routed experts: output [hidden] = sum_k w_k (W_down[e_k]
    swiglu(W_gate_up[e_k] x + b) + b_down). route > 0: the top-k of the
    router's bf16 logits, taken by every warp (also written to ids_out and
    wts_out); route 0: ids and wts. h: scratch [top_k, inter] f32 words (bf16
    in their first half, as gate_up_lean_kernel writes it). sync: SYNC_WORDS
    counters, zero between launches."""
    pdl_enter()
    var top_k = Int(top_k_)
    var n_experts = Int(n_experts_)
    var hidden = Int(hidden_)
    var inter = Int(inter_)
    var rows = 2 * inter
    var n_rt = rows // 16
    var nb = fused_blocks(top_k, hidden, inter)
    var w = Int(warp_id())
    var lane = Int(lane_id())
    var tid = Int(thread_idx.x)
    var raw = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=16]()
    var red = raw.unsafe_offset(_RED).unsafe_bitcast[Float32]()
    var sm = raw.unsafe_offset(_SMS + w * FUSED_SCALE_BYTES)
    var xs = raw.unsafe_offset(_XSS).unsafe_bitcast[UInt32]().unsafe_offset(w * FUSED_X_WORDS)
    var bsm = raw.unsafe_offset(_BIAS).unsafe_bitcast[Float32]()
    var wsm = raw.unsafe_offset(_WTS).unsafe_bitcast[Float32]()
    var vsm = raw.unsafe_offset(_VALID).unsafe_bitcast[Int32]()
    var tk = raw.unsafe_offset(_TICKET).unsafe_bitcast[UInt32]()
    if tid == 0:
        tk[0] = Atomic.fetch_add[ordering=Ordering.RELAXED](sync.unsafe_offset(SYNC_TICKET), 1)
    barrier()
    var ticket = Int(tk[0])
    # this warp's pair slot: a gate_up tile's, or its expert's in a down block
    var is_gu = ticket < nb[0]
    var tile = ticket * FUSED_GU_TILES + w // FUSED_GU_KS
    var k = tile // n_rt if is_gu else w // FUSED_DOWN_KS
    var active = tile < n_rt * top_k if is_gu else k < top_k
    var e = -1
    var wt = Float32(0)
    comptime if route > 0:
        var mine = warp_topk[DType.bfloat16, route](logits, n_experts, top_k)
        if ticket == 0 and w == 0 and lane < top_k:
            ids_out[unsafe_offset=lane] = mine[0]
            wts_out[unsafe_offset=lane] = mine[1]
        var ek = shuffle_idx(mine[0], UInt32(min(k, 31)))
        wt = shuffle_idx(mine[1], UInt32(min(k, 31)))
        if active:
            e = Int(ek)
    else:
        if active:
            e = Int(ids[unsafe_offset=k])
            wt = wts[unsafe_offset=k]
    var valid = active and e >= 0 and e < n_experts
    var acc = SIMD[DType.float32, 4](0)
    if is_gu:
        # gate_up_lean_kernel's tile: rows r0 .. r0 + 15 of expert e's
        # [2I, H], K split over FUSED_GU_KS warps; the tile's first warp sums
        # the fragments and writes h's row k (swiglu of gate and up)
        var t = w // FUSED_GU_KS
        var kw = w % FUSED_GU_KS
        var r0 = (tile % n_rt) * 16
        var nchunks = hidden // 32
        var kc0 = nchunks * kw // FUSED_GU_KS
        var nloc = nchunks * (kw + 1) // FUSED_GU_KS - kc0
        if valid and kw == 0 and lane < 16:
            async_copy[4](
                gu_bias.unsafe_offset(e * rows + r0 + lane).unsafe_address_space_cast[AddressSpace.GLOBAL](),
                bsm + t * 16 + lane,
            )
        async_copy_commit_group()
        if valid:
            acc = _lean_tile(
                gu_blocks, gu_scales, e, rows, r0, nchunks, kc0, nloc, x.unsafe_bitcast[UInt32](), sm, xs, sync, 0
            )
        (red + (w * 32 + lane) * 4).unsafe_store[width=4, alignment=16](0, acc)
        async_copy_wait_group(0)
        barrier()
        if valid and kw == 0:
            comptime for j in range(1, FUSED_GU_KS):
                acc += (red + ((w + j) * 32 + lane) * 4).unsafe_load[width=4, alignment=16](0)
            _lean_swiglu_out(acc, bsm + t * 16, h, k, r0, rows)
            threadfence()  # each writer's h before the barrier and the count below
        barrier()
        if tid == 0:
            comptime for j in range(FUSED_GU_TILES):
                var tj = ticket * FUSED_GU_TILES + j
                if tj < n_rt * top_k:
                    _ = Atomic.fetch_add[ordering=Ordering.RELAXED](sync.unsafe_offset(SYNC_DONE + tj // n_rt), 1)
    else:
        # down_one_token_kernel's tile for rows r0 .. r0 + 15 of the output,
        # FUSED_DOWN_KS warps per expert over parts of I; each waits for its
        # expert's h (all n_rt gate_up tiles of pair slot k) inside the lean
        # tile, after its first weights and its scales
        var kw = w % FUSED_DOWN_KS
        var r0 = (ticket - nb[0]) * 16
        if kw == 0:
            if valid and lane < 16:
                async_copy[4](
                    d_bias.unsafe_offset(e * hidden + r0 + lane).unsafe_address_space_cast[AddressSpace.GLOBAL](),
                    bsm + k * 16 + lane,
                )
            if valid and lane == 16:
                wsm[k] = wt
            if lane == 0 and k < MAX_TOPK:
                vsm[k] = 1 if valid else 0
        async_copy_commit_group()
        if valid:
            var nchunks = inter // 32
            var kc0 = nchunks * kw // FUSED_DOWN_KS
            var nloc = nchunks * (kw + 1) // FUSED_DOWN_KS - kc0
            var hrow = h.unsafe_bitcast[UInt32]().unsafe_offset(k * inter)
            acc = _lean_tile[DOWN1_DEPTH, WAIT_FLAG](
                d_blocks, d_scales, e, hidden, r0, nchunks, kc0, nloc, hrow, sm, xs,
                sync.unsafe_offset(SYNC_DONE + k), UInt32(n_rt),
            )
        (red + (w * 32 + lane) * 4).unsafe_store[width=4, alignment=16](0, acc)
        async_copy_wait_group(0)
        barrier()
        _down1_sum[DType.bfloat16, FUSED_DOWN_KS](output, red, bsm, wsm, vsm, r0, hidden, top_k)
    # the last block to finish resets the counters for the next launch
    if tid == 0:
        threadfence()
        var old = Atomic.fetch_add[ordering=Ordering.RELAXED](sync.unsafe_offset(SYNC_FINISHED), 1)
        if Int(old) == nb[1] - 1:
            comptime for i in range(SYNC_WORDS):
                sync[unsafe_offset=i] = 0
            threadfence()


def launch_moe_one_token[
    route: Int
](
    ctx: DeviceContext,
    output: Pointer[BFloat16, MutAnyOrigin],
    h: Pointer[Float32, MutAnyOrigin],
    sync: Pointer[UInt32, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    ids: Pointer[Int32, ImmutAnyOrigin],
    wts: Pointer[Float32, ImmutAnyOrigin],
    logits: Pointer[BFloat16, ImmutAnyOrigin],
    ids_out: Pointer[Int32, MutAnyOrigin],
    wts_out: Pointer[Float32, MutAnyOrigin],
    gu_blocks: Pointer[UInt8, ImmutAnyOrigin],
    gu_scales: Pointer[UInt8, ImmutAnyOrigin],
    gu_bias: Pointer[Float32, ImmutAnyOrigin],
    d_blocks: Pointer[UInt8, ImmutAnyOrigin],
    d_scales: Pointer[UInt8, ImmutAnyOrigin],
    d_bias: Pointer[Float32, ImmutAnyOrigin],
    top_k: Int,
    n_experts: Int,
    hidden: Int,
    inter: Int,
) raises:
    """moe_one_token_kernel for one token (top_k <= MAX_TOPK, hidden and
    inter multiples of 32 and at most 32 * MAX_K_BLOCKS; sync zero)."""
    if top_k > MAX_TOPK or hidden % 32 != 0 or inter % 32 != 0:
        raise Error("gptoss fused one-token MoE: needs top_k <= 4 and H, I multiples of 32")
    var nb = fused_blocks(top_k, hidden, inter)
    ctx.enqueue_function[moe_one_token_kernel[route]](
        output, h, sync, x, ids, wts, logits, ids_out, wts_out, gu_blocks, gu_scales, gu_bias,
        d_blocks, d_scales, d_bias, Int64(top_k), Int64(n_experts), Int64(hidden), Int64(inter),
        grid_dim=nb[1],
        block_dim=FUSED_WARPS * 32,
        shared_mem_bytes=FUSED_SMEM,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(FUSED_SMEM)),
        attributes=pdl_attributes(True),
    )
