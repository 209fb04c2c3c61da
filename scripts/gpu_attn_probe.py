"""GPU: our sink attention and MAX's GPU flash_attention_ragged (sinks) vs the
NumPy reference, bf16 KV, gpt-oss head shapes. Scratch probe, not a test."""
import importlib.util
import sys
import time

import numpy as np
from max._kv_cache_ops import mha_decode_num_partitions
from max.driver import CPU, Accelerator, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops
from max.nn.attention import MHAMaskVariant
from max.nn.kernels import flash_attention_ragged, kv_cache_store_paged_ragged
from max.nn.kv_cache import MHAKVCacheParams

from gptoss_max.kernels.ops import attention_with_sinks
from gptoss_max.kernels.reference import round_to_bf16
from gptoss_max.maxapi import paged_kv_dispatch_type, paged_kv_input_types, paged_kv_values

spec = importlib.util.spec_from_file_location("t", "tests/test_attention_op.py")
t = importlib.util.module_from_spec(spec)
sys.modules["t"] = t
spec.loader.exec_module(t)
t.N_HEADS, t.N_KV_HEADS, t.HEAD_DIM = 64, 8, 64
t.N_LAYERS, t.LAYER, t.PAGE_SIZE, t.N_PAGES, t.MAX_PAGES = 2, 1, 128, 12, 4
t.SCALE = 64 ** -0.5
WIN = 128
gpu_dev = Accelerator()
gpu, cpu = DeviceRef.from_device(gpu_dev), DeviceRef.CPU()
bf, f32, u32 = DType.bfloat16, DType.float32, DType.uint32
params = MHAKVCacheParams(dtype=bf, n_kv_heads=t.N_KV_HEADS, head_dim=t.HEAD_DIM,
                          num_layers=t.N_LAYERS, page_size=t.PAGE_SIZE, devices=[gpu])
types = [
    TensorType(f32, ["T", t.N_HEADS, t.HEAD_DIM], gpu),
    TensorType(f32, ["T", t.N_KV_HEADS, t.HEAD_DIM], gpu),
    TensorType(f32, ["T", t.N_KV_HEADS, t.HEAD_DIM], gpu),
    *paged_kv_input_types(params, gpu),
    TensorType(u32, ["B1"], gpu),
    TensorType(f32, [t.N_HEADS], gpu),
    paged_kv_dispatch_type(),
]
with Graph("gpu_attn_probe", input_types=types) as g:
    q, k, v, *cache, offs, sinks, meta = g.inputs
    kv = paged_kv_values(cache, meta)
    layer = ops.constant(t.LAYER, u32, device=cpu)
    for which, x in enumerate((k.tensor, v.tensor)):
        kv_cache_store_paged_ragged(kv, ops.cast(x, bf), offs.tensor, layer, key_or_value=which)
    qb = ops.cast(q.tensor, bf)
    sink_b = ops.cast(sinks.tensor, bf)
    outs = [
        attention_with_sinks(qb, kv, layer, offs.tensor, sinks.tensor, t.SCALE, WIN),
        attention_with_sinks(qb, kv, layer, offs.tensor, sinks.tensor, t.SCALE, None),
    ]
    for variant, win in ((MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK, WIN), (MHAMaskVariant.CAUSAL_MASK, -1)):
        outs.append(flash_attention_ragged(params, input=qb, input_row_offsets=offs.tensor,
                                           kv_collection=kv, layer_idx=layer, mask_variant=variant,
                                           scale=t.SCALE, local_window_size=win, sink_weights=sink_b))
    g.output(*[ops.cast(o, f32) for o in outs])
start = time.perf_counter()
model = InferenceSession(devices=[gpu_dev]).load(g)
print(f"compile {time.perf_counter() - start:.1f} s")


def bf16_buffer(a):
    bits = (round_to_bf16(a).view(np.uint32) >> 16).astype(np.uint16)
    return Buffer.from_numpy(np.ascontiguousarray(bits)).view(dtype=bf, shape=a.shape).to(gpu_dev)


for batch in [t.Batch([0, 0], [300, 40]), t.Batch([299, 39], [1, 1]), t.Batch([0, 0], [20, 7]),
              t.Batch([200, 0], [60, 90])]:
    case = t.Case(batch, 0, seed=3)
    # The reference sees what the kernels see: bf16 q/k/v, bf16 sinks for MAX.
    case.q = round_to_bf16(case.q)
    case.keys = [round_to_bf16(x) for x in case.keys]
    case.values = [round_to_bf16(x) for x in case.values]
    arrays = [a.to_numpy() for a in case.inputs]
    ins = []
    for i, a in enumerate(arrays):
        if i == 3:
            ins.append(bf16_buffer(case.pages))
        elif i in (4, 7, 8):
            ins.append(Buffer.from_numpy(a))
        elif i == 11:
            n_seq, maxp, _, maxc = a
            parts = mha_decode_num_partitions(int(n_seq), int(maxc), t.N_KV_HEADS, gpu_dev)
            ins.append(Buffer.from_numpy(np.array([n_seq, maxp, parts, maxc], np.int64)))
        else:
            ins.append(Buffer.from_numpy(np.ascontiguousarray(a)).to(gpu_dev))
    outs = [o.to(CPU()).to_numpy() for o in model.execute(*ins)]
    case.rel_err(outs[0], WIN, "ours")
    case.rel_err(outs[1], None, "ours")
    case.rel_err(outs[2], WIN, "MAX")
    real_sinks = case.sinks
    case.sinks = round_to_bf16(real_sinks)
    case.rel_err(outs[3], None, "MAX")
    case.rel_err(outs[2], WIN, "MAX~")  # vs bf16-rounded sinks
    case.sinks = real_sinks
print("\n".join(t._summary))
