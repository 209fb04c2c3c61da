"""Is greedy decoding repeatable? The same prompt through our pipeline several times, with and
without device graph capture, and the logits behind any difference.

On an H200 (2026-11-29) the server gave two different answers to the same `temperature: 0`
request (bench/NOTES.md, "H200 baseline"); on the CPU it is repeatable. This separates the
candidates: per graph-capture mode, one process runs prompt A `--repeats` times, then another
prompt B, then A again (state a request leaves behind), each greedy with EOS ignored, and records
where each run of A first leaves the first one. Then it takes A's teacher-forced logits twice along
the first run's tokens: whether they are bitwise equal, and the top-2 margin at each divergence
(a near-tie flipped by rounding, or a real difference). Each run samples with its own seed, as the
server draws one per request; top-k 1 must make that irrelevant.

    export PYTHONPATH=<staged MAX site>:$PWD/src PYTHONUNBUFFERED=1 GPTOSS_MAX_CACHE=<tokenizer cache>
    python3 scripts/gpu_repeat.py --out $OUT                       # synthetic:20b, capture off and on
    python3 scripts/gpu_repeat.py --device cpu --model synthetic:tiny --capture off --out DIR   # smoke

Writes `<out>/repeat_<gpu>_<yyyymmdd>.json`; exit status 1 if a run of A differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margins(logits: np.ndarray) -> list[float]:
    """Per step, the gap between the largest and the second largest logit."""
    top = np.sort(logits, axis=-1)[:, -2:]
    return [round(float(m), 6) for m in top[:, 1] - top[:, 0]]


def worker(args: argparse.Namespace) -> int:
    """Subprocess: one pipeline, one graph-capture mode; writes its runs to --save."""
    import logging

    from gptoss_max import maxapi
    from gptoss_max.e2e import prompts
    from gptoss_max.engine import Engine, EngineOptions
    from gptoss_max.fidelity import max_logits

    logging.basicConfig(level=logging.WARNING)
    capture = args.worker == "on"
    engine = Engine(EngineOptions(model=args.model, device=args.device, max_batch_size=1,
                                  max_length=args.prompt_len + args.tokens + 16, graph_capture=capture))  # fmt: skip
    a, b = prompts(2, args.prompt_len, args.seed)

    def greedy(ids: list[int], seed: int) -> list[int]:
        params = maxapi.SamplingParams(top_k=1, max_new_tokens=args.tokens, ignore_eos=True, detokenize=False,
                                       seed=seed)  # fmt: skip
        return list(engine.run(ids, params))

    out: dict[str, Any] = {"graph_capture": capture, "runs": []}
    for i, name in enumerate(["A"] * args.repeats + ["B", "A"]):
        # a new sampling seed per run, as the server draws one per request: greedy must not depend on it
        out["runs"].append({"prompt": name, "seed": i, "tokens": greedy(a if name == "A" else b, seed=i)})
    forced = out["runs"][0]["tokens"][:-1]
    try:
        first, second = max_logits(engine, a, forced), max_logits(engine, a, forced)
        out["logits"] = {
            "bitwise_equal": bool(np.array_equal(first, second)),
            "max_abs_diff": float(np.max(np.abs(first - second))),
            "top2_margin": top2_margins(first),
        }
    except Exception as exc:  # logits processors need the host every step; graph capture may refuse them
        out["logits"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    Path(args.save).write_text(json.dumps(out))
    return 0


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Where each later run of A first differs from the first one, and the margin there."""
    runs = run["runs"]
    base = runs[0]["tokens"]
    b_at = [r["prompt"] for r in runs].index("B")
    margins = run.get("logits", {}).get("top2_margin")
    diffs = []
    for i, r in enumerate(runs[1:], 1):
        if r["prompt"] != "A":
            continue
        at = first_difference(base, r["tokens"])
        margin = margins[at] if margins is not None and at is not None and at < len(margins) else None
        diffs.append({"run": i, "after_b": i > b_at, "first_difference": at, "top2_margin_there": margin})
    return {"repeatable": all(d["first_difference"] is None for d in diffs), "differences": diffs}


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One graph-capture mode in its own process (one pipeline per process); its summarized runs."""
    save, log = args.out / f"repeat_{mode}.json", args.out / f"repeat_{mode}.log"
    cmd = [sys.executable, __file__, "--worker", mode, "--save", str(save), "--model", args.model, "--device",
           args.device, "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--repeats",
           str(args.repeats), "--seed", str(args.seed), "--out", str(args.out)]  # fmt: skip
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc: int | str = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        return {"error": f"exit {rc}", "log_tail": log.read_text(errors="replace").strip().splitlines()[-5:]}
    run = json.loads(save.read_text())
    return {**run, **summarize(run), "seconds": round(time.perf_counter() - t0, 1)}


def describe(mode: dict[str, Any]) -> str:
    if "error" in mode:
        return f"{mode['error']}: {mode['log_tail'][-1:]}"
    logits = {k: v for k, v in mode["logits"].items() if k != "top2_margin"}
    return f"repeatable {mode['repeatable']}, {mode['differences']}, logits {logits}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:20b", help="synthetic:<preset>[,...] or a checkpoint dir")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--capture", choices=["off", "on", "both"], default="both", help="device graph capture")
    ap.add_argument("--prompt-len", type=int, default=69, help="random prompt tokens (the server's 'Hello!': 69)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of prompt A before prompt B")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=None, help="seconds for each mode's process")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--worker", choices=["off", "on"], help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.capture != "off" and args.device == "cpu":
        ap.error("graph capture needs a GPU")
    from gptoss_max.e2e import device_slug, gpu_name

    args.out.mkdir(parents=True, exist_ok=True)
    name = gpu_name() if args.device == "gpu" else None
    path = args.out / f"repeat_{device_slug(name)}_{datetime.date.today():%Y%m%d}.json"
    command = " ".join(["python3", "scripts/gpu_repeat.py", *(sys.argv[1:] if argv is None else argv)])
    result: dict[str, Any] = {"device": name or "cpu", "date": datetime.date.today().isoformat(), "command": command,
                              "model": args.model, "prompt_len": args.prompt_len, "tokens": args.tokens,
                              "modes": {}}  # fmt: skip
    ok = True
    for mode in ["off", "on"] if args.capture == "both" else [args.capture]:
        result["modes"][mode] = run_mode(args, mode)
        ok &= result["modes"][mode].get("repeatable", False)
        print(f"graph capture {mode}: {describe(result['modes'][mode])}", flush=True)
        path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
