import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from layout import coord_to_index_list
from max.gpu.host import DeviceContext
from max.algorithm import elementwise
from std.collections import Array
from std.math import exp
from std.utils.coord import Coord

from .attention_gpu import launch_attention


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
        var outp = output.unsafe_ptr()
        var qp = q.unsafe_ptr()
        var offs = row_offsets.unsafe_ptr()
        var kvp = kv_blocks.unsafe_ptr()
        var lens = cache_lengths.unsafe_ptr()
        var table = lookup_table.unsafe_ptr()
        var sinkp = sinks.unsafe_ptr()
        var batch = row_offsets.dim_size[0]() - 1
        var max_pages = lookup_table.dim_size[1]()
        var n_heads = q.dim_size[1]()
        var n_layers = kv_blocks.dim_size[2]()
        var page_size = kv_blocks.dim_size[3]()
        var n_kv_heads = kv_blocks.dim_size[4]()
        var group = n_heads // n_kv_heads
        var slot_elems = n_kv_heads * head_dim
        var layer_elems = page_size * slot_elems
        var page_elems = Int(page_stride[0])
        if page_elems < 0:
            page_elems = 2 * n_layers * layer_elems
        var k_base = Int(layer_idx) * layer_elems
        var v_base = (n_layers + Int(layer_idx)) * layer_elems
        var win = Int(window)

        comptime if target == "gpu":
            launch_attention[output.dtype, sinks.dtype, head_dim](
                ctx,
                outp,
                scratch.unsafe_ptr(),
                scratch.dim_size[0](),
                qp,
                offs,
                kvp,
                lens,
                table,
                sinkp,
                q.dim_size[0](),
                batch,
                max_pages,
                n_heads,
                page_size,
                group,
                slot_elems,
                page_elems,
                k_base,
                v_base,
                win,
                scale,
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
            var b = 0
            while b + 1 < batch and Int(offs[unsafe_offset=b + 1]) <= t:
                b += 1
            var pos = (
                Int(lens[unsafe_offset=b]) + t - Int(offs[unsafe_offset=b])
            )
            var first = max(pos - win + 1, 0) if win > 0 else 0
            var head_off = (h // group) * head_dim
            var qrow = qp.unsafe_offset((t * n_heads + h) * head_dim)

            # Online softmax, seeded with the sink: it is in the normaliser
            # from the start and never contributes to the value sum.
            var m = sinkp[unsafe_offset=h].cast[DType.float32]()
            var denom: Float32 = 1
            var acc = Array[Float32, head_dim](fill=0)
            for j in range(first, pos + 1):
                var page = Int(
                    table[unsafe_offset=b * max_pages + j // page_size]
                )
                var slot = (
                    page * page_elems + (j % page_size) * slot_elems + head_off
                )
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
                orow[unsafe_offset=d] = (acc[d] / denom).cast[output.dtype]()

        elementwise[simd_width=1, target=target](
            attend_row, Coord(q.dim_size[0](), n_heads), ctx
        )
