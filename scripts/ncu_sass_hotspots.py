#!/usr/bin/env python3
"""The SASS lines where a kernel's warps stall most, from Nsight Compute's source page as CSV.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 scripts/ncu_sass_hotspots.py sass.csv --top 25

ncu's column names move between versions, so this reads them instead of assuming them: the
sample count it sorts by is the first column whose name holds "Sampling" and "All" (else any
"Sampl..." count), and each stall-reason column (a name with "stall", case aside) that is nonzero
on a line is shown with it. A report of several kernels prints one table per kernel: ncu 2025
writes a `"Kernel Name","<name>",` line before each kernel's table, older ones a "Kernel Name" (or
"Function Name") column. It prints the columns it found first, so a new schema shows itself.
Where the page has an "Instructions Executed" column it also prints, per kernel, how many warp
instructions and stall samples lie outside its loops (lines run at most 1.5 times per warp).
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


def _sections(text: str) -> list[tuple[str, list[dict]]]:
    """(kernel, rows) per table. ncu 2025 writes one table per kernel, each after a line
    `"Kernel Name","<name>",`; older ones write one table with a "Kernel Name" column."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    for ln in text.splitlines():
        if ln.startswith('"Kernel Name","') and ln.rstrip().rstrip(",").count('","') == 1:
            sections.append((next(csv.reader([ln]))[1], []))
        elif ln.startswith('"'):  # ncu may print "==PROF==" or blank lines around the CSV
            sections[-1][1].append(ln)
    return [(k, list(csv.DictReader(io.StringIO("\n".join(lines))))) for k, lines in sections if lines]


def hotspots(text: str, top: int) -> tuple[list[str], dict[str, list[dict]]]:
    """(the CSV's columns, kernel -> its `top` lines by samples, each {address, source, samples,
    share, stalls: {reason: count}}). Lines without samples are left out."""
    sections = _sections(text)
    # a row longer than the header puts its extra cells under the key None: not a column
    fields = [f for f in sections[0][1][0].keys() if isinstance(f, str)] if sections and sections[0][1] else []
    col = sample_column(fields)
    if col is None:
        return fields, {}
    kernel_col = next((f for f in fields if f in ("Kernel Name", "Function Name")), None)
    # the "(Not-issued Samples)" twin of the sample column is a total, not a reason, and each
    # reason's "(Not Issued)" twin repeats it
    stall_cols = [
        f for f in fields if "stall" in f.lower() and "sampl" not in f.lower() and "not issued" not in f.lower()
    ]
    per_kernel: dict[str, list[dict]] = defaultdict(list)
    for section_kernel, rows in sections:
        for r in rows:
            n = _number(r.get(col) or "")
            if not n:
                continue
            stalls = {f: v for f in stall_cols if (v := _number(r.get(f) or "")) is not None and v > 0}
            kernel = r.get(kernel_col, "") if kernel_col else section_kernel
            per_kernel[kernel].append(
                {
                    "address": r.get("Address", ""),
                    "source": (r.get("Source") or "").strip(),
                    "samples": n,
                    "stalls": stalls,
                }
            )
    out = {}
    for kernel, items in per_kernel.items():
        total = sum(i["samples"] for i in items)
        items.sort(key=lambda i: -i["samples"])
        for i in items:
            i["share"] = i["samples"] / total
        out[kernel] = items[:top]
    return fields, out


def loop_split(text: str) -> dict[str, dict[str, float]]:
    """Per kernel with an "Instructions Executed" column: its warps (the count of its first line,
    which every warp runs once), its warp instructions and stall samples, and the part of each on
    lines outside its loops (lines run at most 1.5 times per warp: prologue and epilogue)."""
    out: dict[str, dict[str, float]] = {}
    for kernel, rows in _sections(text):
        fields = [f for f in rows[0].keys() if isinstance(f, str)] if rows else []
        col = sample_column(fields)
        if "Instructions Executed" not in fields or col is None:
            continue
        execd = [_number(r.get("Instructions Executed") or "") or 0.0 for r in rows]
        samples = [_number(r.get(col) or "") or 0.0 for r in rows]
        warps = execd[0]
        if not warps:
            continue
        outside = [i for i, n in enumerate(execd) if n <= 1.5 * warps]
        out[kernel] = {
            "warps": warps,
            "instructions": sum(execd),
            "outside_instructions": sum(execd[i] for i in outside),
            "samples": sum(samples),
            "outside_samples": sum(samples[i] for i in outside),
        }
    return out


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
    for kernel, v in loop_split(text).items():
        per_warp = v["instructions"] / v["warps"]
        print(
            f"\n{kernel or '(one kernel)'}: {v['warps']:g} warps, {per_warp:.0f} warp instructions per warp,"
            f" {v['outside_instructions'] / v['warps']:.0f} of them outside loops, holding"
            f" {v['outside_samples'] / max(v['samples'], 1):.0%} of the stall samples"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
