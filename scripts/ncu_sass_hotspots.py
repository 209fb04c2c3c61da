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
With --segments it also cuts each kernel's lines into runs of one execution count (a loop body,
the code a warp runs once) and gives each run's and each opcode's share of the instructions and
stall samples: how much of a kernel's time sits in per-tile code outside its k loop.
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


def _counted(text: str):
    """(kernel, rows, executions per row, stall samples per row) for each table that has an
    "Instructions Executed" column and a sample column."""
    for kernel, rows in _sections(text):
        fields = [f for f in rows[0].keys() if isinstance(f, str)] if rows else []
        col = sample_column(fields)
        if "Instructions Executed" not in fields or col is None:
            continue
        execd = [_number(r.get("Instructions Executed") or "") or 0.0 for r in rows]
        samples = [_number(r.get(col) or "") or 0.0 for r in rows]
        yield kernel, rows, execd, samples


def _unique(out: dict, kernel: str) -> str:
    """kernel, or "kernel #2", "#3"... when ncu profiled it more than once."""
    name, k = kernel, 2
    while name in out:
        name, k = f"{kernel} #{k}", k + 1
    return name


def loop_split(text: str) -> dict[str, dict[str, float]]:
    """Per kernel with an "Instructions Executed" column: its warps (the count of its first line,
    which every warp runs once), its warp instructions and stall samples, and the part of each on
    lines outside its loops (lines run at most 1.5 times per warp: prologue and epilogue)."""
    out: dict[str, dict[str, float]] = {}
    for kernel, _rows, execd, samples in _counted(text):
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


def _opcode(source: str) -> str:
    """The opcode of a SASS line without its modifiers or predicate: "@!P0 LDS.U8 R1, [R2]" -> "LDS"."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def segments(text: str, min_lines: int = 8) -> dict[str, list[dict]]:
    """Per kernel table with an "Instructions Executed" column: its executed lines cut into runs
    of equal execution count, in address order (a loop body, a prologue run once per warp, an
    epilogue...), each {first (its line index), lines, count (executions of each line), share of
    the kernel's warp instructions and of its stall samples, opcodes (the run's 6 most frequent,
    by line)}. Runs shorter than min_lines lines are left out unless they hold at least 2 % of
    the samples. Where ncu profiled one kernel twice, each table is its own entry (name #2...)."""
    out: dict[str, list[dict]] = {}
    for kernel, rows, execd, samples in _counted(text):
        runs: list[dict] = []
        total_i, total_s = sum(execd), sum(samples)
        for i, (r, n, smp) in enumerate(zip(rows, execd, samples, strict=True)):
            if not n:
                continue
            op = _opcode(r.get("Source") or "")
            if runs and runs[-1]["count"] == n and runs[-1]["last"] == i - 1:
                run = runs[-1]
            else:
                run = {"first": i, "lines": 0, "count": n, "instructions": 0.0, "samples": 0.0, "ops": defaultdict(int)}
                runs.append(run)
            run["lines"] += 1
            run["last"] = i
            run["instructions"] += n
            run["samples"] += smp
            run["ops"][op] += 1
        out[_unique(out, kernel)] = [
            {
                "first": r["first"],
                "lines": r["lines"],
                "count": r["count"],
                "instructions_share": r["instructions"] / max(total_i, 1.0),
                "samples_share": r["samples"] / max(total_s, 1.0),
                "opcodes": sorted(r["ops"].items(), key=lambda kv: (-kv[1], kv[0]))[:6],
            }
            for r in runs
            if r["lines"] >= min_lines or r["samples"] >= 0.02 * max(total_s, 1.0)
        ]
    return out


def opcode_mix(text: str) -> dict[str, list[tuple[str, float, float]]]:
    """Per kernel table with an "Instructions Executed" column: (opcode, share of its executed
    warp instructions, share of its stall samples), most executed first."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for kernel, rows, execd, samples in _counted(text):
        ins: dict[str, float] = defaultdict(float)
        smp: dict[str, float] = defaultdict(float)
        for r, n, sm in zip(rows, execd, samples, strict=True):
            op = _opcode(r.get("Source") or "")
            ins[op] += n
            smp[op] += sm
        ti, ts = max(sum(ins.values()), 1.0), max(sum(smp.values()), 1.0)
        out[_unique(out, kernel)] = sorted(((op, ins[op] / ti, smp[op] / ts) for op in ins), key=lambda t: -t[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output ('-': standard input)")
    ap.add_argument("--top", type=int, default=25, help="lines per kernel (default 25)")
    ap.add_argument("--segments", action="store_true",
                    help="also the runs of lines with one execution count (loop bodies, prologue, epilogue)"
                         " and each kernel's opcode mix, with their shares of instructions and samples")
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
    if args.segments:
        for kernel, runs in segments(text).items():
            print(f"\n{kernel or '(one kernel)'}: runs of equal execution count (line, lines, count, instr, samples)")
            for r in runs:
                ops = " ".join(f"{op} {n}" for op, n in r["opcodes"])
                print(f"  {r['first']:6d} {r['lines']:5d} x {r['count']:10g}  {r['instructions_share']:6.1%}"
                      f"  {r['samples_share']:6.1%}  {ops}")
        for kernel, mix in opcode_mix(text).items():
            print(f"\n{kernel or '(one kernel)'}: opcodes (instr, samples): "
                  + ", ".join(f"{op} {a:.1%} {b:.1%}" for op, a, b in mix[:14]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
