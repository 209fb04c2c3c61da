#!/usr/bin/env python3
"""Sort e2e runs into the two step-time modes and show what came with each (bench/NOTES.md,
"Twelfth session": 20b batch-1 runs on the H200 stepped at ~1.66 or ~2.14 ms, whichever the tree).

For each worker batch in the given e2e JSON files (bench/e2e.py's, or directories holding them):
the run's median step, its quarters' medians and CPU time per step where recorded, Python's
collections by generation during the timed batch, the `--gc` mode, and the GPU's clocks and
throttle reasons before and after. Runs of the same model and batch are labelled `fast` or
`slow` when their medians spread by more than --spread (split at the geometric mean of the
fastest and slowest), so a cause shows as a column that changes with the label.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def runs(paths: list[Path]) -> list[dict]:
    """One row per (file, worker, batch) with what the labels and the table need."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("**/e2e_*.json")) if p.is_dir() else [p]
    rows = []
    for f in files:
        d = json.loads(f.read_text())
        for name, run in d.get("runs", {}).items():
            for worker, res in run.get("workers", {}).items():
                for b in res.get("batches", []):
                    if b.get("tpot_p50_ms") is None:
                        continue
                    gs = b.get("gpu_state") or {}
                    rows.append(
                        {
                            "file": f.name,
                            "variant": d.get("variant", ""),
                            "model": name.split()[0],
                            "worker": worker,
                            "batch": b["batch"],
                            "gc_mode": res.get("gc", "default"),
                            "tok_s": b.get("decode_tok_s"),
                            "p50_ms": b["tpot_p50_ms"],
                            "quarters_ms": b.get("tpot_quarters_ms"),
                            "cpu_quarters_ms": b.get("cpu_quarters_ms"),
                            "gc_collections": b.get("gc_collections"),
                            "clocks": [_clocks(gs.get("before")), _clocks(gs.get("after"))],
                        }
                    )
    return rows


def _clocks(state: dict | None) -> str | None:
    if not state:
        return None
    return f"{state.get('clocks.sm')}/{state.get('clocks.mem')} {state.get('clocks_throttle_reasons.active')}"


def label(rows: list[dict], spread: float) -> list[dict]:
    """Each row's `mode`: fast / slow within its (model, worker, batch) group when the group's
    medians spread by more than `spread` (max / min), else `-`."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["worker"], r["batch"]), []).append(r)
    for group in groups.values():
        lo, hi = min(r["p50_ms"] for r in group), max(r["p50_ms"] for r in group)
        split = math.sqrt(lo * hi)
        for r in group:
            r["mode"] = "-" if hi / lo <= spread else ("fast" if r["p50_ms"] < split else "slow")
    return rows


def table(rows: list[dict]) -> str:
    cols = ["file", "model", "batch", "gc", "tok/s", "p50 ms", "mode", "quarters ms", "CPU quarters ms", "collections"]
    cols.append("clocks before / after")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(
            f"| {r['file']} | {r['model']} | {r['batch']} | {r['gc_mode']} | {r['tok_s'] or 0:.1f} | "
            f"{r['p50_ms']:.3f} | "
            f"{r['mode']} | {r['quarters_ms'] or '-'} | {r['cpu_quarters_ms'] or '-'} | {r['gc_collections']} | "
            f"{' / '.join(c or '-' for c in r['clocks'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="e2e JSON files or directories holding them")
    ap.add_argument("--spread", type=float, default=1.15, help="max / min median step above which runs split (1.15)")
    args = ap.parse_args(argv)
    rows = label(runs(args.paths), args.spread)
    if not rows:
        print("no e2e runs with step times found", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
