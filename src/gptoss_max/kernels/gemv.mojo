import extensibility
from extensibility import InputTensor, OutputTensor
from layout import coord_to_index_list
from max.algorithm import elementwise
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, lane_id, warp_id
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext
from max.gpu.memory import AddressSpace, CacheEviction, async_copy, async_copy_commit_group, async_copy_wait_group, load
from max.gpu.primitives.warp import shuffle_xor
from std.collections import Array
from std.memory import bitcast, stack_allocation
from std.utils.coord import Coord
from std.utils.static_tuple import StaticTuple

from .pdl import pdl_attributes, pdl_enter
from .poison import poison

# Dense bf16 projections of decode steps: y = x W^T + b (W [N, K] row-major,
# as MAX's Linear stores it). Two GPU paths:
#   tensor cores (the op's `tc`, T <= 64; "Tensor-core path" below): used by
#       the model for steps of 2..16 tokens (arch/dense.py);
#   a warp per output row (T <= 2): not used by the model. Why it was built: in
#       a 120b batch-1 step MAX runs qkv and o_proj with its split-K GEMV at
#       ~2.4 TB/s, while its own LM-head GEMV reaches the copy bandwidth; on an
#       H100 it was slower than MAX's GEMV at qkv's shape (17.8 vs 16.6 us per
#       projection in bench/gemv.py, 2026-11-22).
#
# Warp per row: lane l reads the row's 16-byte chunks l, l + 32, ... (up to
# GEMV_MAX_CHUNKS per lane, so a row of K <= 4,096 bf16), then
# multiplies them with x in f32 and the warp sums by shuffles. Rows of a block
# are consecutive. Two ways to get the chunks in flight together, timed
# against each other by bench/gemv.py:
#   registers (staged = False): all loads issued before the math; ptxas
#       may still sink them toward their use (sm_90a SASS of [2, 16]: 48
#       registers, the weight loads spread through the FMAs);
#   shared memory (staged = True): cp.async of every chunk into the warp's
#       slice, one wait, then the math from shared memory (no registers held
#       by loads in flight; 32 KB per block of 4 warps at K = 4,096).
# The op's `staged` parameter picks one (ops.gemv: staged by default).
# CPU: a task per (token, row), the same f32 sum.

comptime GEMV_WARPS = 4
comptime GEMV_MAX_TOKENS = 2
comptime GEMV_MAX_CHUNKS = 16  # per lane: K <= 16 * 32 * 8 = 4096


@always_inline
def bf16_pair_f32(w: UInt32) -> SIMD[DType.float32, 2]:
    """The two bf16 of a word (low half first) as f32: exact, two integer ops."""
    return SIMD[DType.float32, 2](bitcast[DType.float32, 1](w << 16), bitcast[DType.float32, 1](w & 0xFFFF0000))


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(GEMV_WARPS * 32)))
def gemv_kernel[
    tokens: Int, chunks: Int, staged: Bool
](
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    n_: Int64,
    k_: Int64,
):
    """tokens (1..GEMV_MAX_TOKENS) rows of x; chunks = 16-byte chunks per
    lane, ceil(K / 256)."""
    pdl_enter()
    var n = Int(n_)
    var k = Int(k_)
    var row = Int(block_idx.x) * GEMV_WARPS + Int(warp_id())
    if row >= n:
        return
    var lane = Int(lane_id())
    var nch = k // 8
    var wrow = w.unsafe_offset(row * k).unsafe_bitcast[UInt32]()
    # Every chunk of the row in flight at once (streamed once: kept out of
    # L1). Indices past the row are clamped, not branched around, so the
    # loads issue together; those chunks meet zero activations below.
    var wv = Array[SIMD[DType.uint32, 4], chunks](fill=0)
    comptime if staged:
        var sm = stack_allocation[GEMV_WARPS * chunks * 128, UInt32, alignment=16, address_space=AddressSpace.SHARED]()
        var mine = sm + (Int(warp_id()) * chunks * 32 + lane) * 4
        comptime for i in range(chunks):
            var c = min(lane + 32 * i, nch - 1)
            async_copy[16](
                (wrow + 4 * c).unsafe_address_space_cast[AddressSpace.GLOBAL](), mine + i * 128
            )
        async_copy_commit_group()
        async_copy_wait_group(0)  # a lane reads back only what it copied itself
        comptime for i in range(chunks):
            wv[i] = (mine + i * 128).unsafe_load[width=4, alignment=16](0)
    else:
        comptime for i in range(chunks):
            var c = min(lane + 32 * i, nch - 1)
            wv[i] = load[width=4, read_only=True, eviction_policy=CacheEviction.NO_ALLOCATE, alignment=16](
                wrow + 4 * c
            )
    var acc = SIMD[DType.float32, tokens](0)
    comptime for t in range(tokens):
        var xrow = x.unsafe_offset(t * k).unsafe_bitcast[UInt32]()
        var s = SIMD[DType.float32, 2](0)
        comptime for i in range(chunks):
            var c = lane + 32 * i
            var xv = xrow.unsafe_load[width=4, alignment=16](4 * min(c, nch - 1))
            if c >= nch:
                xv = SIMD[DType.uint32, 4](0)
            comptime for j in range(4):
                s = bf16_pair_f32(wv[i][j]).fma(bf16_pair_f32(xv[j]), s)
        acc[t] = s[0] + s[1]
    comptime for t in range(tokens):
        comptime for m in range(5):
            acc[t] += shuffle_xor(acc[t], UInt32(16 >> m))
    if lane == 0:
        var b = bias[unsafe_offset=row].cast[DType.float32]()
        comptime for t in range(tokens):
            y[unsafe_offset=t * n + row] = (acc[t] + b).cast[DType.bfloat16]()


