import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from layout import coord_to_index_list
from max.gpu.host import DeviceContext
from max.algorithm import elementwise
from std.collections import Array
from std.math import exp
from std.utils.coord import Coord

from .attention_gpu import _row_pos, _slot, launch_attention, launch_attention_rope, tc_eligible
from .poison import poison


@fieldwise_init
struct PagedGeometry(Copyable):
    """Where layer `layer_idx`'s K and V rows sit in MAX's paged KV buffer
    (layout in AttentionWithSinks's docstring), in elements."""

    var page_size: Int
    var n_kv_heads: Int
    var slot_elems: Int  # one position: all KV heads
    var page_elems: Int  # one page to the next
    var k_base: Int  # layer's K of slot 0 within a page
    var v_base: Int  # layer's V of slot 0 within a page

    @staticmethod
    def of(kv_blocks: MutableInputTensor[rank=6, ...], page_stride: InputTensor[dtype=DType.int64, rank=1, ...], layer_idx: UInt32) -> Self:
        var n_layers = kv_blocks.dim_size[2]()
        var page_size = kv_blocks.dim_size[3]()
        var n_kv_heads = kv_blocks.dim_size[4]()
        var slot_elems = n_kv_heads * kv_blocks.dim_size[5]()
        var layer_elems = page_size * slot_elems
        var page_elems = Int(page_stride[0])
        if page_elems < 0:
            page_elems = 2 * n_layers * layer_elems
        return Self(
            page_size,
            n_kv_heads,
            slot_elems,
            page_elems,
            Int(layer_idx) * layer_elems,
            (n_layers + Int(layer_idx)) * layer_elems,
        )


