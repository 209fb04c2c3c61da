#!/usr/bin/env python3
"""Bisect which piece of MAX 26.7.0's gpt_oss fails to compile on Hopper (SM90).

Each "piece" is a small MAX graph built from MAX's own modules (max.nn and
max.pipelines.architectures.gpt_oss) at real gpt-oss widths (hidden 2880,
64 q / 8 KV heads of 64, intermediate 2880, vocab 201088, bf16) with a
symbolic token dim "T". Every piece is compiled in its own subprocess with a
timeout (a failed Mojo elaboration can take minutes and many GB), several in
parallel; the ones that compile are run at T=1 and T=37 and checked against a
float32 reference computed with torch on the same device.

Run on the GPU machine (MAX staged under /opt/maxsite, see docs/GPU.md):

    export PYTHONPATH=/opt/maxsite:$PWD/src PYTHONUNBUFFERED=1
    python3 scripts/gpu_bisect.py --jobs 8 --deadline 540 --out $OUT

    python3 scripts/gpu_bisect.py --list            # names and descriptions
    python3 scripts/gpu_bisect.py --only a,b --out d
    python3 scripts/gpu_bisect.py --build-only      # build graphs, no compile
                                                    # (safe on a CPU machine)

Writes $OUT/gpu_bisect.json (one record per piece: ok/failed, first error
line with file:line, compile seconds, numeric check) and prints a table.

Found on an H200, 2026-11-21 (bench/results/gpu_bisect_h200_20261121.json,
docs/GPU.md): every dense piece compiles and is right; what fails is MAX's
SM90 grouped matmul (grouped_matmul_ragged, bf16, any epilogue or none):
matmul_kernels.mojo:1307 -> tensor_engine.mojo:90 -> coord.mojo:410
"Coord is not a value type". Workaround: float32 activations into
grouped_matmul_ragged (MAX then takes its naive grouped kernel), see
grouped_matmul_ragged_sm90_safe / make_sm90_safe_moe_class below.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

H = 2880  # hidden
NQ, NKV, HD = 64, 8, 64  # heads, kv heads, head dim
QD, KVD = NQ * HD, NKV * HD  # 4096, 512
INTER = 2880  # expert intermediate
V = 201088  # vocab
E, TOPK = 32, 4  # experts (20b count), experts per token
EPS = 1e-5
RUN_T = (1, 37)

PIECES: dict[str, tuple[str, Callable]] = {}


def piece(name: str, desc: str):
    def deco(fn):
        PIECES[name] = (desc, fn)
        return fn

    return deco


# --------------------------------------------------------------------------
# Helpers (imported lazily: the runner process needs no MAX)
# --------------------------------------------------------------------------


def _max():
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    return DType, DeviceRef, Graph, TensorType, ops


class Spec:
    """What a piece builds: graph, weights, inputs, reference."""

    def __init__(self, graph, weights, make_inputs=None, ref=None, tol=2e-2,
                 load_kwargs=None, check=None):
        self.graph = graph
        self.weights = weights  # name -> torch CPU tensor
        self.make_inputs = make_inputs  # T -> list[torch tensor on cuda]
        self.ref = ref  # (inputs, W) -> list[torch float32]
        self.tol = tol
        self.load_kwargs = load_kwargs or {}
        self.check = check  # optional custom (outs, refs, inputs) -> dict


def _rand_weights(module, std=0.02, overrides=None):
    """Random torch bf16 weights for every Weight of a max.nn Module."""
    import torch

    g = torch.Generator().manual_seed(1234)
    out = {}
    for k, w in module.raw_state_dict().items():
        shape = [int(d) for d in w.shape]
        s = std
        if k.endswith("bias"):
            s = 0.1
        t = torch.randn(shape, generator=g, dtype=torch.float32) * s
        if "norm" in k and k.endswith("weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        if overrides and k in overrides:
            t = overrides[k](shape, g)
        out[k] = t.to(torch.bfloat16).contiguous()
    module.load_state_dict(out)
    return out


def _x(T, n, std=1.0, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + 7 * T)
    return (torch.randn(T, n, device="cuda", generator=g) * std).to(torch.bfloat16)


def _f(t):
    return t.float().cuda()


def _rms(x, w):
    x = x.float()
    r = x * torch_rsqrt((x * x).mean(-1, keepdim=True) + EPS)
    return r * w.float().cuda()


def torch_rsqrt(t):
    import torch

    return torch.rsqrt(t)


def _bf(t):
    import torch

    return t.to(torch.bfloat16).float()


def _gpu():
    _, DeviceRef, *_ = _max()
    return DeviceRef.GPU()


def _box(**mods):
    """A max.nn Module holding sub-modules / weights as named attributes."""
    from max.nn.layer import Module

    class Box(Module):
        def __call__(self, *a, **k):  # pieces call the attributes directly
            raise NotImplementedError

    b = Box()
    for k, v in mods.items():
        setattr(b, k, v)
    return b


def _linear_graph(name, in_dim, out_dim, bias, post=None, extra_inputs=(),
                  ref_post=None, tol=2e-2):
    """Graph: y = post(Linear(x), *extra) with MAX's Linear."""
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.nn.linear import Linear

    box = _box(lin=Linear(in_dim, out_dim, DType.bfloat16, _gpu(), has_bias=bias))
    W = _rand_weights(box)
    types = [TensorType(DType.bfloat16, ["T", in_dim], device=_gpu())]
    for n in extra_inputs:
        types.append(TensorType(DType.bfloat16, ["T", n], device=_gpu()))

    def fwd(x, *extra):
        y = box.lin(x.tensor)
        if post is not None:
            y = post(y, *[e.tensor for e in extra])
        return y

    g = Graph(name, fwd, input_types=types)

    def make_inputs(T):
        return [_x(T, in_dim)] + [_x(T, n, seed=i + 1) for i, n in enumerate(extra_inputs)]

    def ref(inp, W=W):
        y = _f(inp[0]) @ _f(W["lin.weight"]).T
        if bias:
            y = y + _f(W["lin.bias"])
        if ref_post is not None:
            y = ref_post(y, *[_f(e) for e in inp[1:]])
        return [y]

    return Spec(g, box.state_dict(), make_inputs, ref, tol=tol)


# --------------------------------------------------------------------------
# Pieces: stock gpt_oss building blocks
# --------------------------------------------------------------------------


@piece("embed", "Embedding(201088, 2880) gather, int64 tokens [T]")
def p_embed():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    import torch
    from max.nn.embedding import Embedding

    box = _box(emb=Embedding(V, H, DType.bfloat16, _gpu()))
    W = _rand_weights(box, std=1.0)
    g = Graph("embed", lambda t: box.emb(t.tensor),
              input_types=[TensorType(DType.int64, ["T"], device=_gpu())])

    def make_inputs(T):
        return [torch.randint(0, V, (T,), device="cuda", dtype=torch.int64)]

    return Spec(g, box.state_dict(), make_inputs,
                lambda inp: [_f(W["emb.weight"])[inp[0]]], tol=1e-6)


