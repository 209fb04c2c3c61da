#!/usr/bin/env python3
"""Can the projection after a latency-bound kernel load its weight while that kernel runs?

A diagnostic for issue 9, not a product kernel. In a batch-1 decode step the attention
(~7.5 us per 120b layer) barely uses DRAM, and the o_proj GEMV after it then streams its
23.6 MB weight (2880 x 4096 bf16) at ~2.3 TB/s (~10 us). `scripts/l2_prefetch_probe.py` found
that `cp.async.bulk.prefetch.L2` issued during the first kernel does not make the second one
faster. This probe tries the other way: the projection is launched with programmatic stream
serialization (PDL), so its blocks start while the first kernel still runs (which calls
griddepcontrol.launch_dependents at its start); each block bulk-copies its 22 weight rows
(176 KB) into shared memory at once, then waits (griddepcontrol.wait) for the first kernel's
output x, then multiplies from shared memory. All 131 blocks fit the GPU at once, one per SM.

`scripts/pdl_preload_probe.cu` holds the kernels and the timing (CUDA events around a CUDA
graph of 20 iterations, each on the next of 8 weight copies, so no weight is in L2); every
PDL row's output is checked against a plain GEMV of the same x. This script builds it with
nvcc for sm_90a, runs it, prints a table and writes <out>/pdl_preload_probe_<gpu>_<yyyymmdd>.json.
Needs nvcc, torch (the copy bandwidth, as bench/moe.py measures it) and an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
sys.path.insert(0, str(HERE))

from moe import copy_bandwidth  # noqa: E402  (bench/moe.py)
from probe_common import write_result  # noqa: E402

WEIGHT_BYTES = 2880 * 4096 * 2
MAX_REL_ERR = 1e-2  # bf16 output against an f32 GEMV of the same operands


def build(work: Path, nvcc: str = "nvcc") -> Path:
    exe = work / "pdl_preload_probe"
    cmd = [nvcc, "-O3", "-std=c++17", "-arch=sm_90a", str(HERE / "pdl_preload_probe.cu"), "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default: bench/results)")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays per variant (median taken)")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--table-mb", type=int, nargs="+", default=[8, 256],
                    help="sizes (MB, powers of two) of the table the chain reads at random, one run each")  # fmt: skip
    ap.add_argument("--carveout", type=int, nargs="+", default=[-1],
                    help="the chain's preferred shared-memory carveout, %% (-1: unset), one run each")  # fmt: skip
    args = ap.parse_args(argv)
    import torch

    name = torch.cuda.get_device_name()
    copy_tb_s = copy_bandwidth(torch)
    torch.cuda.empty_cache()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp), args.nvcc)
        for mb in args.table_mb:
            for carve in args.carveout:
                cmd = [str(exe), str(args.reps), "20", str(mb), str(carve)]
                runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    for res in runs:
        print(f"chain table {res['table_mb']} MB, chain carveout {res['chain_carveout']} (-1: unset)")
        print(f"{'variant':48s} {'us/iter':>8s} {'p10':>7s} {'p90':>7s} {'rel err':>9s}")
        for row in res["rows"]:
            err = f"{row['rel_err']:.1e}" if row["rel_err"] >= 0 else ""
            print(f"{row['variant']:48s} {row['us']:8.2f} {row['us_p10']:7.2f} {row['us_p90']:7.2f} {err:>9s}")
    worst = max(res["worst_rel_err"] for res in runs)
    roof = round(WEIGHT_BYTES / (copy_tb_s * 1e12) * 1e6, 2)
    fields = {"copy_tb_s": round(copy_tb_s, 3), "weight_bytes": WEIGHT_BYTES, "weight_roofline_us": roof, "runs": runs}
    path = write_result(args.out, "pdl_preload_probe", name, "pdl_preload_probe.py", argv, fields)
    print(f"copy {copy_tb_s:.2f} TB/s, weight roofline {roof} us; wrote {path}")
    if not worst <= MAX_REL_ERR:
        print(f"WRONG: rel err {worst:.2e} > {MAX_REL_ERR}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
