#!/usr/bin/env python3
"""How many (expert, token-tile) blocks the prefill grouped GEMM runs, against its measured speed.

bench/moe.py routes each token to TOP_K distinct uniform experts; a p2 config gives every expert
ceil(pairs / BM) token tiles, and each tile's blocks decode the expert's whole weight tile. This
counts tiles per BM routed pairs under that routing (NumPy, no GPU) and, from a committed
`bench/moe.py --prefill` result, prints TFLOP/s x tiles per BM pairs: if that product is flat
over T, the kernel's time follows its tile count (bench/NOTES.md, "p5 analysis").

    python3 scripts/prefill_tiles.py                              # 120b, c5's BM = 128
    python3 scripts/prefill_tiles.py --results bench/results/moe_prefill_h100_20261122.json

`--padding` prints instead the token rows the p2 wgmmas multiply past the routed ones, by tile
kind, as a share of the routed (useful) rows, for a config (c5, c7, c9, c10, or the auto choice
per T), with the kernels' rules: a one-part tile runs N = BM / 4, BM / 2 or BM (the smallest
covering its rows, `p2_nt_variant`); c9's 160-token tiles past 128 rows and c10's absorbed tiles
(`expert_tiles`) run 128 + a second part of 32, or with `--narrow` (v44) the smallest of 8 / 16 /
32 covering the rows past 128 (bench/NOTES.md, "v44 prepared").

    python3 scripts/prefill_tiles.py --padding --model 120b --narrow
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


def routed_counts(tokens: int, experts: int, rng: np.random.Generator) -> np.ndarray:
    """Pairs per expert of one routing: each token to TOP_K distinct uniform experts (bench/moe.py's rule)."""
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :TOP_K]
    return np.bincount(ids.ravel(), minlength=experts)


def tiles_per_bm_pairs(tokens: int, experts: int, bm: int, draws: int, seed: int = 0) -> float:
    """Mean tiles per BM routed pairs over `draws` routings of `tokens` tokens (bench/moe.py's rule)."""
    rng = np.random.default_rng(seed)
    pairs = tokens * TOP_K
    got = [tiles(routed_counts(tokens, experts, rng), bm) for _ in range(draws)]
    return float(np.mean(got)) / (pairs / bm)


# p2 tile configs: (BM of the layout, one-part base N, absorbed rows: c10's second launch)
CONFIGS = {5: (128, 128, 0), 7: (64, 64, 0), 9: (160, 128, 0), 10: (128, 128, 32)}
EXTRA = 32  # c9's and c10's second wgmma part (160 = 128 + 32; ABSORB)


def auto_config(pairs_per_expert: int, experts: int) -> int:
    """moe_prefill_gpu.mojo's auto_config (the c9 / c10 band, c10 above 240, c5 from 80, else c7)."""
    if 120 <= pairs_per_expert <= 160:
        return 10 if experts >= 64 else 9
    if pairs_per_expert >= 240:
        return 10
    return 5 if pairs_per_expert >= 80 else 7


def one_part_n(rows: int, base: int) -> int:
    """p2_nt_variant: the wgmma N of a one-part tile of `rows` routed rows."""
    return base // 4 if rows <= base // 4 else base // 2 if rows <= base // 2 else base


def second_part_n(rows: int, narrow: bool) -> int:
    """The second wgmma part's N for `rows` (1 .. EXTRA) rows past 128: EXTRA, or with v44 the
    smallest of EXTRA / 4, EXTRA / 2, EXTRA that covers them."""
    if not narrow:
        return EXTRA
    return next(n for n in (EXTRA // 4, EXTRA // 2, EXTRA) if rows <= n)


def mma_rows(count: int, config: int, narrow: bool = False) -> dict[str, int]:
    """Token rows the wgmmas multiply for an expert of `count` routed pairs, by tile kind:
    `full` (regular tiles of the whole base), `partial` (a regular tile with fewer rows),
    `two_part` (c9's tiles past 128 rows, c10's absorbed ones). Routed rows are `count`."""
    bm, base, absorb = CONFIGS[config]
    out = {"full": 0, "partial": 0, "two_part": 0}
    if count == 0:
        return out
    m = -(-count // bm)
    last = count - bm * (m - 1)
    if absorb and m >= 2 and last <= absorb:  # expert_tiles: the last two tiles become one
        m, last = m - 1, bm + last
    out["full"] = base * (m - 1) if bm == base else 0
    if bm != base:  # c9: every tile is BM = 160 rows, of which 128 + 32 two-part
        out["two_part"] += (base + EXTRA) * (m - 1)
    if last > base:
        out["two_part"] += base + second_part_n(last - base, narrow)
    elif last == bm == base:
        out["full"] += base
    else:
        out["partial"] += one_part_n(last, base)
    return out


def padding(tokens: int, experts: int, config: int | None, draws: int, narrow: bool, seed: int = 0) -> dict[str, float]:
    """Padded rows (multiplied past the routed ones) by tile kind over routed rows, mean over
    `draws` routings (bench/moe.py's rule); `config` None takes auto_config per T."""
    rng = np.random.default_rng(seed)
    c = config if config is not None else auto_config(tokens * TOP_K // experts, experts)
    computed = {"full": 0, "partial": 0, "two_part": 0}
    useful = {"full": 0, "partial": 0, "two_part": 0}
    for _ in range(draws):
        for n in routed_counts(tokens, experts, rng):
            rows = mma_rows(int(n), c, narrow)
            # the routed rows are the expert's count, split over its kinds as the tiles hold them:
            # full tiles first, then the two-part tile, the partial tile the rest
            left = int(n)
            for k in ("full", "two_part", "partial"):
                computed[k] += rows[k]
                got = left if k == "partial" and rows[k] else min(left, rows[k])
                useful[k] += got
                left -= got
    total = sum(useful.values())
    out = {k: (computed[k] - useful[k]) / total for k in computed}
    out["all"] = sum(out.values())
    out["config"] = c
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("bench/results/moe_prefill_h100_20261122.json"))
    ap.add_argument("--model", default="120b", choices=sorted(EXPERTS))
    ap.add_argument("--bm", type=int, default=128, help="token tile of the config (c5: 128)")
    ap.add_argument("--draws", type=int, default=20, help="routings averaged per T")
    ap.add_argument("--padding", action="store_true", help="padded wgmma rows by tile kind instead")
    ap.add_argument("--config", type=int, choices=sorted(CONFIGS), help="with --padding (default: auto per T)")
    ap.add_argument("--narrow", action="store_true", help="with --padding: v44's narrow second parts")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    args = ap.parse_args(argv)
    if args.padding:
        e = EXPERTS[args.model]
        parts = "v44 narrow" if args.narrow else "main"
        print(f"{args.model}: padded wgmma rows over routed rows ({parts} second parts)")
        print(f"{'T':>6} {'config':>6} {'full':>6} {'partial':>8} {'two-part':>9} {'all':>6}")
        for t in args.tokens:
            p = padding(t, e, args.config, args.draws, args.narrow)
            cfg = f"c{p['config']}"
            shares = f"{p['full']:>6.3f} {p['partial']:>8.3f} {p['two_part']:>9.3f} {p['all']:>6.3f}"
            print(f"{t:>6} {cfg:>6} {shares}")
        return 0
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
