"""Do Hopper's tensor cores keep subnormal 16-bit operands? (issue 4, bench/NOTES.md "v25 idea").

An MXFP4 (e2m1) code decodes with no arithmetic at all when its bits are placed straight into a
16-bit float word: sign to bit 15, e1 e0 m to bf16 bits 8..6 (value x 2^-126) or to f16 bits
11..9 (value x 2^-14). Code 1 (0.5) then lands on a subnormal (bf16 0x0040, f16 0x0200). A
decode that leaves the block scale to an f32 multiply after the mma needs the mma to take those
subnormals as they are, not flush them to zero.

One warp runs one `mma.sync.aligned.m16n8k16` (f32 accumulators) per case on random e2m1 codes
(all 16 present) against small integer activations, and the result is compared with the float64
product: exact (every sum here is representable in f32), or equal to the model with the 0.5
codes flushed to zero. CuPy only (NVRTC compiles `mma_subnormal_probe.cu`); ~10 s on the GPU.

    python3 scripts/mma_subnormal_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gptoss_max.mxfp4 import E2M1_VALUES

E2M1 = E2M1_VALUES.astype(np.float64)
SOURCE = Path(__file__).with_name("mma_subnormal_probe.cu")

# (name, operand type, the power of two the placed bits carry, the power of two the activations carry)
CASES = [
    ("bf16, activations x 2^100", "bf16", -126, 100),
    ("f16, activations x 1", "f16", -14, 0),
    ("bf16, activations x 1 (products below f32's normal range)", "bf16", -126, 0),
]


def placed_bits(codes: np.ndarray, kind: str) -> np.ndarray:
    """e2m1 codes [..] as 16-bit float bits with no arithmetic: the sign to bit 15, e1 e0 m to
    bits 8..6 (bf16) or 11..9 (f16)."""
    sign = (codes >> 3).astype(np.uint16) << 15
    mag = (codes & 7).astype(np.uint16)
    return sign | (mag << (6 if kind == "bf16" else 9))


def placed_values(bits: np.ndarray, kind: str) -> np.ndarray:
    """16-bit float bits (bf16 or f16) as float64 values, subnormals included."""
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def float_bits(values: np.ndarray, kind: str) -> np.ndarray:
    """Exactly representable values as 16-bit float bits."""
    if kind == "f16":
        return values.astype(np.float16).view(np.uint16)
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def make_case(rng: np.random.Generator, kind: str, a_pow: int, b_pow: int):
    codes = rng.permutation(np.resize(np.arange(16), 256)).reshape(16, 16)
    ints = rng.integers(-4, 5, size=(16, 8)).astype(np.float64)
    a_vals = E2M1[codes] * 2.0**a_pow
    b_vals = ints * 2.0**b_pow
    a_bits = placed_bits(codes, kind)
    b_bits = float_bits(b_vals, kind)
    assert np.array_equal(placed_values(a_bits, kind), a_vals)  # the placed bits mean what they should
    exact = a_vals @ b_vals
    flushed = np.where(np.abs(E2M1[codes]) == 0.5, 0.0, a_vals) @ b_vals
    return a_bits, b_bits, exact, flushed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default: bench/results)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import cupy as cp
    except ImportError:
        print("needs CuPy with a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).parent))
    from probe_common import write_result

    rng = np.random.default_rng(args.seed)
    src = SOURCE.read_text()
    kernels = {
        k: cp.RawKernel(src, "mma_probe", options=("-std=c++17", f"-DF16={int(k == 'f16')}")) for k in ("bf16", "f16")
    }
    rows = []
    for name, kind, a_pow, b_pow in CASES:
        kernel = kernels[kind]
        a_bits, b_bits, exact, flushed = make_case(rng, kind, a_pow, b_pow)
        d = cp.zeros((16, 8), dtype=cp.float32)
        kernel((1,), (32,), (cp.asarray(a_bits), cp.asarray(b_bits), d))
        got = cp.asnumpy(d).astype(np.float64)
        scale = max(float(np.abs(exact).max()), 1e-300)
        row = {
            "case": name,
            "operand": kind,
            "exact": bool(np.array_equal(got, exact)),
            "equals_flush_model": bool(np.array_equal(got, flushed)),
            "max_rel_err": float(np.abs(got - exact).max() / scale),
            "max_rel_err_flush_model": float(np.abs(got - flushed).max() / scale),
        }
        rows.append(row)
        print(
            f"{name:58s} exact {row['exact']!s:5s}  = flush model {row['equals_flush_model']!s:5s}"
            f"  rel err {row['max_rel_err']:.2e} (against the flush model {row['max_rel_err_flush_model']:.2e})"
        )
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    fields = {"seed": args.seed, "rows": rows}
    path = write_result(args.out, "mma_subnormal_probe", device, Path(__file__).name, argv, fields)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
