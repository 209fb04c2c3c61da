"""The MoE op's tiled MXFP4 byte order (gptoss_max.mxfp4.tile_for_op): the element map the
kernels index by (mxfp4.mojo tiled_block_offset / tiled_scale_offset), its inverse, its limits,
and that the loader hands the op tiled experts."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max import mxfp4


def _offsets(e, r, c, rows, nb):
    """The kernels' formulas (mxfp4.mojo), restated: byte of block c of row r, and its scale."""
    blk = e * rows * nb * 16 + (r >> 4) * (nb * 256) + (c >> 1) * 512 + (r & 15) * 32 + (c & 1) * 16
    scl = e * rows * nb + (r >> 4) * (nb * 16) + (c >> 1) * 32 + (r & 15) * 2 + (c & 1)
    return blk, scl


def test_tiled_element_map_matches_the_kernels_formulas():
    rng = np.random.default_rng(0)
    e_, rows, nb = 3, 48, 6
    blocks = rng.integers(0, 256, (e_, rows, nb, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (e_, rows, nb), dtype=np.uint8)
    tb, ts = mxfp4.tile_for_op(blocks, scales)
    assert tb.shape == blocks.shape and ts.shape == scales.shape
    flat_b, flat_s = tb.reshape(-1), ts.reshape(-1)
    for e in range(e_):
        for r in range(rows):
            for c in range(nb):
                ob, os_ = _offsets(e, r, c, rows, nb)
                np.testing.assert_array_equal(flat_b[ob : ob + 16], blocks[e, r, c])
                assert flat_s[os_] == scales[e, r, c]


def test_untile_inverts_tile_numpy_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 32, 4 * 16), dtype=np.uint8)  # the op's [E, rows, nb * 16]
    scales = rng.integers(0, 256, (2, 32, 4), dtype=np.uint8)
    tb, ts = mxfp4.tile_for_op(blocks, scales)
    assert not np.array_equal(tb, blocks)
    ub, us = mxfp4.untile_from_op(tb, ts)
    np.testing.assert_array_equal(ub, blocks)
    np.testing.assert_array_equal(us, scales)
    tb2, ts2 = mxfp4.tile_for_op(torch.from_numpy(blocks), torch.from_numpy(scales))
    np.testing.assert_array_equal(tb2.numpy(), tb)
    np.testing.assert_array_equal(ts2.numpy(), ts)


@pytest.mark.parametrize("rows, nb", [(24, 4), (32, 3)])
def test_untileable_shapes_are_refused(rows, nb):
    with pytest.raises(ValueError, match="tiled MXFP4 layout"):
        mxfp4.tile_scales(np.zeros((1, rows, nb), dtype=np.uint8))


def test_loader_hands_the_op_tiled_experts():
    from max.dtype import DType

    from gptoss_max.arch.weights import SyntheticWeights, adapt_state_dict
    from gptoss_max.synthetic import SyntheticModel

    m = SyntheticModel("tiny", experts="mxfp4")
    hf = {name: arr.copy() for name, (arr, _) in m.arrays().items() if ".experts." in name}
    state = adapt_state_dict(dict(SyntheticWeights.generate(m).items()), m.spec, DType.bfloat16)
    for part in ("gate_up", "down"):
        blocks = hf[f"model.layers.0.mlp.experts.{part}_proj_blocks"]
        scales = hf[f"model.layers.0.mlp.experts.{part}_proj_scales"]
        tb, ts = mxfp4.tile_for_op(blocks, scales)
        got_b = np.from_dlpack(state[f"language_model.layers.0.mlp.experts.{part}_blocks"].data)
        got_s = np.from_dlpack(state[f"language_model.layers.0.mlp.experts.{part}_scales"].data)
        np.testing.assert_array_equal(got_b, tb.reshape(got_b.shape))
        np.testing.assert_array_equal(got_s, ts)


def test_loader_leaves_a_file_backed_source_untouched():
    """Tensors the loader does not own (a checkpoint's) are repacked into new arrays."""
    from max.dtype import DType

    from gptoss_max.arch.weights import SyntheticWeights, adapt_state_dict
    from gptoss_max.synthetic import SyntheticModel

    m = SyntheticModel("tiny", experts="mxfp4")
    arrays = m.arrays()
    sources = {n: a for n, (a, _) in arrays.items() if ".experts." in n}  # SyntheticWeights pops
    pristine = {n: a.copy() for n, a in sources.items()}

    class _FileTensor:  # the same tensors, as a loader that does not own them hands them over
        def __init__(self, generated):
            self.data = generated.data

    weights = {n: _FileTensor(w) for n, w in SyntheticWeights(arrays).items()}
    state = adapt_state_dict(weights, m.spec, DType.bfloat16)
    for n, want in pristine.items():
        np.testing.assert_array_equal(sources[n], want)
    blocks = pristine["model.layers.0.mlp.experts.down_proj_blocks"]
    got = np.from_dlpack(state["language_model.layers.0.mlp.experts.down_blocks"].data)
    np.testing.assert_array_equal(got, mxfp4.tile_blocks(blocks).reshape(got.shape))


def test_threaded_repack_matches_the_single_copy(monkeypatch):
    """Large layers repack one expert per thread; the bytes must not depend on it."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (5, 32, 6, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (5, 32, 6), dtype=np.uint8)
    single = mxfp4.tile_for_op(blocks, scales)
    monkeypatch.setattr(mxfp4, "_THREADED_BYTES", 1)
    threaded = mxfp4.tile_for_op(blocks, scales)
    back = mxfp4.untile_from_op(*threaded)
    for got, want in zip((*threaded, *back), (*single, blocks, scales), strict=True):
        assert got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threaded", [False, True])
def test_in_place_repack_rewrites_the_array_itself(monkeypatch, threaded):
    if threaded:
        monkeypatch.setattr(mxfp4, "_THREADED_BYTES", 1)
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (4, 48, 6 * 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (4, 48, 6), dtype=np.uint8)
    want_b, want_s = mxfp4.tile_for_op(blocks, scales)
    b, s = blocks.copy(), scales.copy()
    assert mxfp4.tile_blocks(b, in_place=True) is b and mxfp4.tile_scales(s, in_place=True) is s
    np.testing.assert_array_equal(b, want_b)
    np.testing.assert_array_equal(s, want_s)
    mxfp4.tile_blocks(b, inverse=True, in_place=True)
    np.testing.assert_array_equal(b, blocks)
    frozen = scales.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        mxfp4.tile_scales(frozen, in_place=True)


def test_repack_bench_writes_its_table(tmp_path):
    """bench/repack.py on a small layer: both modes timed, results equal, the JSON's fields."""
    import json

    from script_loader import load_script

    bench = load_script("bench/repack.py", "bench_repack")
    assert bench.main(["--experts", "3", "--rows", "32", "--blocks", "6", "--reps", "2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("repack_cpu_*.json")
    result = json.loads(path.read_text())
    assert result["results_equal"] is True and result["shape"] == [3, 32, 6, 16]
    assert result["command"].startswith("python3 bench/repack.py --experts 3")
    assert [r["mode"] for r in result["rows"]] == ["fresh array", "in place"]
    assert all(r["seconds"] >= 0 and r["gb"] == round(3 * 32 * 6 * 16 / 1e9, 3) for r in result["rows"])
