"""The second half of a transformer block as the model builds it (`NativeMoE.after_attention`:
residual add, post-attention norm, router, top-k, experts) in a bf16 CPU graph, against a float64
NumPy reference of gpt-oss's semantics with HF's bf16 rounding points. Steps of 1..16 tokens take
our fused router op, larger ones MAX's add + rms_norm + Linear (the graph's ops.cond), so one
graph checks both branches; with GPTOSS_MAX_ROUTER=max the logits of 2..16-token steps come from
our projection op (arch/dense.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.checkpoint import to_bf16_bits
from gptoss_max.kernels import reference

H, INTER, E, K, EPS = 64, 32, 8, 2, 1e-5
F32_WEIGHTS = {"experts.gate_up_bias", "experts.down_bias"}


def _bf16_buffer(a: np.ndarray):
    from max.driver import Buffer
    from max.dtype import DType

    return Buffer.from_numpy(to_bf16_bits(a).reshape(a.shape)).view(DType.bfloat16)


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    bf = reference.round_to_bf16
    return {
        "router.weight": bf(rng.standard_normal((E, H)).astype(np.float32) / np.sqrt(H)),
        "router.bias": bf(rng.standard_normal(E).astype(np.float32)),
        "experts.gate_up_weight": bf(rng.standard_normal((E, 2 * INTER, H)).astype(np.float32) / np.sqrt(H)),
        "experts.down_weight": bf(rng.standard_normal((E, H, INTER)).astype(np.float32) / np.sqrt(INTER)),
        "experts.gate_up_bias": rng.standard_normal((E, 2 * INTER)).astype(np.float32) * 0.1,
        "experts.down_bias": rng.standard_normal((E, H)).astype(np.float32) * 0.1,
        "norm.weight": bf(rng.uniform(0.5, 2.0, H).astype(np.float32)),
    }


def _build(router: str, weights: dict[str, np.ndarray], monkeypatch):
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType
    from max.graph import ops as gops
    from max.nn.norm.rms_norm import RMSNorm

    from gptoss_max.arch.moe import NativeMoE

    monkeypatch.setenv("GPTOSS_MAX_ROUTER", router)
    cpu = DeviceRef.CPU()
    moe = NativeMoE(hidden=H, inter=INTER, experts=E, top_k=K, mxfp4=False, dtype=DType.bfloat16, device=cpu)
    norm = RMSNorm(H, DType.bfloat16, eps=EPS)
    # the module's dtypes: the experts' biases are f32, every other weight bf16
    state = {k: v if k in F32_WEIGHTS else _bf16_buffer(v) for k, v in weights.items()}
    moe.load_state_dict({k: v for k, v in state.items() if not k.startswith("norm.")}, weight_alignment=1)
    types = [TensorType(DType.float32, ["T", H], cpu)] * 2
    with Graph(f"after_attention_{router}", input_types=types) as graph:
        attn, residual = (gops.cast(v.tensor, DType.bfloat16) for v in graph.inputs)
        h, out = moe.after_attention(attn, residual, norm)
        graph.output(gops.cast(h, DType.float32), gops.cast(out, DType.float32))
    if router == "fused":
        assert "gptoss_router_decode" in str(graph) and "rms_norm" in str(graph)  # both branches staged
    else:  # no outer choice: the router's logits go through arch.dense.project's own
        assert "gptoss_router_decode" not in str(graph) and "gptoss_gemv" in str(graph)
    registry = {("weight" if k == "norm.weight" else k): v for k, v in state.items()}
    return InferenceSession(devices=[CPU()]).load(graph, weights_registry=registry)


def _reference(attn: np.ndarray, residual: np.ndarray, w: dict[str, np.ndarray]):
    h, xn, logits = reference.router_head(attn, residual, w["norm.weight"], w["router.weight"], w["router.bias"], EPS)
    logits = reference.round_to_bf16(logits.astype(np.float32))  # the model's bf16 Linear
    order = np.argsort(-logits, axis=1, kind="stable")[:, :K]  # ties: the lower id
    top = np.take_along_axis(logits, order, axis=1).astype(np.float64)
    p = np.exp(top - top[:, :1])
    # the MoE's input is xn; its output joins the residual in bf16
    out = reference.moe(
        xn, order, p / p.sum(axis=1, keepdims=True),
        w["experts.gate_up_weight"], w["experts.gate_up_bias"], w["experts.down_weight"], w["experts.down_bias"],
    )  # fmt: skip
    return h, out, logits


@pytest.mark.parametrize("router", ["fused", "max"])
def test_after_attention_matches_reference(monkeypatch, router) -> None:
    """fused: both sides of the fused op's 16-token bound (one launch on a GPU up to 4); max: MAX's
    add + norm, the router's logits by our projection op for 2..16 tokens (arch/dense.py) and
    MAX's Linear for one."""
    from max.driver import Buffer

    weights = _weights(7)
    model = _build(router, weights, monkeypatch)
    rng = np.random.default_rng(17)
    for tokens in (1, 3, 4, 6, 16, 17):
        attn = reference.round_to_bf16(rng.standard_normal((tokens, H)).astype(np.float32))
        residual = reference.round_to_bf16(3 * rng.standard_normal((tokens, H)).astype(np.float32))
        want_h, want_out, logits = _reference(attn, residual, weights)
        srt = np.sort(logits, axis=1)[:, ::-1]
        assert np.all(srt[:, K - 1] - srt[:, K] > 0.05), "pick another seed: a near tie at the k-th expert"
        got_h, got_out = (v.to_numpy() for v in model.execute(Buffer.from_numpy(attn), Buffer.from_numpy(residual)))
        np.testing.assert_array_equal(got_h, want_h, err_msg=f"T={tokens}")
        rel = np.linalg.norm(got_out - want_out) / np.linalg.norm(want_out)
        assert rel < 1e-2, f"T={tokens}: relative error {rel:.2e}"
