"""gpt-oss attention whose core is our sink-aware op (MAX's is wrong on CPU past 128 keys and drifts in GPU decode)."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops
from max.nn.kernels import rope_split_store_ragged
from max.nn.kv_cache import PagedCacheValues

from gptoss_max import maxapi
from gptoss_max.kernels import ops as kernel_ops


class SinkAttention(maxapi.GptOssAttention):
    """MAX's GptOssAttention (weights, qkv, YaRN rope + KV store, o_proj) with our attention core."""

    def __call__(self, x: TensorValue, kv_collection: PagedCacheValues, **kwargs) -> TensorValue:
        layer_idx = ops.constant(self.layer_idx, DType.uint32, device=DeviceRef.CPU())
        qkv = self.qkv_proj(x)  # [T, (nh + 2 kvh) * d]
        freqs_cis = ops.cast(self.rope.freqs_cis, qkv.dtype).to(qkv.device)
        xq = rope_split_store_ragged(
            kv_params=self.kv_params,
            qkv=qkv,
            input_row_offsets=kwargs["input_row_offsets"],
            freqs_cis=freqs_cis,
            kv_collection=kv_collection,
            layer_idx=layer_idx,
            n_heads=self.n_heads,
            interleaved=self.rope.interleaved,
        )
        xq = xq.reshape((-1, self.n_heads, self.kv_params.head_dim))  # [T, nh, d]
        window = self.local_window_size if self.layer_type == "sliding_attention" else None
        attn = kernel_ops.attention_with_sinks(
            xq, kv_collection, layer_idx, kwargs["input_row_offsets"], self.sinks, self.scale, window
        )
        return self.o_proj(ops.reshape(attn, shape=[x.shape[0], -1]))


def use_sink_attention(block) -> None:
    """Why: MAX's CPU flash attention over-counts sinks past 128 keys (and rejects windows < 256);
    its GPU decode disagrees with the reference too. On a GPU, GPTOSS_MAX_ATTENTION=max keeps MAX's."""
    for shard in block.self_attn_shards:
        shard.__class__ = SinkAttention
