"""The gpt-oss MoE block: the router is MAX's Linear, its top-k + softmax and the experts our Mojo ops.
In bf16 graphs, steps of a few tokens run the residual add, the post-attention norm and the router
as one op of ours instead (`NativeMoE.after_attention`, `FusedRouterBlock`).

Expert weights stay MXFP4-sized: (blocks, scales) uint8 pairs, repacked once at load into the
op's tiled byte order (gptoss_max.mxfp4.tile_for_op), or bf16; never expanded to a BF16 copy of
the expert stack.
"""

from __future__ import annotations

from collections.abc import Iterable

from max.dtype import DType
from max.graph import DeviceRef, ShardingStrategy, TensorType, TensorValue, Weight, ops
from max.nn.layer import Module
from max.nn.linear import Linear

from gptoss_max import maxapi, settings
from gptoss_max import mxfp4 as mxfp4_format
from gptoss_max.arch import dense
from gptoss_max.kernels import ops as moe_ops

# Steps of at most this many tokens take our op for the MoE block's head (`after_attention`): one
# launch up to 4 tokens, our add + norm and tensor-core router past that. At 8 tokens the latter
# takes ~4.6 us of a 120b layer against MAX's matmul's 13.3 (bench/NOTES.md).
ROUTER_HEAD_MAX_TOKENS = 16


