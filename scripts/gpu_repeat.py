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

To find which piece is not repeatable, `--variant NAME:SETTING=VALUE,...` (repeatable) runs the
same check once per variant, each in its own process with those run settings (`settings.py`: the
GPU kernel each piece of the model uses), and `--prefills N` adds N prefill-only passes of A whose
logits must all equal the first one bitwise: a rate per variant, cheap next to a compile. Every third
pass follows a greedy run of B, so a difference that only follows B points at state left behind.
`--deadline` bounds the whole run (a variant that would start too late is skipped, and says so).

    export PYTHONPATH=<staged MAX site>:$PWD/src PYTHONUNBUFFERED=1 GPTOSS_MAX_CACHE=<tokenizer cache>
    python3 scripts/gpu_repeat.py --out $OUT                       # synthetic:20b, capture off and on
    python3 scripts/gpu_repeat.py --out $OUT --capture off --prefills 30 --forced-runs 4 --deadline 560 \
        --variant default --variant moe_decode:GPTOSS_MAX_MOE_PATH=decode
    python3 scripts/gpu_repeat.py --device cpu --model synthetic:tiny --capture off --out DIR   # smoke

Writes `<out>/repeat_<gpu>_<yyyymmdd>.json`; exit status 1 if any run or pass of A differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gptoss_max.settings import RUN_SETTINGS


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


