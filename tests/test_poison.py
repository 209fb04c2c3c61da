"""GPTOSS_MAX_POISON (kernels/poison.mojo): our ops fill their outputs with the named byte before
they run. Here on the CPU, where the MXFP4 down op leaves its `partial` scratch output unused: that
output must come back holding exactly the fill, and the op's result must not change.

GPTOSS_MAX_SCRUB: the MXFP4 down op fills what it leaves behind (h, partial, the counters) after it
ran. The graph here also returns h, which a model never reads after the down op, to see it."""

from __future__ import annotations

import numpy as np
import pytest

from op_graphs import POISONS, host_outputs, load_op_graph

FILL_BYTES = {"zero": 0x00, "small": 0x3C, "big": 0x7B, "nan": 0xFF}
T, K, E, H, INTER = 3, 2, 4, 64, 64


@pytest.fixture(scope="module")
def down_with_scratch():
    """(device, model): x, ids, weights -> the MXFP4 pair's output, the down op's partial [T, K, H]
    and h [T, K, I] (the gate_up op's output, which the down op reads last)."""
    from max.dtype import DType
    from max.graph import DeviceRef, TensorType, ops

    from gptoss_max.kernels import ops as gops

    def forward(x, ids, wts, gub, gus, gubias, db, ds, dbias):
        gops._load_kernels()
        path = ops.constant(gops.PATH_AUTO, DType.int32, device=DeviceRef.CPU())
        h, counters = ops.custom(
            "gptoss_moe_gate_up_mxfp4",
            x.device,
            [x, ids, gub, gus, gubias, gops.big_scale_groups(gus), path],
            [
                TensorType(DType.float32, [T, K, INTER], x.device),
                TensorType(DType.uint32, [gops.counter_count(H)], x.device),
            ],
        )
        out, partial = ops.custom(
            "gptoss_moe_down_mxfp4",
            x.device,
            [h, ids, wts, db, ds, dbias, gops.big_scale_groups(ds), counters, path],
            [TensorType(DType.float32, [T, H], x.device), TensorType(DType.float32, [T, K, H], x.device)],
        )
        return out, partial, h

    def types(dev):
        u8, f32 = DType.uint8, DType.float32
        return [
            TensorType(f32, [T, H], dev),
            TensorType(DType.int32, [T, K], dev),
            TensorType(f32, [T, K], dev),
            TensorType(u8, [E, 2 * INTER, H // 2], dev),
            TensorType(u8, [E, 2 * INTER, H // 32], dev),
            TensorType(f32, [E, 2 * INTER], dev),
            TensorType(u8, [E, H, INTER // 2], dev),
            TensorType(u8, [E, H, INTER // 32], dev),
            TensorType(f32, [E, H], dev),
        ]

    return load_op_graph("cpu", "poison_down", forward, types)


def _inputs():
    from max.driver import Buffer

    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((T, H)).astype(np.float32),
        np.array([[0, 1], [2, 3], [1, 0]], np.int32),
        rng.random((T, K)).astype(np.float32),
        rng.integers(0, 256, (E, 2 * INTER, H // 2), dtype=np.uint8),
        rng.integers(120, 125, (E, 2 * INTER, H // 32), dtype=np.uint8),
        rng.standard_normal((E, 2 * INTER)).astype(np.float32),
        rng.integers(0, 256, (E, H, INTER // 2), dtype=np.uint8),
        rng.integers(120, 125, (E, H, INTER // 32), dtype=np.uint8),
        rng.standard_normal((E, H)).astype(np.float32),
    ]
    return [Buffer.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("variable", ["GPTOSS_MAX_POISON", "GPTOSS_MAX_SCRUB"])
def test_fills_and_results_ignore_them(down_with_scratch, monkeypatch, variable) -> None:
    """POISON fills the outputs before the op ran (the unused scratch keeps the fill); SCRUB fills
    the scratch and h after it (h is given back to see it)."""
    _device, model = down_with_scratch
    inputs = _inputs()
    monkeypatch.delenv("GPTOSS_MAX_POISON", raising=False)
    monkeypatch.delenv("GPTOSS_MAX_SCRUB", raising=False)
    out, _partial, h_plain = host_outputs(model, inputs)
    assert np.isfinite(out).all()
    assert np.isfinite(h_plain).all() and np.abs(h_plain).max() > 0, "without a fill h holds gate_up's values"
    for fill in POISONS:
        monkeypatch.setenv(variable, fill)
        got, partial, h = host_outputs(model, inputs)
        assert np.array_equal(got, out), f"{variable}={fill} changed the op's result"
        assert (partial.view(np.uint8) == FILL_BYTES[fill]).all(), f"{variable}={fill}: the scratch holds the fill"
        if variable == "GPTOSS_MAX_SCRUB":
            assert (h.view(np.uint8) == FILL_BYTES[fill]).all(), f"{fill}: h is scrubbed after its last reader"
        else:
            assert np.array_equal(h, h_plain), f"{fill}: poison fills an op's outputs only before it writes them"


@pytest.mark.parametrize(("variable", "value"), [("GPTOSS_MAX_POISON", "0x7b"), ("GPTOSS_MAX_SCRUB", "ones")])
def test_an_unknown_fill_is_refused(down_with_scratch, monkeypatch, variable, value) -> None:
    _device, model = down_with_scratch
    monkeypatch.delenv("GPTOSS_MAX_POISON", raising=False)
    monkeypatch.delenv("GPTOSS_MAX_SCRUB", raising=False)
    monkeypatch.setenv(variable, value)
    with pytest.raises(Exception, match=f"{variable} must be zero, small, big or nan"):
        host_outputs(model, _inputs())
