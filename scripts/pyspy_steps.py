#!/usr/bin/env python3
"""Where a decode step's host time goes, from a py-spy profile of an e2e worker.

Reads py-spy's raw (collapsed) output (`py-spy record --threads --format raw`, plain or .gz),
keeps the main thread's samples inside the step (stacks that pass through --within), and prints
the call tree from --root down: each frame's share of the step's samples and, given the step's
host time (--step-ms), its share in ms. Frames below --min percent are left out.

    py-spy record --rate 400 --threads --format raw -o prof.txt -- \\
        python3 -m gptoss_max.e2e --worker-out w.json --arch ours --model synthetic:20b \\
        --device gpu --batch 1 --worker-graph-capture
    scripts/pyspy_steps.py prof.txt --step-ms 1.44

(bench/NOTES.md, "Fourteenth session": the 20b's replayed step on the H200.) py-spy stops the
process for each sample, so the profiled run is slower than a plain one; the shares, not the
times, are what it measures.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path
from typing import Any

_LINE = re.compile(r" \((?:[^()]*/)?([^/():]*)(?::\d+)?\)")


def frame_name(frame: str) -> str:
    """`f (pkg/mod.py:12)` -> `f (mod.py)`: a function's samples, whatever its line."""
    return _LINE.sub(r" (\1)", frame)


def read_stacks(path: Path, within: str, thread: str = "MainThread") -> list[tuple[list[str], int]]:
    opener = gzip.open if path.suffix == ".gz" else open
    stacks = []
    with opener(path, "rt") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit() or thread not in stack.split(";", 1)[0]:
                continue
            frames = [frame_name(f) for f in stack.split(";")]
            if any(within in f for f in frames):
                stacks.append((frames, int(count)))
    return stacks


def tree(stacks: list[tuple[list[str], int]], root: str) -> dict[str, Any]:
    """Nested {frame: {"_n": samples, child: ...}} from the first frame starting with `root` (a
    stack without it counts at the top, as its own last frame)."""
    top: dict[str, Any] = {"_n": 0}
    for frames, n in stacks:
        start = next((i for i, f in enumerate(frames) if f.startswith(root)), len(frames) - 1)
        node = top
        node["_n"] += n
        for f in frames[start:]:
            node = node.setdefault(f, {"_n": 0})
            node["_n"] += n
    return top


def render(node: dict[str, Any], total: int, step_ms: float | None, min_pct: float, depth: int = 0) -> list[str]:
    lines = []
    kids = sorted(((k, v) for k, v in node.items() if k != "_n"), key=lambda kv: -kv[1]["_n"])
    for name, child in kids:
        pct = 100 * child["_n"] / total
        if pct < min_pct:
            continue
        ms = f" {step_ms * pct / 100:6.3f} ms" if step_ms else ""
        lines.append(f"{pct:5.1f} %{ms}  {'  ' * depth}{name}")
        lines += render(child, total, step_ms, min_pct, depth + 1)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path, help="py-spy raw output (.txt or .txt.gz)")
    ap.add_argument(
        "--within", default="run_batch.<locals>.step", help="keep stacks through a frame holding this (no line numbers)"
    )
    ap.add_argument("--root", default="OverlapTextGenerationPipeline._execute", help="the tree starts here")
    ap.add_argument("--step-ms", type=float, default=None, help="the step's host time, to show ms too")
    ap.add_argument("--min", type=float, default=1.2, help="leave out frames under this percent")
    args = ap.parse_args(argv)
    stacks = read_stacks(args.profile, args.within)
    if not stacks:
        print(f"no main-thread samples through {args.within!r} in {args.profile}", file=sys.stderr)
        return 1
    top = tree(stacks, args.root)
    print(f"{top['_n']} samples of the main thread inside {args.within}")
    print("\n".join(render(top, top["_n"], args.step_ms, args.min)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
