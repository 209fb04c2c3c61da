"""What the GPU probes under scripts/ share (gpu_mem_probe, l2_prefetch_probe, pdl_preload_probe):
timing a chain of launches as a replayed CUDA graph, and writing the result JSON the way the
benches do (device, date, the exact command, then the probe's own fields)."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path


def probe_parser(doc: str | None, rotate: str, rotate_default: int, rotate_help: str) -> argparse.ArgumentParser:
    """The options every CuPy probe takes: `--out`, `--reps` and `--chain` of the replayed graph,
    and `--<rotate>`, how many copies of its data it rotates through (their total beyond L2)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default: bench/results)")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays per variant (median taken)")
    ap.add_argument("--chain", type=int, default=20, help="launches per replayed graph")
    ap.add_argument(f"--{rotate}", type=int, default=rotate_default, help=rotate_help)
    return ap


def open_gpu():
    """(cupy, torch, the GPU's properties, its copy bandwidth in TB/s measured as bench/moe.py
    measures it), or None after saying what is missing. The caller has bench/ on sys.path."""
    try:
        import cupy as cp
        import torch
    except ImportError:
        print("needs CuPy and torch with a CUDA GPU", file=sys.stderr)
        return None
    from moe import copy_bandwidth  # bench/moe.py

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    copy_tb_s = copy_bandwidth(torch)
    torch.cuda.empty_cache()
    return cp, torch, props, copy_tb_s


def graph_us_per_launch(cp, launch: Callable[[int], None], warm: int, chain: int, reps: int) -> float:
    """Median us per iteration over `reps` replays of a CUDA graph of `chain` iterations
    (`launch(i)` enqueues iteration i on the current stream): host launch costs out, the GPU's
    gaps between dependent kernels in, as in a captured decode step. `warm` iterations run
    uncaptured first."""
    stream = cp.cuda.Stream(non_blocking=True)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        for i in range(warm):
            launch(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(chain):
            launch(i)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        per = []
        for _ in range(reps):
            ev0.record(stream)
            graph.launch(stream)
            ev1.record(stream)
            ev1.synchronize()
            per.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / chain)
    return statistics.median(per)


def write_result(out: str, prefix: str, device: str, script: str, argv: list[str] | None, fields: dict) -> Path:
    """<out>/<prefix>_<gpu>_<yyyymmdd>.json with device, date and command first, then `fields`."""
    from gptoss_max.e2e import device_slug

    today = datetime.date.today()
    args = argv if argv is not None else sys.argv[1:]
    result = {"device": device, "date": today.isoformat(), "command": f"python3 scripts/{script} " + " ".join(args)}
    result.update(fields)
    path = Path(out) / f"{prefix}_{device_slug(device)}_{today.strftime('%Y%m%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