# What a variant may set: the run settings and the kernels' own switches (read in Mojo).
VARIANT_SETTINGS = (
    *RUN_SETTINGS,
    "GPTOSS_MAX_PDL",
    "GPTOSS_MAX_ATTN_ONE_WARPS",
    "GPTOSS_MAX_ROUTE_ORDER",
    "GPTOSS_MAX_POISON",
    "GPTOSS_MAX_SCRUB",
    "GPTOSS_MAX_TAP",
    # MAX's own debug switches (max.engine DebugConfig), e.g. `device-sync-mode` (every device op
    # waits for the one before: a race goes away), `assert-level=all` (bounds checks in MAX's
    # kernels) or `uninitialized-read-check+uninitialized-read-mode=report` (fresh allocations
    # poisoned, loads of unwritten memory reported): in a variant `+` stands for MODULAR_DEBUG's comma
    "MODULAR_DEBUG",
)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`name` or `name:SETTING=VALUE,SETTING=VALUE` -> (name, settings)."""
    name, _, rest = text.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"variant name must be letters, digits, _ or -: {text!r}")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in VARIANT_SETTINGS:
            raise ValueError(f"bad setting {item!r} in variant {text!r}: SETTING=VALUE with SETTING one of "
                             f"{', '.join(VARIANT_SETTINGS)}")  # fmt: skip
        env[key] = value.replace("+", ",") if key == "MODULAR_DEBUG" else value
    return name, env


def compare_passes(passes: list[np.ndarray], after_other: list[bool] | None = None) -> dict[str, Any]:
    """Logits of repeated passes [steps, V] against the first: which differ, at which first step
    (0: the prompt's own step), by how much; with `after_other`, whether another prompt ran just
    before that pass (a difference that follows it points at state a request leaves behind)."""
    first = passes[0]
    differ = []
    for i, p in enumerate(passes[1:], 1):
        if not np.array_equal(first, p):
            steps = np.flatnonzero(np.any(first != p, axis=-1))
            row = {"pass": i, "first_step": int(steps[0]), "max_abs_diff": float(np.max(np.abs(first - p)))}
            differ.append(row if after_other is None else {**row, "after_other": after_other[i]})
    out: dict[str, Any] = {"passes": len(passes), "differ": differ}
    if after_other is not None:
        out["after_other"] = [i for i, flag in enumerate(after_other) if flag]
    return out


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
        passes = [max_logits(engine, a, forced) for _ in range(max(args.forced_runs, 2))]
        forced_cmp = compare_passes(passes)
        out["logits"] = {
            "bitwise_equal": not forced_cmp["differ"],
            "max_abs_diff": max((d["max_abs_diff"] for d in forced_cmp["differ"]), default=0.0),
            "top2_margin": top2_margins(passes[0]),
            **forced_cmp,
        }
        if args.prefills:
            # Every third pass follows a greedy run of B, which leaves other K/V in the cache pages
            # past A's prompt: does A's prompt step depend on what ran before it?
            passes, after = [], []
            for i in range(args.prefills):
                after.append(i % 3 == 2)
                if after[-1]:
                    greedy(b, seed=1000 + i)
                passes.append(max_logits(engine, a, []))
            out["prefill"] = compare_passes(passes, after)
    except Exception as exc:  # logits processors need the host every step; graph capture may refuse them
        out["logits"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    Path(args.save).write_text(json.dumps(out))
    return 0


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Where each later run of A first differs from the first one, and the margin there; whether
    every teacher-forced and prefill-only pass gave the first pass's logits bitwise."""
    runs = run["runs"]
    base = runs[0]["tokens"]
    b_at = [r["prompt"] for r in runs].index("B")
    logits = run.get("logits", {})
    margins = logits.get("top2_margin")
    diffs = []
    for i, r in enumerate(runs[1:], 1):
        if r["prompt"] != "A":
            continue
        at = first_difference(base, r["tokens"])
        margin = margins[at] if margins is not None and at is not None and at < len(margins) else None
        diffs.append({"run": i, "after_b": i > b_at, "first_difference": at, "top2_margin_there": margin})
    same_logits = logits.get("bitwise_equal") is not False and not run.get("prefill", {}).get("differ")
    return {"repeatable": all(d["first_difference"] is None for d in diffs), "logits_repeatable": same_logits,
            "differences": diffs}  # fmt: skip


def run_mode(args: argparse.Namespace, mode: str, out: Path, env: dict[str, str], timeout: float | None):
    """One graph-capture mode in its own process (one pipeline per process, `env` added to this
    one's environment); its summarized runs."""
    save, log = out / f"repeat_{mode}.json", out / f"repeat_{mode}.log"
    cmd = [sys.executable, __file__, "--worker", mode, "--save", str(save), "--model", args.model, "--device",
           args.device, "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--repeats",
           str(args.repeats), "--seed", str(args.seed), "--forced-runs", str(args.forced_runs), "--prefills",
           str(args.prefills), "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc: int | str = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                           env={**os.environ, **env}).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        return {"error": f"exit {rc}", "log_tail": log.read_text(errors="replace").strip().splitlines()[-5:]}
    run = json.loads(save.read_text())
    if env.get("GPTOSS_MAX_TAP") in ("on", "weights"):
        run["taps"] = taps_summary(log.read_text(errors="replace"))
    return {**run, **summarize(run), "seconds": round(time.perf_counter() - t0, 1)}


def taps_summary(log: str) -> dict[str, Any]:
    """Where runs of the same step first differ, from a `GPTOSS_MAX_TAP=on` worker's log
    (kernels/tap.mojo): the taps print `gptoss_tap <tag> <elements> <hash>` once each at every step,
    and the graph build `gptoss_tap_label <tag> <label>`. Steps are grouped by their first activation
    tap (the step's size and layer 0's qkv, i.e. its tokens); in the largest group of multi-token
    steps (the prompt's passes) each step is compared with the first, tap by tap in tag order.
    With `GPTOSS_MAX_TAP=weights`, `weights` says which weight or bias taps changed between steps."""
    import re
    from collections import Counter

    labels = {int(t): lab for t, lab in re.findall(r"^gptoss_tap_label (\d+) (.+)$", log, re.M)}
    # A step's taps may run in any order (a graph runs independent ops as it likes): a step ends
    # where a tag comes again. Steps are compared in tag (build) order.
    runs: list[dict[int, tuple[int, int]]] = []  # per step: tag -> (elements, hash)
    for t, n, h in re.findall(r"gptoss_tap (\d+) (\d+) (\d+)", log):
        if not runs or int(t) in runs[-1]:
            runs.append({})
        runs[-1][int(t)] = (int(n), int(h))
    # GPTOSS_MAX_TAP=weights: the same at every step unless something writes into them
    fixed = {t for t, lab in labels.items() if lab.startswith(("weight ", "bias "))}
    changed = {labels[t] for t in fixed if len({run[t][1] for run in runs if t in run}) > 1}  # by hash
    extra = {"weights": {"tapped": len(fixed), "changed": sorted(changed)}} if fixed else {}
    key = min((t for t in labels if t not in fixed), default=0)  # the first activation tap
    groups: dict[tuple[int, int], list[dict[int, tuple[int, int]]]] = {}
    for run in runs:
        if key in run and run[key][0] > 0:
            groups.setdefault(run[key], []).append(run)
    sizes = sorted({n for n, _h in groups})
    # per step size (elements at the first tap), how many different first taps: > 1 for the prompt's
    # size means its passes already differ at the first tap, or that another prompt has that size
    by_size = {str(n): sum(1 for m, _h in groups if m == n) for n in sizes}
    multi = [g for (n, _h), g in groups.items() if len(g) > 1 and (n > sizes[0] or len(sizes) == 1)]
    if not multi:
        return {"steps": len(runs), "labels": len(labels), "first_taps_by_size": by_size, "compared": 0, **extra}
    group = max(multi, key=len)
    first = group[0]
    diffs = []
    for j, run in enumerate(group[1:], 1):
        tag = next((t for t in sorted(run) if first.get(t, (0, None))[1] != run[t][1]), None)  # by hash, in tag order
        diffs.append({"pass": j, "first_tap": tag, "label": labels.get(tag) if tag is not None else None})
    where = Counter(d["label"] for d in diffs if d["label"] is not None)
    return {"steps": len(runs), "labels": len(labels), "first_taps_by_size": by_size, "compared": len(group),
            "first_differing": dict(where), "passes": diffs, **extra}  # fmt: skip


def describe(mode: dict[str, Any]) -> str:
    if "error" in mode:
        return f"{mode['error']}: {mode['log_tail'][-1:]}"
    if "skipped" in mode:
        return f"skipped: {mode['skipped']}"
    logits = {k: v for k, v in mode["logits"].items() if k != "top2_margin"}
    prefill = f", prefill passes {mode['prefill']}" if "prefill" in mode else ""
    tap_info = {k: v for k, v in mode.get("taps", {}).items() if k != "passes"}
    taps = f", taps {tap_info}" if "taps" in mode else ""
    return f"repeatable {mode['repeatable']}, {mode['differences']}, logits {logits}{prefill}{taps}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:20b", help="synthetic:<preset>[,...] or a checkpoint dir")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--capture", choices=["off", "on", "both"], default="both", help="device graph capture")
    ap.add_argument("--prompt-len", type=int, default=69, help="random prompt tokens (the server's 'Hello!': 69)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of prompt A before prompt B")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--forced-runs", type=int, default=2, help="teacher-forced passes along A's first run (>= 2)")
    ap.add_argument("--prefills", type=int, default=0, help="prefill-only passes of A, compared bitwise")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME[:SETTING=VALUE,...]",
                    help="run the check once per variant, with these settings (default: one, 'default')")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=None, help="seconds for each mode's process")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run: later modes are skipped")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--worker", choices=["off", "on"], help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.capture != "off" and args.device == "cpu":
        ap.error("graph capture needs a GPU")
    try:
        variants = dict(parse_variant(v) for v in args.variant or ["default"])
    except ValueError as exc:
        ap.error(str(exc))
    if len(variants) != len(args.variant or ["default"]):
        ap.error("variant names must differ")
    from gptoss_max.e2e import device_slug, gpu_name

    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    name = gpu_name() if args.device == "gpu" else None
    path = args.out / f"repeat_{device_slug(name)}_{datetime.date.today():%Y%m%d}.json"
    command = " ".join(["python3", "scripts/gpu_repeat.py", *(sys.argv[1:] if argv is None else argv)])
    result: dict[str, Any] = {"device": name or "cpu", "date": datetime.date.today().isoformat(), "command": command,
                              "model": args.model, "prompt_len": args.prompt_len, "tokens": args.tokens,
                              "variants": {}}  # fmt: skip
    ok = True
    for vname, env in variants.items():
        entry: dict[str, Any] = {"settings": env, "modes": {}}
        result["variants"][vname] = entry
        out = args.out / vname if len(variants) > 1 else args.out
        out.mkdir(parents=True, exist_ok=True)
        for mode in ["off", "on"] if args.capture == "both" else [args.capture]:
            left = None if args.deadline is None else args.deadline - (time.perf_counter() - start)
            if left is not None and left < 30:
                entry["modes"][mode] = {"skipped": f"{args.deadline:.0f} s deadline reached"}
                ok = False
            else:
                limits = [t for t in (args.timeout, left) if t is not None]
                timeout = min(limits) if limits else None
                entry["modes"][mode] = run_mode(args, mode, out, env, timeout)
                m = entry["modes"][mode]
                ok &= bool(m.get("repeatable", False) and m.get("logits_repeatable", False))
            print(f"{vname}, graph capture {mode}: {describe(entry['modes'][mode])}", flush=True)
            path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
