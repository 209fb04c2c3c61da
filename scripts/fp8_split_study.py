#!/usr/bin/env python3
"""Design study for an FP8 tensor-core MoE decode (bench/NOTES.md, "v11 proposal"), on the CPU.

Two facts the design rests on:
  1. An e2m1 nibble (s e1 e0 m) placed as the e4m3 byte (s 0 0 e1 e0 m 0 0) is exactly the e2m1
     value times 2^-6, for all 16 codes: MXFP4 weights become e4m3 mma operands by masks and
     shifts, with no conversion and no rounding.
  2. Activations split into e4m3 parts (x ~ hi + lo, one power-of-two scale per token) keep the
     gate_up dot products as accurate as bf16 activations, which today's kernel feeds its mma.

Prints the check of (1) and, for (2), the relative error of x @ W^T against float64 for bf16
activations and for 1, 2 and 3 e4m3 parts, on gpt-oss's gate_up shape (2880 -> 5760) with one
expert's MXFP4 weights as the synthetic 120b checkpoint draws them (`gptoss_max.synthetic`), and
the E8M0 bytes those weights use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e4m3_byte(nibble: int) -> int:
    """The e4m3 byte that holds e2m1 `nibble` times 2^-6."""
    return ((nibble & 8) << 4) | ((nibble & 7) << 2)


def placement_is_exact(torch) -> bool:
    codes = list(range(16))
    got = torch.tensor([e4m3_byte(n) for n in codes], dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    want = torch.tensor([(-1.0 if n & 8 else 1.0) * E2M1[n & 7] * 2.0**-6 for n in codes], dtype=torch.float64)
    return bool(torch.equal(got, want))


def split_e4m3(torch, x, parts: int):
    """x (float64 [T, K]) as the sum of `parts` e4m3 tensors, each with its own per-token power-of-two
    scale that puts the part's largest magnitude at or below 224 (e4m3 tops out at 448)."""
    out, r = torch.zeros_like(x), x.clone()
    for _ in range(parts):
        amax = r.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
        sc = torch.pow(2.0, torch.floor(torch.log2(224.0 / amax)))
        p = (r * sc).to(torch.float8_e4m3fn).double() / sc
        out, r = out + p, r - p
    return out


def synthetic_gate_up(seed: int):
    """Expert 0 of layer 0's gate_up weights [2 * I, H] (float32) and E8M0 bytes of the synthetic
    120b checkpoint, drawn by the generator `--model synthetic:120b` uses."""
    from gptoss_max import mxfp4
    from gptoss_max.config import PRESETS
    from gptoss_max.synthetic import chunk_values, tensor_plans

    spec = PRESETS["120b"]
    rows, nb = 2 * spec.intermediate_size, spec.hidden_size // mxfp4.BLOCK
    name = "model.layers.0.mlp.experts.gate_up_proj_"
    plans = {p.name: p for p in tensor_plans(spec, True) if p.name.startswith(name)}
    blocks = chunk_values(name + "blocks", plans[name + "blocks"].dist, seed, 0, rows * nb).reshape(rows, nb, 16)
    scales = chunk_values(name + "scales", plans[name + "scales"].dist, seed, 0, rows * nb).reshape(rows, nb)
    return mxfp4.decode(blocks, scales), scales


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    torch.manual_seed(args.seed)
    print(f"e2m1 nibble -> e4m3 byte (s 0 0 e1 e0 m 0 0) is value * 2^-6 for all 16 codes: {placement_is_exact(torch)}")
    w, scales = synthetic_gate_up(args.seed)
    n, k = w.shape
    print(f"synthetic 120b gate_up expert: E8M0 bytes {int(scales.min())}..{int(scales.max())}")
    w = torch.from_numpy(w).double()
    cases = {
        "normal": torch.randn(args.tokens, k, dtype=torch.float64),
        "1% outliers x30": torch.randn(args.tokens, k, dtype=torch.float64)
        * torch.where(torch.rand(args.tokens, k) < 0.01, 30.0, 1.0),
    }
    print(f"relative error of x @ W^T ({args.tokens} x {k} -> {n}) against float64:")
    print(f"{'activations':<16} {'bf16':>9} {'e4m3 x1':>9} {'e4m3 x2':>9} {'e4m3 x3':>9}")
    for name, x in cases.items():
        ref = x @ w.T

        def err(xq, ref=ref):
            return ((xq @ w.T - ref).norm() / ref.norm()).item()

        errs = [err(x.to(torch.bfloat16).double())] + [err(split_e4m3(torch, x, p)) for p in (1, 2, 3)]
        print(f"{name:<16} " + " ".join(f"{e:>9.2e}" for e in errs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