def _qkv_module(stacked=False):
    DType, *_ = _max()
    from max.nn.stacked_linear import StackedLinear

    return StackedLinear(in_dim=H, out_dims=[QD, KVD, KVD],
                         names=["q_proj", "k_proj", "v_proj"],
                         dtype=DType.bfloat16, device=_gpu(),
                         stacked=stacked, has_bias=True)


def _qkv_ref_w(W):
    import torch

    # StackedLinear's children are named without the parent's prefix.
    def get(n, kind):
        return next(v for k, v in W.items() if k.endswith(f"{n}.{kind}"))

    w = torch.cat([get(n, "weight") for n in ("q_proj", "k_proj", "v_proj")])
    b = torch.cat([get(n, "bias") for n in ("q_proj", "k_proj", "v_proj")])
    return w, b


@piece("qkv_stacked_linear", "GptOssAttention.qkv_proj: StackedLinear q/k/v "
       "(stacked=False: concat of 3 weights + 3 biases) 2880->5120 + bias")
def p_qkv():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    box = _box(qkv=_qkv_module())
    W = _rand_weights(box)
    g = Graph("qkv", lambda x: box.qkv(x.tensor),
              input_types=[TensorType(DType.bfloat16, ["T", H], device=_gpu())])
    w, b = _qkv_ref_w(W)
    return Spec(g, box.state_dict(), lambda T: [_x(T, H)],
                lambda inp: [_f(inp[0]) @ _f(w).T + _f(b)])


@piece("o_proj", "GptOssAttention.o_proj: Linear 4096->2880 + bias")
def p_oproj():
    return _linear_graph("o_proj", QD, H, True)


@piece("o_proj_residual", "o_proj + bias + residual add (block's h = x + attn)")
def p_oproj_res():
    return _linear_graph("o_proj_res", QD, H, True,
                         post=lambda y, r: r + y, extra_inputs=(H,),
                         ref_post=lambda y, r: r + _bf(y))


@piece("router_linear", "router gate_score: Linear 2880->32 + bias")
def p_router_lin():
    return _linear_graph("router_lin", H, E, True)


@piece("router_gate", "GptOssMoEGate: Linear 2880->32 + bias, top_k 4, softmax")
def p_router_gate():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    import torch
    from max.pipelines.architectures.gpt_oss.layers.moe import GptOssMoEGate

    box = _box(gate=GptOssMoEGate(devices=[_gpu()], hidden_dim=H, num_experts=E,
                                  num_experts_per_token=TOPK, dtype=DType.bfloat16))
    W = _rand_weights(box)

    def fwd(x):
        idx, sc = box.gate(x.tensor)
        return idx, sc

    g = Graph("router_gate", fwd,
              input_types=[TensorType(DType.bfloat16, ["T", H], device=_gpu())])

    def ref(inp):
        s = _bf(_f(inp[0]) @ _f(W["gate.gate_score.weight"]).T + _f(W["gate.gate_score.bias"]))
        v, i = torch.topk(s, TOPK, dim=-1)
        return [i.float(), torch.softmax(v, -1)]

    def check(outs, refs, inp):
        idx, sc = outs
        ri, rs = refs
        same = (torch.sort(idx.long(), -1).values == torch.sort(ri.long(), -1).values).float().mean().item()
        err = (torch.sort(sc, -1).values - torch.sort(rs, -1).values).abs().max().item()
        return {"topk_idx_agree": same, "softmax_max_abs_err": err,
                "ok": same > 0.97 and err < 3e-2}

    return Spec(g, box.state_dict(), lambda T: [_x(T, H)], ref, check=check)


@piece("norm_qkv", "input_layernorm RMSNorm(multiply_before_cast) -> qkv StackedLinear")
def p_norm_qkv():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.nn.norm.rms_norm import RMSNorm

    box = _box(norm=RMSNorm(H, DType.bfloat16, EPS, multiply_before_cast=True),
               qkv=_qkv_module())
    W = _rand_weights(box)
    g = Graph("norm_qkv", lambda x: box.qkv(box.norm(x.tensor)),
              input_types=[TensorType(DType.bfloat16, ["T", H], device=_gpu())])
    w, b = _qkv_ref_w(W)
    return Spec(g, box.state_dict(), lambda T: [_x(T, H)],
                lambda inp: [_bf(_rms(inp[0], W["norm.weight"])) @ _f(w).T + _f(b)])


