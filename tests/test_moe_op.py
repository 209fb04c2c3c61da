"""MoE and MXFP4-decode ops against the NumPy reference.

Runs on the CPU, and also on the GPU where one is present. Each graph compiles
once per device (symbolic dims, so every case shares it) and returns the op's
result for float32 and for bfloat16 activations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from gptoss_max import mxfp4
from gptoss_max.kernels import reference
from op_graphs import host_outputs, op_devices, poisons_that_differ, repeats_that_differ
from reporting import report

pytestmark = pytest.mark.slow

F32_REL_TOL = 1e-5
BF16_REL_TOL = 1e-2


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    routing: str = "random"  # random | busy | few | dropped (some ids -1 or E)
    x_scale: float = 1.0
    # > 0: one down weight of that size in row 9, last column: its MXFP4 block
    # gets a scale byte above 128 (two-multiply decode), in the second half
    # of a 16-row tile and of I, which a one-token GPU down warp pair splits.
    outlier: float = 0.0


# Shapes keep the op's tiled MXFP4 layout possible: rows % 16 == 0, H and I % 64 == 0.
CASES = [
    Case("one_token", 1, 8, 4, 64, 64),
    Case("t64", 64, 8, 4, 128, 128),
    Case("busy_expert", 33, 8, 4, 64, 128, routing="busy"),
    Case("idle_experts", 20, 16, 2, 128, 64, routing="few"),
    Case("top4_of_128", 13, 128, 4, 64, 64),
    Case("t77_clamped", 77, 8, 4, 128, 64, x_scale=4.0),
    Case("top1", 9, 4, 1, 64, 64),
    Case("dropped_slots", 11, 8, 4, 64, 64, routing="dropped"),
    Case("one_token_big_scale", 1, 8, 4, 64, 64, outlier=40.0),
    # one-token GPU kernels (slot = pair, experts summed in the down block):
    # an id of -1 and one of E, fewer slots than 4, more than 4 (general down)
    Case("one_token_dropped", 1, 8, 4, 64, 64, routing="dropped"),
    Case("one_token_top2", 1, 4, 2, 64, 128),
    Case("one_token_top8", 1, 16, 8, 64, 64),
    # the GPU's multi-token down with top_k above its 4-wide combine rounds (k 4, 5 added
    # serially) over three 64-row tiles
    Case("t20_top6", 20, 16, 6, 192, 64),
    # 144 routed pairs per expert: the GPU prefill's 160-token tiles (c9, wgmma N = 128 + 32),
    # and for experts past 160 pairs a second, smaller tile
    Case("t288_c9", 288, 8, 4, 128, 128),
    # 128 pairs per expert over 64 experts: c10 (128-token tiles, and each expert's last <= 32
    # pairs absorbed into a two-part tile by a second launch)
    Case("t2048_c10", 2048, 64, 4, 64, 64),
    # a scale byte above 128 in one 16-row group of down's first 64 rows only: the GPU prefill GEMM
    # (c5) must run one scale path per warpgroup (wgmma is warpgroup-collective), not one per warp
    Case("t77_prefill_big_scale", 77, 8, 4, 128, 128, outlier=40.0),
    # K long enough for the GPU decode kernels' weight rings to wrap: 50 MXFP4 blocks are 13
    # batches of 4 (the last one partial), an odd count for rings loaded in halves of 1, 2 or 4
    # batches. Two tokens: on the GPU the one-token kernels' slots (moe_gpu.as_slots; the
    # few-token gate_up's lean pairs, one expert shared by both tokens, only with SLOT_TOKENS
    # below 2); eight: the many-token gate_up's lean pairs, then (long I) the many-token down's
    Case("two_tokens_long_k", 2, 8, 4, 1600, 64, routing="busy"),
    Case("t8_long_k", 8, 32, 4, 1600, 64, routing="busy"),
    Case("t8_long_i", 8, 32, 4, 64, 1600, routing="busy"),
    # two tokens with ids of -1 and E among their slots, and two tokens over top_k 8 (more slots
    # than a one-token down block holds)
    Case("two_tokens_dropped", 2, 8, 4, 64, 64, routing="dropped"),
    Case("two_tokens_top8", 2, 16, 8, 64, 64),
    # more than two tokens whose pairs are few beside the experts (tokens * top_k * 8 <= E) also
    # take the one-token kernels' slots on the GPU (moe_gpu.as_slots): four tokens over 128
    # experts, and an odd count of three with ids of -1 and E
    Case("t4_of_128_slots", 4, 128, 4, 64, 128),
    Case("t3_of_64_slots_dropped", 3, 64, 2, 128, 64, routing="dropped"),
]


@dataclass
class Target:
    """A device with its session; graphs built for it compile on first use."""

    name: str
    device: Any
    session: Any

    @property
    def ref(self):
        from max.graph import DeviceRef

        return DeviceRef.from_device(self.device)

    def compile(self, name: str, forward, input_types):
        from max.graph import Graph

        start = time.perf_counter()
        graph = Graph(f"{name}_{self.name}", forward=forward, input_types=input_types)
        model = self.session.load(graph)
        report("moe op fidelity", f"compile {name} ({self.name}): {time.perf_counter() - start:.1f} s")
        return model

    def run(self, model, *arrays: np.ndarray) -> list[np.ndarray]:
        from max.driver import CPU, Buffer

        args = [Buffer.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        return [o.to(CPU()).to_numpy() for o in model.execute(*args)]


@pytest.fixture(scope="module", params=op_devices())
def target(request: pytest.FixtureRequest) -> Target:
    from max.driver import CPU, Accelerator
    from max.engine import InferenceSession

    device = Accelerator() if request.param == "gpu" else CPU()
    return Target(request.param, device, InferenceSession(devices=[device]))


def _routing_types(cpu):
    from max.dtype import DType
    from max.graph import TensorType

    return [
        TensorType(DType.float32, ["T", "H"], cpu),
        TensorType(DType.int32, ["T", "K"], cpu),
        TensorType(DType.float32, ["T", "K"], cpu),
    ]


def _both_activations(moe, x, *rest):
    """[moe(x) in f32, moe(bf16(x)) cast back to f32]."""
    from max.dtype import DType
    from max.graph import ops

    out_bf16 = moe(ops.cast(x, DType.bfloat16), *rest)
    return moe(x, *rest), ops.cast(out_bf16, DType.float32)


@pytest.fixture(scope="module")
def mxfp4_model(target: Target):
    from gptoss_max.kernels import ops

    types = _routing_types(target.ref) + _mxfp4_weight_types(target.ref)
    return target.compile("moe_mxfp4", lambda *a: _both_activations(ops.moe_mxfp4, *a), types)


def _mxfp4_weight_types(dev):
    """The six expert tensors of ops.moe_mxfp4 (tiled MXFP4 blocks and scales, f32 biases)."""
    from max.dtype import DType
    from max.graph import TensorType

    u8, f32 = DType.uint8, DType.float32
    return [
        TensorType(u8, ["E", "R", "Hb"], dev),
        TensorType(u8, ["E", "R", "Hs"], dev),
        TensorType(f32, ["E", "R"], dev),
        TensorType(u8, ["E", "H", "Ib"], dev),
        TensorType(u8, ["E", "H", "Is"], dev),
        TensorType(f32, ["E", "H"], dev),
    ]


@pytest.fixture(scope="module")
def bf16_model(target: Target):
    """Weights enter as f32 and are cast to bf16 in the graph (numpy has no bf16)."""
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    cpu = target.ref
    f32 = DType.float32
    types = _routing_types(cpu) + [
        TensorType(f32, ["E", "R", "H"], cpu),
        TensorType(f32, ["E", "R"], cpu),
        TensorType(f32, ["E", "H", "I"], cpu),
        TensorType(f32, ["E", "H"], cpu),
    ]

    def forward(x, ids, w, gu, gu_b, down, down_b):
        gu, down = gops.cast(gu, DType.bfloat16), gops.cast(down, DType.bfloat16)
        return _both_activations(ops.moe_bf16, x, ids, w, gu, gu_b, down, down_b)

    return target.compile("moe_bf16", forward, types)


def _make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    t, e, k, h, i = case.tokens, case.experts, case.top_k, case.hidden, case.inter
    x = (case.x_scale * rng.standard_normal((t, h))).astype(np.float32)
    if case.routing == "busy":  # expert e-1 in every token's top-k
        others = [rng.choice(e - 1, k - 1, replace=False) for _ in range(t)]
        ids = np.stack([np.concatenate([[e - 1], o]) for o in others])
    elif case.routing == "few":  # only experts 1 and e-2 get tokens
        ids = np.stack([rng.permutation([1, e - 2])[:k] for _ in range(t)])
    else:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    if case.routing == "dropped":
        ids[rng.random(ids.shape) < 0.3] = -1
        ids[0, -1] = e
    logits = rng.standard_normal((t, k))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    gate_up = rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)
    down = rng.standard_normal((e, h, i)) / np.sqrt(i)
    if case.outlier:
        down[:, 9, -1] = case.outlier
    gate_up_bias = 0.5 * rng.standard_normal((e, 2 * i))
    down_bias = 0.5 * rng.standard_normal((e, h))
    f32 = np.float32
    return (
        x,
        ids.astype(np.int32),
        weights.astype(f32),
        gate_up.astype(f32),
        gate_up_bias.astype(f32),
        down.astype(f32),
        down_bias.astype(f32),
    )


def _check(case: Case, label: str, out: np.ndarray, ref: np.ndarray, tol: float, record) -> None:
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{label}: non-finite output"
    rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    worst = float(np.abs(out - ref).max() / np.abs(ref).max())
    report("moe op fidelity", f"{case.name:>13} {label:<15} rel {rel:.2e}  max|err|/max|ref| {worst:.2e}")
    record(f"{label}_rel_err", rel)
    assert rel <= tol, f"{label}: relative error {rel:.3e} > {tol}"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max(), err_msg=label)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_moe_mxfp4(case: Case, target: Target, mxfp4_model, record_property) -> None:
    x, ids, w, gate_up, gu_bias, down, down_bias = _make_inputs(case)
    gub, gus = mxfp4.encode(gate_up)
    db, ds = mxfp4.encode(down)
    gub = gub.reshape(*gus.shape[:-1], -1)  # [E, 2I, H/2]
    db = db.reshape(*ds.shape[:-1], -1)  # [E, H, I/2]
    q = (gub, gus, gu_bias, db, ds, down_bias)  # checkpoint layout, for the reference
    gub_t, gus_t = mxfp4.tile_for_op(gub, gus)
    db_t, ds_t = mxfp4.tile_for_op(db, ds)
    out_f32, out_bf16 = target.run(mxfp4_model, x, ids, w, gub_t, gus_t, gu_bias, db_t, ds_t, down_bias)
    ref = reference.moe_mxfp4(x, ids, w, *q)
    _check(case, f"{target.name} mxfp4/f32", out_f32, ref, F32_REL_TOL, record_property)
    ref_b = reference.moe_mxfp4(reference.round_to_bf16(x), ids, w, *q)
    _check(case, f"{target.name} mxfp4/bf16", out_bf16, ref_b, BF16_REL_TOL, record_property)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: c.name)
def test_moe_bf16(case: Case, target: Target, bf16_model, record_property) -> None:
    x, ids, w, gate_up, gu_bias, down, down_bias = _make_inputs(case, seed=1)
    out_f32, out_bf16 = target.run(bf16_model, x, ids, w, gate_up, gu_bias, down, down_bias)
    gate_up, down = reference.round_to_bf16(gate_up), reference.round_to_bf16(down)
    ref = reference.moe(x, ids, w, gate_up, gu_bias, down, down_bias)
    _check(case, f"{target.name} bf16/f32", out_f32, ref, F32_REL_TOL, record_property)
    xb = reference.round_to_bf16(x)
    ref_b = reference.moe(xb, ids, w, gate_up, gu_bias, down, down_bias)
    _check(case, f"{target.name} bf16/bf16", out_bf16, ref_b, BF16_REL_TOL, record_property)


@pytest.fixture(scope="module")
def decode_model(target: Target):
    from max.dtype import DType
    from max.graph import TensorType

    from gptoss_max.kernels import ops

    dev = target.ref
    types = [TensorType(DType.uint8, ["R", "B"], dev), TensorType(DType.uint8, ["R", "S"], dev)]
    return target.compile("mxfp4_decode", lambda b, s: ops.mxfp4_decode(b, s), types)


def _pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def test_moe_mxfp4_one_token_scale_above_192(target: Target, mxfp4_model, record_property) -> None:
    """A weight of 2^70 (scale byte 195) in row 9's last block of gate_up and of down, one token.
    On the GPU the bf16 step's lean tiles apply block scales as f32 multipliers with a fixed bias
    that holds bytes up to 192 (moe_gpu.LEAN_BIG_S); this tile must take its bias from its largest
    scale instead, and the tile's other rows must come out as exactly as without the outlier.
    So row 9 and the other rows are checked each against their own size."""
    case = Case("one_token_scale_above_192", 1, 8, 4, 64, 64, outlier=2.0**70)
    x, ids, w, gate_up, gu_bias, down, down_bias = _make_inputs(case)
    gate_up[:, 9, -1] = 2.0**70  # row 9 is an up row: clamped to +-7 after the product
    gub, gus = mxfp4.encode(gate_up)
    db, ds = mxfp4.encode(down)
    assert int(gus.max()) > 192 and int(ds.max()) > 192
    gub = gub.reshape(*gus.shape[:-1], -1)
    db = db.reshape(*ds.shape[:-1], -1)
    q = (gub, gus, gu_bias, db, ds, down_bias)
    gub_t, gus_t = mxfp4.tile_for_op(gub, gus)
    db_t, ds_t = mxfp4.tile_for_op(db, ds)
    out_f32, out_bf16 = target.run(mxfp4_model, x, ids, w, gub_t, gus_t, gu_bias, db_t, ds_t, down_bias)
    rest = np.arange(case.hidden) != 9
    # Row 9 is about one product per expert, 2^70 x h[-1], so it carries h's own rounding (bf16
    # in a bf16 graph, bf16 hi + lo, ~16 bits, in a float32 one), and the experts' terms may
    # cancel: it is checked against the sum of their sizes. The other rows keep the usual
    # tolerances.
    for label, out, xin, tol, tol9 in (
        ("mxfp4/f32", out_f32, x, F32_REL_TOL, 2.0**-14),
        ("mxfp4/bf16", out_bf16, reference.round_to_bf16(x), BF16_REL_TOL, 2.0**-7),
    ):
        ref = reference.moe_mxfp4(xin, ids, w, *q)
        size9 = sum(
            abs(float(reference.moe_mxfp4(xin, np.where(np.arange(case.top_k) == k, ids, -1), w, *q)[0, 9]))
            for k in range(case.top_k)
        )
        assert size9 > 1e15  # the outlier reaches the output
        err9 = abs(float(out[0, 9]) - float(ref[0, 9])) / size9
        report("moe op fidelity", f"{case.name} {target.name} {label} row 9: |err| / sum |terms| {err9:.2e}")
        record_property(f"{label}_row9_err", err9)
        assert err9 <= tol9, f"{label}: row 9 off by {err9:.3e} of its terms' sizes (> {tol9})"
        _check(case, f"{target.name} {label} others", out[:, rest], ref[:, rest], tol, record_property)


def test_mxfp4_decode_exhaustive(target: Target, decode_model) -> None:
    """All 16 codes under every finite scale byte (0..254, subnormals included),
    two blocks per row so the row/block indexing is exercised too."""
    scales = np.arange(255, dtype=np.uint8)
    one_block = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.uint8)
    codes = np.tile(np.concatenate([one_block, np.roll(one_block, 5)]), (255, 1))  # [255, 64]
    blocks = _pack(codes)  # [255, 32]
    scale_rows = np.stack([scales, scales[::-1]], axis=1)  # [255, 2]
    (out,) = target.run(decode_model, blocks, scale_rows)
    with np.errstate(over="ignore"):
        ref = reference.mxfp4_rows(blocks, scale_rows)
    assert out.dtype == np.float32 and out.shape == (255, 64)
    assert np.isinf(ref).any() and (ref[np.abs(ref) > 0] < np.finfo(np.float32).tiny).any()
    mismatch = out.view(np.uint32) != ref.view(np.uint32)
    assert not mismatch.any(), f"{mismatch.sum()} mismatches, first at {np.argwhere(mismatch)[0]}"


def test_mxfp4_decode_random_rows(target: Target, decode_model) -> None:
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (7, 64), dtype=np.uint8)  # n = 128
    scales = rng.integers(100, 150, (7, 4), dtype=np.uint8)
    (out,) = target.run(decode_model, blocks, scales)
    ref = mxfp4.decode(blocks.reshape(7, 4, 16), scales)
    assert (out.view(np.uint32) == ref.view(np.uint32)).all()


# --- the router's tail: top-k + softmax in one op (ops.router_topk) ---------------------------

ROUTER_K = 4


def _router_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The op's rule, restated: larger logit first, ties to the lower id, NaN never chosen,
    softmax over the chosen k in float64; -1 / 0 where fewer than k are left."""
    t_n, e_n = logits.shape
    ids = np.full((t_n, k), -1, dtype=np.int64)
    w = np.zeros((t_n, k))
    for t in range(t_n):
        order = sorted((e for e in range(e_n) if not np.isnan(logits[t, e])), key=lambda e: (-logits[t, e], e))
        chosen = np.array(order[:k], dtype=np.int64)
        ids[t, : len(chosen)] = chosen
        if len(chosen):
            v = logits[t, chosen].astype(np.float64)
            with np.errstate(invalid="ignore"):  # -inf - -inf: those are the v == v[0] terms
                p = np.where(v == v[0], 1.0, np.exp(v - v[0]))
            w[t, : len(chosen)] = p / p.sum()
    return ids, w


