#!/usr/bin/env python3
"""How many (expert, token-tile) blocks the prefill grouped GEMM runs, against its measured speed.

bench/moe.py routes each token to TOP_K distinct uniform experts; a p2 config gives every expert
ceil(pairs / BM) token tiles, and each tile's blocks decode the expert's whole weight tile. This
counts tiles per BM routed pairs under that routing (NumPy, no GPU) and, from a committed
`bench/moe.py --prefill` result, prints TFLOP/s x tiles per BM pairs: if that product is flat
over T, the kernel's time follows its tile count (bench/NOTES.md, "p5 analysis").

    python3 scripts/prefill_tiles.py                              # 120b, c5's BM = 128
    python3 scripts/prefill_tiles.py --results bench/results/moe_prefill_h100_20261122.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TOP_K = 4
EXPERTS = {"120b": 128, "20b": 32}


def tiles(counts: np.ndarray, bm: int) -> int:
    """Token tiles of BM for experts holding `counts` routed pairs (empty experts take none)."""
    return int(((counts + bm - 1) // bm).sum())


def tiles_per_bm_pairs(tokens: int, experts: int, bm: int, draws: int, seed: int = 0) -> float:
    """Mean tiles per BM routed pairs over `draws` routings of `tokens` tokens (bench/moe.py's rule)."""
    rng = np.random.default_rng(seed)
    pairs = tokens * TOP_K
    got = []
    for _ in range(draws):
        ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :TOP_K]
        got.append(tiles(np.bincount(ids.ravel(), minlength=experts), bm))
    return float(np.mean(got)) / (pairs / bm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("bench/results/moe_prefill_h100_20261122.json"))
    ap.add_argument("--model", default="120b", choices=sorted(EXPERTS))
    ap.add_argument("--bm", type=int, default=128, help="token tile of the config (c5: 128)")
    ap.add_argument("--draws", type=int, default=20, help="routings averaged per T")
    args = ap.parse_args(argv)
    rows = [r for r in json.loads(args.results.read_text())["rows"] if r["model"] == args.model]
    print(f"{args.model}, BM = {args.bm}, {args.results.name}")
    print(f"{'T':>6} {'pairs/expert':>12} {'tiles/BM pairs':>14} {'TFLOP/s':>8} {'product':>8}")
    for r in sorted(rows, key=lambda r: r["tokens"]):
        t = r["tokens"]
        per = tiles_per_bm_pairs(t, EXPERTS[args.model], args.bm, args.draws)
        tf = r["ours_tflops"]
        print(f"{t:>6} {t * TOP_K / EXPERTS[args.model]:>12.0f} {per:>14.2f} {tf:>8.1f} {tf * per:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
