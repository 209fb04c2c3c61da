"""bench/gemv.py's graphs, built and run on the CPU at a small shape: every variant it times
computes the same projection (the GPU timing itself is committed as bench/results/gemv_*.json)."""

from __future__ import annotations

import numpy as np

from gptoss_max.kernels import reference
from script_loader import load_script


def test_every_variant_projects_the_same(tmp_path) -> None:
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph
    from max.graph import ops as gops

    bench = load_script("bench/gemv.py", "bench_gemv")
    assert set(bench.VARIANTS) == {"staged", "regs", "tc", "max", "maxt"}
    k, n, layers = 32, 8, 2  # K % 32 == 0: the tensor-core variant
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, k)).astype(np.float32)
    wb = []
    for _ in range(layers):
        wb += [rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal(n).astype(np.float32)]
    session = InferenceSession(devices=[CPU()])
    cpu = DeviceRef.CPU()
    variants = list(bench.VARIANTS)
    for variant in variants:
        bench.build(variant, layers, k, n, cpu)  # the bench's own graph builds
    # every variant's forward in one graph (one compile), each behind f32 -> bf16 casts (NumPy has
    # no bf16), on the same inputs
    types = bench.input_types(layers, k, n, cpu, DType.float32)
    inners = [bench.projection_forward(variant, layers) for variant in variants]

    def forward(*args):
        ins = [gops.cast(a, DType.bfloat16) for a in args]
        return [gops.cast(o, DType.float32) for inner in inners for o in inner(*ins)]

    model = session.load(Graph("outer_all_variants", forward=forward, input_types=types))
    outs = model.execute(*[Buffer.from_numpy(a) for a in [x, *wb]])
    assert len(outs) == layers * len(variants)
    for v, variant in enumerate(variants):
        for i in range(layers):
            out = outs[v * layers + i]
            w, b = (reference.round_to_bf16(a).astype(np.float64) for a in wb[2 * i : 2 * i + 2])
            want = reference.round_to_bf16(x).astype(np.float64) @ w.T + b
            got = out.to(CPU()).to_numpy()
            np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max(), err_msg=variant)
