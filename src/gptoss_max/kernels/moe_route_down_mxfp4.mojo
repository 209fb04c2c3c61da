import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .moe_down_mxfp4 import down_mxfp4


@extensibility.register("gptoss_moe_route_down_mxfp4")
struct MoeRouteDownMxfp4:
    """gptoss_moe_down_mxfp4 after gptoss_moe_route_gate_up_mxfp4, which also
    gets the router's logits that topk_ids and topk_weights are the top-k of.

    Boundary: gptoss_moe_down_mxfp4's, plus
      logits   [T, E]  output's dtype: the router's output, as given to
                       gptoss_moe_route_gate_up_mxfp4

    Same values as gptoss_moe_down_mxfp4. On the GPU a bf16 one-token step
    takes the top-k of logits itself (the same top-k as the gate_up op's),
    so it needs nothing from the gate_up launch but h and can stream its
    first weights before that launch ends (moe_gpu.down_one_token_kernel,
    PDL). Otherwise logits is not read.
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[rank=2, ...],
        partial: OutputTensor[dtype=DType.float32, rank=3, ...],
        h: InputTensor[dtype=DType.float32, rank=3, ...],
        topk_ids: InputTensor[dtype=DType.int32, rank=2, ...],
        topk_weights: InputTensor[dtype=DType.float32, rank=2, ...],
        logits: InputTensor[dtype=output.dtype, rank=2, ...],
        blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        bias: InputTensor[dtype=DType.float32, rank=2, ...],
        big: InputTensor[dtype=DType.uint8, rank=2, ...],
        counters: InputTensor[dtype=DType.uint32, rank=1, ...],
        path: Int32,
        ctx: DeviceContext,
    ) raises:
        if logits.dim_size[0]() != topk_ids.dim_size[0]() or logits.dim_size[1]() != blocks.dim_size[0]():
            raise Error("gptoss_moe_route_down_mxfp4: logits must be [T, E]")
        down_mxfp4[target](
            output,
            partial,
            h,
            topk_ids,
            topk_weights,
            blocks,
            scales,
            bias,
            big,
            counters,
            path,
            logits.unsafe_ptr().unsafe_bitcast[BFloat16](),
            logits.dtype == DType.bfloat16,
            ctx,
        )