@pytest.fixture(scope="module")
def router_model(target: Target):
    """Our op on f32 and on bf16 logits, and MAX's top_k + softmax (the path it replaces)."""
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    def forward(logits):
        ids, w = ops.router_topk(logits, ROUTER_K)
        ids_b, w_b = ops.router_topk(gops.cast(logits, DType.bfloat16), ROUTER_K)
        top, max_ids = gops.top_k(logits, k=ROUTER_K, axis=-1)
        return ids, w, ids_b, w_b, gops.cast(max_ids, DType.int32), gops.softmax(top)

    return target.compile("router_topk", forward, [TensorType(DType.float32, ["T", "E"], target.ref)])


def _router_logits(kind: str, tokens: int, experts: int, rng) -> np.ndarray:
    x = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    if kind == "ties":  # few distinct values: many equal logits, also across the k-th place
        x = np.round(x).astype(np.float32)
    if kind == "special":  # NaN and -inf logits; a row of NaN but two; a row all -inf
        x[:, ::3] = np.nan
        x[:, 1::5] = -np.inf
        x[0, :] = np.nan
        x[0, [1, experts - 1]] = [0.5, 2.0]
        if tokens > 1:
            x[1, :] = -np.inf
    return x


ROUTER_CASES = [  # kind, tokens, experts (lanes hold 1, 2, 4 or 8 logits)
    ("random", 1, 128),
    ("random", 70, 128),
    ("random", 9, 32),
    ("random", 5, 256),
    ("random", 6, 8),
    ("random", 3, 4),  # k = E
    ("random", 11, 50),  # E not a multiple of 32
    ("ties", 40, 128),
    ("ties", 17, 64),
    ("special", 12, 128),
]


