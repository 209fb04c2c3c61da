#!/usr/bin/env python3
"""Can Hopper's FP8 tensor cores make the one-token MXFP4 expert matvec cheap enough in instructions?

A probe for issue 4 (bench/NOTES.md, "v11 proposal" and v14's ncu: at T = 1 the decode kernels
spend about as long issuing instructions as loading). `fp8_wgmma_probe.cu` (its header says how)
decodes MXFP4 nibbles straight into e4m3 A registers of `wgmma m64n8k32` (~2 instructions per weight
in its SASS loop, against ~3.5 in the Mojo decode kernels), applies each block's E8M0 scale to its
k32 result, and takes the activation as two e4m3 parts. It is a CUDA C kernel run through CuPy,
checked against a float64 reference of the same MXFP4 weights, and timed like `gpu_mem_probe.py`:
a replayed CUDA graph of launches, each on 4 random experts of one of several 120b-sized stacks
(beyond L2).

Rows per variant (K splits KS, 16-byte loads in flight DEPTH, resident warpgroups MINB, PIPE):
  matvec      the whole thing (the relative error against the reference is checked first);
  loads only  the same loads, XOR-folded (MODE 1);
  math only   decode, wgmma and scaling on register data (MODE 2);
for gate_up's shape (4 x 5760 rows) and down's (4 x 2880 rows), K = 2880. Compare with
`bench/moe.py`'s T = 1 row on the same GPU: main's two kernels take ~36 us per layer on an H200.

Needs CuPy (NVRTC), torch (the copy bandwidth and e4m3 rounding) and a Hopper GPU.
Writes <out>/fp8_wgmma_probe_<gpu>_<yyyymmdd>.json.

    python3 scripts/fp8_wgmma_probe.py --out $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_common import graph_us_per_launch, open_gpu, probe_parser, write_result  # noqa: E402

K = 2880
NJ = K // 64  # block pairs per row
SHAPES = {"gate_up": 5760, "down": 2880}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
# (KS, DEPTH, MINB, PIPE)
VARIANTS = ((3, 4, 4, 0), (3, 2, 4, 0), (3, 6, 4, 0), (2, 4, 4, 0), (5, 4, 6, 0), (9, 2, 8, 0), (3, 4, 4, 1))


def pack(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One expert's e2m1 codes (rows, K) and E8M0 scales (rows, K // 32) in the probe's layout
    (fp8_wgmma_probe.cu's header): the packed bytes (rows / 64, NJ, 128 threads, 16 B) and the
    scale words (rows / 64, NJ, 4 warps, 8 groups, 4 B)."""
    rows = codes.shape[0]
    c = codes.reshape(rows // 64, 4, 2, 8, NJ, 2, 2, 4, 4)  # rg, w, half (row + 8), g, j, blk, k16, t, i
    # bytes: (rg, j, w, g, t, word = (blk, k16), i); low nibble = row g, high = row g + 8
    lo = c[:, :, 0].transpose(0, 3, 1, 2, 6, 4, 5, 7)
    hi = c[:, :, 1].transpose(0, 3, 1, 2, 6, 4, 5, 7)
    packed = (lo | (hi << 4)).astype(np.uint8).reshape(rows // 64, NJ, 128, 16)
    s = scales.reshape(rows // 64, 4, 2, 8, NJ, 2)  # rg, w, half, g, j, blk
    words = s.transpose(0, 4, 1, 3, 5, 2).astype(np.uint8)  # rg, j, w, g, blk, half
    return packed, words.reshape(rows // 64, NJ, 4, 8, 4)


def reference(codes: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    w = E2M1[codes] * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=1)
    return w @ x.astype(np.float64)


def activation_image(x: np.ndarray, torch) -> tuple[np.ndarray, float]:
    """x as B's columns 0 (hi) and 1 (lo x 16) in e4m3, per k32 block two K-major 8 x 16-byte core
    matrices (256 B), and the factor that turns the kernel's sums back (2^6 / g)."""
    amax = float(np.abs(x).max()) or 1.0
    g = 2.0 ** np.floor(np.log2(448.0 / amax))
    xs = torch.tensor(x.astype(np.float32) * np.float32(g))
    hi = xs.to(torch.float8_e4m3fn)
    lo = ((xs - hi.float()) * 16).to(torch.float8_e4m3fn)
    img = np.zeros((K // 32, 2, 8, 16), dtype=np.uint8)  # block, k16 core matrix, n, k byte
    for n, part in ((0, hi), (1, lo)):
        img[:, :, n, :] = part.view(torch.uint8).numpy().reshape(K // 32, 2, 16)
    return img.reshape(-1), 64.0 / g


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__, "sets", 6, "stacks of 128 experts per shape (beyond L2)").parse_args(argv)
    gpu = open_gpu()
    if gpu is None:
        return 2
    cp, torch, props, copy_tb_s = gpu
    name = props["name"].decode()
    source = Path(__file__).with_suffix(".cu").read_text()
    mods: dict = {}

    def kernel(**defs):
        key = tuple(sorted(defs.items()))
        if key not in mods:
            opts = tuple(f"-D{k}={v}" for k, v in defs.items()) + ("-arch=sm_90a", "-std=c++17")
            mods[key] = cp.RawModule(code=source, options=opts).get_function("expert_matvec")
        return mods[key]

    rng = np.random.default_rng(0)
    experts = 128
    x = rng.standard_normal(K).astype(np.float32)
    x = torch.tensor(x).to(torch.bfloat16).float().numpy()  # the kernels' bf16 activation
    img, post = activation_image(x, torch)
    bimg = cp.asarray(img)
    rows_out = []
    for shape, rows in SHAPES.items():
        groups = rows // 64
        wbytes = experts * groups * NJ * 128 * 16
        sbytes = experts * groups * NJ * 32 * 4
        wq = cp.empty(args.sets * wbytes, dtype=cp.uint8)
        sq = cp.empty(args.sets * sbytes, dtype=cp.uint8)
        for s in range(args.sets):  # hashed words (random-like bytes), a stack at a time
            words = wq[s * wbytes : (s + 1) * wbytes].view(cp.uint32)
            words[:] = (cp.arange(words.size, dtype=cp.uint32) + np.uint32(s * 7919)) * np.uint32(2654435761)
        sq[:] = 121  # scale bytes of the synthetic checkpoints (119-122)
        # the checked experts: real codes and scales at 4 slots of set 0
        chosen = [3, 50, 77, 120]
        refs = []
        for e in chosen:
            codes = rng.integers(0, 16, (rows, K), dtype=np.uint8)
            scales = rng.integers(117, 125, (rows, K // 32), dtype=np.uint8)
            pw, ps = pack(codes, scales)
            wq[e * (wbytes // experts) : (e + 1) * (wbytes // experts)] = cp.asarray(pw.reshape(-1))
            sq[e * (sbytes // experts) : (e + 1) * (sbytes // experts)] = cp.asarray(ps.reshape(-1))
            refs.append(reference(codes, scales, x))
        ref = np.stack(refs)
        out = cp.zeros(4 * rows, dtype=cp.float32)
        launches = []
        for _ in range(args.chain):
            s = int(rng.integers(args.sets))
            es = cp.asarray(rng.choice(experts, 4, replace=False).astype(np.int32))
            launches.append((wq[s * wbytes :], sq[s * sbytes :], es))
        checked_es = cp.asarray(np.array(chosen, dtype=np.int32))
        total = 4 * (rows * K // 2 + rows * K // 32)
        for ks, depth, minb, pipe in VARIANTS:
            if -(-NJ // ks) < depth - 1:
                continue
            grid = (groups * ks, 4)
            row: dict = {"shape": shape, "ks": ks, "depth": depth, "minb": minb, "pipe": pipe, "bytes": total}
            for mode, label in ((0, "matvec"), (1, "loads only"), (2, "math only")):
                if mode and pipe:
                    continue
                k = kernel(KS=ks, DEPTH=depth, MINB=minb, PIPE=pipe, MODE=mode)
                if mode == 0:
                    out[:] = 0
                    k(grid, (128,), (wq, sq, bimg, checked_es, np.int32(groups), out, np.float32(post), np.uint32(0)))
                    got = cp.asnumpy(out).reshape(4, rows).astype(np.float64)
                    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    row["rel_err"] = rel
                    row["nan"] = bool(np.isnan(got).any())

                def launch(i, k=k, grid=grid, launches=launches, groups=groups, out=out):
                    w, sc, es = launches[i % len(launches)]
                    k(grid, (128,), (w, sc, bimg, es, np.int32(groups), out, np.float32(post), np.uint32(0)))

                us = graph_us_per_launch(cp, launch, 3, args.chain, args.reps)
                row[label.replace(" ", "_") + "_us"] = round(us, 2)
            row["tb_s"] = round(total / (row["matvec_us"] * 1e-6) / 1e12, 3)
            row["frac_of_copy"] = round(row["tb_s"] / copy_tb_s, 3)
            rows_out.append(row)
            parts = "" if pipe else f"  loads only {row['loads_only_us']:7.2f}  math only {row['math_only_us']:7.2f}"
            print(
                f"{shape:8s} KS{ks} D{depth} M{minb} P{pipe}: matvec {row['matvec_us']:7.2f} us "
                f"({row['frac_of_copy']:.2f} of copy, rel err {row['rel_err']:.2e}){parts}",
                flush=True,
            )
        del wq, sq
        cp.get_default_memory_pool().free_all_blocks()
    fields = {"copy_tb_s": round(copy_tb_s, 3), "chain": args.chain, "rows": rows_out}
    path = write_result(args.out, "fp8_wgmma_probe", name, "fp8_wgmma_probe.py", argv, fields)
    print(f"copy {copy_tb_s:.2f} TB/s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
