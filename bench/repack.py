"""Load-time repack of MXFP4 expert bytes into the MoE op's tiled order, on this machine's CPU.

    python3 bench/repack.py                      # one 120b gate_up layer: [128, 5760, 90, 16] u8
    python3 bench/repack.py --experts 32         # a 20b layer

The loader repacks every expert tensor once (`gptoss_max.mxfp4.tile_blocks`). It times the two
ways it can: into a fresh array (what a checkpoint's file-backed tensors get; each rep's result
is kept alive, so every rep writes to pages never touched before) and in place through a
per-thread scratch (what synthetic weights, which the loader owns, get; the array's pages were
touched when it was filled). Both results are checked equal. Prints a table and writes
`<out>/repack_cpu_<yyyymmdd>.json` with the device, date, command and rows
`{"mode", "gb", "seconds", "gb_per_s"}` (median of --reps).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gptoss_max import mxfp4  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rows", type=int, default=5760, help="rows per expert (2I for gate_up)")
    ap.add_argument("--blocks", type=int, default=90, help="32-element blocks per row (H / 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    src = np.random.default_rng(0).integers(0, 256, (args.experts, args.rows, args.blocks, 16), dtype=np.uint8)
    want = mxfp4.tile_blocks(src)  # also warms the code path
    gb = src.nbytes / 1e9

    fresh, kept = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        kept.append(mxfp4.tile_blocks(src))
        fresh.append(time.perf_counter() - t0)
    ok = all(np.array_equal(k, want) for k in kept)
    del kept

    buf = np.empty_like(src)
    in_place = []
    for _ in range(args.reps):
        np.copyto(buf, src)  # untimed: the loader's arrays arrive filled
        t0 = time.perf_counter()
        mxfp4.tile_blocks(buf, in_place=True)
        in_place.append(time.perf_counter() - t0)
    ok = ok and np.array_equal(buf, want)

    rows = []
    for mode, times in (("fresh array", fresh), ("in place", in_place)):
        s = statistics.median(times)
        rows.append({"mode": mode, "gb": round(gb, 3), "seconds": round(s, 3), "gb_per_s": round(gb / s, 2)})
    cmd = "python3 bench/repack.py " + " ".join(sys.argv[1:] if argv is None else argv)
    today = datetime.date.today()
    result = {
        "device": f"CPU {platform.machine()}, {os.cpu_count()} cores",
        "date": today.isoformat(),
        "command": cmd.strip(),
        "shape": [args.experts, args.rows, args.blocks, 16],
        "reps": args.reps,
        "results_equal": ok,
        "rows": rows,
    }
    print(f"{result['device']}  {result['date']}  shape {result['shape']}")
    print(f"{'mode':>12} {'GB':>7} {'s':>7} {'GB/s':>7}")
    for r in rows:
        print(f"{r['mode']:>12} {r['gb']:>7} {r['seconds']:>7} {r['gb_per_s']:>7}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"repack_cpu_{today:%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if not ok:
        print("REPACK RESULTS DIFFER", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
