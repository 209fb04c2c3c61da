import extensibility
from extensibility import InputTensor, OutputTensor
from layout import coord_to_index_list
from max.algorithm import elementwise
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, block_idx, lane_id, warp_id
from max.gpu.host import DeviceContext
from max.gpu.primitives.warp import shuffle_xor
from std.collections import Array
from std.math import exp
from std.memory import bitcast
from std.sys import llvm_intrinsic
from std.utils.coord import Coord
from std.utils.static_tuple import StaticTuple

from .pdl import pdl_attributes, pdl_enter
from .poison import poison

# The MoE router's tail in one op: top-k of each token's expert logits, then
# the softmax over those k, which the expert ops take (ids int32, weights
# f32). It stands for MAX's top_k + cast + softmax + cast (several launches
# per layer in a decode step).
#
# Order: larger logit first; equal logits by lower expert id. NaN logits are
# never chosen; a token with fewer than k choosable logits gets id -1 and
# weight 0 in the remaining slots (the expert ops skip ids outside [0, E)).
# Weights: exp(v - v_max) / sum over the chosen k, in f32 (v_max is the first
# chosen logit; slots holding -inf next to a finite max get 0).
#
# GPU: a warp per token, each lane holding E / 32 logits in registers; k
# rounds of a warp argmax. For 16-bit logits each candidate is one exact
# u32 key (order-preserving logit bits, then the inverted id: ties go to the
# lower id) and a round is one redux.sync max; f32 logits take a butterfly
# of shuffles on (value, id). CPU: a task per token, the same rule.

comptime ROUTER_WARPS = 4
comptime ROUTER_MAX_EXPERTS = 256
comptime ROUTER_MAX_K = 32
comptime _NONE = UInt32(0xFFFFFFFF)


@always_inline
def _before(v: Float32, i: UInt32, bv: Float32, bi: UInt32) -> Bool:
    """(v, i) ranks before (bv, bi): larger logit, then lower id; NaN never."""
    return v > bv or (v == bv and i < bi)


@always_inline
def _softmax_term(v: Float32, vmax: Float32) -> Float32:
    """exp(v - vmax), 1 where v equals vmax (also both -inf: no NaN)."""
    return Float32(1.0) if v == vmax else exp(v - vmax)


@always_inline
def _key16[dtype: DType](x: Scalar[dtype], e: Int) -> UInt32:
    """An exact u32 rank key of a 16-bit float logit x of expert e < 65536:
    larger logit, then lower id, gives the larger key; NaN gives 0 (never
    chosen: every other key is above 0); -0 ranks as +0."""
    var b = UInt32(bitcast[DType.uint16, 1](x))
    b = 0 if b == 0x8000 else b
    var o = (b ^ 0xFFFF) if (b & 0x8000) != 0 else (b | 0x8000)
    return 0 if x != x else (o << 16) | UInt32(0xFFFF - e)


@always_inline
def _key16_value[dtype: DType](key: UInt32) -> Float32:
    """The logit a nonzero _key16 key was made from, as f32."""
    var o = key >> 16
    var b = (o ^ 0x8000) if (o & 0x8000) != 0 else (o ^ 0xFFFF)
    return bitcast[dtype, 1](UInt16(b)).cast[DType.float32]()


@always_inline
def warp_topk[
    in_dtype: DType, per_lane: Int
](row: Pointer[Scalar[in_dtype], _], n_experts: Int, top_k: Int) -> Tuple[Int32, Float32]:
    """Warp-wide: the top_k of one token's logits `row` [n_experts] (E <= 32 *
    per_lane). Lane k < top_k gets the k-th choice and its softmaxed weight
    ((-1, 0) when fewer than k are choosable); other lanes get (-1, 0)."""
    comptime if in_dtype == DType.bfloat16 or in_dtype == DType.float16:
        return _warp_topk_redux[in_dtype, per_lane](row, n_experts, top_k)
    return _warp_topk_shuffle[in_dtype, per_lane](row, n_experts, top_k)


