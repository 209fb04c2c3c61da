import extensibility
from extensibility import InputTensor, OutputTensor
from layout import coord_to_index_list
from max.algorithm import elementwise
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, grid_dim, lane_id, thread_idx, warp_id
from max.gpu.host import DeviceAttribute, DeviceContext
from max.gpu.memory import AddressSpace, load
from max.gpu.primitives.warp import shuffle_xor
from std.collections import Array
from std.math import rsqrt
from std.memory import stack_allocation
from std.utils.coord import Coord
from std.utils.static_tuple import StaticTuple

from .gemv import bf16_pair_f32, launch_tc
from .pdl import pdl_attributes, pdl_enter
from .poison import poison

# The head of a decode step's MoE block in one launch: the residual add after
# attention, the post-attention RMS norm and the router's logits,
#   h      = bf16(residual + attn)               (the new residual stream)
#   xn     = bf16(h * rsqrt(mean(h^2) + eps) * gamma)   (f32 inside, MAX's
#            rms_norm with multiply_before_cast, HF's GptOssRMSNorm)
#   logits = bf16(xn W^T + b)                    (MAX's bf16 Linear)
# Why: a 120b batch-1 step runs these as MAX's fused-residual norm (~2.9 us)
# then its split-K GEMV (~2.8 us), two launches each bound by latency, not
# bytes (the router weight is 0.74 MB). Here the router rows' loads are issued
# first and the norm is computed while they are in flight.
#
# The same op serves any "residual add + RMS norm + bf16 Linear" head: the
# model also runs each layer's attention head through it (the previous layer's
# residual add, the input norm and the qkv projection, arch/attention.py).
#
# GPU, steps of <= RD_MAX_TOKENS tokens (one launch): a block of WARPS warps, a
# warp per weight row (4 warps for the router's 128 rows, 8 for qkv's 5,120).
# Every block computes the norm of the step's tokens itself into shared memory
# (a few KB read from L2) and writes its own slice of h and xn. All of a
# thread's loads (its weight row's chunks, its attn / residual / gamma vectors)
# are issued before any of them is used: one memory round trip, then two block
# barriers.
# GPU, one token and many rows (the qkv head, N >= RD_WIDE_ROWS): router_decode_stream_kernel, a
# grid of one 8-warp block per SM; each block computes the norm once, then each warp streams rows
# with the next row's chunks in flight while it multiplies this one (13.7 -> 12.9 us for qkv on an
# H100, bench/NOTES.md).
# GPU, steps of RD_MAX_TOKENS + 1 .. RD_MAX_STEP tokens, and many-row weights
# at 2..4 tokens (two launches): the add and the norm by a block per token
# (add_norm_kernel), then the projection by gemv.mojo's tensor-core kernel.
# CPU: a task per token, the same arithmetic.

comptime RD_MAX_TOKENS = 4
comptime RD_MAX_STEP = 64  # gemv.mojo's SKINNY_MAX_TOKENS
comptime RD_MAX_CHUNKS = 16  # 16-byte chunks per lane: hidden <= 16 * 32 * 8 = 4096
comptime RD_WIDE_ROWS = 1024  # weights of at least this many rows take 8 warps per block
# ... and at least this many blocks per SM (nvvm.minctasm): ptxas gives the one-token kernel 119
# registers by itself; forcing 3 or 4 blocks spills (qkv head 13.6 -> 17.3 / 26.7 us on an H100)
comptime RD_WIDE_MINB = 2
# One token and many rows (the qkv head): blocks per SM of the streaming kernel, which loops each
# warp over rows with the next row's loads in flight (0: router_decode_kernel, a warp per row)
comptime RD_STREAM_MINB = 1


