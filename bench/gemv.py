#!/usr/bin/env python3
"""Dense bf16 projections of a decode step: our op (kernels/gemv.mojo: the warp-per-row
variants for T <= 2, the tensor-core one for T <= 64) against the path the model uses today
(MAX's matmul of x and W^T plus the bias) and the bandwidth roofline (issue 9: in a 120b batch-1
step MAX runs qkv and o_proj at ~2.4 TB/s, at batch 8 its sm90 matmul at ~1 TB/s, bench/NOTES.md).

For gpt-oss's shapes (qkv 2880 -> 5120, o_proj 4096 -> 2880, router 2880 -> 128) and each T:
  staged_us / regs_us / tc_us / max_us / maxt_us
      (maxt: MAX's matmul the other way round, W [N, K] times x^T, so the weight rows are its M
      and the tokens its N, then the [N, T] result transposed back: a probe of whether MAX's
      sm90 matmul picks a better tile for a skinny step that way)
      one projection: the slope of CUDA-event time between a graph of 1 and of 1 + chain
      projections (launch and host costs of a graph cancel), each projection reading its own
      weight, the weights rotated over two pools per graph so every read misses L2 (not the
      router's: 0.74 MB a weight, launch-bound anyway);
  roofline_us  weight + activation + bias bytes / the device copy bandwidth of the same run;
  correctness first: every variant against torch's float64 product of the same bf16 inputs.

Prints a table and writes <out>/gemv_<gpu>_<yyyymmdd>.json, rewritten after every row (a run cut
short keeps what it measured). Needs MAX (docs/GPU.md) and torch
with CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe import copy_bandwidth, finish, open_gpu, result_header  # noqa: E402  (bench/moe.py)

SHAPES = {"qkv": (2880, 5120), "o_proj": (4096, 2880), "router": (2880, 128)}  # K, N
VARIANTS = ("staged", "regs", "tc", "max", "maxt")
MAX_TOKENS = {"staged": 2, "regs": 2, "tc": 64, "max": 1 << 30, "maxt": 1 << 30}  # the GPU bound of each variant
REL_TOL = 1e-2  # bf16 output


def input_types(layers: int, k: int, n: int, dref, dtype=None) -> list:
    """x [T, K], then (weight [N, K], bias [N]) per projection; bf16 unless `dtype`."""
    from max.dtype import DType
    from max.graph import TensorType

    dt = dtype or DType.bfloat16
    return [TensorType(dt, ["T", k], dref)] + [TensorType(dt, [n, k], dref), TensorType(dt, [n], dref)] * layers


def projection_forward(variant: str, layers: int):
    """forward(x, w0, b0, w1, b1, ...) -> `layers` independent projections of x."""
    from max.graph import ops

    from gptoss_max.kernels import ops as our_ops

    def forward(x, *wb):
        outs = []
        for i in range(layers):
            w, b = wb[2 * i], wb[2 * i + 1]
            if variant == "max":  # what the model's Linear does today
                outs.append(ops.matmul(x, ops.transpose(w, 0, 1)) + b)
            elif variant == "maxt":
                yt = ops.matmul(w, ops.transpose(x, 0, 1)) + ops.unsqueeze(b, 1)
                outs.append(ops.transpose(yt, 0, 1))
            else:
                outs.append(our_ops.gemv(x, w, b, staged=variant == "staged", tc=variant == "tc"))
        return outs

    return forward


def build(variant: str, layers: int, k: int, n: int, dref):
    from max.graph import Graph

    return Graph(
        f"gemv_{variant}_{layers}_{k}x{n}",
        forward=projection_forward(variant, layers),
        input_types=input_types(layers, k, n, dref),
    )


def median_ms(gpu, model, pools: list, reps: int) -> float:
    """Median CUDA-event ms of model.execute, alternating between the argument pools (each
    reads other weights than the last, so no run finds them in L2)."""
    for p in pools:
        model.execute(*p)
    q = gpu.dev.default_queue
    times = []
    for r in range(reps):
        t0, t1 = gpu.timer.event(), gpu.timer.event()
        q.record_event(t0)
        model.execute(*pools[r % len(pools)])
        q.record_event(t1)
        t1.synchronize()
        times.append(t0.elapsed_time(t1))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,64", help="comma list of token counts")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--chain", type=int, default=15, help="extra projections for the slope (default 15)")
    ap.add_argument("--reps", type=int, default=30, help="timed executions per graph (median taken)")
    ap.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    args = ap.parse_args(argv)

    import torch
    from max.driver import Buffer

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    gpu = open_gpu(torch, "bench/gemv.py")
    copy_tb_s = copy_bandwidth(torch)
    print(f"device {gpu.gpu_name}; copy {copy_tb_s:.2f} TB/s (read + write)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, failures = [], []
    big = 1 + args.chain
    path = gpu.result_path(args.out, "gemv")

    def save() -> None:
        """The JSON as it stands: written after every row, so a run cut short keeps its rows."""
        result = result_header("bench/gemv.py", argv, gpu, copy_tb_s) | {"rows": rows, "failures": failures}
        path.write_text(json.dumps(result, indent=1) + "\n")

    def buf(t):
        return Buffer.from_dlpack(t.contiguous())

    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        k, n = SHAPES[shape]
        # two pools of `big` weights: consecutive executions read different ones (> L2 each)
        ws = [torch.randn(n, k, generator=gen, device="cuda").div_(k**0.5).bfloat16() for _ in range(2 * big)]
        bs = [torch.randn(n, generator=gen, device="cuda").bfloat16() for _ in range(2 * big)]
        models = {v: (gpu.session.load(build(v, 1, k, n, gpu.dref)), gpu.session.load(build(v, big, k, n, gpu.dref)))
                  for v in variants}  # fmt: skip
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(tokens, k, generator=gen, device="cuda").bfloat16()
            want = x.double() @ ws[0].double().T + bs[0].double()
            row = {"shape": shape, "k": k, "n": n, "tokens": tokens}
            for v, (small, chained) in models.items():
                if tokens > MAX_TOKENS[v]:
                    continue
                (got,) = small.execute(buf(x), buf(ws[0]), buf(bs[0]))
                got = torch.from_dlpack(got).double()
                err = ((got - want).norm() / want.norm()).item()
                row[f"{v}_rel_err"] = float(f"{err:.3g}")
                if not err <= REL_TOL:  # NaN fails too
                    failures.append(f"{shape} T={tokens} {v}: rel err {err:.3g}")

                pools = {
                    layers: [[buf(x)] + [buf(t) for i in range(layers) for t in (ws[p * big + i], bs[p * big + i])]
                             for p in (0, 1)]
                    for layers in (1, big)
                }  # fmt: skip
                t_big = median_ms(gpu, chained, pools[big], args.reps)
                us = (t_big - median_ms(gpu, small, pools[1], args.reps)) / args.chain * 1e3
                row[f"{v}_us"] = round(us, 2)
            nbytes = 2 * (n * k + tokens * k + n + tokens * n)
            row["roofline_us"] = round(nbytes / (copy_tb_s * 1e12) * 1e6, 2)
            for v in variants:
                if f"{v}_us" in row:
                    row[f"bw_frac_{v}"] = round(row["roofline_us"] / row[f"{v}_us"], 3)
            rows.append(row)
            save()
            timed = "  ".join(f"{v} {row[f'{v}_us']:7.2f}" for v in variants if f"{v}_us" in row)
            print(f"{shape:7s} T={tokens:<3d} {timed}  roof {row['roofline_us']:6.2f} us", flush=True)

    save()
    return finish(path, failures)


if __name__ == "__main__":
    sys.exit(main())
