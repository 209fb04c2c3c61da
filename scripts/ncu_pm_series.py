#!/usr/bin/env python3
"""A kernel's PM-sampling time series from Nsight Compute's raw page: DRAM, L2 and issue activity
over the kernel's life, one column per sample (~1.5 us apart), to see its ramp, dips and tail.

    ncu -i REPORT.ncu-rep --page raw --csv --print-metric-instances values > raw.csv
    python3 scripts/ncu_pm_series.py raw.csv

The report needs the PmSampling section (in `--set full`). ncu writes each sampled metric as
"TOTAL (v0; v1; ...)"; the samples before the kernel's first launched block and after its last
activity are cut. Used by scripts/gpu_moe_profile.sh (issue 4: where the one-token MoE kernels
leave DRAM idle).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

# (label, metric name suffix) of the series shown, in this order
SERIES = (
    ("dram %", "dramc__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("l2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue %", "sm__inst_executed_realtime.avg.pct_of_peak_sustained_elapsed"),
    ("hmma cyc", "sm__pipe_tensor_op_hmma_cycles_active_realtime.avg"),
    ("sm cyc", "sm__cycles_active.avg"),
    ("ctas", "gr__ctas_launched_realtime.sum"),
)


def _values(cell: str) -> list[float] | None:
    m = re.search(r"\(([^()]*)\)\s*$", cell)
    if not m:
        return None
    out = []
    for v in m.group(1).split(";"):
        try:
            out.append(float(v.replace(",", "").strip()))
        except ValueError:
            return None
    return out


def series(text: str) -> dict[str, dict[str, list[float]]]:
    """kernel name -> {label: samples}, trimmed to the kernel's active samples."""
    rows = list(csv.reader(text.splitlines()))
    hdr = next((r for r in rows if "Kernel Name" in r), None)
    if hdr is None:
        return {}
    kcol = hdr.index("Kernel Name")
    cols = {label: next((i for i, h in enumerate(hdr) if h.endswith(suffix)), None) for label, suffix in SERIES}
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows[rows.index(hdr) + 1 :]:
        if len(r) != len(hdr):
            continue
        got = {label: v for label, i in cols.items() if i is not None and (v := _values(r[i])) is not None}
        if not got:
            continue  # the units row, or a kernel without PM sampling
        n = min(len(v) for v in got.values())
        # the kernel's samples: from its first launched block (else its first active SM cycle) to
        # its last active SM cycle
        marks = got.get("ctas") or got.get("sm cyc") or next(iter(got.values()))
        active = got.get("sm cyc") or marks
        start = next((i for i in range(n) if marks[i] > 0), 0)
        end = max((i for i in range(n) if active[i] > 0), default=n - 1) + 1
        out[r[kcol]] = {label: v[start:end] for label, v in got.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page raw --csv --print-metric-instances values output ('-': standard input)")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if args.csv == "-" else open(args.csv, encoding="utf-8", errors="replace").read()
    found = series(text)
    if not found:
        print("no PM-sampling series (was the PmSampling section collected?)", file=sys.stderr)
        return 1
    for kernel, cols in found.items():
        print(f"\n{kernel}")
        for label, vals in cols.items():
            print(f"{label:>9} " + " ".join(f"{v:7.1f}" for v in vals))
        if "dram %" in cols and cols["dram %"]:
            d = cols["dram %"]
            mean = sum(d) / len(d)
            print(f"{'':>9} DRAM busy {sum(d) / 100:.2f} of {len(d)} samples (mean {mean:.1f} %, peak {max(d):.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