comptime SharedBF16 = Pointer[BFloat16, MutUntrackedOrigin, address_space=AddressSpace.SHARED]
comptime SharedU32 = Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def _row_loads[
    chunks: Int
](w: Pointer[BFloat16, ImmutAnyOrigin], row: Int, n: Int, k: Int, lane: Int) -> Array[SIMD[DType.uint32, 4], chunks]:
    """Every 16-byte chunk of weight row `row` that lane `lane` multiplies (chunk lane + 32 i),
    all issued before any is used. A row past the last reads row n - 1 (its result is never
    stored); chunks past the row are clamped so the loads issue together (they meet zero
    activations in _dot)."""
    var nch = k // 8
    var wrow = w.unsafe_offset(min(row, n - 1) * k).unsafe_bitcast[UInt32]()
    var wv = Array[SIMD[DType.uint32, 4], chunks](fill=0)
    comptime for i in range(chunks):
        wv[i] = load[width=4, read_only=True, alignment=16](wrow + 4 * min(lane + 32 * i, nch - 1))
    return wv^


@always_inline
def _dot[
    chunks: Int
](wv: Array[SIMD[DType.uint32, 4], chunks], xrow: SharedU32, lane: Int, nch: Int) -> Float32:
    """This lane's f32 part of a row's dot with the token's xn in shared memory."""
    var s = SIMD[DType.float32, 2](0)
    comptime for i in range(chunks):
        var c = lane + 32 * i
        var xv = xrow.unsafe_load[width=4, alignment=16](4 * min(c, nch - 1))
        if c >= nch:
            xv = SIMD[DType.uint32, 4](0)
        comptime for j in range(4):
            s = bf16_pair_f32(wv[i][j]).fma(bf16_pair_f32(xv[j]), s)
    return s[0] + s[1]


@always_inline
def _add_norm_shared[
    tokens: Int, chunks: Int, WARPS: Int
](
    h_out: Pointer[BFloat16, MutAnyOrigin],
    xn_out: Pointer[BFloat16, MutAnyOrigin],
    attn: Pointer[BFloat16, ImmutAnyOrigin],
    residual: Pointer[BFloat16, ImmutAnyOrigin],
    gamma: Pointer[BFloat16, ImmutAnyOrigin],
    k: Int,
    eps: Float32,
    blocks: Int,
) -> SharedBF16:
    """Steps 2-4 of a block (see router_decode_kernel): the add and the norm of the step's
    tokens into shared memory (token t at t * chunks * 256), and this block's slice (one of
    `blocks`) of h and xn to global memory. Ends behind a block barrier."""
    var lane = Int(lane_id())
    var warp = Int(warp_id())
    var tid = Int(thread_idx.x)
    var nch = k // 8

    # 2. This thread's vectors of attn, residual and gamma, also all in flight
    # at once (vector v = tid + 128 j of each token row; indices past the row
    # are clamped and their values left out of every sum and store).
    comptime VPT = (chunks + WARPS - 1) // WARPS  # 16-byte vectors per thread and token
    comptime THREADS = WARPS * 32
    var gv = Array[SIMD[DType.bfloat16, 8], VPT](fill=0)
    var hv = Array[SIMD[DType.bfloat16, 8], tokens * VPT](fill=0)  # attn, then h
    var rv = Array[SIMD[DType.bfloat16, 8], tokens * VPT](fill=0)
    comptime for j in range(VPT):
        var v = min(tid + THREADS * j, nch - 1)
        gv[j] = gamma.unsafe_offset(8 * v).unsafe_load[width=8, alignment=16]()
        comptime for t in range(tokens):
            hv[t * VPT + j] = attn.unsafe_offset(t * k + 8 * v).unsafe_load[width=8, alignment=16]()
            rv[t * VPT + j] = residual.unsafe_offset(t * k + 8 * v).unsafe_load[width=8, alignment=16]()

    # 3. h = bf16(attn + residual), each token's sum of squares over the block.
    var red = stack_allocation[tokens * WARPS, Float32, address_space=AddressSpace.SHARED]()
    var ss = Array[Float32, tokens](fill=0)  # an Array: SIMD widths must be powers of two
    comptime for t in range(tokens):
        comptime for j in range(VPT):
            var h = (hv[t * VPT + j].cast[DType.float32]() + rv[t * VPT + j].cast[DType.float32]()).cast[
                DType.bfloat16
            ]()
            hv[t * VPT + j] = h
            if tid + THREADS * j < nch:
                var hf = h.cast[DType.float32]()
                ss[t] += (hf * hf).reduce_add()
    comptime for t in range(tokens):
        comptime for m in range(5):
            ss[t] += shuffle_xor(ss[t], UInt32(16 >> m))
        if lane == 0:
            red[unsafe_offset=t * WARPS + warp] = ss[t]
    barrier()
    var inv = Array[Float32, tokens](fill=0)
    comptime for t in range(tokens):
        var total = Float32(0)
        comptime for ww in range(WARPS):
            total += red[unsafe_offset=t * WARPS + ww]
        inv[t] = rsqrt(total / Float32(k) + eps)

    # 4. xn to shared memory for every warp's dot, and this block's slice of
    # h and xn to global memory.
    comptime STRIDE = chunks * 256  # bf16 per token row in shared memory
    var xs = stack_allocation[tokens * STRIDE, BFloat16, alignment=16, address_space=AddressSpace.SHARED]()
    var per_block = (nch + blocks - 1) // blocks
    var lo = Int(block_idx.x) * per_block
    var hi = min(lo + per_block, nch)
    comptime for t in range(tokens):
        comptime for j in range(VPT):
            var v = tid + THREADS * j
            if v < nch:
                var h = hv[t * VPT + j]
                var xv = (h.cast[DType.float32]() * inv[t] * gv[j].cast[DType.float32]()).cast[DType.bfloat16]()
                xs.unsafe_offset(t * STRIDE + 8 * v).unsafe_store[alignment=16](xv)
                if v >= lo and v < hi:
                    h_out.unsafe_offset(t * k + 8 * v).unsafe_store[alignment=16](h)
                    xn_out.unsafe_offset(t * k + 8 * v).unsafe_store[alignment=16](xv)
    barrier()
    return xs


