import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .moe_fused_gpu import SYNC_WORDS, launch_moe_one_token
from .moe_gpu import MAX_TOPK


@extensibility.register("gptoss_moe_one_token_mxfp4")
struct MoeOneTokenMxfp4:
    """gptoss_moe_gate_up_mxfp4 then gptoss_moe_down_mxfp4 for one token of a
    bf16 graph, as one GPU launch (moe_fused_gpu.mojo, v27; a probe, GPU only).

    Boundary (all contiguous, row-major):
      output       [1, H]  bf16    sum_k w[k] * (W_down[e] h[k] + b[e])
      h            [1, K, I] f32   scratch (what gate_up writes)
      x            [1, H]  bf16
      topk_ids     [1, K]  int32   (K <= 4; ids outside [0, E) add nothing)
      topk_weights [1, K]  f32
      gate_up blocks, scales, bias; down blocks, scales, bias: as the two ops'
      sync         [SYNC_WORDS] u32   zero before the first launch; the launch
                                      leaves it zero (the ops of one stream
                                      may share one)
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        h: OutputTensor[dtype=DType.float32, rank=3, ...],
        x: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
        topk_weights: InputTensor[dtype=DType.float32, rank=2, ...],
        gu_blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        gu_scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        gu_bias: InputTensor[dtype=DType.float32, rank=2, ...],
        d_blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        d_scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        d_bias: InputTensor[dtype=DType.float32, rank=2, ...],
        sync: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime who = "gptoss_moe_one_token_mxfp4"
        comptime if target != "gpu":
            raise Error(String(who) + ": GPU only (a probe of the fused one-token launch)")
        else:
            var top_k = topk_ids.dim_size[1]()
            var hidden = x.dim_size[1]()
            var inter = d_blocks.dim_size[2]() * 2
            if x.dim_size[0]() != 1 or top_k > MAX_TOPK:
                raise Error(String(who) + ": one token, top_k <= 4")
            if sync.dim_size[0]() != SYNC_WORDS:
                raise Error(String(who) + ": sync must hold " + String(SYNC_WORDS) + " words")
            var ids = topk_ids.unsafe_ptr()
            launch_moe_one_token[0](
                ctx,
                output.unsafe_ptr(),
                h.unsafe_ptr(),
                sync.unsafe_ptr().unsafe_mut_cast[True](),
                x.unsafe_ptr(),
                ids,
                topk_weights.unsafe_ptr(),
                x.unsafe_ptr(),  # logits: not read with route 0
                ids.unsafe_mut_cast[True](),  # ids_out, wts_out: not written with route 0
                topk_weights.unsafe_ptr().unsafe_mut_cast[True](),
                gu_blocks.unsafe_ptr(),
                gu_scales.unsafe_ptr(),
                gu_bias.unsafe_ptr(),
                d_blocks.unsafe_ptr(),
                d_scales.unsafe_ptr(),
                d_bias.unsafe_ptr(),
                top_k,
                gu_blocks.dim_size[0](),
                hidden,
                inter,
            )