@pytest.mark.parametrize("kind, tokens, experts", ROUTER_CASES, ids=lambda v: str(v))
def test_router_topk(kind, tokens, experts, target: Target, router_model) -> None:
    rng = np.random.default_rng(tokens * 1000 + experts)
    logits = _router_logits(kind, tokens, experts, rng)
    ids, w, ids_b, w_b, max_ids, max_w = target.run(router_model, logits)
    for got_ids, got_w, src in ((ids, w, logits), (ids_b, w_b, reference.round_to_bf16(logits))):
        want_ids, want_w = _router_reference(src, ROUTER_K)
        np.testing.assert_array_equal(got_ids, want_ids)
        assert np.all(np.isfinite(got_w))
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7)
    if kind == "random":  # distinct logits: the same choice and weights as MAX's top_k + softmax
        np.testing.assert_array_equal(ids, max_ids)
        np.testing.assert_allclose(w, max_w, rtol=1e-5, atol=1e-7)


# --- the top-k inside the experts' first op (ops.moe_mxfp4_routed) ----------------------------

# tokens, experts, hidden, inter, logits kind: one-token cases take the GPU's single launch (lanes
# holding 4 and 8 logits); the others its top-k launch + gate_up; "special" leaves fewer than k
# choosable logits in some rows (ids -1, weight 0).
ROUTED_CASES = [
    (1, 8, 64, 64, "random"),
    (1, 128, 64, 128, "random"),
    (1, 256, 128, 64, "random"),
    (1, 8, 64, 64, "special"),
    (5, 32, 128, 64, "random"),
    (12, 16, 64, 64, "special"),
    (4, 128, 64, 64, "special"),  # the GPU's top-k launch, then (4 * 4 * 8 <= 128) the slot kernels
]


