"""bench/attention.py's GPU-side reference, checked on a CPU against the
package's NumPy one (two independent implementations of sink attention)."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max.kernels import reference
from script_loader import load_script

torch = pytest.importorskip("torch")



@pytest.fixture(scope="module")
def bench():
    return load_script("bench/attention.py", "bench_attention")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("cached", "new"), [(0, 9), (13, 1), (6, 4)])
def test_torch_reference_matches_numpy(bench, window, cached, new):
    rng = np.random.default_rng(cached * 31 + new)
    heads, kv_heads, dim = 8, 2, 16
    keys = rng.standard_normal((cached + new, kv_heads, dim)).astype(np.float32)
    values = rng.standard_normal((cached + new, kv_heads, dim)).astype(np.float32)
    q = (3 * rng.standard_normal((new, heads, dim))).astype(np.float32)
    sinks = (2 + rng.standard_normal(heads)).astype(np.float32)
    positions = range(cached, cached + new)
    want = reference.attention_with_sinks(q, keys, values, sinks, positions, dim**-0.5, window)
    got = bench.reference(
        torch, *(torch.from_numpy(a) for a in (q, keys, values, sinks)), list(positions), dim**-0.5, window
    )
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_kv_bytes_counts_window_and_full_layer(bench):
    per_key = bench.N_KV_HEADS * bench.HEAD_DIM * 4
    # 1000 keys: the sliding layer reads 128 of them, the full one all
    assert bench.kv_bytes(bench.Case("x", 2, 1, 999)) == 2 * (128 + 1000) * per_key
    # a 10-token prefill from empty: both read every key
    assert bench.kv_bytes(bench.Case("x", 1, 10, 0)) == 20 * per_key
    # a mixed step: a 10-token chunk after 500 cached, one decode row at 999
    assert bench.kv_bytes(bench.Case("x", 1, 10, 500, ((1, 999),))) == (137 + 510 + 128 + 1000) * per_key
