"""gpt-oss attention whose core is our sink-aware op (MAX's is wrong on CPU past 128 keys and
in GPU decode), optionally MAX's flash attention for steps that hold a prompt chunk."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, StaticDim, TensorType, TensorValue, ops
from max.nn.attention import MHAMaskVariant
from max.nn.kernels import flash_attention_ragged, rope_split_store_ragged
from max.nn.kv_cache import PagedCacheValues
from max.nn.layer import Module

from gptoss_max import maxapi, settings
from gptoss_max.arch import dense
from gptoss_max.kernels import ops as kernel_ops

# Steps of at most this many tokens take our op for the attention head (`attention_head`).
QKV_HEAD_MAX_TOKENS = 16


def attention_head(
    qkv_proj: Module, residual: TensorValue, update: TensorValue, norm: Module
) -> tuple[TensorValue, TensorValue]:
    """`(x, qkv)` with `x = residual + update` (the previous layer's residual add) and
    `qkv = qkv_proj(norm(x))`: what a block hands `SinkAttention.__call__` when the previous
    block left its add to it (arch/moe.py's `DeferredAdd`).

    bf16 graphs with `GPTOSS_MAX_QKV_HEAD` = fused (the default) run steps of at most
    QKV_HEAD_MAX_TOKENS tokens through our op (the MoE head's, kernels/router_decode.mojo),
    chosen in the graph from the step's token count; MAX's add + rms_norm + Linear otherwise.
    Why: at one token MAX runs the add + norm as a launch of its own (~3 us in a 120b layer,
    bench/NOTES.md) before its GEMV; ours normalizes inside the projection's launch."""
    weight, bias = maxapi.linear_weight_bias(qkv_proj)

    def unfused() -> list[TensorValue]:  # MAX's add, rms_norm and Linear (no ops.cond inside)
        x = residual + update
        return [x, qkv_proj(norm(x))]

    hidden = update.shape[1]
    if (
        update.dtype != DType.bfloat16
        or settings.qkv_head_impl() != "fused"
        or bias is None
        or not isinstance(hidden, StaticDim)
        or int(hidden) > 4096  # the op's GPU bound
    ):
        x = residual + update
        return x, dense.project(qkv_proj, norm(x))
    # Materialized here, outside both branches of ops.cond: a weight first used inside one
    # branch is defined in that region and does not dominate its use in the other.
    gamma = ops.cast(TensorValue(norm.weight), update.dtype).to(update.device)
    w, b = TensorValue(weight), TensorValue(bias)

    def fused() -> list[TensorValue]:
        x, _, qkv = kernel_ops.router_decode(update, residual, gamma, norm.eps, w, b)
        return [x, qkv]

    most = kernel_ops.router_decode_bound(int(hidden), QKV_HEAD_MAX_TOKENS)
    out_types = [
        TensorType(update.dtype, update.shape, update.device),
        TensorType(update.dtype, [update.shape[0], w.shape[0]], update.device),
    ]
    x, qkv = ops.cond(dense.tokens_within(update, most), out_types, fused, unfused)
    return x, qkv


class SinkAttention(maxapi.GptOssAttention):
    """MAX's GptOssAttention (weights, qkv, YaRN rope + KV store, o_proj) with our attention core."""

    hybrid = False  # MAX's flash attention when the step holds a prompt chunk (set by use_sink_attention)

    def head(self, residual: TensorValue, update: TensorValue, norm: Module) -> tuple[TensorValue, TensorValue]:
        """`attention_head` of this layer's qkv projection."""
        return attention_head(self.qkv_proj, residual, update, norm)

    def __call__(
        self, x: TensorValue | None, kv_collection: PagedCacheValues, qkv: TensorValue | None = None, **kwargs
    ) -> TensorValue:
        """Attention of the normed x, or of its projection `qkv` when given (from `head`)."""
        layer_idx = ops.constant(self.layer_idx, DType.uint32, device=DeviceRef.CPU())
        offsets = kwargs["input_row_offsets"]
        if qkv is None:
            qkv = dense.project(self.qkv_proj, x)  # [T, (nh + 2 kvh) * d]
        qkv = kernel_ops.tap(qkv, f"layer {self.layer_idx} qkv")  # x itself unless GPTOSS_MAX_TAP=on
        freqs_cis = ops.cast(self.rope.freqs_cis, qkv.dtype).to(qkv.device)
        head_dim = self.kv_params.head_dim
        sliding = self.layer_type == "sliding_attention"
        window = self.local_window_size if sliding else None
        # Materialized here, outside both branches: a weight first used inside one branch of
        # ops.cond is defined in that region and does not dominate its use in the other.
        sinks = TensorValue(self.sinks)

        def stored_q() -> TensorValue:  # MAX's RoPE + this step's K/V store; the roped q
            xq = rope_split_store_ragged(
                kv_params=self.kv_params,
                qkv=qkv,
                input_row_offsets=offsets,
                freqs_cis=freqs_cis,
                kv_collection=kv_collection,
                layer_idx=layer_idx,
                n_heads=self.n_heads,
                interleaved=self.rope.interleaved,
            )
            return xq.reshape((-1, self.n_heads, head_dim))  # [T, nh, d]

        # Our op applies RoPE and stores K/V itself (rotate-half tables only, as gpt-oss's).
        fused = settings.rope_impl() == "fused" and not self.rope.interleaved
        xq = None if fused else stored_q()

        def ours() -> TensorValue:
            if xq is None:
                return kernel_ops.attention_rope_with_sinks(
                    qkv, freqs_cis, kv_collection, layer_idx, offsets, sinks, self.n_heads, self.scale, window
                )
            return kernel_ops.attention_with_sinks(xq, kv_collection, layer_idx, offsets, sinks, self.scale, window)

        def theirs() -> TensorValue:
            return flash_attention_ragged(
                self.kv_params,
                input=stored_q() if xq is None else xq,
                kv_collection=kv_collection,
                layer_idx=layer_idx,
                input_row_offsets=offsets,
                mask_variant=MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK if sliding else MHAMaskVariant.CAUSAL_MASK,
                scale=self.scale,
                local_window_size=self.local_window_size,
                sink_weights=sinks,
            )

        if self.hybrid:
            # A step whose longest new run is one token is pure decode: ours. Otherwise MAX's
            # prefill path, which agrees with the reference (docs/GPU.md, bench/attention.py).
            prompt = ops.reshape(kv_collection.max_prompt_length, [])
            has_chunk = ops.greater(prompt, ops.constant(1, prompt.dtype, device=prompt.device))
            out_type = TensorType(qkv.dtype, [qkv.shape[0], self.n_heads, head_dim], qkv.device)
            attn = ops.cond(has_chunk, [out_type], theirs, ours)[0]
        else:
            attn = ours()
        attn = kernel_ops.tap(attn, f"layer {self.layer_idx} attention")
        return dense.project(self.o_proj, ops.reshape(attn, shape=[qkv.shape[0], -1]))


def use_sink_attention(block, hybrid: bool = False) -> None:
    """Why: MAX's CPU flash attention over-counts sinks past 128 keys (and rejects windows < 256);
    its GPU decode disagrees with the reference too (its GPU prefill agrees: `hybrid`)."""
    for shard in block.self_attn_shards:
        shard.__class__ = SinkAttention
        shard.hybrid = hybrid
