#!/usr/bin/env python3
"""The SASS lines where a kernel's warps stall most, from Nsight Compute's source page as CSV.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 scripts/ncu_sass_hotspots.py sass.csv --top 25

ncu's column names move between versions, so this reads them instead of assuming them: the
sample count it sorts by is the first column whose name holds "Sampling" and "All" (else any
"Sampl..." count), and each stall-reason column (a name with "stall", case aside) that is nonzero
on a line is shown with it. A report of several kernels prints one table per "Kernel Name" (or
"Function Name") value. It prints the columns it found first, so a new schema shows itself.
Used on the device by scripts/gpu_moe_profile.sh (issue 4: where the one-token MoE kernels wait).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def sample_column(fields: list[str]) -> str | None:
    """The column of stall samples to rank lines by."""
    for want in (("sampling", "all"), ("sampl",)):
        for f in fields:
            if all(w in f.lower() for w in want):
                return f
    return None


def hotspots(text: str, top: int) -> tuple[list[str], dict[str, list[dict]]]:
    """(the CSV's columns, kernel -> its `top` lines by samples, each {address, source, samples,
    share, stalls: {reason: count}}). Lines without samples are left out."""
    # ncu may print "==PROF==" or blank lines before the CSV header
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    fields = list(rows[0].keys()) if rows else []
    col = sample_column(fields)
    if col is None:
        return fields, {}
    kernel_col = next((f for f in fields if f in ("Kernel Name", "Function Name")), None)
    stall_cols = [f for f in fields if "stall" in f.lower() and f != col]
    per_kernel: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        n = _number(r.get(col, ""))
        if not n:
            continue
        stalls = {f: v for f in stall_cols if (v := _number(r.get(f, ""))) is not None and v > 0}
        per_kernel[r.get(kernel_col, "") if kernel_col else ""].append(
            {"address": r.get("Address", ""), "source": (r.get("Source") or "").strip(), "samples": n, "stalls": stalls}
        )
    out = {}
    for kernel, items in per_kernel.items():
        total = sum(i["samples"] for i in items)
        items.sort(key=lambda i: -i["samples"])
        for i in items:
            i["share"] = i["samples"] / total
        out[kernel] = items[:top]
    return fields, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output ('-': standard input)")
    ap.add_argument("--top", type=int, default=25, help="lines per kernel (default 25)")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if args.csv == "-" else open(args.csv, encoding="utf-8", errors="replace").read()
    fields, found = hotspots(text, args.top)
    print("columns: " + " | ".join(fields))
    if not found:
        print("no stall-sample column, or no sampled line", file=sys.stderr)
        return 1
    for kernel, items in found.items():
        print(f"\n{kernel or '(one kernel)'}")
        for i in items:
            reasons = ", ".join(f"{k} {v:g}" for k, v in sorted(i["stalls"].items(), key=lambda kv: -kv[1])[:4])
            print(f"{i['share']:6.1%} {i['samples']:8g}  {i['address']:>6}  {i['source'][:60]:60s}  {reasons}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
