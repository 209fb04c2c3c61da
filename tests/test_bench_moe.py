"""bench/moe.py's GPU-side pieces that can be checked on a CPU: its float64
torch reference and MXFP4 decode against the package's NumPy ones (two
independent implementations), and the byte count the roofline uses."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max import mxfp4
from gptoss_max.kernels import reference
from script_loader import load_script

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/moe.py", "bench_moe")


def test_decode_matches_package_decoder_on_every_code_and_scale(bench):
    # scales up to 252: above, the package's float32 decoder overflows to inf
    n = 253
    codes = np.arange(256, dtype=np.uint8)
    blocks = np.tile(codes, (n, 1)).reshape(n, 16, 16)  # 16 blocks of 16 bytes per row
    scales = np.tile(np.arange(n, dtype=np.uint8)[:, None], (1, 16))
    want = mxfp4.decode(blocks, scales).astype(np.float64)
    got = bench.decode_mxfp4(torch, torch.from_numpy(blocks.reshape(n, 256)), torch.from_numpy(scales))
    np.testing.assert_array_equal(got.numpy(), want.reshape(n, 512))


def test_reference_matches_numpy_reference(bench):
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens = 6, 64, 128, 9
    s = bench.make_set(torch, experts, hidden, inter, gen, "cpu")
    ids, w = bench.routing(torch, tokens, experts, gen, "cpu")
    ids[2, 1] = -1  # a dropped slot contributes nothing in both
    x = torch.randn(tokens, hidden, generator=gen)
    got = bench.reference(torch, x, ids, w, s)
    gub, gus = mxfp4.untile_from_op(s.gu_blocks.numpy(), s.gu_scales.numpy())  # the set is in the op's layout
    dnb, dns = mxfp4.untile_from_op(s.dn_blocks.numpy(), s.dn_scales.numpy())
    want = reference.moe_mxfp4(
        x.numpy(), ids.numpy(), w.numpy(), gub, gus, s.gu_bias.numpy(), dnb, dns, s.dn_bias.numpy(),
    )  # fmt: skip
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-9 * np.abs(want).max())


def test_routing_picks_distinct_experts(bench):
    ids, w = bench.routing(torch, 64, 32, torch.Generator().manual_seed(0), "cpu")
    assert all(len(set(row.tolist())) == bench.TOP_K for row in ids)
    torch.testing.assert_close(w.sum(1), torch.ones(64))


def test_expert_bytes_is_the_mxfp4_expert_size(bench):
    # gate_up 5760 x 2880 and down 2880 x 2880 at 4.25 bits, plus f32 biases
    assert bench.expert_bytes() == (5760 * 2880 + 2880 * 2880) * 17 // 32 + 4 * (5760 + 2880)


def test_result_path_names_every_gpu_result_file_alike(bench, tmp_path):
    import datetime

    gpu = bench.GpuRun(None, None, None, None, "NVIDIA H100 80GB HBM3", datetime.date(2026, 11, 21))
    path = gpu.result_path(tmp_path / "new", "moe_decode")
    assert path == tmp_path / "new" / "moe_decode_h100_20261121.json"
    assert path.parent.is_dir()
    assert gpu.result_path(tmp_path, "step_profile_trace", "json.gz").name == "step_profile_trace_h100_20261121.json.gz"
