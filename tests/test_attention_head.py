"""`arch.attention.attention_head`: the previous layer's residual add, the input norm and the qkv
projection as the model builds them for every layer after the first, in a bf16 CPU graph, against
a float64 NumPy reference of the same bf16 inputs with HF's bf16 rounding points. Steps of at most
QKV_HEAD_MAX_TOKENS tokens take our op (router_decode), larger ones MAX's add + rms_norm + Linear
(the graph's ops.cond), so one graph checks both branches."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.checkpoint import to_bf16_bits
from gptoss_max.kernels import reference

H, N, EPS = 64, 40, 1e-5


def _graph(monkeypatch, impl: str):
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType
    from max.graph import ops as gops
    from max.nn import Linear
    from max.nn.norm.rms_norm import RMSNorm

    from gptoss_max.arch.attention import attention_head

    monkeypatch.setenv("GPTOSS_MAX_QKV_HEAD", impl)
    cpu = DeviceRef.CPU()
    linear = Linear(H, N, dtype=DType.bfloat16, device=cpu, has_bias=True, name="qkv")
    norm = RMSNorm(H, DType.bfloat16, eps=EPS)
    with Graph(f"attention_head_{impl}", input_types=[TensorType(DType.float32, ["T", H], cpu)] * 2) as graph:
        residual, update = (gops.cast(v.tensor, DType.bfloat16) for v in graph.inputs)
        x, qkv = attention_head(linear, residual, update, norm)
        graph.output(gops.cast(x, DType.float32), gops.cast(qkv, DType.float32))
    return linear, norm, graph


def test_both_branches_match_float64(monkeypatch) -> None:
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession

    from gptoss_max.arch.attention import QKV_HEAD_MAX_TOKENS

    linear, norm, graph = _graph(monkeypatch, "fused")
    assert "gptoss_router_decode" in str(graph) and "rms_norm" in str(graph)  # both branches staged
    rng = np.random.default_rng(11)
    bf = reference.round_to_bf16
    w = bf(rng.standard_normal((N, H)).astype(np.float32) / 8)
    b = bf(rng.standard_normal(N).astype(np.float32))
    g = bf(rng.uniform(0.5, 2.0, H).astype(np.float32))

    def buf(v):
        return Buffer.from_numpy(to_bf16_bits(v).reshape(v.shape)).view(DType.bfloat16)

    registry = {linear.weight.name: buf(w), linear.bias.name: buf(b), norm.weight.name: buf(g)}
    model = InferenceSession(devices=[CPU()]).load(graph, weights_registry=registry)
    for tokens in (1, 4, 5, QKV_HEAD_MAX_TOKENS, QKV_HEAD_MAX_TOKENS + 1):
        residual = bf((3 * rng.standard_normal((tokens, H))).astype(np.float32))
        update = bf(rng.standard_normal((tokens, H)).astype(np.float32))
        want_x, _, want_qkv = reference.router_head(*(v.astype(np.float64) for v in (update, residual, g, w, b)), EPS)
        got_x, got_qkv = (
            y.to(CPU()).to_numpy() for y in model.execute(Buffer.from_numpy(residual), Buffer.from_numpy(update))
        )
        assert got_x.shape == (tokens, H) and got_qkv.shape == (tokens, N)
        np.testing.assert_array_equal(got_x, want_x)  # the residual add, rounded once: bit for bit
        np.testing.assert_allclose(got_qkv, want_qkv, rtol=2**-7, atol=2**-7 * np.abs(want_qkv).max())


def test_max_ops_only(monkeypatch) -> None:
    """GPTOSS_MAX_QKV_HEAD=max: MAX's add + rms_norm, qkv through arch.dense.project."""
    _, _, graph = _graph(monkeypatch, "max")
    assert "gptoss_router_decode" not in str(graph) and "rms_norm" in str(graph)


def test_setting_is_checked(monkeypatch) -> None:
    from gptoss_max import settings

    monkeypatch.setenv("GPTOSS_MAX_QKV_HEAD", "fast")
    with pytest.raises(ValueError, match="GPTOSS_MAX_QKV_HEAD"):
        settings.qkv_head_impl()
