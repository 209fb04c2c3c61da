#!/usr/bin/env python3
"""MXFP4 MoE layer on the GPU: our decode op against MAX's stock path and the
bandwidth roofline (issue 4).

One run measures, on one GPU:
  * copy_tb_s: a large device-to-device copy (bytes read + written / time);
  * for 120b (E=128) and 20b (E=32) shapes (H = I = 2880, top-4) and each T:
      ours_us      one MoE layer through our op (gptoss_moe_*_mxfp4), the
                   slope of CUDA-event time between a graph of 1 and of
                   1 + N chained layers (launch and host costs of a graph
                   cancel); weights rotate over several sets (> L2);
      max_stock_us MAX's stock MXFP4 step, mxfp4_dequant of the layer's
                   whole gate_up and down stacks to bf16 (max/nn/quant_ops.py)
                   -- only its dequant: the grouped_matmul_ragged that follows
                   it does not compile on SM90 in MAX 26.7 (docs/GPU.md), so
                   this is a lower bound on the stock time;
      roofline_us  the routed experts' bytes (blocks + scales + biases of
                   every distinct routed expert, read once) / copy bandwidth.
  * correctness first: each (model, T) result is compared with a float64
    torch reference on the GPU (fresh random inputs each check; NaN fails;
    every output element must be finite), relative error <= 3e-3.

Prints a table and writes <out>/moe_decode_<gpu>_<yyyymmdd>.json.

Needs MAX (see docs/GPU.md for staging) and torch with CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HIDDEN = INTER = 2880
TOP_K = 4
MODELS = {"120b": 128, "20b": 32}
REL_TOL = 3e-3
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class ExpertSet:
    """One layer's experts as torch tensors, in the op's layout (MXFP4 bytes in the tiled
    order of gptoss_max.mxfp4.tile_for_op; random bytes, so MAX's stock dequant times the same
    on them)."""

    gu_blocks: object  # [E, 2I, H/2] u8
    gu_scales: object  # [E, 2I, H/32] u8
    gu_bias: object  # [E, 2I] f32
    dn_blocks: object  # [E, H, I/2] u8
    dn_scales: object  # [E, H, I/32] u8
    dn_bias: object  # [E, H] f32
    gu_big: object  # [E, 2I / 16] u8: mxfp4.big_scale_groups(gu_scales), as the model loads it
    dn_big: object  # [E, H / 16] u8

    def tensors(self) -> list:
        """The op's inputs: moe_mxfp4's six expert tensors, then its `big` pair."""
        return [
            self.gu_blocks, self.gu_scales, self.gu_bias, self.dn_blocks, self.dn_scales, self.dn_bias,
            self.gu_big, self.dn_big,
        ]  # fmt: skip


def expert_bytes(hidden: int = HIDDEN, inter: int = INTER) -> int:
    """Bytes one expert's MXFP4 weights, scales and f32 biases occupy."""
    rows = 2 * inter * (hidden // 2 + hidden // 32) + hidden * (inter // 2 + inter // 32)
    return rows + 4 * (2 * inter + hidden)


def make_set(torch, experts: int, hidden: int, inter: int, gen, device) -> ExpertSet:
    """Random codes (all 16 e2m1 codes equally likely) with realistic E8M0
    scales (2^-9 .. 2^-4, as trained gpt-oss experts) and small biases."""

    def u8(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=device)

    def scales(*shape):
        return torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8, device=device)

    def bias(*shape):
        return 0.02 * torch.randn(*shape, generator=gen, device=device)

    from gptoss_max import mxfp4

    def big(s):  # computed on the host, as the model's weight adapter does at load
        return torch.from_numpy(mxfp4.big_scale_groups(s.cpu().numpy())).to(device)

    gu_scales, dn_scales = scales(experts, 2 * inter, hidden // 32), scales(experts, hidden, inter // 32)
    return ExpertSet(
        u8(experts, 2 * inter, hidden // 2), gu_scales, bias(experts, 2 * inter),
        u8(experts, hidden, inter // 2), dn_scales, bias(experts, hidden), big(gu_scales), big(dn_scales),
    )  # fmt: skip


def routing(torch, tokens: int, experts: int, gen, device):
    """Each token picks TOP_K distinct experts uniformly (a trained router
    spreads tokens over experts) with softmaxed weights."""
    ids = torch.rand(tokens, experts, generator=gen, device=device).argsort(dim=1)[:, :TOP_K]
    w = torch.softmax(torch.randn(tokens, TOP_K, generator=gen, device=device), dim=1)
    return ids.to(torch.int32).contiguous(), w.float().contiguous()


def decode_mxfp4(torch, blocks, scales):
    """`blocks [..., n/2]`, `scales [..., n/32]` u8 -> float64 [..., n]; byte j
    of a 16-byte block holds element 2j (low nibble) and 2j+1 (high)."""
    lut = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float64, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    exp = torch.exp2(scales.to(torch.float64) - 127.0)
    return (vals.reshape(*scales.shape, 32) * exp[..., None]).reshape(vals.shape)


def reference(torch, x, ids, w, s: ExpertSet):
    """float64 MoE: the independent semantics of gpt-oss's experts."""
    from gptoss_max import mxfp4

    x64 = x.to(torch.float64)
    out = torch.zeros_like(x64)
    n_experts = s.gu_blocks.shape[0]
    for e in torch.unique(ids).tolist():
        if not 0 <= e < n_experts:
            continue
        gu = decode_mxfp4(torch, *(a[0] for a in mxfp4.untile_from_op(s.gu_blocks[e : e + 1], s.gu_scales[e : e + 1])))
        dn = decode_mxfp4(torch, *(a[0] for a in mxfp4.untile_from_op(s.dn_blocks[e : e + 1], s.dn_scales[e : e + 1])))
        t_idx, k_idx = (ids == e).nonzero(as_tuple=True)
        z = x64[t_idx] @ gu.T + s.gu_bias[e].to(torch.float64)
        gate = z[:, 0::2].clamp(max=7.0)
        up = z[:, 1::2].clamp(-7.0, 7.0)
        h = (up + 1.0) * gate * torch.sigmoid(1.702 * gate)
        y = h @ dn.T + s.dn_bias[e].to(torch.float64)
        out.index_add_(0, t_idx, w[t_idx, k_idx].to(torch.float64)[:, None] * y)
    return out


def rel_err(torch, got, ref) -> float:
    got = got.to(torch.float64)
    if not torch.isfinite(got).all():
        return math.inf
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))


def distinct_experts(ids) -> int:
    return int(ids.unique().numel())


# ---------------------------------------------------------------- MAX graphs


def build_ours(layers: int, n_sets: int, device_ref, path_input: bool = False, fused: bool = False):
    """x -> layers chained MoE layers; layer i reads expert set i % n_sets and
    its own routing. Symbolic T and E: one compile serves every shape. With
    `path_input`, the first input is a CPU int32 scalar: the op's GPU kernel
    path (ops.PATH_*), so one compile also serves every path and tile config.
    With `fused`, each layer is ops.moe_mxfp4_one_token (T = 1 only), all
    sharing the last input, its zeroed sync words."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from gptoss_max import mxfp4
    from gptoss_max.kernels import ops as moe_ops

    def t(dt, shape):
        return TensorType(dt, shape, device_ref)

    e, h, i = "E", HIDDEN, INTER
    g = mxfp4.TILE_ROWS
    set_types = [
        t(DType.uint8, [e, 2 * i, h // 2]), t(DType.uint8, [e, 2 * i, h // 32]), t(DType.float32, [e, 2 * i]),
        t(DType.uint8, [e, h, i // 2]), t(DType.uint8, [e, h, i // 32]), t(DType.float32, [e, h]),
        t(DType.uint8, [e, 2 * i // g]), t(DType.uint8, [e, h // g]),
    ]  # fmt: skip
    n_set = len(set_types)
    types = [TensorType(DType.int32, [], DeviceRef.CPU())] if path_input else []
    types += [t(DType.bfloat16, ["T", h])]
    for _ in range(layers):
        types += [t(DType.int32, ["T", TOP_K]), t(DType.float32, ["T", TOP_K])]
    types += set_types * n_sets
    if fused:
        types += [t(DType.uint32, [moe_ops.ONE_TOKEN_SYNC_WORDS])]

    def forward(*args):
        path = args[0] if path_input else moe_ops.PATH_AUTO
        x, *rest = args[1:] if path_input else args
        sync = rest.pop() if fused else None
        routes, sets = rest[: 2 * layers], rest[2 * layers :]
        for layer in range(layers):
            s = sets[n_set * (layer % n_sets) : n_set * (layer % n_sets) + n_set]
            if sync is not None:
                x = moe_ops.moe_mxfp4_one_token(x, routes[2 * layer], routes[2 * layer + 1], *s[:6], sync)
            else:
                x = moe_ops.moe_mxfp4(x, routes[2 * layer], routes[2 * layer + 1], *s[:6], path=path, big=(s[6], s[7]))
        return x

    name = "moe_prefill" if path_input else "moe_fused" if fused else "moe_ours"
    return Graph(f"{name}_{layers}x{n_sets}", forward=forward, input_types=types)


def build_stock_dequant(device_ref):
    """MAX's stock MXFP4 step before its grouped matmul: both whole stacks of
    one layer dequantized to bf16 by max.nn.kernels.mxfp4_dequant."""
    from max.dtype import DType
    from max.graph import Graph, TensorType
    from max.nn.kernels import mxfp4_dequant

    e, h, i = "E", HIDDEN, INTER
    e8 = DType.float8_e8m0fnu  # as MAX's gpt_oss weight adapter hands scales over
    types = [
        TensorType(DType.uint8, [e, 2 * i, h // 2], device_ref),
        TensorType(e8, [e, 2 * i, h // 32], device_ref),
        TensorType(DType.uint8, [e, h, i // 2], device_ref),
        TensorType(e8, [e, h, i // 32], device_ref),
    ]

    def forward(gb, gs, db, ds):
        gu = mxfp4_dequant(gb, gs, out_type=DType.bfloat16)
        dn = mxfp4_dequant(db, ds, out_type=DType.bfloat16)
        return gu, dn

    return Graph("moe_stock_dequant", forward=forward, input_types=types)


# ---------------------------------------------------------------- timing


class Timer:
    """CUDA-event time of model.execute on MAX's default queue."""

    def __init__(self, device):
        from max.driver import DeviceEvent

        self.device = device
        self.event = lambda: DeviceEvent(device, enable_timing=True)

    def time_ms(self, model, args, reps: int, warmup: int = 3) -> list[float]:
        q = self.device.default_queue
        for _ in range(warmup):
            model.execute(*args)
        self.device.synchronize()
        out = []
        for _ in range(reps):
            a, b = self.event(), self.event()
            q.record_event(a)
            model.execute(*args)
            q.record_event(b)
            b.synchronize()
            out.append(a.elapsed_time(b))
        return out

    def slope_ms(self, small, args_small, big, args_big, layers: int, reps: int, warmup: int = 3):
        """(ms per extra layer, times of the big graph): the median time of `big` minus that
        of `small` over the `layers` more it chains, the two interleaved so drifts hit both."""
        ts, tb = [], []
        for _ in range(3):
            ts += self.time_ms(small, args_small, reps=reps, warmup=warmup)
            tb += self.time_ms(big, args_big, reps=reps, warmup=warmup)
        return (statistics.median(tb) - statistics.median(ts)) / layers, tb


def copy_bandwidth(torch, gib: float = 2.0, reps: int = 20) -> float:
    """TB/s of a device-to-device copy, counting bytes read and written."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times) / 1e12


# ---------------------------------------------------------------- main


@dataclass
class GpuRun:
    """What every GPU benchmark here opens first: the device, a MAX session on
    it, its graph device ref, a timer, and the name and date results carry."""

    dev: object
    session: object
    dref: object
    timer: Timer
    gpu_name: str
    today: datetime.date

    def result_path(self, out: str | Path, kind: str, ext: str = "json") -> Path:
        """<out>/<kind>_<gpu>_<yyyymmdd>.<ext>, the name every result file here takes
        (gpu as the e2e bench spells it); the directory is made."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        return out / f"{kind}_{gpu_tag(self.gpu_name)}_{self.today:%Y%m%d}.{ext}"


def finish(path: Path, failures: list[str]) -> int:
    """The end of every GPU benchmark here, once its JSON is written: where it went, and
    status 1 with the correctness failures listed (they are in the JSON as well)."""
    print(f"wrote {path}")
    if failures:
        print("CORRECTNESS FAILURES: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def result_header(script: str, argv: list[str] | None, gpu: GpuRun, copy_tb_s: float) -> dict:
    """The fields every result file here starts with."""
    from gptoss_max import settings

    # the run-changing GPTOSS_MAX_* settings of this process lead the command, as set
    cmd = " ".join([*settings.run_setting_env(), f"python3 {script}", *(sys.argv[1:] if argv is None else argv)])
    return {"device": gpu.gpu_name, "date": gpu.today.isoformat(), "command": cmd.strip(),
            "max_version": version_of("max"), "copy_tb_s": round(copy_tb_s, 3)}  # fmt: skip


def open_gpu(torch, script: str) -> GpuRun:
    """Exits (status 2) with a clear message without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    from max.driver import Accelerator
    from max.engine import InferenceSession
    from max.graph import DeviceRef

    dev = Accelerator()
    return GpuRun(dev, InferenceSession(devices=[dev]), DeviceRef.from_device(dev), Timer(dev),
                  torch.cuda.get_device_name(), datetime.date.today())  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if "--prefill" in (sys.argv[1:] if argv is None else argv):
        from moe_prefill import main as prefill_main  # issue 5: bench/moe_prefill.py

        return prefill_main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="120b,20b", help="comma list of 120b, 20b")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64", help="comma list of routed token counts")
    ap.add_argument("--chain", type=int, default=32, help="extra chained layers for the slope (default 32)")
    ap.add_argument("--sets", type=int, default=4, help="expert sets rotated over (each > L2 at E=128)")
    ap.add_argument("--reps", type=int, default=25, help="timed executions per graph (median taken)")
    ap.add_argument("--checks", type=int, default=2, help="fresh random correctness checks per (model, T)")
    ap.add_argument("--no-stock", action="store_true", help="skip MAX's stock dequant step")
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused", action="store_true",
                    help="time the fused one-token launch (ops.moe_mxfp4_one_token) instead; T = 1 only")  # fmt: skip
    args = ap.parse_args(argv)

    import torch
    from max.driver import Buffer
    from max.dtype import DType

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.fused and token_counts != [1]:
        ap.error("--fused times one-token steps: pass --tokens 1")
    gpu = open_gpu(torch, "bench/moe.py")
    from gptoss_max.kernels.ops import ONE_TOKEN_SYNC_WORDS
    gpu_name, session, dref, timer = gpu.gpu_name, gpu.session, gpu.dref, gpu.timer

    def buf(t):
        return Buffer.from_dlpack(t.contiguous())

    copy_tb_s = copy_bandwidth(torch)
    print(f"device {gpu_name}; copy {copy_tb_s:.2f} TB/s (read + write)", flush=True)

    t0 = time.perf_counter()
    small, big = 1, 1 + args.chain
    g_small = session.load(build_ours(small, args.sets, dref, fused=args.fused))
    g_big = session.load(build_ours(big, args.sets, dref, fused=args.fused))
    compile_s = time.perf_counter() - t0
    print(f"compiled our graphs in {compile_s:.0f} s", flush=True)
    g_stock = None
    if not args.no_stock:
        t0 = time.perf_counter()
        g_stock = session.load(build_stock_dequant(dref))
        print(f"compiled stock dequant in {time.perf_counter() - t0:.0f} s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows, failures = [], []
    for model in models:
        experts = MODELS[model]
        sets = [make_set(torch, experts, HIDDEN, INTER, gen, "cuda") for _ in range(args.sets)]
        set_bufs = [buf(tn) for s in sets for tn in s.tensors()]
        if args.fused:  # the sync words after the sets (zero; each launch leaves them zero)
            sync = torch.zeros(ONE_TOKEN_SYNC_WORDS, dtype=torch.int32, device="cuda")
            set_bufs.append(buf(sync).view(DType.uint32, [ONE_TOKEN_SYNC_WORDS]))
        torch.cuda.synchronize()

        stock_us = None
        if g_stock is not None:
            s0 = sets[0]
            e8 = DType.float8_e8m0fnu
            sargs = [
                buf(s0.gu_blocks), buf(s0.gu_scales).view(e8, list(s0.gu_scales.shape)),
                buf(s0.dn_blocks), buf(s0.dn_scales).view(e8, list(s0.dn_scales.shape)),
            ]  # fmt: skip
            stock_us = 1e3 * statistics.median(timer.time_ms(g_stock, sargs, reps=max(5, args.reps // 5)))

        for tokens in token_counts:
            # Correctness: the 1-layer graph (fresh inputs each time, so an
            # output element left unwritten holds another run's values).
            worst = 0.0
            for _ in range(args.checks):
                x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
                ids, w = routing(torch, tokens, experts, gen, "cuda")
                out = g_small.execute(buf(x), buf(ids), buf(w), *set_bufs)[0]
                got = torch.from_dlpack(out).clone()
                worst = max(worst, rel_err(torch, got, reference(torch, x, ids, w, sets[0])))
            ok = worst <= REL_TOL
            if not ok:
                failures.append(f"{model} T={tokens}: rel err {worst:.3g}")

            # Timing: fresh routing per layer, same for both graphs' shared prefix.
            x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            routes = [routing(torch, tokens, experts, gen, "cuda") for _ in range(big)]
            rbufs = [buf(r) for rw in routes for r in rw]
            a_small = [buf(x), *rbufs[: 2 * small], *set_bufs]
            a_big = [buf(x), *rbufs, *set_bufs]
            slope_ms, tb = timer.slope_ms(g_small, a_small, g_big, a_big, args.chain, args.reps)
            ours_us = 1e3 * slope_ms
            spread_us = 1e3 * (statistics.quantiles(tb, n=4)[2] - statistics.quantiles(tb, n=4)[0]) / args.chain
            extra = routes[small:]
            mean_bytes = statistics.mean(distinct_experts(r[0]) for r in extra) * expert_bytes()
            mean_bytes += tokens * HIDDEN * 2 * 2  # x in, y out (bf16)
            roofline_us = mean_bytes / (copy_tb_s * 1e12) * 1e6
            row = {
                "model": model,
                "tokens": tokens,
                "ours_us": round(ours_us, 2),
                "ours_iqr_us": round(spread_us, 2),
                "max_stock_us": None if stock_us is None else round(stock_us, 1),
                "roofline_us": round(roofline_us, 2),
                "bw_frac": round(roofline_us / ours_us, 3),
                "speedup_vs_stock": None if stock_us is None else round(stock_us / ours_us, 1),
                "distinct_experts": round(mean_bytes / expert_bytes(), 1),
                "rel_err": float(f"{worst:.3g}"),
                "correct": ok,
                "fused": args.fused,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        del sets, set_bufs
        torch.cuda.empty_cache()

    result = {
        **result_header("bench/moe.py", argv, gpu, copy_tb_s),
        "method": "ours_us: slope of CUDA-event time of a graph of 1 vs 1+chain chained MoE layers; "
        "max_stock_us: mxfp4_dequant of gate_up + down stacks only (MAX 26.7's grouped_matmul_ragged "
        "does not compile on SM90), a lower bound on the stock step; roofline: distinct routed experts' "
        "bytes / copy bandwidth",
        "compile_s": round(compile_s, 1),
        "rows": rows,
        "failures": failures,
    }
    path = gpu.result_path(args.out, "moe_decode")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return finish(path, failures)


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  {result['date']}  copy {result['copy_tb_s']} TB/s")
    print(
        f"{'model':>5} {'T':>3} {'ours us':>9} {'stock us':>9} {'roof us':>8} "
        f"{'bw_frac':>7} {'x stock':>8} {'rel err':>8}"
    )
    for r in result["rows"]:
        stock = "-" if r["max_stock_us"] is None else f"{r['max_stock_us']:.0f}"
        speed = "-" if r["speedup_vs_stock"] is None else f"{r['speedup_vs_stock']:.0f}"
        print(
            f"{r['model']:>5} {r['tokens']:>3} {r['ours_us']:>9.1f} {stock:>9} {r['roofline_us']:>8.1f} "
            f"{r['bw_frac']:>7.2f} {speed:>8} {r['rel_err']:>8.1e}"
        )


def gpu_tag(gpu_name: str) -> str:
    """Short name of a GPU for result file names: the one the e2e bench uses (h100, h200, ...)."""
    from gptoss_max.e2e import device_slug

    return device_slug(gpu_name)


def version_of(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return os.environ.get("MAX_VERSION")


if __name__ == "__main__":
    sys.exit(main())
