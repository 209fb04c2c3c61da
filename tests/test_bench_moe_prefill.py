"""bench/moe_prefill.py's accounting, checked on the CPU: the FLOPs a layer's
two GEMMs do, the issue's row (TFLOP/s, frac_of_bf16), the crossover rule,
and that its graphs (path as a runtime scalar) and MAX's stock MoE build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from script_loader import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    return load_script("bench/moe_prefill.py", "bench_moe_prefill")


def test_flops_are_the_two_gemms(bench):
    # T = 4096 tokens, top-4: 16384 rows through [2880 -> 5760] and [2880 -> 2880]
    p = 4096 * 4
    assert bench.moe_flops(p) == 2 * p * 2880 * 5760 + 2 * p * 2880 * 2880
    assert bench.moe_flops(p) == 6 * p * 2880 * 2880


def test_row_fields_and_fractions(bench):
    f = bench.moe_flops(2048 * 4)
    # ours 1 ms, stock 100 ms, dense 0.5 ms
    row = bench.result_row("120b", 2048, 1.0, 100.0, 0.5)
    assert set(row) >= {"model", "tokens", "ours_tflops", "max_stock_tflops", "bf16_dense_tflops", "frac_of_bf16"}
    assert row["ours_tflops"] == round(f / 1e-3 / 1e12, 1)
    assert row["frac_of_bf16"] == 0.5 and row["x_stock"] == 100.0
    missing = bench.result_row("20b", 512, None, None, 0.5)
    assert missing["ours_tflops"] is None and missing["frac_of_bf16"] is None


def test_crossover_is_where_prefill_stays_ahead(bench):
    def pt(ppe, dec, pre):
        return {"pairs_per_expert": ppe, "decode_ms": dec, "prefill_ms": pre}

    pts = [pt(0.5, 1.0, 2.0), pt(1, 1.0, 0.9), pt(2, 1.0, 1.1), pt(4, 2.0, 1.0), pt(8, 4.0, 1.0)]
    assert bench.crossover(pts) == 4
    assert bench.crossover([pt(1, 1.0, 2.0)]) is None
    assert bench.crossover([pt(1, 3.0, 2.0), pt(2, 3.0, 2.0)]) == 1
    assert bench.crossover([pt(1, 3.0, 2.0), pt(2, None, 2.0)]) is None


def test_pairs_per_expert(bench):
    assert bench.pairs_per_expert(512, 128) == 16 and bench.pairs_per_expert(512, 32) == 64


@pytest.mark.slow
def test_graphs_build_on_cpu(bench):
    from max.graph import DeviceRef

    cpu = DeviceRef.CPU()
    g = bench.build_ours(2, 1, cpu)
    assert len(g.inputs) == 2 + 2 * 2 + 8  # path, x; two layers' routes; one set: six tensors + the big pair
    assert bench.build_stock(8, cpu) is not None


@pytest.mark.slow
def test_path_scalar_reaches_the_op_on_cpu(bench):
    """The bench's graph takes the kernel path as a rank-0 CPU int32 buffer;
    the CPU op ignores it, so every path gives the reference's result."""
    import torch
    from max.driver import CPU, Buffer
    from max.engine import InferenceSession
    from max.graph import DeviceRef

    session = InferenceSession(devices=[CPU()])
    model = session.load(bench.build_ours(1, 1, DeviceRef.CPU()))
    gen = torch.Generator().manual_seed(1)
    s = bench.dec.make_set(torch, 4, bench.HIDDEN, bench.INTER, gen, "cpu")
    x = torch.randn(2, bench.HIDDEN, generator=gen).to(torch.bfloat16)
    ids, w = bench.dec.routing(torch, 2, 4, gen, "cpu")
    ours = bench.Ours(model, model, None, lambda t: Buffer.from_dlpack(t.contiguous()), 1)
    ref = bench.dec.reference(torch, x, ids, w, s)
    for path in (bench.PATH_AUTO, bench.PATH_DECODE, bench.path_prefill(0)):
        got = ours.run(path, x, ids, w, [Buffer.from_dlpack(t.contiguous()) for t in s.tensors()])
        assert bench.dec.rel_err(torch, got, ref) < 5e-3
