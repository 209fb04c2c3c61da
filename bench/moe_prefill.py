#!/usr/bin/env python3
"""MXFP4 MoE prefill on the GPU (issue 5): our grouped GEMM against MAX's
stock MXFP4 path and a dense bf16 matmul of the same FLOPs.

Run as `python3 bench/moe.py --prefill [options]` (or this file). For 120b
(E=128) and 20b (E=32) shapes (H = I = 2880, top-4), one run measures, in
this order (the JSON is rewritten after each stage, so a crash of our kernel
keeps what the others measured):

  bf16_dense   torch.mm (cuBLAS) [P, H] x [H, 2I] then [P, I] x [I, H], P =
               T * 4 routed rows: the FLOPs of the MoE's two GEMMs;
  max_stock    MAX 26.7's MXFP4 MoE (max/nn/quant_ops.py): moe_create_indices,
               mxfp4_dequant of both whole stacks, grouped_matmul_ragged x2,
               bias, GLU, moe_finalize. Its bf16 grouped matmul does not
               compile on SM90 (docs/GPU.md), so the activations go in as
               float32, the only form that compiles (MAX's naive grouped
               kernel); also its dequant alone (a lower bound on any stock
               step: `stock_dequant_ms`);
  ours         correctness of every tile config (c0..c4 p1 mma.sync, c5..c10
               p2 wgmma; and auto) against a float64
               torch reference (rel err <= 5e-3, fresh inputs), then the time
               per layer: slope of CUDA-event time of a graph of 1 vs 1 + chain
               layers (weights rotated over sets, routing fresh per layer);
               the crossover against the decode kernel at small T (tokens
               per expert = T * 4 / E); last, the tile-config sweep (what a
               --deadline cuts first).

TFLOP/s count 2 * P * H * 2I + 2 * P * I * H (the two GEMMs; SwiGLU, bias and
combine are free). Writes <out>/moe_prefill_<gpu>_<yyyymmdd>.json with rows
{model, tokens, ours_tflops, max_stock_tflops, bf16_dense_tflops,
frac_of_bf16}, the sweep, the crossover and the failures; exits 1 on any
correctness failure (after writing everything).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe as dec  # noqa: E402  (bench/moe.py: sets, routing, float64 reference, timer)

HIDDEN, INTER, TOP_K, MODELS = dec.HIDDEN, dec.INTER, dec.TOP_K, dec.MODELS
REL_TOL = 5e-3
N_CONFIGS = 11  # moe_prefill_gpu.mojo's N_CONFIGS: c0..c4 p1 (mma.sync), c5..c10 p2 (wgmma)
PATH_AUTO, PATH_DECODE = 0, 1


def path_prefill(config: int) -> int:
    return 2 + config


def moe_flops(pairs: int, hidden: int = HIDDEN, inter: int = INTER) -> int:
    """FLOPs of one MoE layer's two GEMMs over `pairs` routed (token, k) rows."""
    return 2 * pairs * hidden * 2 * inter + 2 * pairs * inter * hidden


