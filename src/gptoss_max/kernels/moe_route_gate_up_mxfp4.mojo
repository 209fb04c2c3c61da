import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .moe_gate_up_mxfp4 import check_big, check_gate_up, gate_up_cpu, gate_up_gpu
from .moe_gpu import launch_route_gate_up
from .moe_prefill_gpu import prefill_choice
from .router_topk import check_topk, router_topk
from .poison import poison


@extensibility.register("gptoss_moe_route_gate_up_mxfp4")
struct MoeRouteGateUpMxfp4:
    """The router's top-k and the experts' gate_up in one op: what
    gptoss_router_topk then gptoss_moe_gate_up_mxfp4 compute, with the top-k
    also returned for gptoss_moe_down_mxfp4.

    Boundary (all contiguous, row-major):
      output   [T, K, I] f32   h, as gptoss_moe_gate_up_mxfp4's
      counters [ceil(H / 8)] u32   as gptoss_moe_gate_up_mxfp4's
      ids      [T, K] int32    as gptoss_router_topk's (K: this output's width)
      weights  [T, K] f32      as gptoss_router_topk's
      x        [T, H]    bf16 | f32
      logits   [T, E]    x's dtype: the router's output (bias included)
      blocks, scales, bias, big, path: as gptoss_moe_gate_up_mxfp4's

    GPU: a one-token step (batch-1 decode) on the decode kernel is one launch,
    whose warps each take the top-k themselves (moe_gpu.launch_route_gate_up):
    no top-k launch before it. Other steps launch the top-k kernel, then
    gate_up as gptoss_moe_gate_up_mxfp4 does. CPU: the two ops' CPU paths.
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.float32, rank=3, ...],
        counters: OutputTensor[dtype=DType.uint32, rank=1, ...],
        ids: OutputTensor[dtype=DType.int32, rank=2, ...],
        weights: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[rank=2, ...],
        logits: InputTensor[dtype=x.dtype, rank=2, ...],
        blocks: InputTensor[dtype=DType.uint8, rank=3, ...],
        scales: InputTensor[dtype=DType.uint8, rank=3, ...],
        bias: InputTensor[dtype=DType.float32, rank=2, ...],
        big: InputTensor[dtype=DType.uint8, rank=2, ...],
        path: Int32,
        ctx: DeviceContext,
    ) raises:
        var xp = x.unsafe_ptr()
        var lp = logits.unsafe_ptr()
        var idp = ids.unsafe_ptr()
        var wp = weights.unsafe_ptr()
        var bp = blocks.unsafe_ptr()
        var sp = scales.unsafe_ptr()
        var biasp = bias.unsafe_ptr()
        var tokens = x.dim_size[0]()
        var n_experts = blocks.dim_size[0]()
        var rows = blocks.dim_size[1]()
        var hidden = x.dim_size[1]()
        var top_k = ids.dim_size[1]()
        var n_count = counters.dim_size[0]()
        comptime who = "gptoss_moe_route_gate_up_mxfp4"
        check_gate_up(n_count, rows, hidden, who)
        check_topk(n_experts, top_k, who)
        check_big(big.dim_size[1](), big.dim_size[0](), n_experts, rows, who)
        if logits.dim_size[1]() != n_experts:
            raise Error(String(who) + ": logits must have one column per expert")
        poison[target](ctx, output.unsafe_ptr(), output.size())
        poison[target](ctx, counters.unsafe_ptr(), n_count)
        poison[target](ctx, idp, ids.size())
        poison[target](ctx, wp, weights.size())

        comptime if target == "gpu":
            var one_launch = tokens == 1
            comptime if x.dtype == DType.bfloat16:
                one_launch = one_launch and prefill_choice(tokens, top_k, n_experts, hidden, rows // 2, Int(path)) < 0
            if one_launch:
                launch_route_gate_up[x.dtype](
                    ctx, output.unsafe_ptr(), counters.unsafe_ptr(), n_count, xp, lp, idp, wp, bp, sp, biasp,
                    top_k, n_experts, rows, hidden,
                )
                return
            router_topk[target, x.dtype](idp, wp, lp, tokens, n_experts, top_k, ctx)
            gate_up_gpu[x.dtype](
                ctx, output.unsafe_ptr(), counters.unsafe_ptr(), n_count, xp, idp, bp, sp, biasp, big.unsafe_ptr(),
                tokens, top_k, n_experts, rows, hidden, Int(path),
            )
            return

        router_topk[target, x.dtype](idp, wp, lp, tokens, n_experts, top_k, ctx)
        var ip = idp.unsafe_mut_cast[False]().unsafe_origin_cast[ImmutAnyOrigin]()
        gate_up_cpu[target, x.dtype](
            ctx, output.unsafe_ptr(), counters.unsafe_ptr(), n_count, xp, ip, bp, sp, biasp,
            tokens, top_k, n_experts, rows, hidden,
        )