def attend[
    target: StaticString, dtype: DType, sink_dtype: DType, head_dim: Int
](
    ctx: DeviceContext,
    outp: Pointer[Scalar[dtype], MutAnyOrigin],
    scratch: Pointer[Float32, MutAnyOrigin],
    scratch_rows: Int,
    qp: Pointer[Scalar[dtype], ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    kvp: Pointer[Scalar[dtype], MutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    sinkp: Pointer[Scalar[sink_dtype], ImmutAnyOrigin],
    tokens: Int,
    batch: Int,
    max_pages: Int,
    n_heads: Int,
    geo: PagedGeometry,
    win: Int,
    scale: Float32,
) raises:
    """Sink attention of q [T, n_heads, head_dim] over the cache, which holds
    this step's K/V: attention_gpu.mojo on the GPU, one task per (row, head)
    on the CPU."""
    var page_size = geo.page_size
    var group = n_heads // geo.n_kv_heads
    var slot_elems = geo.slot_elems
    var page_elems = geo.page_elems
    var k_base = geo.k_base
    var v_base = geo.v_base
    comptime if target == "gpu":
        launch_attention[dtype, sink_dtype, head_dim](
            ctx, outp, scratch, scratch_rows, qp, offs, kvp, lens, table, sinkp, tokens, batch, max_pages,
            n_heads, page_size, group, slot_elems, page_elems, k_base, v_base, win, scale,
        )
        return

    def attend_row[
        width: Int, alignment: Int = 1
    ](idx: Coord) {
        var outp,
        var qp,
        var offs,
        var kvp,
        var lens,
        var table,
        var sinkp,
        var batch,
        var max_pages,
        var n_heads,
        var page_size,
        var group,
        var slot_elems,
        var page_elems,
        var k_base,
        var v_base,
        var win,
        var scale,
    }:
        var th = coord_to_index_list(idx)
        var t = th[0]
        var h = th[1]
        var bp = _row_pos(offs, lens, batch, t)
        var b = bp[0]
        var pos = bp[1]
        var first = max(pos - win + 1, 0) if win > 0 else 0
        var head_off = (h // group) * head_dim
        var qrow = qp.unsafe_offset((t * n_heads + h) * head_dim)

        # Online softmax, seeded with the sink: it is in the normaliser
        # from the start and never contributes to the value sum.
        var m = sinkp[unsafe_offset=h].cast[DType.float32]()
        var denom: Float32 = 1
        var acc = Array[Float32, head_dim](fill=0)
        var trow = table.unsafe_offset(b * max_pages)
        for j in range(first, pos + 1):
            var slot = _slot(trow, j, page_size, page_elems, slot_elems) + head_off
            var kp = kvp.unsafe_offset(slot + k_base)
            var vp = kvp.unsafe_offset(slot + v_base)
            var s: Float32 = 0
            for d in range(head_dim):
                s += (
                    qrow[unsafe_offset=d].cast[DType.float32]()
                    * kp[unsafe_offset=d].cast[DType.float32]()
                )
            s *= scale
            if s > m:
                var c = exp(m - s)
                denom *= c
                for d in range(head_dim):
                    acc[d] *= c
                m = s
            var w = exp(s - m)
            denom += w
            for d in range(head_dim):
                acc[d] += w * vp[unsafe_offset=d].cast[DType.float32]()
        var orow = outp.unsafe_offset((t * n_heads + h) * head_dim)
        for d in range(head_dim):
            orow[unsafe_offset=d] = (acc[d] / denom).cast[dtype]()

    elementwise[simd_width=1, target=target](
        attend_row, Coord(tokens, n_heads), ctx
    )


def rope_store[
    target: StaticString, dtype: DType, fdtype: DType, head_dim: Int
](
    ctx: DeviceContext,
    xq: Pointer[Scalar[dtype], MutAnyOrigin],
    qkv: Pointer[Scalar[dtype], ImmutAnyOrigin],
    freqs: Pointer[Scalar[fdtype], ImmutAnyOrigin],
    offs: Pointer[UInt32, ImmutAnyOrigin],
    lens: Pointer[UInt32, ImmutAnyOrigin],
    table: Pointer[UInt32, ImmutAnyOrigin],
    kvp: Pointer[Scalar[dtype], MutAnyOrigin],
    tokens: Int,
    batch: Int,
    max_pages: Int,
    n_heads: Int,
    geo: PagedGeometry,
) raises:
    """RoPE (rotate-half pairing: dims i and i + head_dim / 2 turn by the
    angle of frequency i, whose (cos, sin) are freqs[p, 2 i], freqs[p, 2 i + 1]
    at the row's position p) of qkv's q heads into xq [T, n_heads, head_dim]
    and of its K heads into the cache, and V copied into the cache, as MAX's
    rope_split_store_ragged does. f32 arithmetic, one rounding to dtype. One
    task per (row, head, pair)."""
    comptime HALF = head_dim // 2
    var n_kv = geo.n_kv_heads
    var page_size = geo.page_size
    var slot_elems = geo.slot_elems
    var page_elems = geo.page_elems
    var k_base = geo.k_base
    var v_base = geo.v_base

    def pair[
        width: Int, alignment: Int = 1
    ](idx: Coord) {
        var xq,
        var qkv,
        var freqs,
        var offs,
        var lens,
        var table,
        var kvp,
        var batch,
        var max_pages,
        var n_heads,
        var n_kv,
        var page_size,
        var slot_elems,
        var page_elems,
        var k_base,
        var v_base,
    }:
        var c = coord_to_index_list(idx)
        var t = c[0]
        var hh = c[1]
        var i = c[2]
        var bp = _row_pos(offs, lens, batch, t)
        var pos = bp[1]
        var row = qkv.unsafe_offset((t * (n_heads + 2 * n_kv) + hh) * head_dim)
        var x = row[unsafe_offset=i].cast[DType.float32]()
        var y = row[unsafe_offset=i + HALF].cast[DType.float32]()
        var cs = freqs.unsafe_offset(pos * head_dim + 2 * i)
        var co = cs[unsafe_offset=0].cast[DType.float32]()
        var si = cs[unsafe_offset=1].cast[DType.float32]()
        var lo = (x * co - y * si).cast[dtype]()
        var hi = (y * co + x * si).cast[dtype]()
        if hh < n_heads:
            var o = xq.unsafe_offset((t * n_heads + hh) * head_dim)
            o[unsafe_offset=i] = lo
            o[unsafe_offset=i + HALF] = hi
            return
        var kvh = hh - n_heads
        var trow = table.unsafe_offset(bp[0] * max_pages)
        var slot = kvp.unsafe_offset(_slot(trow, pos, page_size, page_elems, slot_elems) + kvh * head_dim)
        slot[unsafe_offset=k_base + i] = lo
        slot[unsafe_offset=k_base + i + HALF] = hi
        var vrow = row.unsafe_offset(n_kv * head_dim)
        slot[unsafe_offset=v_base + i] = vrow[unsafe_offset=i]
        slot[unsafe_offset=v_base + i + HALF] = vrow[unsafe_offset=i + HALF]

    elementwise[simd_width=1, target=target](pair, Coord(tokens, n_heads + n_kv, HALF), ctx)


@extensibility.register("gptoss_attention_with_sinks")
struct AttentionWithSinks:
    """Causal (optionally sliding-window) attention over MAX's paged KV cache,
    with one sink logit per head that takes probability mass but adds no value.

    Runs after MAX's `rope_split_store_ragged` has stored this step's K/V.

    Paged KV layout (MAX 26.7, `KVCacheParams.shape_per_block` and
    `mo.kv_cache.store.paged.ragged`):
      kv_blocks    [pages, 2, layers, page_size, n_kv_heads, head_dim]
                   dim 1: 0 = key, 1 = value
      page_stride  [1] int64 (CPU): elements from one page to the next, or
                   -1 when the pages are packed (stride = prod(dims 1..5))
      cache_lengths [B] uint32: tokens already cached BEFORE this step, so
                   new token i of sequence b sits at position
                   p = cache_lengths[b] + i (the store op writes it there)
      lookup_table [B, max_pages] uint32: page ids of each sequence; position
                   p lives in page lookup_table[b, p // page_size], slot
                   p % page_size
    Other tensors:
      output / q   [T, n_heads, head_dim]   (ragged rows, T = row_offsets[B])
      row_offsets  [B + 1] uint32
      sinks        [n_heads]  logits of the sink, any float dtype
      layer_idx, scale, window: CPU scalars; window <= 0 means no window,
                   else token p attends to positions [p - window + 1, p].
      scratch      [16, n_heads, head_dim + 2] f32: the GPU path's per-split
                   partials (attention_gpu.mojo); unused on the CPU.
    Head h reads KV head h // (n_heads / n_kv_heads).

    GPU: attention_gpu.mojo (split keys, one warp per head). CPU: one task
    per (row, head), below.
    """

    @staticmethod
    def execute[
        target: StaticString,
        head_dim: Int,
    ](
        output: OutputTensor[rank=3, ...],
        scratch: OutputTensor[dtype=DType.float32, rank=3, ...],
        q: InputTensor[dtype=output.dtype, rank=3, ...],
        row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv_blocks: MutableInputTensor[dtype=output.dtype, rank=6, ...],
        page_stride: InputTensor[dtype=DType.int64, rank=1, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],
        sinks: InputTensor[rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        window: Int32,
        ctx: DeviceContext,
    ) raises:
        if kv_blocks.dim_size[5]() != head_dim or q.dim_size[2]() != head_dim:
            raise Error("gptoss_attention_with_sinks: head_dim mismatch")
        poison[target](ctx, output.unsafe_ptr(), output.size())
        poison[target](ctx, scratch.unsafe_ptr(), scratch.size())
        attend[target, output.dtype, sinks.dtype, head_dim](
            ctx, output.unsafe_ptr(), scratch.unsafe_ptr(), scratch.dim_size[0](), q.unsafe_ptr(),
            row_offsets.unsafe_ptr(), kv_blocks.unsafe_ptr(), cache_lengths.unsafe_ptr(), lookup_table.unsafe_ptr(),
            sinks.unsafe_ptr(), q.dim_size[0](), row_offsets.dim_size[0]() - 1, lookup_table.dim_size[1](),
            q.dim_size[1](), PagedGeometry.of(kv_blocks, page_stride, layer_idx), Int(window), scale,
        )


# Decode steps of at most this many tokens take the one-launch ROPE kernel.
# Measured on the H100 (120b, 6-layer step profile, bench/NOTES.md): batch 1
# 7.3 us against 6.4 + 2.2 for the two launches; batch 64 55.0 us against
# 36.9 + 3.7 (the ROPE kernel's registers cost blocks per SM). Between 2 and
# 63 it is not measured; 16 is the key-split regime's bound (SPLIT_TOKENS).
comptime ROPE_ONE_LAUNCH_TOKENS = 16


@extensibility.register("gptoss_attention_rope_sinks")
struct AttentionRopeSinks:
    """RoPE, this step's K/V store and sink attention in one op: what MAX's
    rope_split_store_ragged followed by gptoss_attention_with_sinks compute,
    from the qkv projection [T, (n_heads + 2 n_kv) * head_dim] (q heads, then
    K heads, then V heads) and MAX's RoPE table freqs [positions, head_dim]
    ((cos, sin) of frequency i at columns 2 i, 2 i + 1; rotate-half pairing).

    Outputs: output [T, n_heads, head_dim]; scratch as gptoss_attention_with_sinks;
    xq [T, n_heads, head_dim], the roped q, written by the two-step paths only.
    The cache and the other inputs as gptoss_attention_with_sinks.

    GPU, tensor-core shapes (bf16, head_dim 64, 8 query heads per KV head),
    one new token per sequence (T == B, a pure decode step) of at most
    ROPE_ONE_LAUNCH_TOKENS tokens: one launch (attention_gpu.mojo's ROPE
    kernel, + the merge when the keys are split). Otherwise, and on the CPU:
    rope_store, then attend.
    """

    @staticmethod
    def execute[
        target: StaticString,
        head_dim: Int,
    ](
        output: OutputTensor[rank=3, ...],
        scratch: OutputTensor[dtype=DType.float32, rank=3, ...],
        xq: OutputTensor[dtype=output.dtype, rank=3, ...],
        qkv: InputTensor[dtype=output.dtype, rank=2, ...],
        freqs: InputTensor[rank=2, ...],
        row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv_blocks: MutableInputTensor[dtype=output.dtype, rank=6, ...],
        page_stride: InputTensor[dtype=DType.int64, rank=1, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],
        sinks: InputTensor[rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        window: Int32,
        ctx: DeviceContext,
    ) raises:
        comptime dtype = output.dtype
        var geo = PagedGeometry.of(kv_blocks, page_stride, layer_idx)
        var tokens = qkv.dim_size[0]()
        var n_heads = output.dim_size[1]()
        if (
            kv_blocks.dim_size[5]() != head_dim
            or output.dim_size[2]() != head_dim
            or freqs.dim_size[1]() != head_dim
            or qkv.dim_size[1]() != (n_heads + 2 * geo.n_kv_heads) * head_dim
            or n_heads % geo.n_kv_heads != 0
            or head_dim % 2 != 0
        ):
            raise Error("gptoss_attention_rope_sinks: shape mismatch (qkv, freqs, cache, head_dim)")
        var batch = row_offsets.dim_size[0]() - 1
        var max_pages = lookup_table.dim_size[1]()
        var offs = row_offsets.unsafe_ptr()
        var lens = cache_lengths.unsafe_ptr()
        var table = lookup_table.unsafe_ptr()
        var kvp = kv_blocks.unsafe_ptr()
        var qkvp = qkv.unsafe_ptr()
        poison[target](ctx, output.unsafe_ptr(), output.size())
        poison[target](ctx, scratch.unsafe_ptr(), scratch.size())
        poison[target](ctx, xq.unsafe_ptr(), xq.size())
        comptime if target == "gpu" and dtype == DType.bfloat16:
            if (
                tc_eligible[dtype, head_dim](n_heads // geo.n_kv_heads)
                and tokens == batch
                and tokens <= ROPE_ONE_LAUNCH_TOKENS
            ):
                launch_attention_rope[sinks.dtype, freqs.dtype](
                    ctx, output.unsafe_ptr().unsafe_bitcast[BFloat16](), scratch.unsafe_ptr(), scratch.dim_size[0](),
                    qkvp.unsafe_bitcast[BFloat16](), freqs.unsafe_ptr(), offs, kvp.unsafe_bitcast[BFloat16](), lens,
                    table, sinks.unsafe_ptr(), tokens, batch, max_pages, n_heads, geo.page_size, geo.slot_elems,
                    geo.page_elems, geo.k_base, geo.v_base, Int(window), scale,
                )
                return
        rope_store[target, dtype, freqs.dtype, head_dim](
            ctx, xq.unsafe_ptr(), qkvp, freqs.unsafe_ptr(), offs, lens, table, kvp, tokens, batch, max_pages,
            n_heads, geo,
        )
        attend[target, dtype, sinks.dtype, head_dim](
            ctx, output.unsafe_ptr(), scratch.unsafe_ptr(), scratch.dim_size[0](), xq.unsafe_ptr(), offs, kvp, lens,
            table, sinks.unsafe_ptr(), tokens, batch, max_pages, n_heads, geo, Int(window), scale,
        )