def tflops(flops: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def pairs_per_expert(tokens: int, experts: int) -> float:
    return tokens * TOP_K / experts


def result_row(model: str, tokens: int, ours_ms, stock_ms, dense_ms) -> dict:
    """The issue's row: TFLOP/s of each and ours / dense bf16."""
    f = moe_flops(tokens * TOP_K)
    ours, stock, dense = tflops(f, ours_ms), tflops(f, stock_ms), tflops(f, dense_ms)
    return {
        "model": model,
        "tokens": tokens,
        "ours_tflops": _r(ours),
        "max_stock_tflops": _r(stock),
        "bf16_dense_tflops": _r(dense),
        "frac_of_bf16": None if ours is None or dense is None else round(ours / dense, 3),
        "x_stock": None if ours is None or stock is None else round(ours / stock, 1),
    }


def crossover(points: list[dict]) -> float | None:
    """Smallest measured pairs per expert from which the prefill path is at
    least as fast as the decode kernel at every larger measured load."""
    pts = sorted(points, key=lambda p: p["pairs_per_expert"])
    best = None
    for p in reversed(pts):
        if p["decode_ms"] is None or p["prefill_ms"] is None or p["prefill_ms"] > p["decode_ms"]:
            break
        best = p["pairs_per_expert"]
    return best


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


# ---------------------------------------------------------------- graphs


def build_ours(layers: int, n_sets: int, device_ref):
    """bench/moe.py's chained-layer graph with the kernel path as its first
    input (a CPU int32 scalar), so one compile serves every path, tile config
    and T."""
    return dec.build_ours(layers, n_sets, device_ref, path_input=True)


def build_stock(experts: int, device_ref):
    """MAX's stock MXFP4 MoE with float32 activations into its grouped matmul."""
    from max.dtype import DType
    from max.graph import Graph, TensorType, ops
    from max.nn.kernels import grouped_matmul_ragged, moe_create_indices, moe_finalize, mxfp4_dequant
    from max.pipelines.architectures.gpt_oss.layers.moe import gptoss_glu_activation

    h, i, bf, f32 = HIDDEN, INTER, DType.bfloat16, DType.float32
    e8 = DType.float8_e8m0fnu
    types = [
        TensorType(bf, ["T", h], device_ref), TensorType(DType.int32, ["T", TOP_K], device_ref),
        TensorType(f32, ["T", TOP_K], device_ref),
        TensorType(DType.uint8, [experts, 2 * i, h // 2], device_ref),
        TensorType(e8, [experts, 2 * i, h // 32], device_ref), TensorType(f32, [experts, 2 * i], device_ref),
        TensorType(DType.uint8, [experts, h, i // 2], device_ref),
        TensorType(e8, [experts, h, i // 32], device_ref), TensorType(f32, [experts, h], device_ref),
    ]  # fmt: skip

    def gmm(a, w, starts, eids, usage):
        return ops.cast(grouped_matmul_ragged(ops.cast(a, f32), w, starts, eids, usage), bf)

    def forward(x, ids, wts, gb, gs, gbias, db, ds, dbias):
        flat = ops.reshape(ids, [-1])
        order, starts, restore, eids, usage = moe_create_indices(flat, experts)
        perm = ops.gather(x, ops.cast(order // TOP_K, DType.int32), axis=0)
        assign = ops.gather(flat, order, axis=0)
        y = gmm(perm, mxfp4_dequant(gb, gs, out_type=bf), starts, eids, usage)
        y = y + ops.cast(ops.gather(gbias, assign, axis=0), bf)
        hh = gptoss_glu_activation(y[:, 0::2], y[:, 1::2])
        d = gmm(hh, mxfp4_dequant(db, ds, out_type=bf), starts, eids, usage)
        d = d + ops.cast(ops.gather(dbias, assign, axis=0), bf)
        return moe_finalize(d, restore, wts, bf)

    return Graph(f"moe_stock_mxfp4_{experts}", forward=forward, input_types=types)


# ---------------------------------------------------------------- timing


def dense_bf16_ms(torch, tokens: int, reps: int) -> float:
    """cuBLAS time of the two GEMMs a layer does, as dense bf16 matmuls."""
    p = tokens * TOP_K
    a = torch.randn(p, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 50
    hh = torch.randn(p, INTER, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / 50
    for _ in range(3):
        torch.mm(a, w1.t())
        torch.mm(hh, w2.t())
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.mm(a, w1.t())
        torch.mm(hh, w2.t())
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


class Ours:
    """Our op in a 1-layer and a (1 + chain)-layer graph, timed by slope."""

    def __init__(self, g_small, g_big, timer, buf, chain: int):
        self.g_small, self.g_big, self.timer, self.buf, self.chain = g_small, g_big, timer, buf, chain

    def path_buf(self, path: int):
        import numpy as np
        from max.driver import Buffer

        return Buffer.from_numpy(np.array(path, dtype=np.int32))

    def run(self, path: int, x, ids, w, set_bufs):
        b = self.buf
        out = self.g_small.execute(self.path_buf(path), b(x), b(ids), b(w), *set_bufs)[0]
        import torch

        return torch.from_dlpack(out).clone()

    def time_ms(self, torch, path: int, tokens: int, experts: int, gen, set_bufs, reps: int) -> float:
        big = 1 + self.chain
        x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        routes = [dec.routing(torch, tokens, experts, gen, "cuda") for _ in range(big)]
        rb = [self.buf(r) for rw in routes for r in rw]
        pb = self.path_buf(path)
        a_small = [pb, self.buf(x), *rb[:2], *set_bufs]
        a_big = [pb, self.buf(x), *rb, *set_bufs]
        return self.timer.slope_ms(self.g_small, a_small, self.g_big, a_big, self.chain, reps, warmup=1)[0]


# ---------------------------------------------------------------- main


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", action="store_true", help="(accepted, for bench/moe.py --prefill)")
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--tokens", default="512,2048,8192,16384", help="T for the result rows")
    ap.add_argument("--configs", default=",".join(str(c) for c in range(N_CONFIGS)), help="tile configs swept")
    ap.add_argument("--sweep-tokens", default="512,2048,8192,16384", help="T of the tile-config sweep")
    ap.add_argument("--cross-tokens", default="16,32,64,128,256,512", help="T of the decode/prefill crossover")
    ap.add_argument("--chain", type=int, default=4, help="extra chained layers for the slope")
    ap.add_argument("--sets", type=int, default=3, help="expert sets rotated over")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stock-reps", type=int, default=1, help="timed stock calls (its naive kernel is slow)")
    ap.add_argument("--stock-max-tokens", type=int, default=16384, help="skip the full stock step above this T")
    ap.add_argument("--stock-max-s", type=float, default=5.0, help="skip larger T once a stock call took this long")
    ap.add_argument("--no-stock", action="store_true")
    ap.add_argument("--deadline", type=float, default=300, help="seconds; sweeps and stock skipped past it")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


class Run:
    """One benchmark run: its devices, graphs, result dict and file."""

    def __init__(self, args, argv):
        import torch
        from max.driver import Buffer

        self.args, self.torch, self.Buffer = args, torch, Buffer
        self.start = time.perf_counter()
        gpu = dec.open_gpu(torch, "bench/moe.py --prefill")
        gpu_name, today = gpu.gpu_name, gpu.today
        self.path = gpu.result_path(args.out, "moe_prefill")
        self.session, self.dref, self.timer = gpu.session, gpu.dref, gpu.timer
        self.gen = torch.Generator(device="cuda").manual_seed(args.seed)
        given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--prefill"]
        cmd = "python3 bench/moe.py --prefill " + " ".join(given)
        self.result = {
            "device": gpu_name, "date": today.isoformat(), "command": cmd,
            "max_version": dec.version_of("max"), "method": __doc__.split("\n\n")[1].strip(), "rows": [],
            "dense_ms": {}, "stock_ms": {}, "stock_dequant_ms": {}, "correctness": [], "sweep": [], "crossover": {},
            "failures": [], "errors": [],
        }  # fmt: skip
        self.g_stock_dq, self.g_stock, self.ours = None, {}, None

    def buf(self, t):
        return self.Buffer.from_dlpack(t.contiguous())

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.path.write_text(json.dumps(self.result, indent=1) + "\n")

    def late(self) -> bool:
        return time.perf_counter() - self.start > self.args.deadline

    def error(self, what: str, exc: Exception) -> None:
        self.result["errors"].append(f"{what}: {exc!r}"[:2000])
        print(f"{what}: {exc!r}"[:2000], flush=True)

    def compile(self, models: list[str]) -> None:
        if not self.args.no_stock:
            try:
                t0 = time.perf_counter()
                self.g_stock_dq = self.session.load(dec.build_stock_dequant(self.dref))
                self.g_stock = {m: self.session.load(build_stock(MODELS[m], self.dref)) for m in models}
                print(f"compiled stock graphs in {time.perf_counter() - t0:.0f} s", flush=True)
            except Exception as exc:  # keep going: ours is the point
                self.error("stock compile", exc)
        t0 = time.perf_counter()
        small = self.session.load(build_ours(1, self.args.sets, self.dref))
        big = self.session.load(build_ours(1 + self.args.chain, self.args.sets, self.dref))
        self.ours = Ours(small, big, self.timer, self.buf, self.args.chain)
        self.result["compile_ours_s"] = round(time.perf_counter() - t0, 1)
        print(f"compiled our graphs in {self.result['compile_ours_s']} s", flush=True)

    def inputs(self, tokens: int, experts: int):
        torch = self.torch
        x = torch.randn(tokens, HIDDEN, generator=self.gen, device="cuda").to(torch.bfloat16)
        return (x, *dec.routing(torch, tokens, experts, self.gen, "cuda"))


def _stock(run: Run, model: str, s0) -> None:
    from max.dtype import DType

    e8, args = DType.float8_e8m0fnu, run.args

    def scales(t):
        return run.buf(t).view(e8, list(t.shape))

    if run.g_stock_dq is not None:
        sargs = [run.buf(s0.gu_blocks), scales(s0.gu_scales), run.buf(s0.dn_blocks), scales(s0.dn_scales)]
        run.result["stock_dequant_ms"][model] = round(statistics.median(run.timer.time_ms(run.g_stock_dq, sargs, 3)), 3)
    if model not in run.g_stock:
        return
    slow = False
    for tokens in sorted(_ints(args.tokens)):
        if tokens > args.stock_max_tokens or run.late() or slow:
            run.result["stock_ms"][f"{model}/{tokens}"] = None
            continue
        try:
            x, ids, w = run.inputs(tokens, MODELS[model])
            a = [*(run.buf(t) for t in (x, ids, w, s0.gu_blocks)), scales(s0.gu_scales), run.buf(s0.gu_bias),
                 run.buf(s0.dn_blocks), scales(s0.dn_scales), run.buf(s0.dn_bias)]  # fmt: skip
            ms = statistics.median(run.timer.time_ms(run.g_stock[model], a, reps=args.stock_reps, warmup=1))
            run.result["stock_ms"][f"{model}/{tokens}"] = round(ms, 3)
            slow = ms > 1e3 * args.stock_max_s
            print(f"stock {model} T={tokens}: {ms:.1f} ms", flush=True)
        except Exception as exc:
            run.error(f"stock {model} T={tokens}", exc)


def _check(run: Run, model: str, sets, set_bufs) -> None:
    """Every config at the sweep's middle T, auto at every row's T."""
    args, torch = run.args, run.torch
    sweep_t = _ints(args.sweep_tokens)
    check_t = sorted(sweep_t)[len(sweep_t) // 2] if sweep_t else 2048
    checks = [(path_prefill(c), check_t) for c in _ints(args.configs)] + [(PATH_AUTO, t) for t in _ints(args.tokens)]
    for path, tokens in checks:
        try:
            x, ids, w = run.inputs(tokens, MODELS[model])
            got = run.ours.run(path, x, ids, w, set_bufs)
            err = dec.rel_err(torch, got, dec.reference(torch, x, ids, w, sets[0]))
        except Exception as exc:
            err = float("inf")
            run.error(f"ours {model} path={path} T={tokens}", exc)
            traceback.print_exc()
        ok = err <= REL_TOL
        entry = {"model": model, "path": path, "tokens": tokens, "rel_err": float(f"{err:.3g}"), "ok": ok}
        run.result["correctness"].append(entry)
        print(json.dumps(entry), flush=True)
        if not ok:
            run.result["failures"].append(f"{model} path={path} T={tokens}: rel err {err:.3g}")


def _timed(run: Run, model: str, set_bufs, path: int, tokens: int, reps: int) -> float | None:
    try:
        return run.ours.time_ms(run.torch, path, tokens, MODELS[model], run.gen, set_bufs, reps)
    except Exception as exc:
        run.error(f"ours time {model} path={path} T={tokens}", exc)
        return None


def _rows(run: Run, model: str, set_bufs) -> None:
    args, res = run.args, run.result
    for tokens in _ints(args.tokens):
        ms = _timed(run, model, set_bufs, PATH_AUTO, tokens, args.reps)
        row = result_row(model, tokens, ms, res["stock_ms"].get(f"{model}/{tokens}"), res["dense_ms"][str(tokens)])
        row["ours_ms"] = None if ms is None else round(ms, 4)
        dq = tflops(moe_flops(tokens * TOP_K), res["stock_dequant_ms"].get(model))
        row["stock_dequant_only_tflops"] = _r(dq)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        run.save()


def _sweep(run: Run, model: str, set_bufs) -> None:
    """Tile configs at the sweep's T."""
    args, res = run.args, run.result
    configs, few = _ints(args.configs), max(2, args.reps // 2)
    for tokens in _ints(args.sweep_tokens):
        for c in configs:
            if run.late():
                break
            ms = _timed(run, model, set_bufs, path_prefill(c), tokens, few)
            tf = _r(tflops(moe_flops(tokens * TOP_K), ms))
            ms = None if ms is None else round(ms, 4)
            res["sweep"].append({"model": model, "tokens": tokens, "config": c, "ms": ms, "tflops": tf})
            print(json.dumps(res["sweep"][-1]), flush=True)
        run.save()


def _crossover(run: Run, model: str, set_bufs) -> None:
    """The decode kernel against each prefill config at small T (what the dispatch rule rests on)."""
    args, res = run.args, run.result
    configs, few = _ints(args.configs), max(2, args.reps // 2)
    points = []
    for tokens in _ints(args.cross_tokens):
        if run.late():
            break
        pt = {"tokens": tokens, "pairs_per_expert": pairs_per_expert(tokens, MODELS[model])}
        pt["decode_ms"] = _timed(run, model, set_bufs, PATH_DECODE, tokens, few)
        by_cfg = {c: _timed(run, model, set_bufs, path_prefill(c), tokens, few) for c in configs}
        good = {c: v for c, v in by_cfg.items() if v is not None}
        pt["prefill_ms"] = min(good.values()) if good else None
        pt["prefill_best_config"] = min(good, key=good.get) if good else None
        pt["prefill_ms_by_config"] = by_cfg
        points.append(pt)
        print(json.dumps(pt), flush=True)
    res["crossover"][model] = {"points": points, "pairs_per_expert": crossover(points)}
    run.save()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = Run(args, argv)
    torch, res = run.torch, run.result
    models = [m for m in args.models.split(",") if m]
    print(f"device {res['device']}", flush=True)
    for tokens in sorted(set(_ints(args.tokens) + _ints(args.sweep_tokens))):
        res["dense_ms"][str(tokens)] = round(dense_bf16_ms(torch, tokens, reps=max(5, args.reps)), 4)
    print("dense bf16 ms:", res["dense_ms"], flush=True)
    run.save()
    run.compile(models)
    sets, bufs = {}, {}
    for model in models:
        sets[model] = [dec.make_set(torch, MODELS[model], HIDDEN, INTER, run.gen, "cuda") for _ in range(args.sets)]
        bufs[model] = [run.buf(tn) for s in sets[model] for tn in s.tensors()]
    # what the issue asks first, for every model; the tuning sweeps after
    for model in models:
        _stock(run, model, sets[model][0])
        run.save()
        _check(run, model, sets[model], bufs[model])
        run.save()
        _rows(run, model, bufs[model])
    # the crossover (the dispatch rule's evidence) before the tuning sweep, so a deadline cuts the sweep
    for model in models:
        _crossover(run, model, bufs[model])
    for model in models:
        _sweep(run, model, bufs[model])
    run.save()
    print_table(res)
    print(f"wrote {run.path}")
    bad = res["failures"] + [e for e in res["errors"] if e.startswith("ours")]
    if bad:
        print("PREFILL CORRECTNESS FAILURES: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  {result['date']}  (TFLOP/s)")
    print(f"{'model':>5} {'T':>6} {'ours':>7} {'stock':>7} {'bf16':>7} {'frac':>6} {'x stock':>8}")
    for r in result["rows"]:
        cells = [r["ours_tflops"], r["max_stock_tflops"], r["bf16_dense_tflops"], r["frac_of_bf16"], r["x_stock"]]
        txt = ["-" if v is None else f"{v:g}" for v in cells]
        print(f"{r['model']:>5} {r['tokens']:>6} {txt[0]:>7} {txt[1]:>7} {txt[2]:>7} {txt[3]:>6} {txt[4]:>8}")
    for m, c in result["crossover"].items():
        print(f"{m}: prefill path >= decode kernel from {c['pairs_per_expert']} routed pairs per expert")


if __name__ == "__main__":
    sys.exit(main())
