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
    for variant in bench.VARIANTS:
        bench.build(variant, layers, k, n, cpu)  # the bench's own graph builds
        # run the same forward behind f32 -> bf16 casts (NumPy has no bf16)
        types = bench.input_types(layers, k, n, cpu, DType.float32)
        inner = bench.projection_forward(variant, layers)

        def forward(*args, inner=inner):
            outs = inner(*[gops.cast(a, DType.bfloat16) for a in args])
            return [gops.cast(o, DType.float32) for o in outs]

        model = session.load(Graph(f"outer_{variant}", forward=forward, input_types=types))
        outs = model.execute(*[Buffer.from_numpy(a) for a in [x, *wb]])
        assert len(outs) == layers
        for i, out in enumerate(outs):
            w, b = (reference.round_to_bf16(a).astype(np.float64) for a in wb[2 * i : 2 * i + 2])
            want = reference.round_to_bf16(x).astype(np.float64) @ w.T + b
            got = out.to(CPU()).to_numpy()
            np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())
