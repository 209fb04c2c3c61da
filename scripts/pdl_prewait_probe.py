#!/usr/bin/env python3
"""Does a kernel that loads before its griddepcontrol.wait slow a CUDA-graph-replayed chain?

A diagnostic for issues 4 and 9, not a product kernel. Twice a kernel of ours that issued
loads of data the previous grid does not write before its `griddepcontrol.wait` was faster in
bench/moe.py (which launches without CUDA graphs) but slower end to end, where decode steps
replay as CUDA graphs: the qkv head and the attention on the H100 (2026-11-23, -11 % at 20b
batch 1) and the routed one-token down on the H200 (2026-11-29, v26, -15 %). This probe takes
MAX and our kernels out of it: `scripts/pdl_prewait_probe.cu` chains, 24 times, stand-ins for a
layer's gate_up, down and next qkv head (weight streams of the same sizes, grids and
occupancy; bench/NOTES.md has the shapes), with the down's first loads before or after its
wait, launched on a stream or replayed as a graph, with and without PDL, and with and without
the head after the down. A pathology of pre-wait loads under graphs shows as `pre` 1 slower
than 0 in the graph rows only. In graph replay it also times PDL on some launches only (`mask`:
1 the gate_up stand-in, 2 the down, 4 the head) and every kernel signalling its dependents after
its weight stream instead of at its start (`late`): which edges PDL helps and which it hurts.

On the H200 (2026-11-30) it found no such pathology: the pre-wait loads saved 0.5-0.8 µs per
layer everywhere. The e2e losses turned out to be the e2e bench's two step-time modes (v26 ran
at 600 tok/s in the fast one), so v26 is on main. `--soak N` replays the chain N times back to
back with the GPU's clocks sampled, to see whether replay times are bimodal below MAX too.

Builds the probe with nvcc for sm_90a, runs it, prints a table and writes
<out>/pdl_prewait_probe_<gpu>_<yyyymmdd>.json. Needs nvcc and an sm_90 GPU (not MAX or torch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from probe_common import write_result  # noqa: E402

SOURCE = HERE / "pdl_prewait_probe.cu"


def build(work: Path, nvcc: str = "nvcc") -> Path:
    exe = work / "pdl_prewait_probe"
    subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90a", str(SOURCE), "-o", str(exe)], check=True)
    return exe


def table(result: dict) -> str:
    """The probe's rows as a table. A pre-wait row is compared with its wait-first twin; a row with
    PDL on some launches only (`mask`: 1 gate_up, 2 down, 4 head) or late signals with the same
    chain and PDL on every launch."""
    rows = result["rows"]

    def key(r: dict) -> tuple:
        return r["head"], r["graph"], r.get("mask", 7 if r["pdl"] else 0), r.get("late", 0)

    base = {key(r): r["us_per_layer"] for r in rows if not r["pre"]}
    lines = [
        f"{result['device']}, {result['layers']} layers; µs per layer (median; min-max)",
        f"{'head':>4s} {'launch':>6s} {'pdl':>4s} {'down':>10s} {'signal':>6s} {'µs':>8s} {'range':>15s}"
        f" {'vs twin':>8s}",
    ]
    for r in rows:
        head, graph, mask, late = key(r)
        every = 7 if head else 3  # PDL on every launch of the chain: without the head, 2 kernels
        mask &= every
        on_all = mask == every
        twin = None
        if r["pre"]:
            twin = base.get(key(r))
        elif (mask and not on_all) or late:
            twin = base.get((r["head"], graph, 7, 0), base.get((r["head"], graph, 3, 0)))
        delta = f"{r['us_per_layer'] - twin:+.2f}" if twin is not None else ""
        pdl = "on" if on_all else "off" if not mask else f"m{mask}"
        lines.append(
            f"{'yes' if head else 'no':>4s} {'graph' if graph else 'stream':>6s} {pdl:>4s} "
            f"{'pre-wait' if r['pre'] else 'wait first':>10s} {'late' if late else 'start':>6s} "
            f"{r['us_per_layer']:8.2f} {r['min_us']:7.2f}-{r['max_us']:<7.2f} {delta:>8s}"
        )
    return "\n".join(lines)


def soak_summary(us: list[float]) -> dict:
    """A soak's replay times (µs per layer): quantiles, and the share of replays more than 15 %
    above the fastest tenth's (the e2e bench's slow mode was +29 %: ~2.14 against ~1.66 ms)."""
    v = sorted(us)
    q = {f"p{k}": v[min(len(v) - 1, len(v) * k // 100)] for k in (1, 10, 50, 90, 99)}
    slow = sum(1 for x in us if x > 1.15 * q["p10"])
    return {**q, "max": v[-1], "replays": len(v), "slow_share": slow / len(v)}


def soak(exe: Path, replays: int) -> dict:
    """Run `exe soak replays` while sampling the GPU's clocks and throttle reasons (nvidia-smi,
    every ~0.1 s)."""
    import threading
    import time

    from gptoss_max.e2e import gpu_state

    samples: list[dict] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            state = gpu_state()
            if state:
                samples.append({"t": round(time.perf_counter() - t0, 3), **state})
            done.wait(0.1)

    t0 = time.perf_counter()
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        out = subprocess.run([str(exe), "soak", str(replays)], check=True, capture_output=True, text=True).stdout
    finally:
        done.set()
        th.join()
    res = json.loads(out)
    res["summary"] = soak_summary(res["soak_us_per_layer"])
    res["gpu_samples"] = samples
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default: bench/results)")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--runs", type=int, default=2, help="runs of the whole probe (each times every variant)")
    ap.add_argument(
        "--soak",
        type=int,
        default=0,
        help="instead: replay the chain (head, PDL on every launch) this many times back to back and report"
        " the spread of replay times with the GPU's clocks sampled meanwhile (~0.67 ms a replay on an H200)",
    )
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp), args.nvcc)
        if args.soak:
            res = soak(exe, args.soak)
            summary = res["summary"]
            print(
                f"{res['device']}: {summary['replays']} replays, µs per layer "
                + ", ".join(f"{k} {summary[k]:.2f}" for k in ("p1", "p10", "p50", "p90", "p99", "max"))
                + f"; {100 * summary['slow_share']:.1f} % over 1.15 x p10"
            )
            clocks = sorted(
                {(x["clocks.sm"], x["clocks.mem"], x["clocks_throttle_reasons.active"]) for x in res["gpu_samples"]}
            )
            print(f"clocks seen (sm, mem, throttle reasons): {clocks}")
            path = write_result(args.out, "pdl_soak_probe", res["device"], "pdl_prewait_probe.py", argv, res)
            print(f"wrote {path}")
            return 0
        for _ in range(args.runs):
            out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out))
    for res in results:
        print(table(res))
    path = write_result(
        args.out, "pdl_prewait_probe", results[0]["device"], "pdl_prewait_probe.py", argv, {"runs": results}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