# Tensor-core path (the op's `tc` parameter): y = x W^T + b for up to
# SKINNY_MAX_TOKENS tokens, the MoE decode kernel's mma layout without the
# decode. Why: in a 120b batch-8 step MAX runs qkv / o_proj / the router with
# its sm90 matmul at 30.7 / 21.8 / 13.4 us per layer, against ~10 / 8 / 0.3
# us of weight bytes at the copy bandwidth (bench/NOTES.md).
#   A block owns 16 weight rows (mma M) and its warps split K: warp w takes
#   32-element chunks w, w + WARPS, ...; lane (g = lane / 4, q = lane % 4)
#   loads 16 bytes of rows g and g + 8 at k = 32c + 8q (A) and 16 bytes of
#   token 8j + g at the same k (B, n tile j): both operands carry the same
#   permutation of k inside the chunk, so the dot products are exact sums
#   over k. Loads go in rounds of DEPTH chunks, the next round in flight
#   while this one's mma run.
#   The warps' f32 partials meet in shared memory; warp 0 sums them in warp
#   order (deterministic), adds the bias and stores bf16.
comptime SKINNY_MAX_TOKENS = 64


@always_inline
def skinny_depth(nt: Int) -> Int:
    """Chunks per round (two rounds in flight) for nt n tiles of 8 tokens."""
    return 2 if nt <= 2 else 1


