"""MAX graph wrappers for the gpt-oss kernels.

Each wrapper runs its op on `x`'s device and loads the kernel package into the
current graph, so callers need not pass `custom_extensions` themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from max.dtype import DType
from max.graph import DeviceRef, Dim, Graph, StaticDim, TensorType, TensorValue, ops

from gptoss_max import mxfp4
from gptoss_max.kernels import kernels_path

if TYPE_CHECKING:
    from max.nn.kv_cache import PagedCacheValues

ACTIVATION_DTYPES = (DType.float32, DType.bfloat16)

# GPU kernel choice of the MXFP4 pair (moe_prefill_gpu.mojo): auto by
# routed pairs per expert, the decode kernel, or prefill tile config c.
PATH_AUTO = 0
PATH_DECODE = 1


def path_prefill(config: int) -> int:
    return 2 + config


def _load_kernels() -> None:
    graph = Graph.current
    path = kernels_path()
    if path not in graph.kernel_libraries_paths:
        graph._import_kernels([path])


def _check_dim(what: str, got: Dim, want: Dim) -> None:
    """Compare two dims where both are static; symbolic ones are left to run time."""
    if isinstance(got, StaticDim) and isinstance(want, StaticDim) and got != want:
        raise ValueError(f"{what}: expected {want}, got {got}")


def _as(value: TensorValue, dtype: DType) -> TensorValue:
    return value if value.dtype == dtype else ops.cast(value, dtype)


def _routing(x: TensorValue, topk_ids: TensorValue, topk_weights: TensorValue) -> tuple[TensorValue, TensorValue]:
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.rank != 2 or topk_ids.rank != 2 or topk_weights.rank != 2:
        raise ValueError("x, topk_ids and topk_weights must be rank 2")
    _check_dim("topk_ids tokens", topk_ids.shape[0], x.shape[0])
    _check_dim("topk_weights shape", topk_weights.shape[1], topk_ids.shape[1])
    return _as(topk_ids, DType.int32), _as(topk_weights, DType.float32)


def _run_moe(
    kind: str,
    x: TensorValue,
    topk_ids: TensorValue | TensorType,
    topk_weights: TensorValue | TensorType,
    gate_up: list[TensorValue],
    down: list[TensorValue],
    intermediate: Dim,
    path: int | TensorValue = PATH_AUTO,
    logits: TensorValue | None = None,
) -> TensorValue:
    _load_kernels()
    tokens, top_k = topk_ids.shape
    h_type = TensorType(DType.float32, [tokens, top_k, intermediate], x.device)
    out_type = TensorType(x.dtype, x.shape, x.device)
    if kind != "mxfp4":
        h = ops.custom(f"gptoss_moe_gate_up_{kind}", x.device, [x, topk_ids, *gate_up], [h_type])[0].tensor
        return ops.custom(f"gptoss_moe_down_{kind}", x.device, [h, topk_ids, topk_weights, *down], [out_type])[0].tensor
    # The MXFP4 pair also passes tile counters (zeroed by gate_up) and a
    # per-(token, k) scratch for the GPU path's combine; see moe_gpu.mojo.
    # `path` picks the GPU kernel (moe_prefill_gpu.prefill_choice); both
    # ops get the same one.
    hidden = x.shape[1]
    counters_type = TensorType(DType.uint32, [counter_count(hidden)], x.device)
    path_value = ops.constant(path, DType.int32, device=DeviceRef.CPU()) if isinstance(path, int) else path
    if logits is None:
        h, counters = ops.custom(
            "gptoss_moe_gate_up_mxfp4", x.device, [x, topk_ids, *gate_up, path_value], [h_type, counters_type]
        )
    else:  # the routing comes out of gate_up; topk_ids only gave its shape
        h, counters, topk_ids, topk_weights = ops.custom(
            "gptoss_moe_route_gate_up_mxfp4",
            x.device,
            [x, logits, *gate_up, path_value],
            [
                h_type,
                counters_type,
                TensorType(DType.int32, [tokens, top_k], x.device),
                TensorType(DType.float32, [tokens, top_k], x.device),
            ],
        )
    # With the routing out of gate_up, down also gets the logits: a one-token step on the GPU takes
    # the same top-k itself, so it can start streaming before gate_up ends (PDL).
    down_name, routing = (
        ("gptoss_moe_down_mxfp4", [topk_ids, topk_weights])
        if logits is None
        else ("gptoss_moe_route_down_mxfp4", [topk_ids, topk_weights, logits])
    )
    out, _partial = ops.custom(
        down_name,
        x.device,
        [h, *routing, *down, counters, path_value],
        [out_type, TensorType(DType.float32, [tokens, top_k, hidden], x.device)],
    )
    return out.tensor


# moe_fused_gpu.mojo's SYNC_WORDS: the fused one-token launch's counters.
ONE_TOKEN_SYNC_WORDS = 6


def moe_mxfp4_one_token(
    x: TensorValue,  # [1, H] bf16
    topk_ids: TensorValue,  # [1, K] int32
    topk_weights: TensorValue,  # [1, K] f32
    gate_up_blocks: TensorValue,
    gate_up_scales: TensorValue,
    gate_up_bias: TensorValue,
    down_blocks: TensorValue,
    down_scales: TensorValue,
    down_bias: TensorValue,
    sync: TensorValue,  # [ONE_TOKEN_SYNC_WORDS] uint32, zero; the launch leaves it zero
) -> TensorValue:  # [1, H] bf16
    """`moe_mxfp4` for one token of a bf16 graph as one GPU launch (gptoss_moe_one_token_mxfp4:
    gate_up and down in one grid, the down's loads started before its h is done). A probe for
    bench/moe.py (`--fused`), GPU only; the model does not use it."""
    _load_kernels()
    tokens, top_k = topk_ids.shape
    inter = down_blocks.shape[2] * 2
    h_type = TensorType(DType.float32, [tokens, top_k, inter], x.device)
    out_type = TensorType(x.dtype, x.shape, x.device)
    weights = [gate_up_blocks, gate_up_scales, _as(gate_up_bias, DType.float32)]
    weights += [down_blocks, down_scales, _as(down_bias, DType.float32)]
    out, _h = ops.custom(
        "gptoss_moe_one_token_mxfp4", x.device, [x, topk_ids, topk_weights, *weights, sync], [out_type, h_type]
    )
    return out.tensor


# moe_gpu.mojo's COUNTER_TILE_ROWS: one counter per 8 output rows of down.
COUNTER_TILE_ROWS = 8


def counter_count(hidden: Dim) -> Dim:
    return (hidden + (COUNTER_TILE_ROWS - 1)) // COUNTER_TILE_ROWS


def moe_mxfp4(
    x: TensorValue,  # [T, H] bf16 | f32
    topk_ids: TensorValue,  # [T, K] int32
    topk_weights: TensorValue,  # [T, K] f32, softmaxed over the top-k
    gate_up_blocks: TensorValue,  # [E, 2I, H/2] u8, rows interleaved gate/up; MXFP4 bytes and scales
    # in the tiled order of gptoss_max.mxfp4.tile_for_op (2I, H % 16; H, I % 64)
    gate_up_scales: TensorValue,  # [E, 2I, H/32] u8
    gate_up_bias: TensorValue,  # [E, 2I] f32
    down_blocks: TensorValue,  # [E, H, I/2] u8
    down_scales: TensorValue,  # [E, H, I/32] u8
    down_bias: TensorValue,  # [E, H] f32
    path: int | TensorValue = PATH_AUTO,  # or a CPU int32 scalar (benchmarks)
    big: tuple[TensorValue, TensorValue] | None = None,  # gate_up's and down's `big` flags
) -> TensorValue:  # [T, H] x.dtype
    """gpt-oss experts with MXFP4 weights, reading only the routed experts.
    On the GPU, `path` (PATH_AUTO by default) picks the decode kernel or the
    prefill grouped GEMM; the CPU ignores it. `big`: each projection's
    `mxfp4.big_scale_groups` of its scales ([E, rows / 16] u8), computed
    once when the weights are loaded; without it the graph computes them from
    the scales on every run (exact, but a pass over every scale byte)."""
    topk_ids, topk_weights = _routing(x, topk_ids, topk_weights)
    experts = (gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    return _mxfp4_experts(x, topk_ids, topk_weights, experts, path, None, big)


def moe_mxfp4_routed(
    x: TensorValue,  # [T, H] bf16 | f32
    logits: TensorValue,  # [T, E] x.dtype: the router's output
    top_k: int,
    gate_up_blocks: TensorValue,
    gate_up_scales: TensorValue,
    gate_up_bias: TensorValue,
    down_blocks: TensorValue,
    down_scales: TensorValue,
    down_bias: TensorValue,
    path: int | TensorValue = PATH_AUTO,
    big: tuple[TensorValue, TensorValue] | None = None,
) -> TensorValue:  # [T, H] x.dtype
    """`moe_mxfp4(x, *router_topk(logits, top_k), ...)` with the top-k inside the experts' first op
    (gptoss_moe_route_gate_up_mxfp4): on the GPU a one-token step then has no top-k launch of its
    own. Same values as the two ops (tests/test_moe_op.py)."""
    if logits.dtype != x.dtype or logits.rank != 2:
        raise TypeError(f"logits must be a rank-2 {x.dtype} tensor, got {logits.dtype} rank {logits.rank}")
    _check_dim("logits experts", logits.shape[1], gate_up_blocks.shape[0])
    _check_router(logits.shape[1], top_k)
    tokens = x.shape[0]
    # placeholders that carry the routing's types into _run_moe (never computed)
    ids_type = TensorType(DType.int32, [tokens, top_k], x.device)
    wts_type = TensorType(DType.float32, [tokens, top_k], x.device)
    experts = (gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    return _mxfp4_experts(x, ids_type, wts_type, experts, path, logits, big)


def _mxfp4_experts(
    x: TensorValue,
    topk_ids: TensorValue | TensorType,
    topk_weights: TensorValue | TensorType,
    experts: tuple[TensorValue, ...],  # moe_mxfp4's six expert tensors, in its order
    path: int | TensorValue,
    logits: TensorValue | None,
    big: tuple[TensorValue, TensorValue] | None = None,
) -> TensorValue:
    gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = experts
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    n_experts, rows, half_h = gate_up_blocks.shape
    _check_dim("gate_up_blocks last dim", half_h * 2, x.shape[1])
    _check_dim("gate_up_scales", gate_up_scales.shape[2] * 32, x.shape[1])
    _check_dim("down_blocks rows", down_blocks.shape[1], x.shape[1])
    _check_dim("down_blocks last dim", down_blocks.shape[2] * 4, rows)
    _check_dim("down_scales", down_scales.shape[2] * 64, rows)
    _check_dim("down_blocks experts", down_blocks.shape[0], n_experts)
    for rows_dim, k_dim in ((rows, x.shape[1]), (down_blocks.shape[1], down_blocks.shape[2] * 2)):
        if isinstance(rows_dim, StaticDim) and isinstance(k_dim, StaticDim):
            mxfp4.check_tileable(int(rows_dim), int(k_dim) // mxfp4.BLOCK)
    if big is None:
        big = (big_scale_groups(gate_up_scales), big_scale_groups(down_scales))
    gate_up_big, down_big = big
    return _run_moe(
        "mxfp4",
        x,
        topk_ids,
        topk_weights,
        [gate_up_blocks, gate_up_scales, _as(gate_up_bias, DType.float32), gate_up_big],
        [down_blocks, down_scales, _as(down_bias, DType.float32), down_big],
        down_blocks.shape[2] * 2,
        path,
        logits,
    )


def big_scale_groups(scales: TensorValue) -> TensorValue:
    """`mxfp4.big_scale_groups` in the graph: `scales [E, rows, nb]` u8 (rows a multiple of 16,
    as the tiled layout needs; the op checks it) -> `[E, rows / 16]` u8, 1 where a scale byte of
    the group's 16 rows is above 128."""
    e, rows, nb = scales.shape
    g = mxfp4.TILE_ROWS
    wide = ops.cast(scales, DType.int32).rebind([e, (rows // g) * g, nb])
    peak = ops.max(ops.reshape(wide, [e, rows // g, nb * g]), axis=-1)  # [E, rows / 16, 1]
    return ops.cast(ops.reshape(ops.greater(peak, mxfp4.BIG_SCALE), [e, rows // g]), DType.uint8)


def moe_bf16(
    x: TensorValue,  # [T, H] bf16 | f32
    topk_ids: TensorValue,  # [T, K] int32
    topk_weights: TensorValue,  # [T, K] f32
    gate_up_weight: TensorValue,  # [E, 2I, H] bf16, rows interleaved gate/up
    gate_up_bias: TensorValue,  # [E, 2I] f32
    down_weight: TensorValue,  # [E, H, I] bf16
    down_bias: TensorValue,  # [E, H] f32
) -> TensorValue:  # [T, H] x.dtype
    """gpt-oss experts with dense (bf16) weights, reading only routed experts."""
    topk_ids, topk_weights = _routing(x, topk_ids, topk_weights)
    _check_dim("gate_up_weight last dim", gate_up_weight.shape[2], x.shape[1])
    _check_dim("down_weight rows", down_weight.shape[1], x.shape[1])
    _check_dim("down_weight last dim", down_weight.shape[2] * 2, gate_up_weight.shape[1])
    return _run_moe(
        "bf16",
        x,
        topk_ids,
        topk_weights,
        [gate_up_weight, _as(gate_up_bias, DType.float32)],
        [down_weight, _as(down_bias, DType.float32)],
        down_weight.shape[2],
    )


ROUTER_MAX_EXPERTS = 256  # router_topk.mojo
ROUTER_MAX_K = 32


def _check_router(n_experts: Dim, k: int) -> None:
    """The top-k's bounds (router_topk.mojo), where E is static."""
    if isinstance(n_experts, StaticDim) and not (1 <= k <= min(int(n_experts), ROUTER_MAX_K)):
        raise ValueError(f"k must be in [1, min(E, {ROUTER_MAX_K})], got k={k} with E={int(n_experts)}")
    if isinstance(n_experts, StaticDim) and int(n_experts) > ROUTER_MAX_EXPERTS:
        raise ValueError(f"router_topk takes at most {ROUTER_MAX_EXPERTS} experts, got {int(n_experts)}")


def router_topk(logits: TensorValue, k: int) -> tuple[TensorValue, TensorValue]:
    """`logits [T, E]` (bf16 | f32, the router's output) -> (`ids [T, k]` int32, best first;
    `weights [T, k]` f32, the softmax over those k logits), in one op (router_topk.mojo). Ties go
    to the lower expert id; NaN logits are never chosen (id -1, weight 0 when fewer than k are
    left)."""
    if logits.dtype not in ACTIVATION_DTYPES or logits.rank != 2:
        raise TypeError(f"logits must be a rank-2 float32 or bfloat16 tensor, got {logits.dtype} rank {logits.rank}")
    _check_router(logits.shape[1], k)
    _load_kernels()
    tokens = logits.shape[0]
    ids, weights = ops.custom(
        "gptoss_router_topk",
        logits.device,
        [logits],
        [TensorType(DType.int32, [tokens, k], logits.device), TensorType(DType.float32, [tokens, k], logits.device)],
    )
    return ids.tensor, weights.tensor


ROUTER_DECODE_MAX_TOKENS = 4  # router_decode.mojo's one-launch GPU bound (RD_MAX_TOKENS)
ROUTER_DECODE_GPU_MAX_TOKENS = 64  # its GPU bound (RD_MAX_STEP): norm + tensor-core projection past 4


def router_decode_bound(hidden: int, most: int) -> int:
    """The largest step, up to `most`, that a caller may hand router_decode's GPU path for this
    hidden size: past ROUTER_DECODE_MAX_TOKENS it projects on tensor cores, which need H % 32 == 0."""
    return min(most, ROUTER_DECODE_GPU_MAX_TOKENS if hidden % 32 == 0 else ROUTER_DECODE_MAX_TOKENS)


def router_decode(
    attn: TensorValue,
    residual: TensorValue,
    gamma: TensorValue,
    eps: float,
    weight: TensorValue,
    bias: TensorValue,
) -> tuple[TensorValue, TensorValue, TensorValue]:
    """The head of a decode step's MoE block in one op (router_decode.mojo), all bf16:
    `h = residual + attn`, `xn = rms_norm(h, gamma, eps)` (f32 inside, the weight applied before
    the cast) and `logits = xn @ weight^T + bias`. Returns (h, xn, logits). Any such head fits,
    not only the router's (the model's qkv heads use it too). The GPU path takes H <= 4096 and
    T <= ROUTER_DECODE_MAX_TOKENS in one launch, or up to ROUTER_DECODE_GPU_MAX_TOKENS with
    H % 32 == 0 in two (the norm, then gemv's tensor-core projection); a caller dispatches larger
    steps to the unfused ops. The CPU path takes any T."""
    for name, v, rank in (
        ("attn", attn, 2), ("residual", residual, 2), ("gamma", gamma, 1), ("weight", weight, 2), ("bias", bias, 1),
    ):  # fmt: skip
        if v.dtype != DType.bfloat16 or v.rank != rank:
            raise TypeError(f"{name} must be a rank-{rank} bfloat16 tensor, got {v.dtype} rank {v.rank}")
    hidden = attn.shape[1]
    _check_dim("residual tokens", residual.shape[0], attn.shape[0])
    _check_dim("residual H", residual.shape[1], hidden)
    _check_dim("gamma H", gamma.shape[0], hidden)
    _check_dim("weight H", weight.shape[1], hidden)
    _check_dim("bias E", bias.shape[0], weight.shape[0])
    if isinstance(hidden, StaticDim) and int(hidden) % 8:
        raise ValueError(f"router_decode needs H % 8 == 0, got H={int(hidden)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    _load_kernels()
    tokens = attn.shape[0]
    dev = attn.device
    h, xn, logits = ops.custom(
        "gptoss_router_decode",
        dev,
        [attn, residual, gamma, weight, bias],
        [
            TensorType(DType.bfloat16, [tokens, hidden], dev),
            TensorType(DType.bfloat16, [tokens, hidden], dev),
            TensorType(DType.bfloat16, [tokens, weight.shape[0]], dev),
        ],
        parameters={"eps": float(eps)},
    )
    return h.tensor, xn.tensor, logits.tensor


def gemv(x: TensorValue, weight: TensorValue, bias: TensorValue, staged: bool = True, tc: bool = False) -> TensorValue:
    """`x [T, K] @ weight[N, K]^T + bias [N]`, all bf16 (gemv.mojo) for decode steps. GPU:
    `tc` takes tensor cores (16 weight rows per block, K split over its warps) for T <= 64 and
    K % 32 == 0; else a warp per output row for T <= 2 and K <= 4096, `staged` staging each row
    in shared memory by cp.async (else registers). A caller dispatches larger steps to a matmul.
    The CPU path takes any T (the same f32 sum whatever the flags)."""
    for name, v, rank in (("x", x, 2), ("weight", weight, 2), ("bias", bias, 1)):
        if v.dtype != DType.bfloat16 or v.rank != rank:
            raise TypeError(f"{name} must be a rank-{rank} bfloat16 tensor, got {v.dtype} rank {v.rank}")
    _check_dim("weight K", weight.shape[1], x.shape[1])
    _check_dim("bias N", bias.shape[0], weight.shape[0])
    k = x.shape[1]
    if isinstance(k, StaticDim) and int(k) % 8:
        raise ValueError(f"gemv needs K % 8 == 0, got K={int(k)}")
    if tc and isinstance(k, StaticDim) and int(k) % 32:
        raise ValueError(f"gemv(tc=True) needs K % 32 == 0, got K={int(k)}")
    _load_kernels()
    (y,) = ops.custom(
        "gptoss_gemv",
        x.device,
        [x, weight, bias],
        [TensorType(DType.bfloat16, [x.shape[0], weight.shape[0]], x.device)],
        parameters={"staged": staged, "tc": tc},
    )
    return y.tensor


def tap(x: TensorValue, label: str, after: TensorValue | None = None) -> TensorValue:
    """`x`, through `gptoss_tap` when `GPTOSS_MAX_TAP` is on at graph build (x itself otherwise):
    every run then prints `gptoss_tap <tag> <elements> <hash of x's bits>`. Tags number the current
    graph's taps in build order; building prints `gptoss_tap_label <tag> <label>` once for each.
    `after` (rank 2, not read): a tensor of the step, for taps of weights, which MAX would
    otherwise run once at load."""
    from gptoss_max import settings

    if not settings.tap_enabled():
        return x
    if x.dtype not in ACTIVATION_DTYPES or x.rank < 2:
        raise TypeError(f"tap takes a float32 or bfloat16 tensor of rank >= 2, got {x.dtype} rank {x.rank}")
    _load_kernels()
    graph = Graph.current
    tag = getattr(graph, "_gptoss_taps", 0)
    graph._gptoss_taps = tag + 1  # type: ignore[attr-defined]
    print(f"gptoss_tap_label {tag} {label}", flush=True)
    flat = x if x.rank == 2 else ops.reshape(x, [x.shape[0], -1])
    out = ops.custom(
        "gptoss_tap",
        x.device,
        [flat, ops.constant(tag, DType.int32, device=DeviceRef.CPU()), flat if after is None else after],
        [TensorType(x.dtype, flat.shape, x.device)],
    )[0].tensor
    return out if x.rank == 2 else ops.reshape(out, x.shape)


def mxfp4_decode(
    blocks: TensorValue,  # [..., n/2] u8
    scales: TensorValue,  # [..., n/32] u8
) -> TensorValue:  # [..., n] f32
    """Decodes MXFP4 with the same device function the MoE kernels use."""
    _check_dim("blocks vs scales", blocks.shape[-1], scales.shape[-1] * 16)
    _load_kernels()
    lead = list(blocks.shape[:-1])
    rows = _prod(lead)
    n = blocks.shape[-1] * 2
    flat = ops.custom(
        "gptoss_mxfp4_decode",
        blocks.device,
        [
            ops.reshape(blocks, [rows, blocks.shape[-1]]),
            ops.reshape(scales, [rows, scales.shape[-1]]),
        ],
        [TensorType(DType.float32, [rows, n], blocks.device)],
    )[0].tensor
    return flat if len(lead) == 1 else ops.reshape(flat, [*lead, n])


def _prod(dims: list[Dim]) -> Dim:
    total: Dim = StaticDim(1)
    for d in dims:
        total = total * d
    return total


# attention_gpu.mojo's SPLIT_TOKENS: rows of the GPU path's split-partials scratch.
ATTENTION_SPLIT_ROWS = 16


def _attention_inputs(
    kv_collection: PagedCacheValues,
    layer_idx: TensorValue,
    input_row_offsets: TensorValue,
    sinks: TensorValue,
    n_heads: Dim,
    head_dim: int,
    scale: float,
    window: int | None,
) -> list[TensorValue]:
    """The inputs both attention ops take after their own (q or qkv + table), checked: the row
    offsets, the paged cache, sinks, then layer_idx, scale and window as CPU scalars."""
    if kv_collection.kv_scales is not None or kv_collection.kv_blocks_per_layer is not None:
        raise NotImplementedError("quantized or per-layer KV buffers")
    if layer_idx.dtype != DType.uint32 or input_row_offsets.dtype != DType.uint32:
        raise TypeError("layer_idx and input_row_offsets must be uint32")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    _check_dim("sinks", sinks.shape[0], Dim(n_heads))
    _check_dim("kv head_dim", kv_collection.kv_blocks.shape[5], StaticDim(head_dim))
    cpu = DeviceRef.CPU()
    return [
        input_row_offsets,
        kv_collection.kv_blocks,
        kv_collection.page_stride,
        kv_collection.cache_lengths,
        kv_collection.lookup_table,
        sinks,
        layer_idx,
        ops.constant(scale, DType.float32, device=cpu),
        ops.constant(window or 0, DType.int32, device=cpu),
    ]


def _attention_out_types(dtype: DType, tokens: Dim, n_heads: Dim, head_dim: int, device: DeviceRef) -> list[TensorType]:
    return [
        TensorType(dtype, [tokens, n_heads, head_dim], device),
        # attention_gpu.mojo's SPLIT_TOKENS rows of per-split partials (m, l, acc)
        TensorType(DType.float32, [ATTENTION_SPLIT_ROWS, n_heads, head_dim + 2], device),
    ]


def attention_with_sinks(
    xq: TensorValue,  # [T, n_heads, head_dim], roped, kv dtype
    kv_collection: PagedCacheValues,  # this step's K/V already stored
    layer_idx: TensorValue,  # uint32 scalar on CPU
    input_row_offsets: TensorValue,  # [B + 1] uint32
    sinks: TensorValue,  # [n_heads]
    scale: float,
    window: int | None,
) -> TensorValue:  # [T, n_heads, head_dim] xq.dtype
    """Causal attention with per-head sink logits over MAX's paged KV cache;
    `window` limits token p to positions [p - window + 1, p]. The layout it
    reads is written down in attention_sinks.mojo."""
    if xq.rank != 3 or not isinstance(xq.shape[2], StaticDim):
        raise ValueError(f"xq must be [T, n_heads, head_dim] with static head_dim, got {xq.shape}")
    n_heads, head_dim = xq.shape[1], int(xq.shape[2])
    rest = _attention_inputs(kv_collection, layer_idx, input_row_offsets, sinks, n_heads, head_dim, scale, window)
    _load_kernels()
    return ops.inplace_custom(
        "gptoss_attention_with_sinks",
        xq.device,
        [xq, *rest],
        out_types=_attention_out_types(xq.dtype, xq.shape[0], n_heads, head_dim, xq.device),
        parameters={"head_dim": head_dim},
    )[0].tensor


def attention_rope_with_sinks(
    qkv: TensorValue,  # [T, (n_heads + 2 n_kv) * head_dim]: q heads, K heads, V heads; not roped
    freqs_cis: TensorValue,  # [positions, head_dim]: MAX's RoPE table, (cos, sin) of frequency i at 2i, 2i + 1
    kv_collection: PagedCacheValues,  # this step's K/V NOT yet stored: this op stores them
    layer_idx: TensorValue,  # uint32 scalar on CPU
    input_row_offsets: TensorValue,  # [B + 1] uint32
    sinks: TensorValue,  # [n_heads]
    n_heads: int,
    scale: float,
    window: int | None,
) -> TensorValue:  # [T, n_heads, head_dim] qkv.dtype
    """RoPE (rotate-half) + this step's K/V store + `attention_with_sinks`, as one op: what MAX's
    `rope_split_store_ragged(..., interleaved=False)` then `attention_with_sinks` compute. On a GPU, a
    pure decode step (one new token per sequence) of gpt-oss's attention shape is one launch."""
    head_dim = int(kv_collection.kv_blocks.shape[5])
    n_kv = int(kv_collection.kv_blocks.shape[4])
    if qkv.rank != 2 or qkv.shape[1] != StaticDim((n_heads + 2 * n_kv) * head_dim):
        raise ValueError(f"qkv must be [T, {(n_heads + 2 * n_kv) * head_dim}], got {qkv.shape}")
    if freqs_cis.rank != 2 or freqs_cis.shape[1] != StaticDim(head_dim):
        raise ValueError(f"freqs_cis must be [positions, {head_dim}], got {freqs_cis.shape}")
    if freqs_cis.device != qkv.device:
        raise ValueError(f"freqs_cis is on {freqs_cis.device}, qkv on {qkv.device}")
    rest = _attention_inputs(kv_collection, layer_idx, input_row_offsets, sinks, n_heads, head_dim, scale, window)
    _load_kernels()
    out_types = _attention_out_types(qkv.dtype, qkv.shape[0], n_heads, head_dim, qkv.device)
    out_types.append(out_types[0])  # xq, the roped q: the output's type
    return ops.inplace_custom(
        "gptoss_attention_rope_sinks",
        qkv.device,
        [qkv, freqs_cis, *rest],
        out_types=out_types,
        parameters={"head_dim": head_dim},
    )[0].tensor