@pytest.fixture(scope="module")
def routed_model(target: Target):
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    dev = target.ref
    f32 = DType.float32
    types = [TensorType(f32, ["T", "H"], dev), TensorType(f32, ["T", "E"], dev), *_mxfp4_weight_types(dev)]

    def forward(x, logits, *weights):
        bf = DType.bfloat16
        out = ops.moe_mxfp4_routed(x, logits, ROUTER_K, *weights)
        out_b = ops.moe_mxfp4_routed(gops.cast(x, bf), gops.cast(logits, bf), ROUTER_K, *weights)
        return out, gops.cast(out_b, f32)

    return target.compile("moe_mxfp4_routed", forward, types)


@pytest.mark.parametrize("tokens, experts, hidden, inter, kind", ROUTED_CASES, ids=lambda v: str(v))
def test_moe_mxfp4_routed(tokens, experts, hidden, inter, kind, target: Target, routed_model, record_property):
    """Against the float64 experts on the routing _router_reference gives for the same logits."""
    case = Case(f"routed_t{tokens}_e{experts}_{kind}", tokens, experts, ROUTER_K, hidden, inter)
    x, _ids, _w, gate_up, gu_bias, down, down_bias = _make_inputs(case, seed=2)
    logits = _router_logits(kind, tokens, experts, np.random.default_rng(tokens + experts))
    gub, gus = mxfp4.encode(gate_up)
    db, ds = mxfp4.encode(down)
    gub = gub.reshape(*gus.shape[:-1], -1)
    db = db.reshape(*ds.shape[:-1], -1)
    q = (gub, gus, gu_bias, db, ds, down_bias)
    gub_t, gus_t = mxfp4.tile_for_op(gub, gus)
    db_t, ds_t = mxfp4.tile_for_op(db, ds)
    out, out_b = target.run(routed_model, x, logits, gub_t, gus_t, gu_bias, db_t, ds_t, down_bias)
    ids, w = _router_reference(logits, ROUTER_K)
    _check(case, f"{target.name} routed/f32", out, reference.moe_mxfp4(x, ids, w, *q), F32_REL_TOL, record_property)
    ids_b, w_b = _router_reference(reference.round_to_bf16(logits), ROUTER_K)
    ref_b = reference.moe_mxfp4(reference.round_to_bf16(x), ids_b, w_b, *q)
    _check(case, f"{target.name} routed/bf16", out_b, ref_b, BF16_REL_TOL, record_property)


