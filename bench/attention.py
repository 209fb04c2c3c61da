#!/usr/bin/env python3
"""Sink attention over MAX's paged KV cache on the GPU: our op against MAX's
flash_attention_ragged and the KV-bandwidth roofline, at gpt-oss's attention
shape (64 query heads, 8 KV heads, head_dim 64, bf16 KV, pages of 128).

One run measures, on one GPU, for each case (batch, new tokens per sequence,
cached tokens per sequence):
  * ours_us / max_us: one attention layer, averaged over gpt-oss's layer
    pattern (a sliding-window layer of 128 and a full one): the slope of
    CUDA-event time between graphs of 1 and of 1 + N chained layer pairs
    (the output of a layer is the next one's q), so launch and host costs
    of a graph cancel;
  * roofline_us: the KV bytes a layer pair must read (each sequence's keys
    and values in range, once) / the device copy bandwidth, halved per layer;
  * correctness first: every case's output of one layer pair is compared
    with a float64 torch reference of the semantics (causal, windowed,
    sink logit in the normaliser only) on the same bf16 inputs, for ours
    (relative error <= 1e-2; bf16 output rounding is ~3e-3) and, recorded
    only, for MAX's.

Prints a table and writes <out>/attention_<gpu>_<yyyymmdd>.json.
Needs MAX (docs/GPU.md for staging) and torch with CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

N_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_SIZE, WINDOW = 64, 8, 64, 128, 128
N_LAYERS = 2  # layer 0 sliding, layer 1 full, as gpt-oss alternates them
SCALE = HEAD_DIM**-0.5
REL_TOL = 1e-2


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    new: int  # tokens per sequence this step
    cached: int  # tokens per sequence already in the cache
    extra: tuple[tuple[int, int], ...] = ()  # more sequences (new, cached) after those: mixed steps

    @property
    def seqs(self) -> list[tuple[int, int]]:
        return [(self.new, self.cached)] * self.batch + list(self.extra)


CASES = [
    Case("decode b1 ctx1k", 1, 1, 1279),
    Case("decode b1 ctx4k", 1, 1, 4095),
    Case("decode b1 ctx16k", 1, 1, 16383),
    Case("decode b8 ctx1k", 8, 1, 1279),
    Case("decode b64 ctx1k", 64, 1, 1279),
    Case("prefill 1x1024", 1, 1024, 0),
    Case("prefill 1x2048", 1, 2048, 0),
    Case("chunk 512 after 1536", 1, 512, 1536),
    Case("mixed chunk 256 + 7 decode", 1, 256, 300, ((1, 1279),) * 7),
]


def reference(torch, q, keys, values, sinks, positions, scale: float, window: int | None):
    """float64: q [n, H, D] rows at absolute `positions` of one sequence whose
    keys/values [L, KVH, D] are all known; causal, optional window, sinks."""
    q64, k64, v64 = (a.to(torch.float64) for a in (q, keys, values))
    group = q.shape[1] // keys.shape[1]
    k64 = k64.repeat_interleave(group, dim=1)  # [L, H, D]
    v64 = v64.repeat_interleave(group, dim=1)
    logits = scale * torch.einsum("nhd,lhd->hnl", q64, k64)
    pos = torch.as_tensor(positions, device=q.device)[:, None]
    j = torch.arange(keys.shape[0], device=q.device)[None, :]
    allowed = j <= pos
    if window:
        allowed &= j > pos - window
    logits = logits.masked_fill(~allowed[None], -math.inf)
    s = sinks.to(torch.float64)[:, None, None].expand(-1, q.shape[0], 1)
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), s)
    w = torch.exp(logits - m)
    out = torch.einsum("hnl,lhd->nhd", w, v64)
    return out / (w.sum(-1) + torch.exp(s - m)[..., 0]).permute(1, 0)[..., None]


def kv_bytes(case: Case) -> int:
    """Bytes of K and V a (sliding, full) layer pair reads for one step."""
    per_key = N_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    return sum(min(new + cached, WINDOW + new - 1) + new + cached for new, cached in case.seqs) * per_key


# ---------------------------------------------------------------- MAX graphs


def build(pairs: int, ours: bool, gpu_ref):
    """q -> `pairs` chained (sliding, full) layers over one paged cache."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops
    from max.nn.attention import MHAMaskVariant
    from max.nn.kernels import flash_attention_ragged
    from max.nn.kv_cache import MHAKVCacheParams

    from gptoss_max.kernels.ops import attention_with_sinks
    from gptoss_max.maxapi import paged_kv_dispatch_type, paged_kv_input_types, paged_kv_values

    cpu = DeviceRef.CPU()
    bf, u32 = DType.bfloat16, DType.uint32
    params = MHAKVCacheParams(
        dtype=bf, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, num_layers=N_LAYERS, page_size=PAGE_SIZE,
        devices=[gpu_ref],
    )  # fmt: skip
    types = [
        TensorType(bf, ["T", N_HEADS, HEAD_DIM], gpu_ref),
        *paged_kv_input_types(params, gpu_ref),  # blocks, page_stride, lengths, lookup, max prompt / cache
        TensorType(u32, ["B1"], gpu_ref),  # input_row_offsets
        TensorType(DType.float32, [N_HEADS], gpu_ref),  # sinks
        paged_kv_dispatch_type(),
    ]
    name = f"attn_{'ours' if ours else 'max'}_{pairs}"
    with Graph(name, input_types=types) as g:
        q, *cache, offs, sinks, meta = g.inputs
        kv = paged_kv_values(cache, meta)
        x = q.tensor
        sink_bf = ops.cast(sinks.tensor, bf)
        for _ in range(pairs):
            for layer, window in enumerate((WINDOW, None)):
                idx = ops.constant(layer, u32, device=cpu)
                if ours:
                    x = attention_with_sinks(x, kv, idx, offs.tensor, sinks.tensor, SCALE, window)
                else:
                    variant = MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK if window else MHAMaskVariant.CAUSAL_MASK
                    x = flash_attention_ragged(
                        params, input=x, input_row_offsets=offs.tensor, kv_collection=kv, layer_idx=idx,
                        mask_variant=variant, scale=SCALE, local_window_size=window or -1,
                        sink_weights=sink_bf,
                    )  # fmt: skip
        g.output(x)
    return g