def _lm_head(name, *, norm=True, gather_last=True, cast_f32=True, weight_in_out=False,
             barrier=None, load_kwargs=None):
    """gpt_oss logits path: gather last token per sequence -> final norm ->
    lm_head (ColumnParallelLinear = Linear on one device) -> cast float32."""
    DType, DeviceRef, Graph, TensorType, ops = _max()
    import torch
    from max.graph import Weight
    from max.nn.linear import Linear
    from max.nn.norm.rms_norm import RMSNorm

    mods = {}
    if norm:
        mods["norm"] = RMSNorm(H, DType.bfloat16, EPS, multiply_before_cast=True)
    if weight_in_out:
        mods["lm_w"] = Weight("lm_w", DType.bfloat16, [H, V], _gpu())
    else:
        mods["lm"] = Linear(H, V, DType.bfloat16, _gpu(), has_bias=False)
    box = _box(**mods)
    W = _rand_weights(box)
    types = [TensorType(DType.bfloat16, ["T", H], device=_gpu())]
    if gather_last:
        types.append(TensorType(DType.uint32, ["offsets_len"], device=_gpu()))

    def fwd(h, *rest):
        x = h.tensor
        if gather_last:
            off = rest[0].tensor
            x = ops.gather(x, off[1:] - 1, axis=0)
        if norm:
            x = box.norm(x)
        if weight_in_out:
            y = ops.matmul(x, box.lm_w)
        else:
            y = box.lm(x)
        if barrier is not None:
            y = barrier(y)
        if cast_f32:
            y = ops.cast(y, DType.float32)
        return y

    g = Graph(name, fwd, input_types=types)

    def make_inputs(T):
        inp = [_x(T, H)]
        if gather_last:
            # two sequences when T > 1
            cuts = [0, T] if T < 2 else [0, T // 2, T]
            inp.append(torch.tensor(cuts, dtype=torch.int32, device="cuda").to(torch.uint32))
        return inp

    def ref(inp):
        x = _f(inp[0])
        if gather_last:
            off = inp[1].cpu().long()
            x = x[(off[1:] - 1).cuda()]
        if norm:
            x = _bf(_rms(x, W["norm.weight"]))
        wt = _f(W["lm_w"]) if weight_in_out else _f(W["lm.weight"]).T
        return [x @ wt]

    return Spec(g, box.state_dict(), make_inputs, ref, load_kwargs=load_kwargs)


@piece("lm_head_stock", "logits path as in gpt_oss: gather last tokens, final "
       "RMSNorm, Linear 2880->201088 (no bias), cast float32")
def p_lm_stock():
    return _lm_head("lm_head_stock")


@piece("lm_head_linear", "Linear 2880->201088 alone, bf16 out (no norm, no cast)")
def p_lm_lin():
    return _lm_head("lm_head_linear", norm=False, gather_last=False, cast_f32=False)


@piece("lm_head_linear_f32", "Linear 2880->201088 then cast float32 (no norm)")
def p_lm_lin_f32():
    return _lm_head("lm_head_linear_f32", norm=False, gather_last=False)


@piece("lm_head_norm_f32", "RMSNorm -> Linear 2880->201088 -> cast float32, all T rows")
def p_lm_norm_f32():
    return _lm_head("lm_head_norm_f32", gather_last=False)


@piece("resid_norm_router", "h = resid + o_proj(a)+b; RMSNorm(h); router Linear+bias "
       "(the fusion chain between attention and MoE); outputs h and logits")
def p_chain():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.nn.linear import Linear
    from max.nn.norm.rms_norm import RMSNorm

    box = _box(o=Linear(QD, H, DType.bfloat16, _gpu(), has_bias=True),
               norm=RMSNorm(H, DType.bfloat16, EPS, multiply_before_cast=True),
               r=Linear(H, E, DType.bfloat16, _gpu(), has_bias=True))
    W = _rand_weights(box)

    def fwd(a, res):
        h = res.tensor + box.o(a.tensor)
        return h, box.r(box.norm(h))

    g = Graph("chain", fwd, input_types=[
        TensorType(DType.bfloat16, ["T", QD], device=_gpu()),
        TensorType(DType.bfloat16, ["T", H], device=_gpu())])

    def ref(inp):
        h = _bf(_f(inp[1]) + _bf(_f(inp[0]) @ _f(W["o.weight"]).T + _f(W["o.bias"])))
        n = _bf(_rms(h, W["norm.weight"]))
        return [h, n @ _f(W["r.weight"]).T + _f(W["r.bias"])]

    return Spec(g, box.state_dict(), lambda T: [_x(T, QD), _x(T, H, seed=3)], ref)


def _raw_matmul(name, n, k, bias, post=None, ref_post=None, in_out=False,
                barrier=None):
    """ops.matmul with a raw Weight: W [N,K] used as W.T (transpose_b), or
    W stored [K,N] (in_out=True, no transpose)."""
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.graph import Weight

    mods = {"w": Weight("w", DType.bfloat16, [k, n] if in_out else [n, k], _gpu())}
    if bias:
        mods["b"] = Weight("b", DType.bfloat16, [n], _gpu())
    box = _box(**mods)
    W = _rand_weights(box)

    def fwd(x):
        y = ops.matmul(x.tensor, box.w if in_out else box.w.T)
        if barrier is not None:
            y = barrier(y)
        if bias:
            y = y + box.b
        if post is not None:
            y = post(y)
        return y

    g = Graph(name, fwd, input_types=[TensorType(DType.bfloat16, ["T", k], device=_gpu())])

    def ref(inp):
        y = _f(inp[0]) @ (_f(W["w"]) if in_out else _f(W["w"]).T)
        if bias:
            y = y + _f(W["b"])
        if ref_post is not None:
            y = ref_post(y)
        return [y]

    return Spec(g, box.state_dict(), lambda T: [_x(T, k)], ref)


@piece("raw_mm_5120", "baseline: ops.matmul(x, W.T) 2880->5120, no epilogue")
def p_raw():
    return _raw_matmul("raw_mm_5120", QD + 2 * KVD, H, False)


@piece("raw_mm_bias_5120", "ops.matmul(x, W.T) + bias 2880->5120 (single weight)")
def p_raw_b():
    return _raw_matmul("raw_mm_bias_5120", QD + 2 * KVD, H, True)


@piece("raw_mm_bias_4096", "ops.matmul(x, W.T) + bias 2880->4096 (the shape that compiled before)")
def p_raw_b4096():
    return _raw_matmul("raw_mm_bias_4096", 4096, H, True)


@piece("raw_mm_f32_v", "ops.matmul(x, W.T) 2880->201088 then cast float32")
def p_raw_f32v():
    DType, *_ , ops = _max()
    return _raw_matmul("raw_mm_f32_v", V, H, False, post=lambda y: ops.cast(y, DType.float32))


@piece("raw_mm_f32_4096", "ops.matmul(x, W.T) 2880->4096 then cast float32")
def p_raw_f32_4096():
    DType, *_ , ops = _max()
    return _raw_matmul("raw_mm_f32_4096", 4096, H, False, post=lambda y: ops.cast(y, DType.float32))


# --------------------------------------------------------------------------
# MoE and attention
# --------------------------------------------------------------------------


@piece("moe_stacked_bf16", "MAX StackedMoE as GptOssMoE (bf16 experts, 32 experts "
       "top-4, interleaved gate/up, biases, clamped GLU): router + "
       "moe_create_indices + grouped_matmul_ragged x2 + moe_finalize")
def p_moe():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    import torch
    from max.nn.moe import GateUpFormat, StackedMoE
    from max.pipelines.architectures.gpt_oss.layers.moe import (
        GptOssMoEGate,
        gptoss_glu_activation,
    )

    box = _box(moe=StackedMoE(devices=[_gpu()], hidden_dim=H, num_experts=E,
                              num_experts_per_token=TOPK, moe_dim=INTER,
                              gate_cls=GptOssMoEGate, dtype=DType.bfloat16,
                              gate_up_format=GateUpFormat.INTERLEAVED,
                              gated_activation_fn=gptoss_glu_activation,
                              has_bias=True))
    W = _rand_weights(box)
    g = Graph("moe", lambda x: box.moe(x.tensor),
              input_types=[TensorType(DType.bfloat16, ["T", H], device=_gpu())])

    def ref(inp):
        x = _f(inp[0])
        s = _bf(x @ _f(W["moe.gate.gate_score.weight"]).T + _f(W["moe.gate.gate_score.bias"]))
        v, idx = torch.topk(s, TOPK, dim=-1)
        wts = torch.softmax(v, -1)
        gu_w, gu_b = W["moe.experts.gate_up_proj"], W["moe.experts.gate_up_proj_bias"]
        dn_w, dn_b = W["moe.experts.down_proj"], W["moe.experts.down_proj_bias"]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOPK):
                e = int(idx[t, j])
                gu = _bf(x[t] @ _f(gu_w[e]) + _f(gu_b[e]))
                gate, up = gu[0::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
                hdn = _bf((up + 1) * (gate * torch.sigmoid(gate * 1.702)))
                out[t] += wts[t, j] * _bf(hdn @ _f(dn_w[e]) + _f(dn_b[e]))
        return [out]

    return Spec(g, box.state_dict(), lambda T: [_x(T, H)], ref, tol=3e-2)


# ---- MoE, bisected: our own forward that mirrors StackedMoE._forward_bf16
# (max/nn/moe/stacked_moe.py) with knobs for where to stop, the weight
# layout, and where the expert biases are added.

PAD = 8  # K padding for folded biases: K*2 bytes must stay 16 B aligned


def _moe_base():
    import torch

    g = torch.Generator().manual_seed(99)
    r = lambda *sh, s=0.02: (torch.randn(*sh, generator=g) * s).to(torch.bfloat16)  # noqa: E731
    return {"gate_w": r(E, H), "gate_b": r(E, s=0.1), "gu_w": r(E, H, 2 * INTER),
            "gu_b": r(E, 2 * INTER, s=0.1), "dn_w": r(E, INTER, H), "dn_b": r(E, H, s=0.1)}


def _moe_variant(name, *, upto="full", layout="stock", gu_bias="stock",
                 dn_bias="stock", dyn="none", f32=False):
    """upto: perm | gmm1 | gmm1_bias | glu | full
    layout: stock (weights [E,in,out] + transpose(1,2) in the graph, as
            StackedMoE) | pre_t (stored [E,out,in], no transpose op)
    gu_bias: stock (gather+add after the gate_up grouped matmul) | none |
             fold (bias as an extra K column of the weight, ones column on x)
    dn_bias: stock (gather+add after the down grouped matmul) | none |
             fold | after (sum_k w_k * b_e(k) added after moe_finalize)
    dyn: none | N | E: see grouped_matmul_ragged_sm90_safe
    f32: run the grouped matmuls in float32 (a float32 C output also skips
         the SM90 path)"""
    DType, DeviceRef, Graph, TensorType, ops = _max()
    import torch
    from max.graph import Weight
    from max.nn.kernels import grouped_matmul_ragged, moe_create_indices, moe_finalize
    from max.pipelines.architectures.gpt_oss.layers.moe import (
        GptOssMoEGate,
        gptoss_glu_activation,
    )

    B = _moe_base()
    bf = DType.bfloat16
    gate = GptOssMoEGate(devices=[_gpu()], hidden_dim=H, num_experts=E,
                         num_experts_per_token=TOPK, dtype=bf)
    st = {"gate.gate_score.weight": B["gate_w"], "gate.gate_score.bias": B["gate_b"]}
    mods = {"gate": gate}
    gu_fold, dn_fold = gu_bias == "fold", dn_bias == "fold"
    if layout == "stock":
        assert not (gu_fold or dn_fold)
        mods["gu_w"] = Weight("gu_w", bf, [E, H, 2 * INTER], _gpu())
        mods["dn_w"] = Weight("dn_w", bf, [E, INTER, H], _gpu())
        st["gu_w"], st["dn_w"] = B["gu_w"], B["dn_w"]
    else:
        gu_t = B["gu_w"].transpose(1, 2).contiguous()  # [E, 2I, H]
        dn_t = B["dn_w"].transpose(1, 2).contiguous()  # [E, H, INTER]
        if gu_fold:
            z = torch.zeros(E, 2 * INTER, PAD, dtype=torch.bfloat16)
            z[:, :, 0] = B["gu_b"]
            gu_t = torch.cat([gu_t, z], 2).contiguous()
        if dn_fold:
            z = torch.zeros(E, H, PAD, dtype=torch.bfloat16)
            z[:, :, 0] = B["dn_b"]
            dn_t = torch.cat([dn_t, z], 2).contiguous()
        mods["gu_t"] = Weight("gu_t", bf, list(gu_t.shape), _gpu())
        mods["dn_t"] = Weight("dn_t", bf, list(dn_t.shape), _gpu())
        st["gu_t"], st["dn_t"] = gu_t, dn_t
    if gu_bias == "stock":
        mods["gu_b"] = Weight("gu_b", bf, [E, 2 * INTER], _gpu())
        st["gu_b"] = B["gu_b"]
    if dn_bias in ("stock", "after"):
        mods["dn_b"] = Weight("dn_b", bf, [E, H], _gpu())
        st["dn_b"] = B["dn_b"]
    box = _box(**mods)
    box.load_state_dict(st)

    def ones_cols(v):
        one = ops.constant(1.0, bf, device=_gpu())
        col = ops.broadcast_to(ops.reshape(one, [1, 1]), [v.shape[0], 1])
        zer = ops.broadcast_to(ops.reshape(ops.constant(0.0, bf, device=_gpu()), [1, 1]),
                               [v.shape[0], PAD - 1])
        return ops.concat([v, col, zer], axis=1)

    def gmm(a, w, starts, eids, usage):
        if f32:
            y = grouped_matmul_ragged(ops.cast(a, DType.float32), ops.cast(w, DType.float32),
                                      starts, eids, usage)
            return ops.cast(y, bf)
        if dyn != "none":
            return grouped_matmul_ragged_sm90_safe(a, w, starts, eids, usage, mode=dyn)
        return grouped_matmul_ragged(a, w, starts, eids, usage)

    def fwd(xv):
        x = xv.tensor
        idx, wts = box.gate(x)
        idx_flat = ops.reshape(idx, [-1])
        ind = moe_create_indices(ops.cast(idx_flat, DType.int32), E)
        order, starts, restore, eids, usage = ind[0], ind[1], ind[2], ind[3], ind[4]
        perm = ops.gather(x, ops.cast(order // TOPK, DType.int32), axis=0)
        extra = (ops.cast(order, DType.int32), ops.cast(idx_flat, DType.int32))
        if upto == "perm":
            return (perm, *extra)
        a = ones_cols(perm) if gu_fold else perm
        w1 = box.gu_w.transpose(1, 2) if layout == "stock" else box.gu_t
        y = gmm(a, w1, starts, eids, usage)
        if upto == "gmm1":
            return (y, *extra)
        assign = ops.gather(idx_flat, order, axis=0)
        if gu_bias == "stock":
            y = y + ops.gather(box.gu_b, assign, axis=0)
        if upto == "gmm1_bias":
            return (y, *extra)
        h = gptoss_glu_activation(y[:, 0::2], y[:, 1::2])
        if upto == "glu":
            return (h, *extra)
        a2 = ones_cols(h) if dn_fold else h
        w2 = box.dn_w.transpose(1, 2) if layout == "stock" else box.dn_t
        d = gmm(a2, w2, starts, eids, usage)
        if dn_bias == "stock":
            d = d + ops.gather(box.dn_b, assign, axis=0)
        out = moe_finalize(d, restore, wts, bf)
        if dn_bias == "after":
            bt = ops.reshape(ops.gather(box.dn_b, idx_flat, axis=0), [-1, TOPK, H])
            wt = ops.reshape(ops.cast(wts, DType.float32), [-1, TOPK, 1])
            bsum = ops.sum(ops.cast(bt, DType.float32) * wt, axis=1)
            out = out + ops.cast(ops.reshape(bsum, [-1, H]), bf)
        return out

    g = Graph(name, fwd, input_types=[TensorType(bf, ["T", H], device=_gpu())])
    use_gu_b = gu_bias != "none"
    use_dn_b = dn_bias != "none"
    _cache = {}

    def cb(k):  # base weight k as float32 on the GPU, cached
        if k not in _cache:
            _cache[k] = _f(B[k])
        return _cache[k]

    def route(x):
        sc = _bf(x @ _f(B["gate_w"]).T + _f(B["gate_b"]))
        v, i = torch.topk(sc, TOPK, dim=-1)
        return i, torch.softmax(v, -1)

    def rows(x, order, idx_flat):
        """Reference rows of the first grouped matmul stage for the given order."""
        o = order.long()
        t, e = o // TOPK, idx_flat.long()[o]
        xr = x[t]
        gu_w = cb("gu_w")
        gu = torch.stack([xr[j] @ gu_w[int(e[j])] for j in range(len(o))])
        return xr, gu, e

    def check_partial(outs, refs, inp):
        x = _f(inp[0])
        y, order, idx_flat = outs[0], outs[1], outs[2]
        ri, _ = route(x)
        same = (torch.sort(idx_flat.view(-1, TOPK).long(), -1).values ==
                torch.sort(ri.long(), -1).values).float().mean().item()
        xr, gu, e = rows(x, order, idx_flat)
        if upto == "perm":
            ref = xr
        elif upto == "gmm1":
            ref = gu
        else:
            gb = gu + cb("gu_b")[e]
            ref = gb
            if upto == "glu":
                gb = _bf(gb)
                gt, up = gb[:, 0::2].clamp(max=7.0), gb[:, 1::2].clamp(-7.0, 7.0)
                ref = (up + 1) * (gt * torch.sigmoid(gt * 1.702))
        rel = ((y - ref).norm() / ref.norm()).item()
        return {"rel_err": [rel], "topk_idx_agree": same, "ok": rel < 3e-2 and same > 0.97}

    def ref_full(inp):
        x = _f(inp[0])
        idx, wts = route(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOPK):
                e = int(idx[t, j])
                gu = x[t] @ cb("gu_w")[e] + (cb("gu_b")[e] if use_gu_b else 0)
                gu = _bf(gu)
                gt, up = gu[0::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
                hdn = _bf((up + 1) * (gt * torch.sigmoid(gt * 1.702)))
                d = hdn @ cb("dn_w")[e] + (cb("dn_b")[e] if use_dn_b else 0)
                out[t] += wts[t, j] * _bf(d)
        return [out]

    if upto == "full":
        return Spec(g, box.state_dict(), lambda T: [_x(T, H)], ref_full, tol=3e-2)
    return Spec(g, box.state_dict(), lambda T: [_x(T, H)], lambda inp: [],
                check=check_partial)


for _n, _kw, _d in [
    ("moe_perm_only", dict(upto="perm"), "router + moe_create_indices + permute gather"),
    ("moe_gmm1_stock", dict(upto="gmm1"), "+ gate_up grouped_matmul_ragged, weight "
     "[E,in,out].transpose(1,2) as StackedMoE, no epilogue"),
    ("moe_gmm1_pre_t", dict(upto="gmm1", layout="pre_t"), "gate_up grouped matmul, "
     "weight stored [E,out,in] (no transpose op), no epilogue"),
    ("moe_gmm1_bias", dict(upto="gmm1_bias"), "gate_up grouped matmul + gathered "
     "expert bias add (stock)"),
    ("moe_gmm1_bias_glu", dict(upto="glu"), "gate_up grouped matmul + bias + "
     "interleaved split + clamped GLU (stock)"),
    ("moe_full_stock", dict(), "whole MoE re-implemented as StackedMoE (control)"),
    ("moe_full_nobias", dict(gu_bias="none", dn_bias="none"), "whole MoE, no expert "
     "biases at all"),
    ("moe_full_pre_t", dict(layout="pre_t"), "whole MoE, weights stored [E,out,in], "
     "biases stock"),
    ("moe_full_dnbias_after", dict(dn_bias="after"), "whole MoE, down bias added after "
     "moe_finalize as sum_k w_k b_e(k); gate_up bias stock"),
    ("moe_full_fold", dict(layout="pre_t", gu_bias="fold", dn_bias="after"),
     "whole MoE, gate_up bias folded into the weight (extra K column, ones on x), "
     "down bias after moe_finalize"),
    ("moe_full_fold_both", dict(layout="pre_t", gu_bias="fold", dn_bias="fold"),
     "whole MoE, both biases folded into the weights as an extra K column"),
    ("moe_gmm1_dynN", dict(upto="gmm1", dyn="N"), "gate_up grouped matmul, weight's "
     "N dim rebound to a symbol (output rebound back)"),
    ("moe_full_dynN", dict(dyn="N"), "whole MoE as StackedMoE, both grouped matmuls "
     "with the weight's N dim rebound to a symbol (ops.rebind)"),
    ("moe_full_dynE", dict(dyn="E"), "whole MoE, weights and expert_ids rebound to a "
     "symbolic num_experts dim"),
    ("moe_full_f32", dict(f32=True), "whole MoE, grouped matmuls in float32 (cast in, "
     "cast out)"),
    ("moe_full_mixed", dict(dyn="mixed"), "whole MoE, grouped matmuls with float32 "
     "activations and bf16 weights (output float32, cast back)"),
]:
    piece(_n, _d)((lambda kw, n: (lambda: _moe_variant(n, **kw)))(_kw, _n))


def grouped_matmul_ragged_sm90_safe(a, w, starts, eids, usage, mode="mixed"):
    """max.nn.kernels.grouped_matmul_ragged, steered off MAX 26.7's SM90
    grouped-matmul kernel, which fails to compile on Hopper for bf16
    (matmul_kernels.mojo:1307 -> coord.mojo:410 "Coord is not a value type").

    MAX's grouped_matmul dispatch skips the SM90 kernel when the output C is
    float32 (C takes the input activations' dtype) and runs its naive grouped
    kernel, which accumulates in float32 either way.
      mode "f32":   cast activations and weights to float32 (the weight cast
                    costs a full pass over the expert stack every call)
      mode "mixed": cast only the activations; weights stay bf16
      mode "N"/"E": ops.rebind the weight's N / num_experts dim to a symbol
                    (tried: does NOT help, the SM90 kernel is still built)
    The result is cast back to the input dtype."""
    DType, _, _, _, ops = _max()
    from max.nn.kernels import grouped_matmul_ragged

    dt = a.dtype
    if mode == "f32":
        y = grouped_matmul_ragged(ops.cast(a, DType.float32), ops.cast(w, DType.float32),
                                  starts, eids, usage)
        return ops.cast(y, dt)
    if mode == "mixed":
        y = grouped_matmul_ragged(ops.cast(a, DType.float32), w, starts, eids, usage)
        return ops.cast(y, dt)
    n = int(w.shape[1])
    if mode == "N":
        w = ops.rebind(w, [w.shape[0], f"moe_n_{n}", w.shape[2]])
    elif mode == "E":
        w = ops.rebind(w, ["moe_num_experts", w.shape[1], w.shape[2]])
        eids = ops.rebind(eids, ["moe_num_experts"])
    else:
        raise ValueError(mode)
    y = grouped_matmul_ragged(a, w, starts, eids, usage)
    return ops.rebind(y, [a.shape[0], n])


def make_sm90_safe_moe_class(base, mode="mixed"):
    """The workaround as a StackedMoE subclass (GptOssMoE works the same way):
    _forward_bf16 as in max/nn/moe/stacked_moe.py, with each grouped matmul
    through grouped_matmul_ragged_sm90_safe."""

    class SM90SafeMoE(base):
        def _forward_bf16(self, permuted_states, routing):
            gate_up_output = grouped_matmul_ragged_sm90_safe(
                permuted_states, self.gate_up_proj_transposed,
                routing.expert_start_indices, routing.expert_ids,
                routing.expert_usage_stats, mode=mode)
            gated_output = self._apply_gated_activation(gate_up_output, routing)
            down_output = grouped_matmul_ragged_sm90_safe(
                gated_output, self.down_proj_transposed,
                routing.expert_start_indices, routing.expert_ids,
                routing.expert_usage_stats, mode=mode)
            return self._apply_down_bias(down_output, routing)

    return SM90SafeMoE


def _wa_moe_subclass(mode):
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.nn.moe import GateUpFormat, StackedMoE
    from max.pipelines.architectures.gpt_oss.layers.moe import (
        GptOssMoEGate,
        gptoss_glu_activation,
    )

    cls = make_sm90_safe_moe_class(StackedMoE, mode)
    box = _box(moe=cls(devices=[_gpu()], hidden_dim=H, num_experts=E,
                       num_experts_per_token=TOPK, moe_dim=INTER, gate_cls=GptOssMoEGate,
                       dtype=DType.bfloat16, gate_up_format=GateUpFormat.INTERLEAVED,
                       gated_activation_fn=gptoss_glu_activation, has_bias=True))
    B = _moe_base()
    box.load_state_dict({
        "moe.gate.gate_score.weight": B["gate_w"], "moe.gate.gate_score.bias": B["gate_b"],
        "moe.experts.gate_up_proj": B["gu_w"], "moe.experts.gate_up_proj_bias": B["gu_b"],
        "moe.experts.down_proj": B["dn_w"], "moe.experts.down_proj_bias": B["dn_b"]})
    g = Graph("moe_sub", lambda x: box.moe(x.tensor),
              input_types=[TensorType(DType.bfloat16, ["T", H], device=_gpu())])
    ref_spec = _moe_variant("ref_only")  # same base weights: reuse its ref
    return Spec(g, box.state_dict(), lambda T: [_x(T, H)], ref_spec.ref, tol=3e-2)


for _m, _d in [("N", "weight N dim rebound to a symbol"),
               ("f32", "activations and weights cast to float32"),
               ("mixed", "activations cast to float32, weights stay bf16")]:
    piece(f"wa_moe_subclass_{_m}", "StackedMoE subclass with GptOssMoE's arguments whose "
          f"_forward_bf16 calls grouped_matmul_ragged_sm90_safe: {_d}")(
        (lambda m: (lambda: _wa_moe_subclass(m)))(_m))


def _kv_params():
    DType, *_ = _max()
    from max.nn.kv_cache import MHAKVCacheParams

    return MHAKVCacheParams(dtype=DType.bfloat16, head_dim=HD, num_layers=1,
                            devices=[_gpu()], n_kv_heads=NKV, page_size=128)


def _rope():
    from max.nn.rotary_embedding import YarnRotaryEmbedding, YarnScalingParams

    return YarnRotaryEmbedding(
        dim=H, n_heads=NQ, theta=150000.0, max_seq_len=131072, head_dim=HD,
        interleaved=False,
        scaling_params=YarnScalingParams(factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                         original_max_position_embeddings=4096,
                                         truncate=False))


def _attn(name, *, full_layer: bool, sliding: bool):
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.graph import Weight
    from max.nn.attention import MHAMaskVariant
    from max.nn.kernels import flash_attention_ragged, rope_split_store_ragged

    kvp = _kv_params()
    kv_types = list(kvp.flattened_kv_inputs())
    layer_type = "sliding_attention" if sliding else "full_attention"
    if full_layer:
        from max.pipelines.architectures.gpt_oss.layers.attention import GptOssAttention

        attn = GptOssAttention(rope=_rope(), num_attention_heads=NQ,
                               num_key_value_heads=NKV, hidden_size=H, kv_params=kvp,
                               layer_idx=0, layer_type=layer_type, dtype=DType.bfloat16,
                               devices=[_gpu()], has_bias=True, local_window_size=128)
        box = _box(attn=attn)
        in_dim = H
    else:
        box = _box(sinks=Weight("sinks", DType.bfloat16, [NQ], _gpu()))
        in_dim = QD + 2 * KVD
    _rand_weights(box, overrides={"sinks": lambda s, g: __import__("torch").randn(s, generator=g),
                                  "attn.sinks": lambda s, g: __import__("torch").randn(s, generator=g)})
    rope = _rope()
    types = [TensorType(DType.bfloat16, ["T", in_dim], device=_gpu()),
             TensorType(DType.uint32, ["offsets_len"], device=_gpu())] + kv_types

    def fwd(x, off, *kv):
        kv_coll = kvp.unflatten_kv_inputs(iter(kv))[0]
        if full_layer:
            return box.attn(x.tensor, kv_coll, input_row_offsets=off.tensor)
        qkv = x.tensor
        layer_idx = ops.constant(0, DType.uint32, device=DeviceRef.CPU())
        freqs = ops.cast(rope.freqs_cis, qkv.dtype).to(qkv.device)
        xq = rope_split_store_ragged(kv_params=kvp, qkv=qkv, input_row_offsets=off.tensor,
                                     freqs_cis=freqs, kv_collection=kv_coll,
                                     layer_idx=layer_idx, n_heads=NQ, interleaved=False)
        xq = xq.reshape((-1, NQ, HD))
        out = flash_attention_ragged(
            kvp, input=xq, kv_collection=kv_coll, layer_idx=layer_idx,
            input_row_offsets=off.tensor,
            mask_variant=(MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK if sliding
                          else MHAMaskVariant.CAUSAL_MASK),
            scale=HD ** -0.5, local_window_size=128, sink_weights=box.sinks)
        return ops.reshape(out, [x.tensor.shape[0], -1])

    g = Graph(name, fwd, input_types=types)
    return Spec(g, box.state_dict())  # compile only


@piece("attn_flash_sinks", "rope_split_store_ragged + flash_attention_ragged with "
       "sink_weights, causal, qkv given as input (compile only)")
def p_attn_flash():
    return _attn("attn_flash_sinks", full_layer=False, sliding=False)


@piece("attn_flash_sinks_sliding", "as attn_flash_sinks with SLIDING_WINDOW_CAUSAL_MASK "
       "window 128 (compile only)")
def p_attn_flash_sw():
    return _attn("attn_flash_sinks_sliding", full_layer=False, sliding=True)


@piece("attn_layer_full", "GptOssAttention whole (qkv, rope+store, flash w/ sinks, "
       "o_proj), full_attention (compile only)")
def p_attn_layer():
    return _attn("attn_layer_full", full_layer=True, sliding=False)


# --------------------------------------------------------------------------
# Workaround variants
# --------------------------------------------------------------------------


@piece("wa_qkv_stacked_true", "qkv as ONE stacked weight [5120,2880] + one bias "
       "(StackedLinear stacked=True: no concat)")
def p_wa_qkv_stacked():
    DType, DeviceRef, Graph, TensorType, ops = _max()
    box = _box(qkv=_qkv_module(stacked=True))
    W = _rand_weights(box)
    g = Graph("qkv_stacked", lambda x: box.qkv(x.tensor),
              input_types=[TensorType(DType.bfloat16, ["T", H], device=_gpu())])
    return Spec(g, box.state_dict(), lambda T: [_x(T, H)],
                lambda inp: [_f(inp[0]) @ _f(W["qkv.weight"]).T + _f(W["qkv.bias"])])


@piece("wa_lm_head_in_out", "lm head with weight stored [2880,201088]: "
       "matmul(x, W) (no transpose_b) + norm/gather/cast f32 as stock")
def p_wa_lm_inout():
    return _lm_head("wa_lm_head_in_out", weight_in_out=True)


@piece("wa_lm_head_bf16_out", "stock logits path without the float32 cast "
       "(gather, norm, Linear; bf16 logits)")
def p_wa_lm_nocast():
    return _lm_head("wa_lm_head_bf16_out", cast_f32=False)


def _buffer_barrier(y):
    """Store the matmul output into a graph buffer and load it back: a side
    effect the elementwise fuser cannot see through."""
    DType, DeviceRef, Graph, TensorType, ops = _max()
    from max.graph import BufferType

    buf = ops.buffer_create(BufferType(y.dtype, y.shape, device=y.device))
    ops.buffer_store(buf, y)
    return ops.buffer_load(buf)


@piece("wa_lm_head_buffer_barrier", "stock logits path with buffer_store/buffer_load "
       "between the matmul and the float32 cast")
def p_wa_lm_barrier():
    return _lm_head("wa_lm_head_buffer_barrier", barrier=_buffer_barrier)


@piece("wa_lm_head_tile_fusion", "stock logits path, session.load(tile_based_fusion=True)")
def p_wa_lm_tbf():
    return _lm_head("wa_lm_head_tile_fusion", load_kwargs={"tile_based_fusion": True})


@piece("wa_qkv_in_out", "qkv as one weight stored [2880,5120]: matmul(x, W) + bias")
def p_wa_qkv_io():
    return _raw_matmul("wa_qkv_in_out", QD + 2 * KVD, H, True, in_out=True)


@piece("wa_o_proj_in_out", "o_proj weight stored [4096,2880]: matmul(x, W) + bias")
def p_wa_o_io():
    return _raw_matmul("wa_o_proj_in_out", H, QD, True, in_out=True)


@piece("wa_router_in_out", "router weight stored [2880,32]: matmul(x, W) + bias")
def p_wa_r_io():
    return _raw_matmul("wa_router_in_out", E, H, True, in_out=True)


@piece("raw_mm_bias_2880_k4096", "ops.matmul(x, W.T) + bias 4096->2880 (o_proj shape, raw)")
def p_raw_o():
    return _raw_matmul("raw_mm_bias_2880_k4096", H, QD, True)


@piece("raw_mm_bias_32", "ops.matmul(x, W.T) + bias 2880->32 (router shape, raw)")
def p_raw_r():
    return _raw_matmul("raw_mm_bias_32", E, H, True)


@piece("wa_qkv_buffer_barrier", "ops.matmul(x, W.T) 2880->5120, buffer barrier, + bias")
def p_wa_qkv_bar():
    return _raw_matmul("wa_qkv_buffer_barrier", QD + 2 * KVD, H, True, barrier=_buffer_barrier)


# --------------------------------------------------------------------------
# Child: build, compile, run, check one piece
# --------------------------------------------------------------------------

ERR_RE = re.compile(r"([\w./-]+\.mojo:\d+(?::\d+)?)[: ]+(.*)")


def first_error(text: str) -> dict:
    lines = text.splitlines()
    out = {}
    for ln in lines:
        if "constraint failed" in ln or "error:" in ln.lower():
            out["first_error_line"] = ln.strip()[:400]
            break
    locs = []
    for ln in lines:
        m = ERR_RE.search(ln)
        if m:
            s = (m.group(1) + ": " + m.group(2)).strip()[:300]
            if s not in locs:
                locs.append(s)
    out["mojo_locations"] = locs[:25]
    cf = [ln.strip()[:400] for ln in lines if "constraint failed" in ln]
    if cf:
        out["constraint"] = cf[0]
    return out


def run_child(name: str, result_path: str) -> None:
    import torch

    rec: dict = {"piece": name, "desc": PIECES[name][0]}

    def dump():
        Path(result_path).write_text(json.dumps(rec, default=str))

    t0 = time.time()
    try:
        spec = PIECES[name][1]()
        rec["build_s"] = round(time.time() - t0, 2)
    except Exception as e:  # noqa: BLE001
        import traceback

        rec.update(status="build_failed", error=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-3000:])
        dump()
        return
    rec["status"] = "compiling"
    dump()
    from max.driver import Accelerator
    from max.engine import InferenceSession

    dev = Accelerator()
    sess = InferenceSession(devices=[dev])
    t1 = time.time()
    try:
        model = sess.load(spec.graph, weights_registry=spec.weights, **spec.load_kwargs)
    except Exception as e:  # noqa: BLE001
        rec["compile_s"] = round(time.time() - t1, 1)
        msg = _chain(e)
        rec.update(status="compile_failed", error=msg[:6000], **first_error(msg))
        dump()
        return
    rec["compile_s"] = round(time.time() - t1, 1)
    rec["status"] = "compiled"
    dump()
    if spec.make_inputs is None:
        rec["status"] = "ok_compile_only"
        dump()
        return
    checks = []
    try:
        for T in RUN_T:
            inp = spec.make_inputs(T)
            bufs = [_to_buffer(t, dev) for t in inp]
            torch.cuda.synchronize()
            t2 = time.time()
            outs = model.execute(*bufs)
            outs_t = [_to_torch(o) for o in outs]  # copies to host: syncs
            run_s = time.time() - t2
            refs = spec.ref(inp)
            c = {"T": T, "run_s": round(run_s, 4)}
            if spec.check is not None:
                c.update(spec.check(outs_t, refs, inp))
            else:
                errs = []
                for o, r in zip(outs_t, refs, strict=True):
                    o = o.float()
                    if tuple(o.shape) != tuple(r.shape):
                        errs.append(f"shape {tuple(o.shape)} vs ref {tuple(r.shape)}")
                        continue
                    if not torch.isfinite(o).all():
                        errs.append("nonfinite")
                        continue
                    rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
                    errs.append(rel)
                c["rel_err"] = errs
                c["ok"] = all(isinstance(x, float) and x < spec.tol for x in errs)
            checks.append(c)
        rec["checks"] = checks
        rec["status"] = "ok" if all(c["ok"] for c in checks) else "wrong_result"
        if "moe" in name:
            rec["timing_ms"] = _time_model(model, spec, dev)
    except Exception as e:  # noqa: BLE001
        import traceback

        rec["checks"] = checks
        rec.update(status="run_failed", error=f"{type(e).__name__}: {e}"[:3000],
                   traceback=traceback.format_exc()[-3000:])
    dump()


def _time_model(model, spec, dev, sizes=(1, 512), reps=7):
    """Median wall ms of execute + copy of the first output to the host
    (which waits for the device), after 2 warm-up calls."""
    import statistics

    import torch
    from max.driver import CPU

    res = {}
    for T in sizes:
        bufs = [_to_buffer(t, dev) for t in spec.make_inputs(T)]
        torch.cuda.synchronize()
        ts = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            outs = model.execute(*bufs)
            outs[0].to(CPU())
            if i >= 2:
                ts.append((time.perf_counter() - t0) * 1e3)
        res[f"T={T}"] = round(statistics.median(ts), 3)
    return res


def _chain(e: BaseException) -> str:
    """The message of an exception and of every exception it was raised from
    (MAX wraps the compiler's diagnostics in __cause__)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n--- caused by ---\n".join(parts)


def _to_buffer(t, dev):
    from max.driver import Buffer

    t = t.contiguous()
    try:
        return Buffer.from_dlpack(t)
    except Exception:  # noqa: BLE001
        return Buffer.from_dlpack(t.cpu()).to(dev)


def _to_torch(o):
    import torch
    from max.driver import CPU

    return torch.from_dlpack(o.to(CPU())).float().cuda()


# --------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------


WARM_IMPORTS = (
    "import max.nn.kernels, max.nn.kv_cache, max.nn.moe, max.nn.linear, "
    "max.pipelines.architectures.gpt_oss.layers.moe, "
    "max.pipelines.architectures.gpt_oss.layers.attention"
)


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--build-only", action="store_true",
                    help="build every graph in this process (no compile)")
    ap.add_argument("--child")
    ap.add_argument("--result")
    ap.add_argument("--only", default="")
    ap.add_argument("--skip", default="")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=420, help="per piece, seconds")
    ap.add_argument("--deadline", type=int, default=560, help="whole run, seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "bisect_out"))
    a = ap.parse_args()

    if a.child:
        run_child(a.child, a.result)
        return
    names = a.only.split(",") if a.only else list(PIECES)
    unknown = [n for n in names if n not in PIECES]
    if unknown:
        sys.exit(f"unknown pieces: {unknown}")
    names = [n for n in names if n not in a.skip.split(",")]
    if a.list:
        for n in names:
            print(f"{n:28s} {PIECES[n][0]}")
        return
    if a.build_only:
        for n in names:
            try:
                s = PIECES[n][1]()
                print(f"{n:28s} built, {len(s.weights)} weights")
            except Exception as e:  # noqa: BLE001
                print(f"{n:28s} BUILD FAILED {type(e).__name__}: {e}")
        return

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bisect_"))
    start = time.time()
    # The first import of MAX's kernels JIT-builds max/_kv_cache_ops into a
    # shared __mojocache__; children importing it at once raced ("file too
    # short"), so import once here, serially, before the children start.
    w = subprocess.run([sys.executable, "-c", WARM_IMPORTS], capture_output=True, text=True)
    print(f"warm-up imports: rc={w.returncode} {time.time() - start:.1f}s {w.stderr[-500:]}",
          flush=True)
    pending = list(names)
    running: dict[str, tuple[subprocess.Popen, float, Path, Path]] = {}
    results: dict[str, dict] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def finish(n, p, t0, rp, lp, killed=None):
        try:
            rec = json.loads(rp.read_text())
        except Exception:  # noqa: BLE001
            rec = {"piece": n, "desc": PIECES[n][0], "status": "no_result"}
        log = lp.read_text(errors="replace")
        rec["wall_s"] = round(time.time() - t0, 1)
        rec["returncode"] = p.returncode
        if killed:
            rec["status"] = f"{killed}({rec.get('status')})"
        if rec.get("status") not in ("ok", "ok_compile_only", "compiled"):
            fe = first_error(log)
            for k, v in fe.items():
                rec.setdefault(k, v)
            rec["log_tail"] = log[-4000:]
        results[n] = rec
        print(f"[{time.time() - start:6.1f}s] {n}: {rec['status']} "
              f"compile_s={rec.get('compile_s')} {rec.get('constraint', '')[:160]}", flush=True)

    while pending or running:
        now = time.time()
        for n, (p, t0, rp, lp) in list(running.items()):
            if p.poll() is not None:
                del running[n]
                finish(n, p, t0, rp, lp)
            elif now - t0 > a.timeout or now - start > a.deadline:
                p.kill()
                p.wait()
                del running[n]
                finish(n, p, t0, rp, lp, killed="timeout")
        while pending and len(running) < a.jobs and time.time() - start < a.deadline - 30:
            n = pending.pop(0)
            rp, lp = tmp / f"{n}.json", tmp / f"{n}.log"
            lf = open(lp, "w")
            p = subprocess.Popen([sys.executable, __file__, "--child", n, "--result", str(rp)],
                                 stdout=lf, stderr=subprocess.STDOUT, env=env)
            running[n] = (p, time.time(), rp, lp)
        if pending and time.time() - start >= a.deadline - 30 and not running:
            for n in pending:
                results[n] = {"piece": n, "desc": PIECES[n][0], "status": "not_started"}
            pending = []
        time.sleep(0.5)

    doc = {
        "device": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python3"] + sys.argv),
        "max_version": _ver("max"),
        "jobs": a.jobs,
        "total_wall_s": round(time.time() - start, 1),
        "pieces": [results[n] for n in names if n in results],
    }
    (out / "gpu_bisect.json").write_text(json.dumps(doc, indent=1, default=str))
    print()
    print(f"device: {doc['device']}  max {doc['max_version']}  wall {doc['total_wall_s']} s")
    print(f"{'piece':28s} {'status':22s} {'compile_s':>9s}  check / error")
    for r in doc["pieces"]:
        chk = ""
        if r.get("checks"):
            chk = "; ".join(
                f"T={c['T']}:" + (",".join(f"{x:.1e}" if isinstance(x, float) else str(x)
                                          for x in c.get("rel_err", []))
                                  or f"idx={c.get('topk_idx_agree')} err={c.get('softmax_max_abs_err')}")
                for c in r["checks"])
        if r.get("timing_ms"):
            chk += " ms:" + ",".join(f"{k}={v}" for k, v in r["timing_ms"].items())
        err = r.get("constraint") or r.get("first_error_line") or r.get("error", "")
        print(f"{r['piece']:28s} {r['status']:22s} {str(r.get('compile_s', '')):>9s}  "
              f"{chk} {str(err)[:150]}")


def _ver(pkg):
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()