@always_inline
def _warp_topk_redux[
    in_dtype: DType, per_lane: Int
](row: Pointer[Scalar[in_dtype], _], n_experts: Int, top_k: Int) -> Tuple[Int32, Float32]:
    """warp_topk for 16-bit logits: a round is one redux.sync max over the
    lanes' best keys; every lane sees every winner, so each sums the softmax
    itself (no shuffles)."""
    var lane = Int(lane_id())
    var keys = SIMD[DType.uint32, per_lane](0)
    comptime for j in range(per_lane):
        var e = lane + 32 * j
        if e < n_experts:
            keys[j] = _key16[in_dtype](row[unsafe_offset=e], e)
    var mine_v = Float32(0)
    var mine_i = Int32(-1)
    var vmax = Float32(0)
    var total = Float32(0)
    for k in range(top_k):
        var best = llvm_intrinsic["llvm.nvvm.redux.sync.umax", UInt32](keys.reduce_max(), UInt32(0xFFFFFFFF))
        if best == 0:  # nothing choosable is left
            break
        var v = _key16_value[in_dtype](best)
        if k == 0:
            vmax = v
        total += _softmax_term(v, vmax)
        if lane == k:
            mine_v = v
            mine_i = Int32(0xFFFF - Int(best & 0xFFFF))
        comptime for j in range(per_lane):
            if keys[j] == best:  # only its owner: keys are unique
                keys[j] = 0
    if mine_i < 0 or lane >= top_k:
        return (Int32(-1), Float32(0))
    return (mine_i, _softmax_term(mine_v, vmax) / total)


@always_inline
def _warp_topk_shuffle[
    in_dtype: DType, per_lane: Int
](row: Pointer[Scalar[in_dtype], _], n_experts: Int, top_k: Int) -> Tuple[Int32, Float32]:
    """warp_topk for f32 logits: a round is a butterfly of shuffles on (value, id)."""
    var lane = Int(lane_id())
    var v = Array[Float32, per_lane](fill=0)
    var free = Array[Bool, per_lane](fill=False)
    comptime for j in range(per_lane):
        var e = lane + 32 * j
        if e < n_experts:
            var x = row[unsafe_offset=e].cast[DType.float32]()
            v[j] = x
            free[j] = x == x  # NaN is never chosen
    var mine_v = Float32(0)
    var mine_i = _NONE
    var vmax = Float32(0)
    for k in range(top_k):
        var bv = Float32(0)
        var bi = _NONE
        comptime for j in range(per_lane):
            var e = UInt32(lane + 32 * j)
            if free[j] and (bi == _NONE or _before(v[j], e, bv, bi)):
                bv = v[j]
                bi = e
        comptime for s in range(5):
            var ov = shuffle_xor(bv, UInt32(16 >> s))
            var oi = shuffle_xor(bi, UInt32(16 >> s))
            if oi != _NONE and (bi == _NONE or _before(ov, oi, bv, bi)):
                bv = ov
                bi = oi
        # Every lane now holds the same winner; its owner retires it.
        if bi != _NONE and Int(bi) % 32 == lane:
            comptime for j in range(per_lane):
                if Int(bi) == lane + 32 * j:
                    free[j] = False
        if k == 0:
            vmax = bv
        if lane == k:
            mine_v = bv
            mine_i = bi
    var p = Float32(0)
    if lane < top_k and mine_i != _NONE:
        p = _softmax_term(mine_v, vmax)
    var total = p
    comptime for s in range(5):
        total += shuffle_xor(total, UInt32(16 >> s))
    if mine_i == _NONE or lane >= top_k:
        return (Int32(-1), Float32(0))
    return (Int32(mine_i), p / total if total > 0 else Float32(0))


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(ROUTER_WARPS * 32)))
def router_topk_kernel[
    in_dtype: DType, per_lane: Int
](
    ids: Pointer[Int32, MutAnyOrigin],
    weights: Pointer[Float32, MutAnyOrigin],
    logits: Pointer[Scalar[in_dtype], ImmutAnyOrigin],
    tokens_: Int64,
    n_experts_: Int64,
    top_k_: Int64,
):
    pdl_enter()
    var tokens = Int(tokens_)
    var n_experts = Int(n_experts_)
    var top_k = Int(top_k_)
    var t = Int(block_idx.x) * ROUTER_WARPS + Int(warp_id())
    if t >= tokens:
        return
    var lane = Int(lane_id())
    var mine = warp_topk[in_dtype, per_lane](logits.unsafe_offset(t * n_experts), n_experts, top_k)
    if lane < top_k:
        ids[unsafe_offset=t * top_k + lane] = mine[0]
        weights[unsafe_offset=t * top_k + lane] = mine[1]


