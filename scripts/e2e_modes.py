#!/usr/bin/env python3
"""Sort e2e runs into the two step-time modes and show what came with each (bench/NOTES.md,
"Twelfth session": 20b batch-1 runs on the H200 stepped at ~1.66 or ~2.14 ms, whichever the tree;
"Thirteenth session": these are slow stretches of a few to ~1,000 steps, anywhere in a run).

For each worker batch in the given e2e JSON files (bench/e2e.py's, or directories holding them):
the run's median step, its quarters' medians and CPU time per step where recorded, Python's
collections by generation during the timed batch, the `--gc` mode, and the GPU's clocks and
throttle reasons before and after. Runs of the same model and batch are labelled `fast` or
`slow` when their medians spread by more than --spread (split at the geometric mean of the
fastest and slowest), so a cause shows as a column that changes with the label.

Where a run recorded every step (`step_ms`), its slow stretches too: steps whose 9-step running
median is over --spread times the run's 10th percentile, as the share of steps, their count and
the longest. Where it also recorded how long the host waited for the GPU each step
(`sync_wait_ms`, device graphs), the median wait and the median host work (step less wait) in
and out of the stretches: a stretch the host's own work grew through is the host's; one whose
wait grew, the GPU's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
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
                            "step_ms": b.get("step_ms") or [],
                            "sync_wait_ms": b.get("sync_wait_ms") or [],
                            "setup": _setup(res, b),
                        }
                    )
    return rows


def _setup(worker: dict, batch: dict) -> str:
    """What the run changed from the plain one: small graphs replayed (with check mode's
    mismatches over checked calls), the main thread isolated, worker environment."""
    parts = []
    replay = worker.get("replay_small_graphs") or "off"
    replay = "on" if replay is True else replay  # (a flag before it took check: 2026-11-30's run)
    if replay != "off":
        counts = (batch.get("replayed") or {}).values()
        parts.append(f"replay {replay}")
        if replay == "check":
            mism, checked = sum(c.get("mismatch", 0) for c in counts), sum(c.get("checked", 0) for c in counts)
            parts.append(f"mismatch {mism} of {checked}")
    iso = batch.get("isolated_main_thread")
    if iso:
        parts.append(f"main thread on CPU {iso['cpu']}" if iso.get("isolated") else "isolation refused")
    parts += [f"{k}={v}" for k, v in (worker.get("worker_env") or {}).items()]
    return "; ".join(parts) or "-"


def stretches(step_ms: list[float], spread: float, window: int = 9) -> tuple[list[bool], list[tuple[int, int, float]]]:
    """Which steps are in a slow stretch (their `window`-step running median over `spread` times
    the run's 10th percentile), and the stretches as (first step, last step, their ms)."""
    if not step_ms:
        return [], []
    base = statistics.quantiles(step_ms, n=10)[0] if len(step_ms) > 1 else step_ms[0]
    half = window // 2
    slow = [statistics.median(step_ms[max(0, i - half) : i + half + 1]) > spread * base for i in range(len(step_ms))]
    found, first = [], None
    for i, s in enumerate([*slow, False]):
        if s and first is None:
            first = i
        elif not s and first is not None:
            found.append((first, i - 1, round(sum(step_ms[first:i]), 1)))
            first = None
    return slow, found


def split_waits(step_ms: list[float], waits: list[float], slow: list[bool]) -> dict[str, float | None]:
    """Median wait for the GPU and median host work (step less wait) of the fast and slow steps."""

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 3) if xs else None

    out: dict[str, float | None] = {}
    for name, want in (("fast", False), ("slow", True)):
        pick = [i for i, s in enumerate(slow) if s == want and i < len(waits)]
        out[f"wait_{name}_ms"] = med([waits[i] for i in pick])
        out[f"host_{name}_ms"] = med([step_ms[i] - waits[i] for i in pick])
    return out


def add_stretches(rows: list[dict], spread: float) -> list[dict]:
    """Each row's slow stretches (share of steps, count, longest in ms) and, with waits, the split."""
    for r in rows:
        slow, found = stretches(r["step_ms"], spread)
        r["slow_share"] = sum(slow) / len(slow) if slow else None
        r["stretches"] = len(found)
        r["longest_ms"] = max((ms for *_, ms in found), default=0.0)
        r.update(split_waits(r["step_ms"], r["sync_wait_ms"], slow) if r["sync_wait_ms"] else {})
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
    cols = ["file", "model", "setup", "batch", "gc", "tok/s", "p50 ms", "mode", "quarters ms", "CPU quarters ms"]
    cols.append("collections")
    cols += ["slow steps", "stretches (longest ms)", "wait fast / slow ms", "host fast / slow ms"]
    cols.append("clocks before / after")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        share = "-" if r.get("slow_share") is None else f"{100 * r['slow_share']:.0f} %"
        lines.append(
            f"| {r['file']} | {r['model']} | {r['setup']} | {r['batch']} | {r['gc_mode']} | {r['tok_s'] or 0:.1f} | "
            f"{r['p50_ms']:.3f} | "
            f"{r['mode']} | {r['quarters_ms'] or '-'} | {r['cpu_quarters_ms'] or '-'} | {r['gc_collections']} | "
            f"{share} | {r.get('stretches', 0)} ({r.get('longest_ms', 0.0):.0f}) | "
            f"{_pair(r.get('wait_fast_ms'), r.get('wait_slow_ms'))} | "
            f"{_pair(r.get('host_fast_ms'), r.get('host_slow_ms'))} | "
            f"{' / '.join(c or '-' for c in r['clocks'])} |"
        )
    return "\n".join(lines)


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None and b is None else f"{'-' if a is None else a} / {'-' if b is None else b}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="e2e JSON files or directories holding them")
    ap.add_argument(
        "--spread",
        type=float,
        default=1.15,
        help="max / min median step above which runs split; also the running median over the 10th"
        " percentile above which a step is slow (1.15)",
    )
    args = ap.parse_args(argv)
    rows = add_stretches(label(runs(args.paths), args.spread), args.spread)
    if not rows:
        print("no e2e runs with step times found", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
