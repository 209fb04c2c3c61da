#!/usr/bin/env python3
"""How fast can a GPU read the bytes of one MoE decode step, by access structure?

A diagnostic for issue 4, not a product kernel. The MoE decode kernels (Mojo,
`kernels/moe_gpu.mojo`) read, at T = 1, four experts' gate_up (4 x 8.29 MB) and
then down (4 x 4.15 MB), each expert a contiguous region somewhere in a layer's
1.06 GB stack. Their load-only variant (no decode, no mma) still takes ~42 us
per layer against a 17.7 us roofline, so this probe times bare reads of exactly
those regions with the structures a kernel could have, to find which structure
the memory system rewards:

  tile      every warp owns a contiguous chunk (the decode kernels' 16-row tile
            is 23,040 B) and walks it in batches of U x 512 B (a 16-byte load
            per lane per 512 B), with D batches in flight (a register ring);
            W warps per block, a register budget that allows M warps per SM;
  stream    a grid-stride read of the same regions by a full GPU (the best
            case for the bytes: what a copy kernel would do);

each with `ld.global.nc.L1::no_allocate` 16-byte loads (the decode kernels'
load), XOR-folded so nothing is dead. Every launch reads four experts chosen at
random from one of several weight sets whose total is beyond L2. Times are CUDA
events around a chain of launches replayed as a CUDA graph (the gaps between
dependent kernels included, as in a captured decode step; the `empty launch` row
is that gap alone).

Needs CuPy (with NVRTC), torch (the copy bandwidth, as bench/moe.py measures it) and a CUDA
GPU. Prints a table and writes <out>/mem_probe_<gpu>_<yyyymmdd>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_common import graph_us_per_launch, open_gpu, probe_parser, write_result  # noqa: E402

HIDDEN = INTER = 2880
GATE_UP_BYTES = 2 * INTER * HIDDEN // 2  # one expert's gate_up blocks
DOWN_BYTES = HIDDEN * INTER // 2
TILE = 16 * HIDDEN // 2  # the decode kernels' 16-row tile: 23,040 B

# (chunk bytes per warp, warps per block, warps per SM the registers allow, 16-byte loads per
# lane per batch, batches in flight); the first is the decode kernels' structure at T = 1.
TILE_VARIANTS = (
    (TILE, 2, 12, 2, 2),
    (TILE, 2, 12, 2, 4),
    (TILE, 2, 12, 2, 8),
    (TILE, 2, 12, 1, 4),
    (TILE, 4, 16, 2, 4),
    (TILE, 4, 32, 2, 4),
    (TILE // 2, 2, 24, 2, 4),
    (TILE // 2, 4, 32, 2, 4),
    (TILE // 2, 4, 32, 1, 8),
    (TILE // 4, 4, 32, 1, 4),
    (TILE // 4, 8, 48, 1, 4),
    (TILE // 8, 8, 64, 1, 4),
)


def tile_grid(region: int, chunk: int, warps: int) -> tuple[int, int] | None:
    """Launch grid of tile_read over 4 experts' regions (blocks of `warps` warps, a chunk per
    warp), or None when the chunks would not tile a region exactly."""
    if chunk % 16 or chunk < 512 or region % (chunk * warps):
        return None
    return (region // (chunk * warps), 4)


SOURCE = r"""
// each RawModule is compiled with the -D values of one variant; the rest take these
#ifndef CHUNK
#define CHUNK 23040
#endif
#ifndef W
#define W 2
#endif
#ifndef MINB
#define MINB 1
#endif
#ifndef U
#define U 1
#endif
#ifndef D
#define D 2
#endif
#ifndef UNR
#define UNR 4
#endif
__device__ __forceinline__ uint4 ld_na(const char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void fold(unsigned& acc, uint4 v) { acc ^= v.x ^ v.y ^ v.z ^ v.w; }
// grid: (chunks per expert / W, 4 experts); block: W warps
extern "C" __global__ void __launch_bounds__(W * 32, MINB)
tile_read(const char* __restrict__ base, const long long* __restrict__ off, unsigned* out, unsigned z) {
    // z is 0 at run time: `p + (acc & z)` makes each load depend on the fold of the batch D
    // before it, so exactly D batches are in flight (the compiler cannot hoist the loads).
    const int lane = threadIdx.x & 31;
    const long long chunk = (long long)blockIdx.x * W + (threadIdx.x >> 5);
    const char* p = base + off[blockIdx.y] + chunk * CHUNK + lane * 16;
    constexpr int BATCH = 512 * U;
    constexpr int NB = (CHUNK + BATCH - 1) / BATCH;
    uint4 r[D][U];
    unsigned acc = 0;
#pragma unroll
    for (int i = 0; i < D - 1; i++)
#pragma unroll
        for (int u = 0; u < U; u++)
            r[i][u] = ld_na(p + min(i * BATCH + u * 512, CHUNK - 512));
#pragma unroll
    for (int b = 0; b < NB; b++) {
        if (b + D - 1 < NB) {
#pragma unroll
            for (int u = 0; u < U; u++)
                r[(b + D - 1) % D][u] = ld_na(p + (acc & z) + min((b + D - 1) * BATCH + u * 512, CHUNK - 512));
        }
#pragma unroll
        for (int u = 0; u < U; u++) fold(acc, r[b % D][u]);
    }
    if (acc == 0x9E3779B9u) out[chunk] = acc;
}
// grid-stride over the 4 regions of `bytes` each: every thread 16 B x UNR per step
extern "C" __global__ void __launch_bounds__(256)
stream_read(const char* __restrict__ base, const long long* __restrict__ off, long long bytes, unsigned* out,
            unsigned z) {
    const long long per = bytes / 16;
    const long long n = 4 * per;
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += stride * UNR) {
        uint4 v[UNR];
#pragma unroll
        for (int j = 0; j < UNR; j++) {
            long long i = min(i0 + j * stride, n - 1);
            v[j] = ld_na(base + (acc & z) + off[i / per] + (i % per) * 16);
        }
#pragma unroll
        for (int j = 0; j < UNR; j++) fold(acc, v[j]);
    }
    if (acc == 0x9E3779B9u) out[threadIdx.x] = acc;
}
extern "C" __global__ void empty_kernel(unsigned* out) {
    if (threadIdx.x == 1023) out[0] = 1;
}
"""


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__, "sets", 6, "weight sets (a 120b layer's gate_up stack each)").parse_args(argv)
    gpu = open_gpu()
    if gpu is None:
        return 2
    cp, _torch, props, copy_tb_s = gpu
    name = props["name"].decode()
    n_sm = props["multiProcessorCount"]
    experts = 128
    stack = experts * GATE_UP_BYTES
    buf = cp.empty(args.sets * stack, dtype=cp.uint8)
    buf[:] = 1
    out = cp.zeros(1 << 20, dtype=cp.uint32)
    rng = __import__("random").Random(0)

    def offsets(region: int, n: int):
        """n launches' worth of 4 distinct experts' region offsets (each set a layer)."""
        rows = []
        for _ in range(n):
            s = rng.randrange(args.sets)
            es = rng.sample(range(experts), 4)
            rows.append([s * stack + e * region for e in es])
        return cp.asarray(rows, dtype=cp.int64)

    mods: dict = {}

    def kernel(fn: str, **defs):
        key = (fn, tuple(sorted(defs.items())))
        if key not in mods:
            opts = tuple(f"-D{k}={v}" for k, v in defs.items()) + ("-std=c++17",)
            mods[key] = cp.RawModule(code=SOURCE, options=opts).get_function(fn)
        return mods[key]

    def time_chain(launch, n_off) -> float:
        """Median us per launch of a replayed graph of `chain` launches, each on its own offsets."""
        offs = n_off()
        return graph_us_per_launch(cp, lambda i: launch(offs[i]), 3, args.chain, args.reps)

    rows = []

    def add(label: str, region: int, us: float):
        bw = 4 * region / (us * 1e-6) / 1e12
        rows.append(
            {
                "variant": label,
                "bytes": 4 * region,
                "us": round(us, 2),
                "tb_s": round(bw, 3),
                "frac_of_copy": round(bw / copy_tb_s, 3),
            }
        )
        print(f"{label:48s} {us:8.2f} us  {bw:5.2f} TB/s  {bw / copy_tb_s:5.2f} of copy", flush=True)

    e = kernel("empty_kernel")
    t_empty = time_chain(lambda o: e((1,), (32,), (out,)), lambda: offsets(GATE_UP_BYTES, args.chain))
    rows.append({"variant": "empty launch", "us": round(t_empty, 2)})
    print(f"{'empty launch':48s} {t_empty:8.2f} us", flush=True)

    for region, shape in ((GATE_UP_BYTES, "gate_up"), (DOWN_BYTES, "down")):
        for chunk, w, minw, u, d in TILE_VARIANTS:
            grid = tile_grid(region, chunk, w)
            if grid is None:
                continue
            k = kernel("tile_read", CHUNK=chunk, W=w, MINB=max(1, minw // w), U=u, D=d)
            label = f"{shape} tile {chunk}B W{w} M{minw} U{u} D{d} ({grid[0] * w * 4} warps)"
            us = time_chain(
                lambda o, k=k, grid=grid, w=w: k(grid, (32 * w,), (buf, o, out, cp.uint32(0))),
                lambda region=region: offsets(region, args.chain),
            )
            add(label, region, us)
        for blocks_per_sm, unr in ((4, 4), (8, 4), (8, 8), (16, 4)):
            k = kernel("stream_read", UNR=unr)
            grid = (n_sm * blocks_per_sm,)
            label = f"{shape} stream {blocks_per_sm}x256/SM U{unr}"
            us = time_chain(
                lambda o, k=k, grid=grid, region=region: k(grid, (256,), (buf, o, cp.int64(region), out, cp.uint32(0))),
                lambda region=region: offsets(region, args.chain),
            )
            add(label, region, us)

    fields = {"copy_tb_s": round(copy_tb_s, 3), "chain": args.chain, "rows": rows}
    path = write_result(args.out, "mem_probe", name, "gpu_mem_probe.py", argv, fields)
    print(f"copy {copy_tb_s:.2f} TB/s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
