#!/usr/bin/env python3
"""Medians of a kernel A/B (scripts/gpu_patch_ab.sh's OUT_DIR): every round's bench/moe.py JSON
under patched_<r>/ and main_<r>/, per measured point, patched against main.

    python3 scripts/ab_summary.py OUT_DIR [--json FILE]
    python3 scripts/ab_summary.py --round ROUND_DIR    # one round's points and correctness checks

A point is a decode row (µs per layer, lower is better), a prefill sweep row (TFLOP/s, higher is
better) or a crossover point (ms per layer of the decode kernel and of each config, lower is
better). For each it prints the median of each side, the change of the patched median against
main's, each side's spread (max / min - 1) and in how many paired rounds the patched side was
better. A change smaller than the spread is noise: c7 at 20b T = 128 read 0.174 - 0.245 ms over
eight runs of two trees (bench/NOTES.md, "Twenty-eighth session"). In a prefill A/B the decode
kernel's crossover rows are a control: a patch to the prefill path does not touch them, so their
changes show how far same-code medians move between the sides.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

# a measured point: (kind: decode | sweep | cross, model, tokens, what: "ours", "decode" or "c<config>")
Key = tuple[str, str, int, str]


def points(d: dict) -> dict[Key, tuple[float, str, bool]]:
    """The measured points of one bench/moe.py JSON: key -> (value, unit, higher is better)."""
    out: dict[Key, tuple[float, str, bool]] = {}
    for r in d.get("sweep") or []:
        out[("sweep", r["model"], int(r["tokens"]), f"c{r['config']}")] = (float(r["tflops"]), "TFLOP/s", True)
    for model, c in (d.get("crossover") or {}).items():
        for p in c.get("points", []):
            t = int(p["tokens"])
            if p.get("decode_ms") is not None:
                out[("cross", model, t, "decode")] = (float(p["decode_ms"]), "ms", False)
            for cfg, v in p["prefill_ms_by_config"].items():
                if v is not None:
                    out[("cross", model, t, f"c{cfg}")] = (float(v), "ms", False)
    if not d.get("sweep") and not d.get("crossover"):
        for r in d.get("rows", []):
            if r.get("ours_us") is not None:
                out[("decode", r["model"], int(r["tokens"]), "ours")] = (float(r["ours_us"]), "us", False)
    return out


def load(out_dir: str) -> dict[str, dict[int, dict[Key, tuple[float, str, bool]]]]:
    """side -> round -> that round's points (every moe_*.json of the round's folder)."""
    sides: dict[str, dict[int, dict[Key, tuple[float, str, bool]]]] = {"patched": {}, "main": {}}
    for folder in sorted(glob.glob(os.path.join(out_dir, "*_*"))):
        side, _, r = os.path.basename(folder).rpartition("_")
        if side not in sides or not r.isdigit() or not os.path.isdir(folder):
            continue
        merged: dict[Key, tuple[float, str, bool]] = {}
        for f in sorted(glob.glob(os.path.join(folder, "moe_*.json"))):
            with open(f) as fh:
                merged.update(points(json.load(fh)))
        if merged:
            sides[side][int(r)] = merged
    return sides


def round_lines(folder: str) -> list[str]:
    """One round's figures (gpu_patch_ab.sh prints them as each round ends): every point of its
    moe_*.json files, then each file's correctness checks (path, tokens, relative error)."""
    lines = []
    for f in sorted(glob.glob(os.path.join(folder, "moe_*.json"))):
        with open(f) as fh:
            d = json.load(fh)
        for (kind, model, t, what), (v, unit, _) in sorted(points(d).items()):
            lines.append(f"  {kind:<6} {model:>4} T={t:<6} {what:<7} {v:.4f} {unit}")
        checks = [(c.get("path"), c.get("tokens"), c.get("rel_err")) for c in d.get("correctness", [])]
        lines.append(f"  correctness: {checks}")
    return lines


def summarize(sides) -> list[dict]:
    keys = sorted({k for rounds in sides.values() for pts in rounds.values() for k in pts})
    rows = []
    for k in keys:
        vals = {s: {r: pts[k] for r, pts in rounds.items() if k in pts} for s, rounds in sides.items()}
        if not vals["patched"] or not vals["main"]:
            continue
        unit, higher = next(iter(vals["main"].values()))[1:]
        med = {s: statistics.median(v[0] for v in vals[s].values()) for s in vals}
        spread = {s: max(v[0] for v in vals[s].values()) / min(v[0] for v in vals[s].values()) - 1 for s in vals}
        paired = sorted(set(vals["patched"]) & set(vals["main"]))
        better = sum(
            (vals["patched"][r][0] > vals["main"][r][0]) if higher else (vals["patched"][r][0] < vals["main"][r][0])
            for r in paired
        )
        rows.append(
            {
                "kind": k[0], "model": k[1], "tokens": k[2], "what": k[3], "unit": unit,
                "higher_is_better": higher, "patched": med["patched"], "main": med["main"],
                "change": med["patched"] / med["main"] - 1,
                "spread_patched": spread["patched"], "spread_main": spread["main"],
                "rounds": len(paired), "patched_better": better,
            }
        )  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{'kind':<6} {'model':>5} {'T':>6} {'what':<7} {'patched':>10} {'main':>10} {'change':>8} "
        f"{'spread p/m':>13} {'better':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r['kind']:<6} {r['model']:>5} {r['tokens']:>6} {r['what']:<7} {r['patched']:>10.4f} {r['main']:>10.4f} "
            f"{100 * r['change']:>+7.1f}% {100 * r['spread_patched']:>5.1f}/{100 * r['spread_main']:<5.1f}% "
            f"{r['patched_better']:>3}/{r['rounds']:<3}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="gpu_patch_ab.sh's OUT_DIR (patched_<r>/, main_<r>/)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--round", action="store_true", help="out_dir is one round's folder: print its points")
    args = ap.parse_args(argv)
    if args.round:
        print("\n".join(round_lines(args.out_dir)))
        return 0
    rows = summarize(load(args.out_dir))
    if not rows:
        print(f"no paired points under {args.out_dir}", file=sys.stderr)
        return 1
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