@always_inline
def _store_logit(
    acc: Float32, logits: Pointer[BFloat16, MutAnyOrigin], bias: Pointer[BFloat16, ImmutAnyOrigin], row: Int, lane: Int
):
    """Lane 0 stores row's logit: the warp's sum of acc, plus the bias, rounded to bf16."""
    var a = acc
    comptime for m in range(5):
        a += shuffle_xor(a, UInt32(16 >> m))
    if lane == 0:
        logits[unsafe_offset=row] = (a + bias[unsafe_offset=row].cast[DType.float32]()).cast[DType.bfloat16]()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WARPS * 32)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(MINB))
def router_decode_kernel[
    tokens: Int, chunks: Int, WARPS: Int, MINB: Int = 1
](
    h_out: Pointer[BFloat16, MutAnyOrigin],
    xn_out: Pointer[BFloat16, MutAnyOrigin],
    logits: Pointer[BFloat16, MutAnyOrigin],
    attn: Pointer[BFloat16, ImmutAnyOrigin],
    residual: Pointer[BFloat16, ImmutAnyOrigin],
    gamma: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    n_: Int64,
    k_: Int64,
    eps: Float32,
):
    """tokens: the step's token count (1..RD_MAX_TOKENS); chunks: 16-byte
    chunks per lane, ceil(K / 256). Grid: ceil(N / WARPS) blocks."""
    pdl_enter()
    var n = Int(n_)
    var k = Int(k_)
    var lane = Int(lane_id())
    var row = Int(block_idx.x) * WARPS + Int(warp_id())

    # 1. This warp's row, every chunk in flight before the norm starts.
    var wv = _row_loads[chunks](w, row, n, k, lane)
    # 2-4. The add and the norm.
    var blocks = (n + WARPS - 1) // WARPS
    var xs = _add_norm_shared[tokens, chunks, WARPS](h_out, xn_out, attn, residual, gamma, k, eps, blocks)

    # 5. The warp's logits: the f32 dot of its row with each token's xn, then
    # bias, rounded to bf16 as MAX's Linear returns them.
    var acc = Array[Float32, tokens](fill=0)
    comptime for t in range(tokens):
        acc[t] = _dot[chunks](wv, xs.unsafe_offset(t * chunks * 256).unsafe_bitcast[UInt32](), lane, k // 8)
    if row < n:  # warp-uniform
        comptime for t in range(tokens):
            _store_logit(acc[t], logits.unsafe_offset(t * n), bias, row, lane)


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WARPS * 32)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(MINB))
def router_decode_stream_kernel[
    chunks: Int, WARPS: Int, MINB: Int
](
    h_out: Pointer[BFloat16, MutAnyOrigin],
    xn_out: Pointer[BFloat16, MutAnyOrigin],
    logits: Pointer[BFloat16, MutAnyOrigin],
    attn: Pointer[BFloat16, ImmutAnyOrigin],
    residual: Pointer[BFloat16, ImmutAnyOrigin],
    gamma: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    bias: Pointer[BFloat16, ImmutAnyOrigin],
    n_: Int64,
    k_: Int64,
    eps: Float32,
):
    """One token, many rows (the qkv head): a grid of at most the blocks that fit at once,
    each computing the norm once, then every warp streams rows warp, warp + NW, ... (NW: the
    grid's warps) with the next row's chunks in flight while it multiplies this one. Grid: at
    most ceil(N / WARPS) blocks."""
    pdl_enter()
    var n = Int(n_)
    var k = Int(k_)
    var lane = Int(lane_id())
    var nw = Int(grid_dim.x) * WARPS
    var row = Int(block_idx.x) * WARPS + Int(warp_id())

    var wa = _row_loads[chunks](w, row, n, k, lane)
    var xs = _add_norm_shared[1, chunks, WARPS](h_out, xn_out, attn, residual, gamma, k, eps, Int(grid_dim.x))
    var xrow = xs.unsafe_bitcast[UInt32]()
    var wb = Array[SIMD[DType.uint32, 4], chunks](fill=0)
    # Two rows per turn, so that the two register sets alternate without copies.
    while row < n:
        if row + nw < n:
            wb = _row_loads[chunks](w, row + nw, n, k, lane)
        _store_logit(_dot[chunks](wa, xrow, lane, k // 8), logits, bias, row, lane)
        row += nw
        if row >= n:
            break
        if row + nw < n:
            wa = _row_loads[chunks](w, row + nw, n, k, lane)
        _store_logit(_dot[chunks](wb, xrow, lane, k // 8), logits, bias, row, lane)
        row += nw


def _launch_warps[
    tokens: Int, WARPS: Int, MINB: Int = 1
](
    ctx: DeviceContext,
    h: Pointer[BFloat16, MutAnyOrigin],
    xn: Pointer[BFloat16, MutAnyOrigin],
    lg: Pointer[BFloat16, MutAnyOrigin],
    a: Pointer[BFloat16, ImmutAnyOrigin],
    r: Pointer[BFloat16, ImmutAnyOrigin],
    g: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    b: Pointer[BFloat16, ImmutAnyOrigin],
    n: Int,
    k: Int,
    eps: Float32,
) raises:
    var grid = (n + WARPS - 1) // WARPS
    # gpt-oss's hidden is 2880: 12 chunks per lane
    if (k // 8 + 31) // 32 <= 12:
        ctx.enqueue_function[router_decode_kernel[tokens, 12, WARPS, MINB]](
            h, xn, lg, a, r, g, w, b, Int64(n), Int64(k), eps, grid_dim=grid, block_dim=WARPS * 32,
            attributes=pdl_attributes(tokens == 1),
        )
    else:
        ctx.enqueue_function[router_decode_kernel[tokens, RD_MAX_CHUNKS, WARPS, MINB]](
            h, xn, lg, a, r, g, w, b, Int64(n), Int64(k), eps, grid_dim=grid, block_dim=WARPS * 32,
            attributes=pdl_attributes(tokens == 1),
        )


def _launch[
    tokens: Int
](
    ctx: DeviceContext,
    h: Pointer[BFloat16, MutAnyOrigin],
    xn: Pointer[BFloat16, MutAnyOrigin],
    lg: Pointer[BFloat16, MutAnyOrigin],
    a: Pointer[BFloat16, ImmutAnyOrigin],
    r: Pointer[BFloat16, ImmutAnyOrigin],
    g: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    b: Pointer[BFloat16, ImmutAnyOrigin],
    n: Int,
    k: Int,
    eps: Float32,
) raises:
    """4 warps per block for few rows (the router: 32 blocks), 8 for many (qkv: 640 blocks, so
    each block's norm is shared by 8 rows)."""
    comptime if tokens == 1 and RD_STREAM_MINB > 0:
        if n >= RD_WIDE_ROWS and (k // 8 + 31) // 32 <= 12:
            # at most the blocks that fit at once: the grid streams the rows (qkv: 132 blocks on an H100)
            comptime W = 8
            var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
            var grid = min((n + W - 1) // W, sms * RD_STREAM_MINB)
            ctx.enqueue_function[router_decode_stream_kernel[12, W, RD_STREAM_MINB]](
                h, xn, lg, a, r, g, w, b, Int64(n), Int64(k), eps, grid_dim=grid, block_dim=W * 32,
                attributes=pdl_attributes(True),
            )
            return
    if n >= RD_WIDE_ROWS:
        _launch_warps[tokens, 8, RD_WIDE_MINB](ctx, h, xn, lg, a, r, g, w, b, n, k, eps)
    else:
        _launch_warps[tokens, 4](ctx, h, xn, lg, a, r, g, w, b, n, k, eps)


comptime AN_THREADS = 128
comptime AN_VPT = RD_MAX_CHUNKS * 32 // AN_THREADS  # 16-byte vectors per thread: hidden <= 4096


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(AN_THREADS)))
def add_norm_kernel(
    h_out: Pointer[BFloat16, MutAnyOrigin],
    xn_out: Pointer[BFloat16, MutAnyOrigin],
    attn: Pointer[BFloat16, ImmutAnyOrigin],
    residual: Pointer[BFloat16, ImmutAnyOrigin],
    gamma: Pointer[BFloat16, ImmutAnyOrigin],
    k_: Int64,
    eps: Float32,
):
    """h = bf16(attn + residual) and xn = bf16(rms_norm(h) * gamma) of one token per block
    (block_idx.x), the same arithmetic as router_decode_kernel's. K % 8 == 0, K <= 4096."""
    pdl_enter()
    var k = Int(k_)
    var t = Int(block_idx.x)
    var tid = Int(thread_idx.x)
    var lane = Int(lane_id())
    var warp = Int(warp_id())
    var nch = k // 8
    var hv = Array[SIMD[DType.bfloat16, 8], AN_VPT](fill=0)
    var gv = Array[SIMD[DType.bfloat16, 8], AN_VPT](fill=0)
    var rv = Array[SIMD[DType.bfloat16, 8], AN_VPT](fill=0)
    comptime for j in range(AN_VPT):  # every load in flight before the first use
        var v = min(tid + AN_THREADS * j, nch - 1)
        hv[j] = attn.unsafe_offset(t * k + 8 * v).unsafe_load[width=8, alignment=16]()
        rv[j] = residual.unsafe_offset(t * k + 8 * v).unsafe_load[width=8, alignment=16]()
        gv[j] = gamma.unsafe_offset(8 * v).unsafe_load[width=8, alignment=16]()
    var ss = Float32(0)
    comptime for j in range(AN_VPT):
        var h = (hv[j].cast[DType.float32]() + rv[j].cast[DType.float32]()).cast[DType.bfloat16]()
        hv[j] = h
        if tid + AN_THREADS * j < nch:
            var hf = h.cast[DType.float32]()
            ss += (hf * hf).reduce_add()
    comptime for m in range(5):
        ss += shuffle_xor(ss, UInt32(16 >> m))
    var red = stack_allocation[AN_THREADS // 32, Float32, address_space=AddressSpace.SHARED]()
    if lane == 0:
        red[unsafe_offset=warp] = ss
    barrier()
    var total = Float32(0)
    comptime for ww in range(AN_THREADS // 32):
        total += red[unsafe_offset=ww]
    var inv = rsqrt(total / Float32(k) + eps)
    comptime for j in range(AN_VPT):
        var v = tid + AN_THREADS * j
        if v < nch:
            var xv = (hv[j].cast[DType.float32]() * inv * gv[j].cast[DType.float32]()).cast[DType.bfloat16]()
            h_out.unsafe_offset(t * k + 8 * v).unsafe_store[alignment=16](hv[j])
            xn_out.unsafe_offset(t * k + 8 * v).unsafe_store[alignment=16](xv)


def _launch_norm_then_tc(
    ctx: DeviceContext,
    h: Pointer[BFloat16, MutAnyOrigin],
    xn: Pointer[BFloat16, MutAnyOrigin],
    lg: Pointer[BFloat16, MutAnyOrigin],
    a: Pointer[BFloat16, ImmutAnyOrigin],
    r: Pointer[BFloat16, ImmutAnyOrigin],
    g: Pointer[BFloat16, ImmutAnyOrigin],
    w: Pointer[BFloat16, ImmutAnyOrigin],
    b: Pointer[BFloat16, ImmutAnyOrigin],
    tokens: Int,
    n: Int,
    k: Int,
    eps: Float32,
) raises:
    """Steps past RD_MAX_TOKENS: the add and the norm (a block per token), then the projection of
    xn on tensor cores (gemv.mojo). Not parametric, so the package build checks it on any host."""
    ctx.enqueue_function[add_norm_kernel](
        h, xn, a, r, g, Int64(k), eps, grid_dim=tokens, block_dim=AN_THREADS,
        attributes=pdl_attributes(tokens == 1),
    )
    launch_tc(ctx, lg, xn.unsafe_mut_cast[False]().unsafe_origin_cast[ImmutAnyOrigin](), w, b, tokens, n, k)


@extensibility.register("gptoss_router_decode")
struct RouterDecode:
    """Residual add + RMS norm + router logits of a decode step.

    Boundary (contiguous, row-major, all bf16):
      h        [T, H]  out: residual + attn
      xn       [T, H]  out: rms_norm(h) * gamma
      logits   [T, E]  out: xn W^T + bias
      attn     [T, H]  the attention block's output (after o_proj)
      residual [T, H]  the residual stream before it
      gamma    [H]     the post-attention norm's weight
      w        [E, H]  the router weight (MAX Linear's layout)
      bias     [E]
    eps: the norm's epsilon (op parameter). H % 8 == 0. GPU: H <= 4096 and
    T <= 4 (one launch) or T <= 64 with H % 32 == 0 (two: the norm, then
    gemv.mojo's tensor-core projection); the caller dispatches larger steps to
    the unfused ops. CPU: any T and H.
    """

    @staticmethod
    def execute[
        target: StaticString,
        eps: Float32,
    ](
        h: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        xn: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        logits: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        attn: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        residual: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        gamma: InputTensor[dtype=DType.bfloat16, rank=1, ...],
        w: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        bias: InputTensor[dtype=DType.bfloat16, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var tokens = attn.dim_size[0]()
        var k = attn.dim_size[1]()
        var n = w.dim_size[0]()
        if (
            residual.dim_size[0]() != tokens
            or residual.dim_size[1]() != k
            or gamma.dim_size[0]() != k
            or w.dim_size[1]() != k
            or bias.dim_size[0]() != n
            or h.dim_size[0]() != tokens
            or h.dim_size[1]() != k
            or xn.dim_size[0]() != tokens
            or xn.dim_size[1]() != k
            or logits.dim_size[0]() != tokens
            or logits.dim_size[1]() != n
        ):
            raise Error(
                "gptoss_router_decode: shapes must be attn, residual, h, xn [T, H], gamma [H], w [E, H], bias [E],"
                " logits [T, E]"
            )
        if k % 8 != 0:
            raise Error("gptoss_router_decode: needs H % 8 == 0")
        if tokens == 0 or n == 0:
            return
        var hp = h.unsafe_ptr()
        var xp = xn.unsafe_ptr()
        var lp = logits.unsafe_ptr()
        var ap = attn.unsafe_ptr()
        var rp = residual.unsafe_ptr()
        var gp = gamma.unsafe_ptr()
        var wp = w.unsafe_ptr()
        var bp = bias.unsafe_ptr()
        poison[target](ctx, hp, tokens * k)
        poison[target](ctx, xp, tokens * k)
        poison[target](ctx, lp, tokens * n)

        comptime if target == "gpu":
            if k > RD_MAX_CHUNKS * 256:
                raise Error("gptoss_router_decode GPU path: needs H <= 4096")
            # Many rows and more than one token: the one-launch kernel's registers grow with the
            # tokens (160 at 2, 8 warps: one block per SM), so the norm and tensor cores instead.
            if tokens > RD_MAX_TOKENS or (tokens > 1 and n >= RD_WIDE_ROWS and k % 32 == 0):
                if tokens > RD_MAX_STEP or k % 32 != 0:
                    raise Error("gptoss_router_decode GPU path: past 4 tokens needs T <= 64 and H % 32 == 0")
                _launch_norm_then_tc(ctx, hp, xp, lp, ap, rp, gp, wp, bp, tokens, n, k, eps)
                return
            if tokens == 1:
                _launch[1](ctx, hp, xp, lp, ap, rp, gp, wp, bp, n, k, eps)
            elif tokens == 2:
                _launch[2](ctx, hp, xp, lp, ap, rp, gp, wp, bp, n, k, eps)
            elif tokens == 3:
                _launch[3](ctx, hp, xp, lp, ap, rp, gp, wp, bp, n, k, eps)
            else:
                _launch[4](ctx, hp, xp, lp, ap, rp, gp, wp, bp, n, k, eps)
            return

        def one_token[
            width: Int, alignment: Int = 1
        ](idx: Coord) {var hp, var xp, var lp, var ap, var rp, var gp, var wp, var bp, var n, var k}:
            var t = coord_to_index_list(idx)[0]
            var ss: Float32 = 0
            for c in range(k):
                var hv = (
                    ap[unsafe_offset=t * k + c].cast[DType.float32]() + rp[unsafe_offset=t * k + c].cast[DType.float32]()
                ).cast[DType.bfloat16]()
                hp[unsafe_offset=t * k + c] = hv
                var hf = hv.cast[DType.float32]()
                ss += hf * hf
            var inv = rsqrt(ss / Float32(k) + eps)
            for c in range(k):
                var hf = hp[unsafe_offset=t * k + c].cast[DType.float32]()
                xp[unsafe_offset=t * k + c] = (hf * inv * gp[unsafe_offset=c].cast[DType.float32]()).cast[
                    DType.bfloat16
                ]()
            for e in range(n):
                var s: Float32 = 0
                for c in range(k):
                    s += wp[unsafe_offset=e * k + c].cast[DType.float32]() * xp[unsafe_offset=t * k + c].cast[
                        DType.float32
                    ]()
                lp[unsafe_offset=t * n + e] = (s + bp[unsafe_offset=e].cast[DType.float32]()).cast[DType.bfloat16]()

        elementwise[simd_width=1, target=target](one_token, Coord(tokens), ctx)