def test_router_topk_refuses_bad_k() -> None:
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from gptoss_max.kernels import ops

    for k, e in ((0, 8), (9, 8), (33, 64)):
        with pytest.raises(ValueError, match="k must be"):
            Graph(
                "bad_k",
                forward=lambda x, k=k: ops.router_topk(x, k),
                input_types=[TensorType(DType.float32, [3, e], DeviceRef.CPU())],
            )
    with pytest.raises(ValueError, match="at most 256"):
        Graph(
            "many",
            forward=lambda x: ops.router_topk(x, 4),
            input_types=[TensorType(DType.float32, [3, 300], DeviceRef.CPU())],
        )


# Repeatability: the same inputs through the op again and again, other inputs between the
# repeats, must give the first result bit for bit (scripts/gpu_repeat.py found whole-model greedy
# decoding on an H200 not repeatable, 2026-11-29; a race in a kernel would show here first).
# (tokens, experts, hidden = inter, routing): small shapes on every device, gpt-oss's own widths
# where the GPU runs them (20b: 32 experts; 120b: 128), through the decode kernels (1 and 64 tokens)
# and the prefill GEMM's tile configurations (69 and 101 tokens of 20b: c7; 512 of 120b: c7; 1024
# of 20b: c5). "skewed": every token routed to experts 0..3, as a random model's deep layers can
# do: each of them gets every token, so its last tile is a short one (69 = 64 + 5 in c7, 300 =
# 2 x 128 + 44 in c5), and which pairs land there follows the route kernel's atomic arrival order.
# "bigscale": scale bytes above 128 in some 16-row groups (the second multiply, p16).
REPEAT_SHAPES = {
    "cpu": [(1, 8, 64, "random"), (64, 8, 128, "random"), (77, 8, 128, "random"), (288, 8, 128, "random"),
            (77, 8, 128, "skewed")],
    "gpu": [(1, 8, 64, "random"), (77, 8, 128, "random"), (288, 8, 128, "random"), (1, 32, 2880, "random"),
            (64, 32, 2880, "random"), (69, 32, 2880, "random"), (101, 32, 2880, "random"),
            (1024, 32, 2880, "random"), (1, 128, 2880, "random"), (512, 128, 2880, "random"),
            (69, 32, 2880, "skewed"), (300, 32, 2880, "skewed"), (69, 32, 2880, "bigscale"),
            (1024, 32, 2880, "bigscale")],
}  # fmt: skip
REPEATS = {"cpu": 3, "gpu": 12}


