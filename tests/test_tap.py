"""gptoss_tap (kernels/tap.mojo, ops.tap; GPTOSS_MAX_TAP): an identity op that prints a hash of its
input's bits at every run, for finding the first layer where two runs of a step differ."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gptoss_max.checkpoint import to_bf16_bits
from op_graphs import host_outputs, load_op_graph

M64 = (1 << 64) - 1


def tap_hash(bits: np.ndarray) -> int:
    """kernels/tap.mojo's hash: the wrapping sum over i of splitmix64's finalizer of bits[i] ^ i * phi."""
    total = 0
    for i, b in enumerate(bits.reshape(-1).tolist()):
        z = (int(b) ^ (i * 0x9E3779B97F4A7C15)) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        total = (total + (z ^ (z >> 31))) & M64
    return total


@pytest.fixture(scope="module")
def tapped(request):
    """(device, model): a [3, 5] f32 input a and a [2, 3, 4] bf16-cast input b through a tap each."""
    from max.dtype import DType
    from max.graph import TensorType, ops

    from gptoss_max.kernels import ops as gops

    mp = pytest.MonkeyPatch()
    mp.setenv("GPTOSS_MAX_TAP", "on")
    request.addfinalizer(mp.undo)

    def forward(a, b):
        return gops.tap(a, "a"), ops.cast(gops.tap(ops.cast(b, DType.bfloat16), "b as bf16"), DType.float32)

    def types(dev):
        return [TensorType(DType.float32, [3, 5], dev), TensorType(DType.float32, [2, 3, 4], dev)]

    return load_op_graph("cpu", "tap", forward, types)


def test_tap_is_identity_and_prints_the_hash(tapped, capfd) -> None:
    from max.driver import Buffer

    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((2, 3, 4)).astype(np.float32)
    _device, model = tapped
    capfd.readouterr()
    out_a, out_b = host_outputs(model, [Buffer.from_numpy(a), Buffer.from_numpy(b)])
    b16 = to_bf16_bits(b)
    assert np.array_equal(out_a, a)
    assert np.array_equal(to_bf16_bits(out_b), b16)
    lines = re.findall(r"gptoss_tap (\d+) (\d+) (\d+)", capfd.readouterr().out)
    assert sorted((int(t), int(n), int(h)) for t, n, h in lines) == [
        (0, 15, tap_hash(a.view(np.uint32))),
        (1, 24, tap_hash(b16)),
    ]
    b16_changed = b16.copy()
    b16_changed.reshape(-1)[7] ^= 1
    assert tap_hash(b16_changed) != tap_hash(b16)


def test_tap_is_nothing_when_off(monkeypatch) -> None:
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from gptoss_max.kernels import ops as gops

    monkeypatch.delenv("GPTOSS_MAX_TAP", raising=False)
    with Graph("no_tap", input_types=[TensorType(DType.float32, [2, 2], DeviceRef.CPU())]) as g:
        x = g.inputs[0].tensor
        assert gops.tap(x, "x") is x
    monkeypatch.setenv("GPTOSS_MAX_TAP", "yes")
    with pytest.raises(ValueError, match="GPTOSS_MAX_TAP must be"):
        with Graph("bad_tap", input_types=[TensorType(DType.float32, [2, 2], DeviceRef.CPU())]) as g:
            gops.tap(g.inputs[0].tensor, "x")


def test_a_weight_tap_runs_at_every_step(monkeypatch, capfd) -> None:
    """GPTOSS_MAX_TAP=weights (arch.dense.tapped_linear): x @ W.T + b with W and b through taps given
    the step's x, so their hashes print at every run (a tap of a constant alone would run once, at
    load) and a stray write into a weight would show as a changed hash."""
    from max.driver import Buffer
    from max.dtype import DType
    from max.graph import DeviceRef, TensorType, ops

    from gptoss_max.arch import dense

    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    monkeypatch.setenv("GPTOSS_MAX_TAP", "weights")

    def forward(x):
        cpu = DeviceRef.CPU()
        return dense.tapped_linear(
            x, ops.constant(w, DType.float32, device=cpu), ops.constant(b, DType.float32, device=cpu)
        )

    _device, model = load_op_graph("cpu", "tap_weights", forward, lambda dev: [TensorType(DType.float32, [2, 4], dev)])
    want = sorted([(0, 12, tap_hash(w.view(np.uint32))), (1, 3, tap_hash(b.view(np.uint32)))])
    for run in range(2):
        x = rng.standard_normal((2, 4)).astype(np.float32)
        capfd.readouterr()
        (out,) = host_outputs(model, [Buffer.from_numpy(x)])
        np.testing.assert_allclose(out, x @ w.T + b, rtol=1e-6, atol=1e-6)
        lines = re.findall(r"gptoss_tap (\d+) (\d+) (\d+)", capfd.readouterr().out)
        assert sorted((int(t), int(n), int(h)) for t, n, h in lines) == want, f"run {run}"