@always_inline
def _skinny_round[
    NT: Int, DEPTH: Int, WARPS: Int
](
    wa: Pointer[BFloat16, ImmutAnyOrigin],
    wb: Pointer[BFloat16, ImmutAnyOrigin],
    xr: Array[Pointer[BFloat16, ImmutAnyOrigin], NT],
    c0: Int,
    nchunks: Int,
    mut av: SIMD[DType.uint32, 8 * DEPTH],
    mut bv: SIMD[DType.uint32, 4 * NT * DEPTH],
):
    """Loads of chunks c0 + d * WARPS (d < DEPTH): A (rows g, g + 8: words
    8d..8d+3, 8d+4..8d+7 of av) and B (n tile j: words 4(NT d + j).. of bv);
    chunks past the end repeat the last one (the caller skips their mma)."""
    comptime for d in range(DEPTH):
        var c = min(c0 + d * WARPS, nchunks - 1)
        av = av.insert[offset=8 * d](
            load[width=4, read_only=True, eviction_policy=CacheEviction.NO_ALLOCATE, alignment=16](
                wa.unsafe_offset(32 * c).unsafe_bitcast[UInt32]()
            )
        )
        av = av.insert[offset=8 * d + 4](
            load[width=4, read_only=True, eviction_policy=CacheEviction.NO_ALLOCATE, alignment=16](
                wb.unsafe_offset(32 * c).unsafe_bitcast[UInt32]()
            )
        )
        comptime for j in range(NT):
            bv = bv.insert[offset=4 * (NT * d + j)](
                xr[j].unsafe_offset(32 * c).unsafe_bitcast[UInt32]().unsafe_load[width=4, alignment=16](0)
            )


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(32 * WARPS)))
def skinny_kernel[
    NT: Int, WARPS: Int
](
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    t_: Int64,
    n_: Int64,
    k_: Int64,
):
    """NT n tiles (tokens <= 8 NT), WARPS warps per 16-row block; K % 32 == 0."""
    pdl_enter()
    comptime DEPTH = skinny_depth(NT)
    var tokens = Int(t_)
    var n = Int(n_)
    var k = Int(k_)
    var lane = Int(lane_id())
    var wid = Int(warp_id())
    var g = lane >> 2
    var q = lane & 3
    var r0 = Int(block_idx.x) * 16
    var nchunks = k // 32
    var wa = w.unsafe_offset(min(r0 + g, n - 1) * k + 8 * q)
    var wb = w.unsafe_offset(min(r0 + g + 8, n - 1) * k + 8 * q)
    var xr = Array[Pointer[BFloat16, ImmutAnyOrigin], NT](fill=x)
    comptime for j in range(NT):
        xr[j] = x.unsafe_offset(min(8 * j + g, tokens - 1) * k + 8 * q)
    var acc = Array[SIMD[DType.float32, 4], NT](fill=SIMD[DType.float32, 4](0))
    # two rounds of DEPTH chunks: the next round's loads are in flight while
    # this round's mma run
    comptime STEP = DEPTH * WARPS
    var cur_a = SIMD[DType.uint32, 8 * DEPTH](0)
    var cur_b = SIMD[DType.uint32, 4 * NT * DEPTH](0)
    _skinny_round[NT, DEPTH, WARPS](wa, wb, xr, wid, nchunks, cur_a, cur_b)
    var c0 = wid
    while c0 < nchunks:
        var nxt_a = cur_a
        var nxt_b = cur_b
        if c0 + STEP < nchunks:
            _skinny_round[NT, DEPTH, WARPS](wa, wb, xr, c0 + STEP, nchunks, nxt_a, nxt_b)
        comptime for d in range(DEPTH):
            if c0 + d * WARPS < nchunks:
                comptime for s in range(2):
                    comptime ra = 8 * d  # row g's 4 words, then row g + 8's
                    var a = bitcast[DType.bfloat16, 8](
                        SIMD[DType.uint32, 4](
                            cur_a[ra + 2 * s], cur_a[ra + 4 + 2 * s], cur_a[ra + 2 * s + 1], cur_a[ra + 4 + 2 * s + 1]
                        )
                    )
                    comptime for j in range(NT):
                        comptime rb = 4 * (NT * d + j)
                        var b = bitcast[DType.bfloat16, 4](SIMD[DType.uint32, 2](cur_b[rb + 2 * s], cur_b[rb + 2 * s + 1]))
                        mma(acc[j], a, b, acc[j])
        cur_a = nxt_a
        cur_b = nxt_b
        c0 += STEP
    # the warps' partials -> warp 0, summed in warp order
    comptime if WARPS > 1:
        var red = stack_allocation[WARPS * NT * 128, Float32, alignment=16, address_space=AddressSpace.SHARED]()
        if wid != 0:
            comptime for j in range(NT):
                red.unsafe_offset(((wid * NT + j) * 32 + lane) * 4).unsafe_store[width=4, alignment=16](0, acc[j])
        barrier()
        if wid != 0:
            return
        for v in range(1, WARPS):
            comptime for j in range(NT):
                acc[j] += red.unsafe_offset(((v * NT + j) * 32 + lane) * 4).unsafe_load[width=4, alignment=16](0)
    # lane (g, q): rows r0 + g (acc 0, 1) and r0 + g + 8 (acc 2, 3), tokens 8j + 2q, + 1
    comptime for h in range(2):
        var r = r0 + g + 8 * h
        if r < n:
            var b = bias[unsafe_offset=r].cast[DType.float32]()
            comptime for j in range(NT):
                comptime for z in range(2):
                    var t = 8 * j + 2 * q + z
                    if t < tokens:
                        y[unsafe_offset=t * n + r] = (acc[j][2 * h + z] + b).cast[DType.bfloat16]()


def launch_skinny[
    NT: Int
](
    ctx: DeviceContext,
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    tokens: Int,
    n: Int,
    k: Int,
) raises:
    """More warps over K when the row blocks are few: qkv's 320 blocks of
    8 warps, o_proj's 180 and the router's 8 of 16 (of 8 past one n tile)."""
    var blocks = (n + 15) // 16
    if blocks >= 264:
        ctx.enqueue_function[skinny_kernel[NT, 8]](
            y, x, w, bias, Int64(tokens), Int64(n), Int64(k), grid_dim=blocks, block_dim=256,
            attributes=pdl_attributes(tokens == 1),
        )
    else:
        # 16 warps only for one n tile: past it their 128-register cap spills
        comptime W = 16 if NT == 1 else 8
        ctx.enqueue_function[skinny_kernel[NT, W]](
            y, x, w, bias, Int64(tokens), Int64(n), Int64(k), grid_dim=blocks, block_dim=32 * W,
            attributes=pdl_attributes(tokens == 1),
        )


