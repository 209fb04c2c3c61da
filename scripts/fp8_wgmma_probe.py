#!/usr/bin/env python3
"""Can Hopper's FP8 tensor cores make the one-token MXFP4 expert matvec cheap enough in instructions?

A probe for issue 4 (bench/NOTES.md, "v11 proposal" and v14's ncu: at T = 1 the decode kernels
spend about as long issuing instructions as loading). `fp8_wgmma_probe.cu` (its header says how)
decodes MXFP4 nibbles straight into e4m3 A registers of `wgmma m64n8k32` (~2 instructions per weight
in its SASS loop, against ~3.5 in the Mojo decode kernels) and takes the activation as two e4m3 parts.
Two algorithms: `blockscale` applies each block's E8M0 scale to its k32 result; `lut` puts the
scale into the e4m3 exponent through a per-block byte table (prmt), so the wgmmas accumulate over
all of K without waiting (a row's scales must lie within 11 of each other). A third, `bf16`, keeps
the op's own layout and bf16 decode and only swaps mma.sync for wgmma m64n8k16 bf16 with x in
shared memory: the smallest change to the Mojo kernels, if it is fast enough. It is a CUDA C kernel run through CuPy,
checked against a float64 reference of the same MXFP4 weights, and timed like `gpu_mem_probe.py`:
a replayed CUDA graph of launches, each on 4 random experts of one of several 120b-sized stacks
(beyond L2).

Rows per variant (algorithm, K splits KS, 16-byte loads in flight DEPTH, resident warpgroups MINB,
PIPE):
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

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from probe_common import graph_us_per_launch, open_gpu, probe_parser, write_result  # noqa: E402

from gptoss_max import mxfp4  # noqa: E402

K = 2880
NJ = K // 64  # block pairs per row
SHAPES = {"gate_up": 5760, "down": 2880}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
NB = K // 32  # blocks per row
NBATCH = -(-NB // 4)  # bf16: batches of 4 blocks, one per lane of a quad
ALGOS = ("blockscale", "lut", "bf16")
KERNELS = ("expert_matvec", "expert_matvec", "bf16_matvec")
# (ALGO, KS, DEPTH, MINB, PIPE); blockscale's PIPE 1 is serialized by ptxas (C7514), lut's and bf16's
# are not; bf16 (101 registers) is serialized at 8 warpgroups per SM (C7512)
VARIANTS = (
    (0, 3, 4, 4, 0), (0, 3, 2, 4, 0), (0, 3, 6, 4, 0), (0, 2, 4, 4, 0), (0, 5, 4, 6, 0), (0, 9, 2, 8, 0),
    (0, 3, 4, 4, 1), (1, 3, 4, 4, 1), (1, 3, 4, 4, 0), (1, 3, 2, 4, 1), (1, 2, 4, 4, 1), (1, 5, 4, 6, 1),
    (1, 9, 2, 8, 1), (2, 3, 4, 4, 1), (2, 3, 4, 4, 0), (2, 3, 2, 4, 1), (2, 2, 4, 4, 1), (2, 4, 4, 4, 1),
    (2, 6, 2, 4, 1),
)  # fmt: skip
LUT_MAX_D = 11  # lut: a block's scale at most this far above its row's smallest (e4m3 exponent 15)


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


def pack_lut(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`pack` for ALGO 1 (lut): the same words and thread order, other bits inside each word
    (fp8_wgmma_probe.cu, `lut_g` / `lut_g8`): row g's value i keeps its magnitude in nibble i and
    its sign at bit 8 i + 7, row g + 8's its magnitude in nibble 4 + i and its sign at bit 8 i + 3.
    Also each row's smallest scale byte (rows,), which the kernel subtracts."""
    sref = scales.min(axis=1)
    if int((scales - sref[:, None]).max()) > LUT_MAX_D:
        raise ValueError(f"a row's scales span more than {LUT_MAX_D}: lut cannot take it")
    packed, words = pack(codes, scales)
    u = packed.reshape(-1, 4, 4).astype(np.uint32)  # (word, byte i): low nibble row g, high row g + 8
    a, b = u & 0xF, u >> 4
    i = np.arange(4, dtype=np.uint32)
    lut_words = ((a & 7) << (4 * i)) | ((a >> 3) << (8 * i + 7)) | ((b & 7) << (16 + 4 * i)) | ((b >> 3) << (8 * i + 3))
    out = lut_words.sum(axis=-1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(packed.shape)
    return out, words, sref


def splits_fit(algo: int, ks: int, depth: int) -> bool:
    """Every K split of the variant holds at least DEPTH - 1 steps (the ring's first loads)."""
    total = NBATCH if algo == 2 else NJ
    per = -(-total // ks)
    return total - (ks - 1) * per >= max(depth - 1, 1)


def bf16_image(x: np.ndarray) -> np.ndarray:
    """x for ALGO 2 (bf16): per batch b and k16 step t, B's K-major 8 x 8-element core matrices
    (256 B), column 0 = x in the decode order of lane q's block 4 b + q: logical k = 2 q + h is
    element 4 t + h of that block, k = 8 + 2 q + h element 4 t + 2 + h (zero past the last block)."""
    img = np.zeros((NBATCH, 8, 2, 8, 8), dtype=np.float32)  # b, t, core (k 0-7, 8-15), n, k
    for b in range(NBATCH):
        for q in range(4):
            blk = 4 * b + q
            if blk >= NB:
                continue
            for t in range(8):
                for h in range(2):
                    img[b, t, 0, 0, 2 * q + h] = x[32 * blk + 4 * t + h]
                    img[b, t, 1, 0, 2 * q + h] = x[32 * blk + 4 * t + 2 + h]
    bits = (img.reshape(-1).view(np.uint32) >> 16).astype(np.uint16)  # x is bf16: exact
    return bits.view(np.uint8)


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


class Stack:
    """One shape's weights on the GPU: `sets` stacks of 128 experts of hashed bytes (timing), 4 of
    set 0's experts holding real codes (the check), in the layout of the algorithm last loaded."""

    EXPERTS = 128
    CHECKED = (3, 50, 77, 120)

    def __init__(self, cp, rows: int, sets: int, chain: int, x: np.ndarray, rng: np.random.Generator):
        self.cp, self.rows, self.groups = cp, rows, rows // 64
        self.wbytes = self.EXPERTS * self.groups * NJ * 128 * 16  # a stack's packed blocks
        self.sbytes = self.EXPERTS * self.groups * NJ * 32 * 4  # and its scale words
        self.wq = cp.empty(sets * self.wbytes, dtype=cp.uint8)
        self.sq = cp.full(sets * self.sbytes, 121, dtype=cp.uint8)  # the synthetic checkpoints' scales
        self.sref = cp.full(self.EXPERTS * rows, 121, dtype=cp.uint8)
        for s in range(sets):  # hashed words (random-like bytes), a stack at a time
            words = self.wq[s * self.wbytes : (s + 1) * self.wbytes].view(cp.uint32)
            words[:] = (cp.arange(words.size, dtype=cp.uint32) + np.uint32(s * 7919)) * np.uint32(2654435761)
        self.layouts: dict[int, list] = {0: [], 1: [], 2: []}
        refs = []
        for e in self.CHECKED:
            codes = rng.integers(0, 16, (rows, K), dtype=np.uint8)
            scales = rng.integers(117, 125, (rows, K // 32), dtype=np.uint8)
            self.layouts[0].append(pack(codes, scales))
            packed_lut, words, sref = pack_lut(codes, scales)
            self.layouts[1].append((packed_lut, words))
            ckpt = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(1, rows, NB, 16)
            self.layouts[2].append(mxfp4.tile_for_op(ckpt, scales[None]))  # the op's own layout
            self.sref[e * rows : (e + 1) * rows] = cp.asarray(sref)
            refs.append(reference(codes, scales, x))
        self.ref = np.stack(refs)
        self.checked = cp.asarray(np.array(self.CHECKED, dtype=np.int32))
        self.chain = [
            (int(rng.integers(sets)), cp.asarray(rng.choice(self.EXPERTS, 4, replace=False).astype(np.int32)))
            for _ in range(chain)
        ]
        self.out = cp.zeros(4 * rows, dtype=cp.float32)

    def load_checked(self, algo: int) -> None:
        """The checked experts' bytes in `algo`'s layout."""
        w, s = self.wbytes // self.EXPERTS, self.sbytes // self.EXPERTS
        for e, (packed, words) in zip(self.CHECKED, self.layouts[algo], strict=True):
            self.wq[e * w : (e + 1) * w] = self.cp.asarray(packed.reshape(-1))
            self.sq[e * s : (e + 1) * s] = self.cp.asarray(words.reshape(-1))

    def args(self, bimg, post: float, i: int | None, scratch=None):
        """Kernel arguments: launch i of the timed chain, or (None) the checked experts; `scratch`
        (bf16 with a last-block sum) in place of the unused `sref`."""
        if i is None:
            wq, sq, experts = self.wq, self.sq, self.checked
        else:
            s, experts = self.chain[i % len(self.chain)]
            wq, sq = self.wq[s * self.wbytes :], self.sq[s * self.sbytes :]
        sref = self.sref if scratch is None else scratch
        return (wq, sq, bimg, sref, experts, np.int32(self.groups), self.out, np.float32(post), np.uint32(0))


def variant_spec(text: str) -> tuple[int, int, int, int, int]:
    """`--only`'s ALGO:KS:DEPTH:MINB:PIPE (ALGO by name) as a VARIANTS entry."""
    parts = text.split(":")
    if len(parts) != 5 or parts[0] not in ALGOS or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"not ALGO:KS:DEPTH:MINB:PIPE with ALGO in {ALGOS}: {text!r}")
    v = (ALGOS.index(parts[0]), *(int(p) for p in parts[1:]))
    if v not in VARIANTS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of the probe's variants")
    return v  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, "sets", 6, "stacks of 128 experts per shape (beyond L2)")
    ap.add_argument("--only", action="append", type=variant_spec, metavar="ALGO:KS:DEPTH:MINB:PIPE",
                    help="run only this variant (repeatable), e.g. bf16:6:2:4:1 (for ncu)")  # fmt: skip
    ap.add_argument("--inblock", type=int, choices=(0, 1, 2), default=0,
                    help="bf16 only: 1 runs the KS splits as KS warpgroups of one block, met in shared "
                         "memory (as the product kernels split K), instead of KS blocks with atomics; "
                         "2 as 1, but each warpgroup starts once its own image part is staged")  # fmt: skip
    ap.add_argument("--mma", action="store_true",
                    help="bf16 only: each warp's mma.sync m16n8k16 (the product kernels' instruction) in "
                         "place of the warpgroup's wgmma, same A registers, B from the same image")  # fmt: skip
    ap.add_argument("--epi", type=int, choices=(0, 1, 2), default=0,
                    help="bf16, splits across blocks: 0 sums them by float atomics into the output; 1 the "
                         "last block of a row group sums the stored partials in a fixed order (counters "
                         "reset by it); 2 as 1 with the counters zeroed by a memset before each launch")  # fmt: skip
    args = ap.parse_args(argv)
    gpu = open_gpu()
    if gpu is None:
        return 2
    cp, torch, props, copy_tb_s = gpu
    source = Path(__file__).with_suffix(".cu").read_text()
    mods: dict = {}

    def kernel(fn: str, **defs):
        key = tuple(sorted(defs.items()))
        if key not in mods:
            opts = tuple(f"-D{k}={v}" for k, v in defs.items()) + ("-arch=sm_90a", "-std=c++17")
            opts += (f"--include-path={Path(__file__).parent}",)  # probe_cuda.h, beside the source
            mods[key] = cp.RawModule(code=source, options=opts)
        return mods[key].get_function(fn)

    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal(K).astype(np.float32)).to(torch.bfloat16).float().numpy()  # bf16, as h
    img, post = activation_image(x, torch)
    images = {0: (cp.asarray(img), post), 1: (cp.asarray(img), post), 2: (cp.asarray(bf16_image(x)), 1.0)}
    rows_out = []
    for shape, rows in SHAPES.items():
        stack = Stack(cp, rows, args.sets, args.chain, x, rng)
        total = 4 * (rows * K // 2 + rows * K // 32)
        for algo, ks, depth, minb, pipe in VARIANTS:
            if not splits_fit(algo, ks, depth) or (args.only and (algo, ks, depth, minb, pipe) not in args.only):
                continue
            if (args.inblock or args.mma) and algo != 2:
                continue
            if args.epi and (algo != 2 or args.inblock):
                continue
            if args.inblock and ks > 4:
                continue  # in-block splits: bf16 only, and blocks of at most 4 warpgroups (registers)
            stack.load_checked(algo)
            bimg, post = images[algo]
            twins = (algo == 0 and pipe == 0) or (algo > 0 and pipe == 1 and depth == 4)  # once per structure
            grid, block = ((stack.groups, 4), (128 * ks,)) if args.inblock else ((stack.groups * ks, 4), (128,))
            row: dict = {"shape": shape, "algo": ALGOS[algo], "ks": ks, "depth": depth, "minb": minb, "pipe": pipe}
            row["inblock"], row["mma"], row["epi"] = args.inblock, args.mma, args.epi
            scratch = cp.zeros(4 * stack.groups + 4 * ks * rows, dtype=cp.uint32) if args.epi else None
            counters = 4 * stack.groups * 4  # bytes: the scratch's counters, which EPI 2 zeroes
            row["bytes"] = total
            for mode, label in ((0, "matvec"), (1, "loads_only"), (2, "math_only")):
                if mode and not twins:
                    continue
                defs = {"ALGO": algo, "KS": ks, "DEPTH": depth, "MINB": minb, "PIPE": pipe, "MODE": mode}
                defs.update({"INBLK": args.inblock} if args.inblock else {}, **({"MMA": 1} if args.mma else {}))
                k = kernel(KERNELS[algo], **defs, **({"EPI": args.epi} if args.epi else {}))
                if mode == 0:
                    stack.out[:] = 0
                    k(grid, block, stack.args(bimg, post, None, scratch))
                    got = cp.asnumpy(stack.out).reshape(4, rows).astype(np.float64)
                    row["rel_err"] = float(np.linalg.norm(got - stack.ref) / np.linalg.norm(stack.ref))
                    row["nan"] = bool(np.isnan(got).any())
                chain = [stack.args(bimg, post, i, scratch) for i in range(len(stack.chain))]

                def launch(i, k=k, g=grid, b=block, c=chain, zero=scratch, n=counters):
                    if args.epi == 2:
                        cp.cuda.runtime.memsetAsync(zero.data.ptr, 0, n, cp.cuda.get_current_stream().ptr)
                    k(g, b, c[i % len(c)])

                us = graph_us_per_launch(cp, launch, 3, args.chain, args.reps)
                row[label + "_us"] = round(us, 2)
            row["tb_s"] = round(total / (row["matvec_us"] * 1e-6) / 1e12, 3)
            row["frac_of_copy"] = round(row["tb_s"] / copy_tb_s, 3)
            rows_out.append(row)
            parts = "".join(
                f"  {k[:-3].replace('_', ' ')} {row[k]:7.2f}" for k in ("loads_only_us", "math_only_us") if k in row
            )
            split = f"KS{ks}{'i' * args.inblock}{'m' if args.mma else ''}{'e' * args.epi}"
            print(
                f"{shape:8s} {ALGOS[algo]:10s} {split} D{depth} M{minb} P{pipe}: matvec {row['matvec_us']:7.2f} us "
                f"({row['frac_of_copy']:.2f} of copy, rel err {row['rel_err']:.2e}){parts}",
                flush=True,
            )
        del stack
        cp.get_default_memory_pool().free_all_blocks()
    fields = {"copy_tb_s": round(copy_tb_s, 3), "chain": args.chain, "rows": rows_out}
    path = write_result(args.out, "fp8_wgmma_probe", props["name"].decode(), "fp8_wgmma_probe.py", argv, fields)
    print(f"copy {copy_tb_s:.2f} TB/s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
