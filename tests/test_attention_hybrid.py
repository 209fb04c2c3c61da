"""The hybrid attention core (MAX's flash attention for steps holding a prompt chunk, ours for
decode steps, chosen by ops.cond; RoPE + the K/V store inside our op, or MAX's before it) builds
into a valid GPU graph: both branches must only use values defined outside them (a weight moved to
the GPU inside one branch is not). Built, which verifies each op, not compiled: no GPU is needed.
With `exact`, its projections are the exact-float32 ones a float32 GPU graph takes
(arch/exact_f32.py): each matmul becomes two."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("rope_impl", ["fused", "max"])
@pytest.mark.parametrize(
    ("layer_type", "exact"), [("sliding_attention", False), ("full_attention", False), ("full_attention", True)]
)
def test_hybrid_attention_graph_verifies(layer_type, exact, rope_impl, monkeypatch):
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, ShardingStrategy, TensorType
    from max.nn.kv_cache import MHAKVCacheParams
    from max.nn.rotary_embedding import YarnRotaryEmbedding, YarnScalingParams

    from gptoss_max.arch.attention import SinkAttention
    from gptoss_max.arch.exact_f32 import use_exact_f32_projections
    from gptoss_max.maxapi import paged_kv_dispatch_type, paged_kv_input_types, paged_kv_values

    monkeypatch.setenv("GPTOSS_MAX_ROPE", rope_impl)  # read when the layer builds its graph
    gpu = DeviceRef.GPU()
    heads, kv_heads, dim, hidden = 4, 2, 16, 32
    params = MHAKVCacheParams(dtype=DType.float32, n_kv_heads=kv_heads, head_dim=dim, num_layers=1,
                              page_size=16, devices=[gpu])  # fmt: skip
    rope = YarnRotaryEmbedding(
        dim=hidden, n_heads=heads, theta=150000.0, max_seq_len=256, head_dim=dim, interleaved=False,
        scaling_params=YarnScalingParams(factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                         original_max_position_embeddings=64, truncate=False),
    )  # fmt: skip
    attn = SinkAttention(
        rope=rope, num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden,
        kv_params=params, layer_idx=0, layer_type=layer_type, dtype=DType.float32, devices=[gpu],
        local_window_size=8,
    )  # fmt: skip
    for name, weight in attn.raw_state_dict().items():  # unique names, as a model's state dict gives
        weight.name = name
    # As MAX's gpt_oss runs it: a shard of the layer (its weights reach the graph sliced / moved).
    attn.sharding_strategy = ShardingStrategy.replicate(1)
    attn.sinks.sharding_strategy = ShardingStrategy.replicate(1)
    attn = attn.shard([gpu])[0]
    attn.__class__ = SinkAttention
    attn.hybrid = True
    if exact:
        assert use_exact_f32_projections(attn) == 5  # qkv (and its q, k, v), o_proj
    u32 = DType.uint32
    types = [
        TensorType(DType.float32, ["T", hidden], gpu),
        *paged_kv_input_types(params, gpu),
        TensorType(u32, ["B1"], gpu),
        paged_kv_dispatch_type(),
    ]
    with Graph(f"hybrid_{layer_type}", input_types=types) as g:
        x, *cache, offsets, meta = g.inputs
        kv = paged_kv_values(cache, meta)
        out = attn(x.tensor, kv, input_row_offsets=offsets.tensor)
        g.output(out)
    text = str(g._module)  # building verifies each op: the cond fails there if a branch uses the other's values
    assert "mo.if" in text
    # fused: our op ropes and stores K/V in the decode branch; MAX's rope + store only in the other
    ours = "gptoss_attention_rope_sinks" if rope_impl == "fused" else "gptoss_attention_with_sinks"
    other = "gptoss_attention_with_sinks" if rope_impl == "fused" else "gptoss_attention_rope_sinks"
    assert ours in text and other not in text
    assert text.count("mo.matmul") == (4 if exact else 2)  # qkv and o_proj, each split in two