def _launch[
    in_dtype: DType, per_lane: Int
](
    ctx: DeviceContext,
    ids: Pointer[Int32, MutAnyOrigin],
    weights: Pointer[Float32, MutAnyOrigin],
    logits: Pointer[Scalar[in_dtype], ImmutAnyOrigin],
    tokens: Int,
    n_experts: Int,
    top_k: Int,
) raises:
    ctx.enqueue_function[router_topk_kernel[in_dtype, per_lane]](
        ids,
        weights,
        logits,
        Int64(tokens),
        Int64(n_experts),
        Int64(top_k),
        grid_dim=(tokens + ROUTER_WARPS - 1) // ROUTER_WARPS,
        block_dim=ROUTER_WARPS * 32,
        attributes=pdl_attributes(tokens == 1),
    )


def check_topk(n_experts: Int, top_k: Int, who: StaticString) raises:
    if n_experts > ROUTER_MAX_EXPERTS or top_k > min(n_experts, ROUTER_MAX_K) or top_k < 1:
        raise Error(String(who) + ": needs 1 <= K <= min(E, 32) and E <= 256")


def router_topk[
    target: StaticString, in_dtype: DType
](
    idp: Pointer[Int32, MutAnyOrigin],
    wp: Pointer[Float32, MutAnyOrigin],
    lp: Pointer[Scalar[in_dtype], ImmutAnyOrigin],
    tokens: Int,
    n_experts: Int,
    top_k: Int,
    ctx: DeviceContext,
) raises:
    """ids [T, K], weights [T, K] from logits [T, E] (the rule above) on
    `target`; E, K as check_topk allows."""
    if tokens == 0:
        return
    comptime if target == "gpu":
        if n_experts <= 32:
            _launch[in_dtype, 1](ctx, idp, wp, lp, tokens, n_experts, top_k)
        elif n_experts <= 64:
            _launch[in_dtype, 2](ctx, idp, wp, lp, tokens, n_experts, top_k)
        elif n_experts <= 128:
            _launch[in_dtype, 4](ctx, idp, wp, lp, tokens, n_experts, top_k)
        else:
            _launch[in_dtype, 8](ctx, idp, wp, lp, tokens, n_experts, top_k)
        return

    def route_token[
        width: Int, alignment: Int = 1
    ](idx: Coord) {var idp, var wp, var lp, var n_experts, var top_k}:
        var t = coord_to_index_list(idx)[0]
        var row = lp.unsafe_offset(t * n_experts)
        var taken = Array[Bool, ROUTER_MAX_EXPERTS](fill=False)
        var vmax = Float32(0)
        var chosen = Array[Float32, ROUTER_MAX_K](fill=0)
        var total = Float32(0)
        var found = 0
        for k in range(top_k):
            var bv = Float32(0)
            var bi = _NONE
            for e in range(n_experts):
                var x = row[unsafe_offset=e].cast[DType.float32]()
                if taken[e] or x != x:
                    continue
                if bi == _NONE or _before(x, UInt32(e), bv, bi):
                    bv = x
                    bi = UInt32(e)
            if bi == _NONE:
                break
            taken[Int(bi)] = True
            if k == 0:
                vmax = bv
            chosen[k] = _softmax_term(bv, vmax)
            total += chosen[k]
            idp[unsafe_offset=t * top_k + k] = Int32(bi)
            found = k + 1
        for k in range(top_k):
            if k >= found:
                idp[unsafe_offset=t * top_k + k] = Int32(-1)
                wp[unsafe_offset=t * top_k + k] = Float32(0)
            else:
                wp[unsafe_offset=t * top_k + k] = chosen[k] / total

    elementwise[simd_width=1, target=target](route_token, Coord(tokens), ctx)


@extensibility.register("gptoss_router_topk")
struct RouterTopK:
    """Top-k experts of each token and their softmaxed weights.

    Boundary (contiguous, row-major):
      ids      [T, K] int32   chosen experts, best first (-1: none left)
      weights  [T, K] f32     softmax over the chosen k logits
      logits   [T, E] bf16 | f32   the router's output (bias included)
    E <= 256, K <= min(E, 32).
    """

    @staticmethod
    def execute[
        target: StaticString,
    ](
        ids: OutputTensor[dtype=DType.int32, rank=2, ...],
        weights: OutputTensor[dtype=DType.float32, rank=2, ...],
        logits: InputTensor[rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var n_experts = logits.dim_size[1]()
        var top_k = ids.dim_size[1]()
        check_topk(n_experts, top_k, "gptoss_router_topk")
        poison[target](ctx, ids.unsafe_ptr(), ids.size())
        poison[target](ctx, weights.unsafe_ptr(), weights.size())
        router_topk[target, logits.dtype](
            ids.unsafe_ptr(), weights.unsafe_ptr(), logits.unsafe_ptr(), logits.dim_size[0](), n_experts, top_k, ctx
        )