# ---------------------------------------------------------------- inputs


class Inputs:
    """One case's cache (random bf16 everywhere, pages shuffled), q, sinks."""

    def __init__(self, torch, case: Case, gen, accel):
        from max._kv_cache_ops import mha_decode_num_partitions
        from max.driver import Buffer
        from max.dtype import DType

        device = "cuda"

        self.case = case
        seqs = case.seqs
        totals = [new + cached for new, cached in seqs]
        max_pages = max(-(-t // PAGE_SIZE) for t in totals)
        n_pages = len(seqs) * max_pages + 3
        perm = torch.randperm(n_pages, generator=gen, device=device)[: len(seqs) * max_pages]
        self.table = perm.reshape(len(seqs), max_pages).to(torch.int32)
        shape = (n_pages, 2, N_LAYERS, PAGE_SIZE, N_KV_HEADS, HEAD_DIM)
        self.pool = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        tokens = sum(new for new, _ in seqs)
        self.q = (2 * torch.randn(tokens, N_HEADS, HEAD_DIM, generator=gen, device=device)).to(torch.bfloat16)
        self.sinks = (3 + 2 * torch.randn(N_HEADS, generator=gen, device=device)).float()
        offsets = torch.tensor([0, *itertools.accumulate(new for new, _ in seqs)], dtype=torch.int32)
        lengths = torch.tensor([cached for _, cached in seqs], dtype=torch.int32)
        max_new = max(new for new, _ in seqs)
        parts = mha_decode_num_partitions(len(seqs), max(totals), N_KV_HEADS, accel)
        meta = torch.tensor([len(seqs), max_new, parts, max(totals)], dtype=torch.int64)

        def u32(t):
            return Buffer.from_dlpack(t.contiguous()).view(DType.uint32, list(t.shape))

        self.args = [
            Buffer.from_dlpack(self.q),
            Buffer.from_dlpack(self.pool),
            Buffer.from_dlpack(torch.tensor([-1], dtype=torch.int64)),
            u32(lengths.to(device)),
            u32(self.table),
            u32(torch.tensor([max_new], dtype=torch.int32)),
            u32(torch.tensor([max(totals)], dtype=torch.int32)),
            u32(offsets.to(device)),
            Buffer.from_dlpack(self.sinks),
            Buffer.from_dlpack(meta),
        ]

    def kv_of(self, b: int, layer: int):
        """Keys and values [total, KVH, D] of sequence b in `layer`."""
        new, cached = self.case.seqs[b]
        pages = self.pool[self.table[b].long()]  # [pages, 2, L, page, KVH, D]
        k = pages[:, 0, layer].reshape(-1, N_KV_HEADS, HEAD_DIM)[: new + cached]
        v = pages[:, 1, layer].reshape(-1, N_KV_HEADS, HEAD_DIM)[: new + cached]
        return k, v

    def expected(self, torch):
        """One (sliding, full) layer pair, the first layer's output rounded
        to bf16 as the graph hands it on."""
        out, row = [], 0
        for b, (new, cached) in enumerate(self.case.seqs):
            x = self.q[row : row + new]
            row += new
            for layer, window in enumerate((WINDOW, None)):
                k, v = self.kv_of(b, layer)
                x = reference(torch, x, k, v, self.sinks, list(range(cached, cached + new)), SCALE, window)
                if layer == 0:
                    x = x.to(torch.bfloat16)
            out.append(x)
        return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", type=int, default=16, help="extra chained layer pairs for the slope (default 16)")
    ap.add_argument("--reps", type=int, default=15, help="timed executions per graph (median taken)")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--no-max", action="store_true", help="skip MAX's flash_attention_ragged")
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from moe import copy_bandwidth, finish, open_gpu, rel_err, result_header

    gpu = open_gpu(torch, "bench/attention.py")
    cases = [c for c in CASES if not args.cases or c.name in args.cases.split(",")]
    gpu_name, today, dev, session, dref, timer = gpu.gpu_name, gpu.today, gpu.dev, gpu.session, gpu.dref, gpu.timer
    copy_tb_s = copy_bandwidth(torch)
    print(f"device {gpu_name}; copy {copy_tb_s:.2f} TB/s (read + write)", flush=True)

    t0 = time.perf_counter()
    graphs = {"ours": [session.load(build(p, True, dref)) for p in (1, 1 + args.chain)]}
    if not args.no_max:
        graphs["max"] = [session.load(build(p, False, dref)) for p in (1, 1 + args.chain)]
    compile_s = time.perf_counter() - t0
    print(f"compiled {2 * len(graphs)} graphs in {compile_s:.0f} s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows, failures = [], []
    for case in cases:
        inp = Inputs(torch, case, gen, dev)
        ref = inp.expected(torch)
        row: dict = {"case": case.name, "seqs": len(case.seqs), "new_tokens": sum(n for n, _ in case.seqs),
                     "cached": sum(c for _, c in case.seqs)}  # fmt: skip
        for which, (small, big) in graphs.items():
            got = torch.from_dlpack(small.execute(*inp.args)[0]).clone()
            err = rel_err(torch, got, ref)
            row[f"{which}_rel_err"] = float(f"{err:.3g}")
            if which == "ours" and not err <= REL_TOL:
                failures.append(f"{case.name}: rel err {err:.3g}")
            slope_ms, _ = timer.slope_ms(small, inp.args, big, inp.args, 2 * args.chain, args.reps)
            row[f"{which}_us"] = round(1e3 * slope_ms, 2)
        row["roofline_us"] = round(kv_bytes(case) / 2 / (copy_tb_s * 1e12) * 1e6, 2)
        row["bw_frac"] = round(row["roofline_us"] / row["ours_us"], 3) if row["ours_us"] > 0 else None
        if "max_us" in row and row["ours_us"] > 0:
            row["speedup_vs_max"] = round(row["max_us"] / row["ours_us"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del inp, ref
        torch.cuda.empty_cache()

    result = {
        **result_header("bench/attention.py", argv, gpu, copy_tb_s),
        "shape": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
                  "window": WINDOW, "kv_dtype": "bfloat16"},  # fmt: skip
        "method": "per layer, averaged over a (window 128, full) pair: slope of CUDA-event time of a graph of 1 vs "
        "1+chain chained pairs; roofline: K and V bytes in range / copy bandwidth; rel_err: one pair against "
        "a float64 torch reference on the same bf16 inputs",
        "compile_s": round(compile_s, 1),
        "rows": rows,
        "failures": failures,
    }
    path = gpu.result_path(args.out, "attention")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{gpu_name}  {today}  copy {copy_tb_s:.2f} TB/s  (per layer, µs)")
    print(f"{'case':<27} {'ours':>8} {'MAX':>8} {'roof':>7} {'bw_frac':>7} {'err ours':>9} {'err MAX':>8}")
    for r in rows:
        mx = f"{r['max_us']:.1f}" if "max_us" in r else "-"
        emx = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
        print(f"{r['case']:<27} {r['ours_us']:>8.1f} {mx:>8} {r['roofline_us']:>7.1f} {r['bw_frac'] or 0:>7.2f} "
              f"{r['ours_rel_err']:>9.1e} {emx:>8}")  # fmt: skip
    return finish(path, failures)


if __name__ == "__main__":
    sys.exit(main())