def _random_mxfp4_inputs(tokens: int, experts: int, width: int, seed: int, routing: str = "random") -> list:
    """Op inputs of random MXFP4 bytes (any byte is a valid pair of codes, in any layout) with
    gpt-oss-like scale bytes (2^-7 .. 2^-3; "bigscale": 2^-9 .. 2^8), activations, and random
    routing ("skewed": every token to experts 0..3, in a random order)."""
    rng = np.random.default_rng(seed)
    if routing == "skewed":
        ids = np.stack([rng.permutation(4) for _ in range(tokens)]).astype(np.int32)
    else:
        ids = np.stack([rng.choice(experts, 4, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, 4)).astype(np.float32)
    blocks = [rng.integers(0, 256, (experts, rows, width // 2), dtype=np.uint8) for rows in (2 * width, width)]
    # "bigscale": random routing, scale bytes up to 2^8 (above 128 the GPU decode takes a second
    # multiply, chosen per warpgroup in the prefill GEMM: p16)
    lo, hi = (118, 136) if routing == "bigscale" else (120, 125)
    scales = [rng.integers(lo, hi, (experts, rows, width // 32), dtype=np.uint8) for rows in (2 * width, width)]
    bias = [(0.1 * rng.standard_normal((experts, rows))).astype(np.float32) for rows in (2 * width, width)]
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    return [x, ids, w, blocks[0], scales[0], bias[0], blocks[1], scales[1], bias[1]]


def _on_device(target: Target, arrays) -> list:
    from max.driver import Buffer

    return [Buffer.from_numpy(np.ascontiguousarray(a)).to(target.device) for a in arrays]


def _repeat_check(target: Target, model, make_inputs, label: str) -> None:
    """Each shape's inputs through `model` REPEATS times (other inputs between every other
    repeat): every result must equal the first bit for bit."""
    failures = []
    for tokens, experts, width, routing in REPEAT_SHAPES[target.name]:
        same = _on_device(target, make_inputs(tokens, experts, width, tokens, routing))
        other = _on_device(target, make_inputs(max(tokens // 2, 1), experts, width, tokens + 1, "random"))
        first, differ = repeats_that_differ(model, same, other, REPEATS[target.name])
        assert all(np.isfinite(f).all() for f in first)
        report(
            label,
            f"{target.name} T={tokens} E={experts} H=I={width} {routing}: {differ} of {REPEATS[target.name]} differ",
        )
        if differ:
            failures.append((tokens, experts, width, routing, differ))
    assert not failures, f"{label}: (tokens, experts, width, routing, repeats that differ): {failures}"


def test_moe_mxfp4_repeats_bitwise(target: Target, mxfp4_model) -> None:
    _repeat_check(target, mxfp4_model, _random_mxfp4_inputs, "moe op repeats")


def test_moe_mxfp4_routed_repeats_bitwise(target: Target, routed_model) -> None:
    """The op that takes the router's top-k itself (a one-token step's default on the GPU)."""

    def make(tokens, experts, width, seed, routing):
        x, _ids, _w, *weights = _random_mxfp4_inputs(tokens, experts, width, seed, routing)  # the logits route
        logits = np.random.default_rng(seed + 7).standard_normal((tokens, experts)).astype(np.float32)
        if routing == "skewed":  # experts 0..3 first for every token
            logits[:, :4] += 20.0
        return [x, logits, *weights]

    _repeat_check(target, routed_model, make, "routed moe op repeats")


# The same tokens in another order: each token's output row must be the same bits wherever the
# token sits. The GPU prefill GEMM orders an expert's pairs by atomic arrival and gives an expert's
# last, short tile a narrower wgmma; this holds only if neither changes a row's bits.
PERMUTE_SHAPES = {
    "cpu": [(77, 8, 128, "skewed"), (288, 8, 128, "random")],
    "gpu": [(77, 8, 128, "skewed"), (288, 8, 128, "random"), (69, 32, 2880, "skewed"),
            (300, 32, 2880, "skewed"), (1024, 32, 2880, "random"), (512, 128, 2880, "random")],
}  # fmt: skip


@pytest.mark.parametrize("route_order", ["arrival", "stable"])
def test_moe_mxfp4_rows_do_not_depend_on_token_order(target: Target, mxfp4_model, route_order, monkeypatch) -> None:
    """`stable` (GPTOSS_MAX_ROUTE_ORDER, read at each GPU launch): the route kernel orders an
    expert's pairs by pair index, not by atomic arrival; rows must not depend on the order either way."""
    monkeypatch.setenv("GPTOSS_MAX_ROUTE_ORDER", route_order)

    failures = []
    for tokens, experts, width, routing in PERMUTE_SHAPES[target.name]:
        x, ids, w, *weights = _random_mxfp4_inputs(tokens, experts, width, tokens + 3, routing)
        perm = np.random.default_rng(tokens).permutation(tokens)
        inputs = _on_device(target, [x, ids, w, *weights])
        outs = host_outputs(mxfp4_model, inputs)
        assert all(np.isfinite(o).all() for o in outs)
        if route_order == "stable":  # the same values as the default order's, up to f32 rounding
            monkeypatch.setenv("GPTOSS_MAX_ROUTE_ORDER", "arrival")
            for o, a in zip(outs, host_outputs(mxfp4_model, inputs), strict=True):
                np.testing.assert_allclose(o, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
            monkeypatch.setenv("GPTOSS_MAX_ROUTE_ORDER", route_order)
        outs_p = host_outputs(mxfp4_model, _on_device(target, [x[perm], ids[perm], w[perm], *weights]))
        rows = sum(int(np.sum(np.any(o[perm] != p, axis=-1))) for o, p in zip(outs, outs_p, strict=True))
        report(
            "moe op token order",
            f"{target.name} {route_order} T={tokens} E={experts} H=I={width} {routing}: {rows} rows differ",
        )
        if rows:
            failures.append((tokens, experts, width, routing, rows))
    assert not failures, f"(tokens, experts, width, routing, rows that differ): {failures}"


# What the op's output memory held before it ran must not reach its results (GPTOSS_MAX_POISON,
# kernels/poison.mojo): MAX gives an op's outputs and scratch memory that other tensors just left,
# and a repeat sees the same leftovers each time, so the repeat checks above cannot show such a
# read. A 24-layer model on an H200 was not repeatable with the prefill GEMM where it was with the
# decode kernel (bench/NOTES.md, "Greedy repeatability, third session"). Shapes: every decode and
# prefill path of both ops, gpt-oss widths on the GPU (69 tokens of 20b: c7, that model's prompt;
# 1024: c5; 120b 512: c7; 4096: c10 with its absorbed tiles).
POISON_SHAPES = {
    "cpu": [(1, 8, 64, "random"), (77, 8, 128, "skewed"), (288, 8, 128, "random")],
    "gpu": [(1, 8, 64, "random"), (77, 8, 128, "skewed"), (288, 8, 128, "random"), (1, 32, 2880, "random"),
            (5, 32, 2880, "random"), (64, 32, 2880, "random"), (69, 32, 2880, "random"),
            (69, 32, 2880, "skewed"), (300, 32, 2880, "skewed"), (1024, 32, 2880, "random"),
            (1, 128, 2880, "random"), (512, 128, 2880, "random"), (4096, 128, 2880, "random"),
            (69, 32, 2880, "bigscale"), (1024, 32, 2880, "bigscale")],
}  # fmt: skip


@pytest.mark.parametrize("routed", [False, True], ids=["topk_given", "routed"])
def test_moe_mxfp4_outputs_ignore_what_their_memory_held(target: Target, routed: bool, request) -> None:
    """Both MoE op pairs give the same bits whatever byte their outputs and scratch held."""
    model = request.getfixturevalue("routed_model" if routed else "mxfp4_model")
    failures = []
    for tokens, experts, width, routing in POISON_SHAPES[target.name]:
        x, ids, w, *weights = _random_mxfp4_inputs(tokens, experts, width, tokens + 5, routing)
        if routed:  # logits whose top-4 are the ids above, best first
            logits = np.random.default_rng(tokens).standard_normal((tokens, experts)).astype(np.float32)
            np.put_along_axis(logits, ids, 10.0 + 4.0 - np.arange(4, dtype=np.float32), axis=1)
            arrays = [x, logits, *weights]
        else:
            arrays = [x, ids, w, *weights]
        differ = poisons_that_differ(model, _on_device(target, arrays))
        report(
            "moe op poison",
            f"{target.name} {'routed' if routed else 'topk given'} T={tokens} E={experts} H=I={width} {routing}: "
            f"fills that change the outputs {differ}",
        )
        if differ:
            failures.append((tokens, experts, width, routing, differ))
    assert not failures, f"(tokens, experts, width, routing, fills that change the outputs): {failures}"


@pytest.fixture(scope="module")
def one_token_model(target: Target):
    """ops.moe_mxfp4_one_token (the fused one-token launch, a GPU probe) on bf16(x)."""
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    dev = target.ref
    types = _routing_types(dev) + _mxfp4_weight_types(dev)
    types.append(TensorType(DType.uint32, [ops.ONE_TOKEN_SYNC_WORDS], dev))

    def forward(x, ids, w, *rest):
        out = ops.moe_mxfp4_one_token(gops.cast(x, DType.bfloat16), ids, w, *rest)
        return gops.cast(out, DType.float32)

    return target.compile("moe_mxfp4_one_token", forward, types)


def test_moe_mxfp4_takes_the_loaders_big_flags_and_checks_their_shape(target: Target, mxfp4_model) -> None:
    """moe_mxfp4 handed each projection's `big` flags (as the model's loader derives them,
    mxfp4.big_scale_groups) gives the same output as mxfp4_model, which derives them in the
    graph; flags of the wrong shape are refused by the op, with the shape it needs."""
    from max.dtype import DType
    from max.graph import TensorType
    from max.graph import ops as gops

    from gptoss_max.kernels import ops

    types = _routing_types(target.ref) + _mxfp4_weight_types(target.ref)
    types += [TensorType(DType.uint8, ["E", "Gu"], target.ref), TensorType(DType.uint8, ["E", "Gd"], target.ref)]

    def forward(x, ids, w, *rest):
        out = ops.moe_mxfp4(gops.cast(x, DType.bfloat16), ids, w, *rest[:6], big=(rest[6], rest[7]))
        return gops.cast(out, DType.float32)

    model = target.compile("moe_mxfp4_big", forward, types)
    x, ids, w, gate_up, gu_bias, down, down_bias = _make_inputs(CASES[1])  # t64: a GPU's prefill GEMM
    gub, gus = mxfp4.encode(gate_up)
    db, ds = mxfp4.encode(down)
    gub_t, gus_t = mxfp4.tile_for_op(gub.reshape(*gus.shape[:-1], -1), gus)
    db_t, ds_t = mxfp4.tile_for_op(db.reshape(*ds.shape[:-1], -1), ds)
    weights = (gub_t, gus_t, gu_bias, db_t, ds_t, down_bias)
    flags = (mxfp4.big_scale_groups(gus_t), mxfp4.big_scale_groups(ds_t))
    (got,) = target.run(model, x, ids, w, *weights, *flags)
    np.testing.assert_array_equal(got, target.run(mxfp4_model, x, ids, w, *weights)[1])
    with pytest.raises(Exception, match=r"big must be \[E, rows / 16\]"):
        target.run(model, x, ids, w, *weights, flags[0][:, :-1], flags[1])


ONE_TOKEN_FUSED_CASES = [c for c in CASES if c.tokens == 1 and c.top_k <= 4]


@pytest.mark.parametrize("case", ONE_TOKEN_FUSED_CASES, ids=lambda c: c.name)
def test_moe_mxfp4_one_token_fused(case: Case, target: Target, one_token_model, record_property) -> None:
    """The fused one-token launch (gate_up and down in one grid, the down's warps waiting on
    counters for their expert's h) against the reference, twice on the same sync words (the
    launch must leave them zero); on the CPU the op says it is GPU only."""
    x, ids, w, gate_up, gu_bias, down, down_bias = _make_inputs(case)
    gub, gus = mxfp4.encode(gate_up)
    db, ds = mxfp4.encode(down)
    gub = gub.reshape(*gus.shape[:-1], -1)
    db = db.reshape(*ds.shape[:-1], -1)
    gub_t, gus_t = mxfp4.tile_for_op(gub, gus)
    db_t, ds_t = mxfp4.tile_for_op(db, ds)
    from gptoss_max.kernels import ops

    sync = np.zeros(ops.ONE_TOKEN_SYNC_WORDS, np.uint32)
    args = (x, ids, w, gub_t, gus_t, gu_bias, db_t, ds_t, down_bias, sync)
    if target.name != "gpu":
        with pytest.raises(Exception, match="GPU only"):
            target.run(one_token_model, *args)
        return
    from max.driver import CPU, Buffer

    bufs = [Buffer.from_numpy(np.ascontiguousarray(a)).to(target.device) for a in args]
    ref = reference.moe_mxfp4(reference.round_to_bf16(x), ids, w, gub, gus, gu_bias, db, ds, down_bias)
    for run in range(2):
        out = one_token_model.execute(*bufs)[0].to(CPU()).to_numpy()
        _check(case, f"gpu fused/bf16 run {run}", out, ref, BF16_REL_TOL, record_property)
    assert not bufs[-1].to(CPU()).to_numpy().any(), "the launch left its sync words non-zero"
