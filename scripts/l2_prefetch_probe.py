#!/usr/bin/env python3
"""Can a latency-bound kernel bring the next projection's weight into L2 for free?

A diagnostic for issue 9, not a product kernel. In a batch-1 decode step the attention op
(~7.5 us per 120b layer) barely touches DRAM: it is a chain of dependent key-chunk loads on
a few blocks. The projection after it (o_proj, 2880 x 4096 bf16 = 23.6 MB) then streams its
weight from DRAM (MAX's GEMV, ~10 us). If extra blocks of the attention launch issued
`cp.async.bulk.prefetch.L2` for that weight (fire and forget: no register, no wait), the
weight could arrive while the attention runs and the projection would read L2.

This probe measures the three things that idea depends on, with stand-ins:

  chain     a latency-bound kernel: B blocks of 4 warps, every thread `steps` dependent
            loads at random places in a 256 MB table (DRAM latency each), like the attention's
            key-chunk chain; optionally with P more blocks that only prefetch a weight to L2
  gemv      a bf16 GEMV over a [2880, 4096] weight, a warp per row with all of a lane's
            16-byte loads in flight (~the copy bandwidth from DRAM)

Rows: each alone; chain then gemv without and with the prefetch (the whole weight, or part
of it); a bare prefetch launch then gemv. Every launch uses the next of several weight copies
(beyond L2), so nothing is left in L2 from an earlier launch. Times are CUDA events around a
chain of launches replayed as a CUDA graph (gaps between dependent kernels in, as in a
captured decode step).

Needs CuPy (with NVRTC), torch (the copy bandwidth, as bench/moe.py measures it) and a CUDA
GPU of sm_90 or later. Prints a table and writes <out>/l2_prefetch_probe_<gpu>_<yyyymmdd>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_common import graph_us_per_launch, open_gpu, probe_parser, write_result  # noqa: E402

ROWS, COLS = 2880, 4096  # o_proj of gpt-oss: hidden x (64 heads x 64)
WEIGHT_BYTES = ROWS * COLS * 2
TABLE_WORDS = 1 << 26  # 256 MB of u32 indices: the chain's loads miss L2
GEMV_WARPS = 8

SOURCE = r"""
#define K16 (COLS / 8)          // 16-byte vectors per weight row
#define PER_LANE (K16 / 32)
__device__ __forceinline__ uint4 ld_na(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void prefetch_l2(const char* p, unsigned n) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(n) : "memory");
}
// Blocks [0, nchain): each thread walks `steps` dependent indices of the table.
// Blocks [nchain, nchain + pf_blocks): warp 0 prefetches (piece > 0) an equal 16-byte-aligned slice of
// pf[0, pf_bytes) to L2 in pieces of `piece` bytes, lane i taking pieces i, i + 32, ...
extern "C" __global__ void __launch_bounds__(128)
chain(const unsigned* __restrict__ table, unsigned mask, int steps, int nchain, const char* pf,
      long long pf_bytes, int pf_blocks, int piece, unsigned* out) {
    if ((int)blockIdx.x >= nchain) {
        long long j = blockIdx.x - nchain;
        long long per = ((pf_bytes + pf_blocks - 1) / pf_blocks + 15) / 16 * 16;
        long long lo = j * per, hi = min(lo + per, pf_bytes);
        if (piece > 0) {
            if (threadIdx.x >= 32) return;
            for (long long a = lo + (long long)threadIdx.x * piece; a < hi; a += 32LL * piece)
                prefetch_l2(pf + a, (unsigned)min((long long)piece, hi - a));
        } else {  // piece 0: plain 16-byte loads (lane-strided, 8 in flight), folded so none is dead
            unsigned acc = 0;
            // the block's 4 warps take 4 KB steps in turn
            for (long long a = lo + (threadIdx.x >> 5) * 4096LL + (threadIdx.x & 31) * 16LL; a < hi; a += 4 * 4096LL) {
                uint4 v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) v[u] = ld_na((const uint4*)(pf + min(a + u * 512LL, hi - 16)));
#pragma unroll
                for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
            }
            if (acc == 0x9E3779B9u) out[0] = acc;
        }
        return;
    }
    unsigned i = ((blockIdx.x * blockDim.x + threadIdx.x) * 2654435761u) & mask;
    for (int s = 0; s < steps; s++) i = table[i];
    if (i == 0xFFFFFFFFu) out[0] = i;
}
// y = W x for W [ROWS, COLS] bf16 (bits), x [COLS] bf16: a warp per row, every load issued first
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv(const uint4* __restrict__ w, const uint4* __restrict__ x, float* y) {
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= ROWS) return;
    const uint4* wr = w + (long long)row * K16;
    uint4 v[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; j++) v[j] = ld_na(wr + lane + 32 * j);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; j++) {
        uint4 xv = x[lane + 32 * j];
        unsigned a[4] = {v[j].x, v[j].y, v[j].z, v[j].w}, b[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            acc += __uint_as_float(a[q] << 16) * __uint_as_float(b[q] << 16);
            acc += __uint_as_float(a[q] & 0xFFFF0000u) * __uint_as_float(b[q] & 0xFFFF0000u);
        }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
    if (lane == 0) y[row] = acc;
}
"""

# (label, chain blocks, chain steps, prefetched fraction of the weight, prefetch blocks,
#  piece bytes, gemv after it). Chain blocks: 8 is a sliding-window layer at batch 1 (8 KV
#  heads, one split), 128 a full layer at 1k context (16 splits).
VARIANTS = (
    ("gemv alone (weight from DRAM)", 0, 0, 0.0, 0, 0, True),
    ("chain 8x4 warps alone", 8, 8, 0.0, 0, 0, False),
    ("chain 128x4 warps alone", 128, 8, 0.0, 0, 0, False),
    ("chain 8 + prefetch (128 blocks, 32 KB)", 8, 8, 1.0, 128, 32768, False),
    ("chain 128 + prefetch (128 blocks, 32 KB)", 128, 8, 1.0, 128, 32768, False),
    ("chain 8, gemv", 8, 8, 0.0, 0, 0, True),
    ("chain 8 + prefetch all (128 blocks, 32 KB), gemv", 8, 8, 1.0, 128, 32768, True),
    ("chain 8 + prefetch all (264 blocks, 16 KB), gemv", 8, 8, 1.0, 264, 16384, True),
    ("chain 8 + prefetch all (32 blocks, 64 KB), gemv", 8, 8, 1.0, 32, 65536, True),
    ("chain 8 + prefetch half (128 blocks, 32 KB), gemv", 8, 8, 0.5, 128, 32768, True),
    ("chain 128, gemv", 128, 8, 0.0, 0, 0, True),
    ("chain 128 + prefetch all (128 blocks, 32 KB), gemv", 128, 8, 1.0, 128, 32768, True),
    ("chain 128 + prefetch half (128 blocks, 32 KB), gemv", 128, 8, 0.5, 128, 32768, True),
    ("prefetch launch only, gemv", 0, 0, 1.0, 128, 32768, True),
    ("chain 8 (4 steps) + prefetch all, gemv", 8, 4, 1.0, 128, 32768, True),
    ("chain 8 (4 steps), gemv", 8, 4, 0.0, 0, 0, True),
    ("chain 8 + warm by loads (128 blocks), gemv", 8, 8, 1.0, 128, 0, True),
    ("chain 8 + warm by loads (264 blocks), gemv", 8, 8, 1.0, 264, 0, True),
    ("warm by loads (264 blocks) alone", 0, 0, 1.0, 264, 0, False),
    ("gemv, same weight every launch (L2-warm?)", 0, 0, 0.0, 0, -1, True),
    ("chain 8 + prefetch all, gemv, same weight every launch", 8, 8, 1.0, 128, -32768, True),
)


def prefetch_bytes(fraction: float) -> int:
    """Bytes of the weight's head the prefetch covers (16-byte multiple)."""
    return int(WEIGHT_BYTES * fraction) // 16 * 16


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__, "copies", 8, "weight copies rotated (their total beyond L2)").parse_args(argv)
    gpu = open_gpu()
    if gpu is None:
        return 2
    import numpy as np

    cp, _torch, props, copy_tb_s = gpu
    name = props["name"].decode()

    rng = np.random.default_rng(0)
    table = cp.asarray(rng.integers(0, TABLE_WORDS, TABLE_WORDS, dtype=np.uint32))

    def bf16_bits(n: int):  # normal(0, 1) values as bf16 bit patterns (no inf / NaN)
        return cp.asarray((rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))

    weights = [bf16_bits(ROWS * COLS) for _ in range(args.copies)]
    x = bf16_bits(COLS)
    y = cp.zeros(ROWS, dtype=cp.float32)
    out = cp.zeros(1, dtype=cp.uint32)
    opts = (f"-DCOLS={COLS}", f"-DROWS={ROWS}", f"-DGEMV_WARPS={GEMV_WARPS}", "-arch=sm_90a", "-std=c++17")
    mod = cp.RawModule(code=SOURCE, options=opts)
    k_chain, k_gemv = mod.get_function("chain"), mod.get_function("gemv")
    gemv_grid = ((ROWS + GEMV_WARPS - 1) // GEMV_WARPS,)

    # The GEMV is right (so its time is the time of real work): float64 reference on copy 0.
    k_gemv(gemv_grid, (GEMV_WARPS * 32,), (weights[0], x, y))
    f = lambda a: (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    ref = f(cp.asnumpy(weights[0]).reshape(ROWS, COLS)) @ f(cp.asnumpy(x))
    err = float(np.max(np.abs(cp.asnumpy(y) - ref)) / np.max(np.abs(ref)))
    if not err < 1e-4:
        print(f"gemv wrong: rel err {err:.2e}", file=sys.stderr)
        return 1

    def launch(i: int, blocks: int, steps: int, frac: float, pf_blocks: int, piece: int, with_gemv: bool) -> None:
        w = weights[0 if piece < 0 else i % args.copies]  # piece < 0: the same copy every launch
        piece = abs(piece) if piece != -1 else 0
        if blocks or pf_blocks:
            k_chain(
                (blocks + pf_blocks,),
                (128,),
                (table, cp.uint32(TABLE_WORDS - 1), cp.int32(steps), cp.int32(blocks), w,
                 cp.int64(prefetch_bytes(frac)), cp.int32(max(pf_blocks, 1)), cp.int32(piece), out),
            )  # fmt: skip
        if with_gemv:
            k_gemv(gemv_grid, (GEMV_WARPS * 32,), (w, x, y))

    def time_variant(v) -> float:
        return graph_us_per_launch(cp, lambda i: launch(i, *v), args.copies, args.chain, args.reps)

    rows = []
    print(f"{'variant':56s} {'us/iter':>8s}")
    for label, *v in VARIANTS:
        us = time_variant(v)
        rows.append({"variant": label, "chain_blocks": v[0], "chain_steps": v[1], "prefetch_fraction": v[2],
                     "prefetch_blocks": v[3], "piece_bytes": v[4], "gemv": v[5], "us": round(us, 2)})  # fmt: skip
        print(f"{label:56s} {us:8.2f}", flush=True)

    roof = round(WEIGHT_BYTES / (copy_tb_s * 1e12) * 1e6, 2)
    fields = {"copy_tb_s": round(copy_tb_s, 3), "weight_bytes": WEIGHT_BYTES, "weight_roofline_us": roof,
              "gemv_rel_err": err, "chain": args.chain, "rows": rows}  # fmt: skip
    path = write_result(args.out, "l2_prefetch_probe", name, "l2_prefetch_probe.py", argv, fields)
    print(f"copy {copy_tb_s:.2f} TB/s, weight roofline {roof} us; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