def launch_tc(
    ctx: DeviceContext,
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    tokens: Int,
    n: Int,
    k: Int,
) raises:
    """The tensor-core path for 1..SKINNY_MAX_TOKENS tokens (K % 32 == 0): n tiles by token count."""
    if tokens <= 8:
        launch_skinny[1](ctx, y, x, w, bias, tokens, n, k)
    elif tokens <= 16:
        launch_skinny[2](ctx, y, x, w, bias, tokens, n, k)
    elif tokens <= 32:
        launch_skinny[4](ctx, y, x, w, bias, tokens, n, k)
    else:
        launch_skinny[8](ctx, y, x, w, bias, tokens, n, k)


def _launch[
    tokens: Int, staged: Bool
](
    ctx: DeviceContext,
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    n: Int,
    k: Int,
) raises:
    var grid = (n + GEMV_WARPS - 1) // GEMV_WARPS
    # instantiations by row length: gpt-oss's K are 2880 (12 chunks per lane) and 4096 (16)
    if (k // 8 + 31) // 32 <= 12:
        ctx.enqueue_function[gemv_kernel[tokens, 12, staged]](
            y, x, w, bias, Int64(n), Int64(k), grid_dim=grid, block_dim=GEMV_WARPS * 32,
            attributes=pdl_attributes(tokens == 1),
        )
    else:
        ctx.enqueue_function[gemv_kernel[tokens, GEMV_MAX_CHUNKS, staged]](
            y, x, w, bias, Int64(n), Int64(k), grid_dim=grid, block_dim=GEMV_WARPS * 32,
            attributes=pdl_attributes(tokens == 1),
        )


@extensibility.register("gptoss_gemv")
struct Gemv:
    """y = x W^T + bias for a few tokens.

    Boundary (contiguous, row-major, all bf16):
      y     [T, N]   output
      x     [T, K]   activations
      w     [N, K]   weight (MAX Linear's layout)
      bias  [N]
    K % 8 == 0. GPU: T <= 2 and K <= 4096 (the caller dispatches larger
    steps to a matmul), or with `tc` (tensor cores) T <= 64 and K % 32 == 0;
    CPU: any T and K.
    """

    @staticmethod
    def execute[
        target: StaticString,
        staged: Bool,
        tc: Bool,
    ](
        y: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        x: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        w: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        bias: InputTensor[dtype=DType.bfloat16, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var tokens = x.dim_size[0]()
        var k = x.dim_size[1]()
        var n = w.dim_size[0]()
        if w.dim_size[1]() != k or bias.dim_size[0]() != n or y.dim_size[0]() != tokens or y.dim_size[1]() != n:
            raise Error("gptoss_gemv: shapes must be y [T, N], x [T, K], w [N, K], bias [N]")
        if k % 8 != 0:
            raise Error("gptoss_gemv: needs K % 8 == 0")
        if tokens == 0 or n == 0:
            return
        var yp = y.unsafe_ptr()
        var xp = x.unsafe_ptr()
        var wp = w.unsafe_ptr()
        var bp = bias.unsafe_ptr()
        poison[target](ctx, yp, tokens * n)

        comptime if target == "gpu" and tc:
            if tokens > SKINNY_MAX_TOKENS or k % 32 != 0:
                raise Error("gptoss_gemv GPU tensor-core path: needs T <= 64 and K % 32 == 0")
            launch_tc(ctx, yp, xp, wp, bp, tokens, n, k)
            return
        comptime if target == "gpu":
            if tokens > GEMV_MAX_TOKENS or k > GEMV_MAX_CHUNKS * 256:
                raise Error("gptoss_gemv GPU path: needs T <= 2 and K <= 4096")
            if tokens == 1:
                _launch[1, staged](ctx, yp, xp, wp, bp, n, k)
            else:
                _launch[2, staged](ctx, yp, xp, wp, bp, n, k)
            return

        def one_output[
            width: Int, alignment: Int = 1
        ](idx: Coord) {var yp, var xp, var wp, var bp, var n, var k}:
            var tr = coord_to_index_list(idx)
            var t = tr[0]
            var r = tr[1]
            var wrow = wp.unsafe_offset(r * k)
            var xrow = xp.unsafe_offset(t * k)
            var s: Float32 = 0
            for c in range(k):
                s += wrow[unsafe_offset=c].cast[DType.float32]() * xrow[unsafe_offset=c].cast[DType.float32]()
            yp[unsafe_offset=t * n + r] = (s + bp[unsafe_offset=r].cast[DType.float32]()).cast[DType.bfloat16]()

        elementwise[simd_width=1, target=target](one_output, Coord(tokens, n), ctx)