class ExpertWeights(Module):
    """`[E, out, in]`-major expert tensors, gate/up rows interleaved (gate = even rows)."""

    def __init__(self, experts: int, hidden: int, inter: int, mxfp4: bool, dtype: DType, device: DeviceRef):
        super().__init__()
        self.mxfp4 = mxfp4

        def w(name: str, dt: DType, shape: list[int]) -> Weight:
            return Weight(name=name, dtype=dt, shape=shape, device=device)

        if mxfp4:
            self.gate_up_blocks = w("gate_up_blocks", DType.uint8, [experts, 2 * inter, hidden // 2])
            self.gate_up_scales = w("gate_up_scales", DType.uint8, [experts, 2 * inter, hidden // 32])
            self.down_blocks = w("down_blocks", DType.uint8, [experts, hidden, inter // 2])
            self.down_scales = w("down_scales", DType.uint8, [experts, hidden, inter // 32])
            # derived when the weights are loaded (arch.weights): mxfp4.big_scale_groups
            g = mxfp4_format.TILE_ROWS
            self.gate_up_big = w("gate_up_big", DType.uint8, [experts, 2 * inter // g])
            self.down_big = w("down_big", DType.uint8, [experts, hidden // g])
        else:
            self.gate_up_weight = w("gate_up_weight", dtype, [experts, 2 * inter, hidden])
            self.down_weight = w("down_weight", dtype, [experts, hidden, inter])
        self.gate_up_bias = w("gate_up_bias", DType.float32, [experts, 2 * inter])
        self.down_bias = w("down_bias", DType.float32, [experts, hidden])

    def routed(self, x: TensorValue, logits: TensorValue, top_k: int) -> TensorValue:
        """MXFP4 experts with the router's top-k inside their first op (moe_mxfp4_routed)."""
        return moe_ops.moe_mxfp4_routed(
            x, logits, top_k,
            self.gate_up_blocks, self.gate_up_scales, self.gate_up_bias,
            self.down_blocks, self.down_scales, self.down_bias, path=settings.moe_path(),
            big=(self.gate_up_big, self.down_big),
        )  # fmt: skip

    def __call__(self, x: TensorValue, ids: TensorValue, weights: TensorValue) -> TensorValue:
        if self.mxfp4:
            return moe_ops.moe_mxfp4(
                x, ids, weights,
                self.gate_up_blocks, self.gate_up_scales, self.gate_up_bias,
                self.down_blocks, self.down_scales, self.down_bias, path=settings.moe_path(),
                big=(self.gate_up_big, self.down_big),
            )  # fmt: skip
        return moe_ops.moe_bf16(
            x, ids, weights, self.gate_up_weight, self.gate_up_bias, self.down_weight, self.down_bias
        )


class NativeMoE(Module):
    """router (Linear + bias) -> top-k -> softmax over the k -> experts (our op)."""

    def __init__(
        self,
        *,
        hidden: int,
        inter: int,
        experts: int,
        top_k: int,
        mxfp4: bool,
        dtype: DType,
        device: DeviceRef,
    ):
        super().__init__()
        self.top_k = top_k
        self.router = Linear(hidden, experts, dtype=dtype, device=device, has_bias=True)
        self.experts = ExpertWeights(experts, hidden, inter, mxfp4, dtype, device)
        self._strategy: ShardingStrategy | None = None

    def __call__(self, x: TensorValue) -> TensorValue:  # x: [T, H]
        return self._experts_of(x, dense.project(self.router, x))

    def _experts_of(self, x: TensorValue, logits: TensorValue) -> TensorValue:
        """x [T, H] through the experts the router's logits [T, E] pick (top-k, softmax over k)."""
        x, logits = moe_ops.tap(x, "moe input"), moe_ops.tap(logits, "router logits")  # GPTOSS_MAX_TAP
        if self.experts.mxfp4 and settings.topk_impl() == "experts":
            return moe_ops.tap(self.experts.routed(x, logits, self.top_k), "moe output")
        ids, weights = moe_ops.router_topk(logits, self.top_k)  # [T, K] int32, f32 softmaxed
        return moe_ops.tap(self.experts(x, ids, weights), "moe output")  # [T, H]

    def after_attention(
        self, attn: TensorValue, residual: TensorValue, norm: Module
    ) -> tuple[TensorValue, TensorValue]:
        """`(h, mlp(norm(h)))` with `h = residual + attn`: the second half of a transformer block.

        bf16 graphs with `GPTOSS_MAX_ROUTER` = fused (the default) take our op for the add, the
        norm and the router's logits (`router_decode`: one launch up to 4 tokens) on steps of at most
        `ROUTER_HEAD_MAX_TOKENS` tokens, chosen in the graph from the step's token count (the
        same choice on a CPU, whose path has no bound, so CPU tests run both branches); MAX's
        add + rms_norm and the router's Linear otherwise. With `GPTOSS_MAX_ROUTER=max` (no cond here)
        the logits go through `arch.dense.project`. Both compute the same values
        (tests/test_router_decode_op.py)."""

        if settings.tap_weights():
            residual = moe_ops.tap(residual, "residual")
            attn = moe_ops.tap(attn, "o_proj output")

        def unfused(nested: bool = True) -> list[TensorValue]:  # MAX's add, rms_norm and Linear
            h = residual + attn
            xn = norm(h)
            # Not nested inside a branch of the ops.cond below: MAX 26.7 fails to verify an
            # ops.cond nested in another one when its branch holds a custom op (the branch
            # yields a chain defined in a region it cannot see).
            return [h, xn, self.router(xn) if nested else dense.project(self.router, xn)]

        if attn.dtype != DType.bfloat16 or settings.router_impl() != "fused":
            h, xn, logits = unfused(nested=False)
            return h, self._experts_of(xn, logits)
        # Materialized here, outside both branches of ops.cond: a weight first used inside one
        # branch is defined in that region and does not dominate its use in the other.
        gamma = ops.cast(TensorValue(norm.weight), attn.dtype).to(attn.device)
        weight, bias = TensorValue(self.router.weight), TensorValue(self.router.bias)

        def fused() -> list[TensorValue]:
            return list(moe_ops.router_decode(attn, residual, gamma, norm.eps, weight, bias))

        most = moe_ops.router_decode_bound(int(attn.shape[1]), ROUTER_HEAD_MAX_TOKENS)
        out_types = [
            TensorType(attn.dtype, attn.shape, attn.device),
            TensorType(attn.dtype, attn.shape, attn.device),
            TensorType(attn.dtype, [attn.shape[0], weight.shape[0]], attn.device),
        ]
        h, xn, logits = ops.cond(dense.tokens_within(attn, most), out_types, fused, unfused)
        return h, self._experts_of(xn, logits)

    # MAX's transformer block shards every mlp; one device is all we support so far.
    @property
    def sharding_strategy(self) -> ShardingStrategy | None:
        return self._strategy

    @sharding_strategy.setter
    def sharding_strategy(self, strategy: ShardingStrategy) -> None:
        if strategy.num_devices != 1:
            raise NotImplementedError(
                "gptoss-max runs the MoE on one device; block-aligned MXFP4 tensor parallelism is not built yet"
            )
        self._strategy = strategy

    def shard(self, devices: Iterable[DeviceRef]) -> list[NativeMoE]:
        return [self for _ in devices]


class DeferredAdd:
    """A block's output `residual + update` not yet added: the next block adds it inside its
    attention head (`SinkAttention.head`), which on one-token steps saves MAX's add + norm launch."""

    def __init__(self, residual: TensorValue, update: TensorValue):
        self.residual, self.update = residual, update

    def value(self) -> TensorValue:
        return self.residual + self.update

    @staticmethod
    def resolved(x: TensorValue | DeferredAdd) -> TensorValue:
        return x.value() if isinstance(x, DeferredAdd) else x


class FusedRouterBlock(maxapi.GptOssTransformerBlock):
    """MAX's gpt-oss transformer block whose second half is `NativeMoE.after_attention` on one
    device (the same add, norm, MoE and add as MAX's `__call__`, with the head fusable). With
    `defer_add` (every layer but the last, when the next one can take it) it returns its final
    residual add undone, as a `DeferredAdd`, and a block given one finishes it in its attention
    head."""

    defer_add = False

    def __call__(self, layer_idx, xs, signal_buffers, kv_collections, input_row_offsets, **kwargs):  # type: ignore[override]
        if len(xs) != 1 or not isinstance(self.mlp, NativeMoE):
            xs = [DeferredAdd.resolved(x) for x in xs]
            return super().__call__(layer_idx, xs, signal_buffers, kv_collections, input_row_offsets, **kwargs)
        (x,) = xs
        attention, norm = self.self_attn_shards[0], self.input_layernorm_shards[0]
        if isinstance(x, DeferredAdd) and hasattr(attention, "head"):
            x, qkv = attention.head(x.residual, x.update, norm)
            attn = attention(None, kv_collections[0], qkv=qkv, input_row_offsets=input_row_offsets[0], **kwargs)
        else:
            x = DeferredAdd.resolved(x)
            attn = attention(norm(x), kv_collections[0], input_row_offsets=input_row_offsets[0], **kwargs)
        (attn,) = self.allreduce([attn], signal_buffers)
        h, mlp_out = self.mlp.after_attention(attn, x, self.post_attention_layernorm_shards[0])
        return [DeferredAdd(h, mlp_out)] if self.defer_add else [h + mlp_out]


def use_fused_router(block: maxapi.GptOssTransformerBlock) -> None:
    block.__class__ = FusedRouterBlock
