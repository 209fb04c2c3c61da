"""`arch.dense.project`: a Linear's projection as the model builds it (qkv, o_proj, the router's
logits) in a bf16 CPU graph, against float64 NumPy of the same bf16 inputs. Steps of
DENSE_MIN_TOKENS..DENSE_MAX_TOKENS tokens take our gemv op (tc=True), the others MAX's Linear (the
graph's ops.cond), so one graph checks both branches; GPTOSS_MAX_DENSE=max stages MAX's only."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gptoss_max.checkpoint import to_bf16_bits
from gptoss_max.kernels import reference

K_IN, N_OUT = 64, 40


def _graph(monkeypatch, impl: str, k: int = K_IN):
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType
    from max.graph import ops as gops
    from max.nn import Linear

    from gptoss_max.arch import dense

    monkeypatch.setenv("GPTOSS_MAX_DENSE", impl)
    cpu = DeviceRef.CPU()
    linear = Linear(k, N_OUT, dtype=DType.bfloat16, device=cpu, has_bias=True)
    with Graph(f"dense_{impl}_{k}", input_types=[TensorType(DType.float32, ["T", k], cpu)]) as graph:
        x = gops.cast(graph.inputs[0].tensor, DType.bfloat16)
        graph.output(gops.cast(dense.project(linear, x), DType.float32))
    return linear, graph


def test_both_branches_match_float64(monkeypatch) -> None:
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession

    from gptoss_max.arch import dense

    linear, graph = _graph(monkeypatch, "tc")
    assert "gptoss_gemv" in str(graph) and "matmul" in str(graph)  # both branches staged
    rng = np.random.default_rng(5)
    w = reference.round_to_bf16(rng.standard_normal((N_OUT, K_IN)).astype(np.float32) / 8)
    b = reference.round_to_bf16(rng.standard_normal(N_OUT).astype(np.float32))
    bf = {k: Buffer.from_numpy(to_bf16_bits(v).reshape(v.shape)).view(DType.bfloat16) for k, v in (("w", w), ("b", b))}
    model = InferenceSession(devices=[CPU()]).load(
        graph, weights_registry={linear.weight.name: bf["w"], linear.bias.name: bf["b"]}
    )
    for tokens in (1, dense.DENSE_MIN_TOKENS, 7, dense.DENSE_MAX_TOKENS, dense.DENSE_MAX_TOKENS + 1):
        x = rng.standard_normal((tokens, K_IN)).astype(np.float32)
        want = reference.round_to_bf16(x).astype(np.float64) @ w.T.astype(np.float64) + b
        (got,) = model.execute(Buffer.from_numpy(x))
        got = got.to(CPU()).to_numpy()
        assert got.shape == (tokens, N_OUT)
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


def test_tc1_takes_one_token_steps_too(monkeypatch) -> None:
    """GPTOSS_MAX_DENSE=tc1: the choice's lower bound is 1, not DENSE_MIN_TOKENS (the graph's
    greater_equal constants: 16 and 1 for tc1, 16 and 2 for tc)."""
    from gptoss_max.arch import dense

    def bounds(graph) -> list[int]:
        return [int(v) for v in re.findall(r"mo\.constant <#M\.dense_array<(\d+)> : tensor<si64>>", str(graph))]

    _, tc = _graph(monkeypatch, "tc")
    _, tc1 = _graph(monkeypatch, "tc1")
    assert "gptoss_gemv" in str(tc1)
    assert bounds(tc) == [dense.DENSE_MAX_TOKENS, dense.DENSE_MIN_TOKENS] and dense.DENSE_MIN_TOKENS > 1
    assert bounds(tc1) == [dense.DENSE_MAX_TOKENS, 1]


@pytest.mark.parametrize("impl, k", [("max", K_IN), ("tc", 48)])
def test_max_linear_only(monkeypatch, impl, k) -> None:
    """GPTOSS_MAX_DENSE=max, or K not a multiple of 32: MAX's Linear alone."""
    _, graph = _graph(monkeypatch, impl, k)
    assert "gptoss_gemv" not in str(graph)


def test_setting_is_checked(monkeypatch) -> None:
    from gptoss_max import settings

    monkeypatch.setenv("GPTOSS_MAX_DENSE", "fast")
    with pytest.raises(ValueError, match="GPTOSS_MAX_DENSE"):
        settings.dense_impl()
