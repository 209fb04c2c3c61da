"""The MoE op's MXFP4 layout (gptoss_max.mxfp4.tile_for_op): the block map the kernels index by
(mxfp4.mojo tiled_block_offset / tiled_scale_offset), the word repack inside each block and the
kernels' decode of it, their inverses, their limits, and that the loader hands the op its layout."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max import mxfp4


def _offsets(e, r, c, rows, nb):
    """The kernels' formulas (mxfp4.mojo), restated: byte of block c of row r, and its scale."""
    blk = e * rows * nb * 16 + (r >> 4) * (nb * 256) + (c >> 1) * 512 + (r & 15) * 32 + (c & 1) * 16
    scl = e * rows * nb + (r >> 4) * (nb * 16) + (c >> 1) * 32 + (r & 15) * 2 + (c & 1)
    return blk, scl


def _rotr(w, r):
    return ((w >> np.uint32(r)) | (w << np.uint32(32 - r))) if r else w


def _kernel_decode(block_bytes, scales):
    """The kernels' decode, restated: `[..., 16]` u8 blocks as 4 little-endian u32 words; slot c of
    word q is elements 8c + 2q (low bf16 half) and 8c + 2q + 1 (high half), as e2m1 * 2**-126, then
    times 2**(s - 1). Float64 `[..., 32]`."""
    w = np.ascontiguousarray(block_bytes).view("<u4")  # [..., 4]
    pairs = [_rotr(w, 6 * c) & np.uint32(0x81C081C0) for c in range(3)]
    pairs.append((_rotr(w, 10) & np.uint32(0x00400040)) | (_rotr(w, 2) & np.uint32(0x81808180)))
    out = np.empty((*w.shape[:-1], 32))
    for c, p in enumerate(pairs):
        for b, half in enumerate((p & np.uint32(0xFFFF), p >> np.uint32(16))):
            bf16 = (half.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
            out[..., 8 * c + b : 8 * c + 8 : 2] = bf16 * 2.0**126  # element 8c + 2q + b, q = 0..3
    return out * np.exp2(scales.astype(np.float64) - 1.0)[..., None] * 2.0**-126


def _op_view(tb, ts, e_, rows, nb):
    """The blocks and scales at the kernels' offsets, back in `[E, rows, nb]` order."""
    flat_b, flat_s = tb.reshape(-1), ts.reshape(-1)
    blocks, scales = np.empty((e_, rows, nb, 16), np.uint8), np.empty((e_, rows, nb), np.uint8)
    for e in range(e_):
        for r in range(rows):
            for c in range(nb):
                ob, os_ = _offsets(e, r, c, rows, nb)
                blocks[e, r, c] = flat_b[ob : ob + 16]
                scales[e, r, c] = flat_s[os_]
    return blocks, scales


def test_tiled_element_map_matches_the_kernels_formulas():
    rng = np.random.default_rng(0)
    e_, rows, nb = 3, 48, 6
    blocks = rng.integers(0, 256, (e_, rows, nb, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (e_, rows, nb), dtype=np.uint8)
    tb, ts = mxfp4.tile_for_op(blocks, scales)
    assert tb.shape == blocks.shape and ts.shape == scales.shape
    got_b, got_s = _op_view(tb, ts, e_, rows, nb)
    np.testing.assert_array_equal(got_s, scales)
    assert not np.array_equal(got_b, blocks)  # the bits inside each block moved
    np.testing.assert_array_equal(mxfp4.repack_words(got_b, inverse=True), blocks)
    np.testing.assert_array_equal(got_b, mxfp4.repack_words(blocks))
    ok = scales <= 252  # where mxfp4.decode's float32 stays finite
    with np.errstate(over="ignore", invalid="ignore"):
        want = mxfp4.decode(blocks, scales).reshape(e_, rows, nb, 32)
    np.testing.assert_array_equal(_kernel_decode(got_b, got_s)[ok], want[ok])


@pytest.mark.parametrize("scale", [0, 1, 100, 118, 127, 128, 200, 252])
def test_kernel_decode_of_the_op_layout_is_decode_on_every_byte(scale):
    """Every byte value at every byte position of a block, through the op's layout and the kernels'
    word decode (rotations and masks, bf16 bits), against mxfp4.decode exactly, signs of zero too."""
    k = np.arange(256)
    blocks = ((k[:, None] + np.arange(16)) % 256).astype(np.uint8).reshape(1, 32, 8, 16)
    scales = np.full((1, 32, 8), scale, dtype=np.uint8)
    got_b, got_s = _op_view(*mxfp4.tile_for_op(blocks, scales), 1, 32, 8)
    got = _kernel_decode(got_b, got_s)
    want = mxfp4.decode(blocks, scales).reshape(got.shape).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_word_bit_positions_are_distinct_and_each_bit_lands_there():
    pos = mxfp4.word_bit_positions()
    assert pos.shape == (4, 2, 4) and sorted(pos.reshape(-1).tolist()) == list(range(32))
    assert pos[0].tolist() == [[6, 7, 8, 15], [22, 23, 24, 31]]  # a bf16 pair's sign and magnitude bits
    rng = np.random.default_rng(4)
    background = rng.integers(0, 256, 16, dtype=np.uint8)
    base = mxfp4.repack_words(background)
    for e in range(32):  # element e = 8c + 2q + b: checkpoint byte e // 2, nibble b
        c, q, b = e // 8, (e % 8) // 2, e % 2
        for i in range(4):
            flipped = background.copy()
            flipped[e // 2] ^= np.uint8(1 << (4 * b + i))
            diff = (mxfp4.repack_words(flipped) ^ base).view("<u4")
            assert np.count_nonzero(diff) == 1 and int(diff[q]) == 1 << int(pos[c, b, i]), (e, i)


def test_repack_words_round_trips_numpy_and_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (7, 3, 5 * 16), dtype=np.uint8)  # any shape, read as 16-byte blocks
    y = mxfp4.repack_words(x)
    assert y.shape == x.shape and not np.array_equal(y, x)
    np.testing.assert_array_equal(mxfp4.repack_words(y, inverse=True), x)
    monkeypatch.setattr(mxfp4, "_WORD_CHUNK", 4)  # steps that end mid-array
    np.testing.assert_array_equal(mxfp4.repack_words(x), y)
    np.testing.assert_array_equal(mxfp4.repack_words(y, inverse=True), x)
    monkeypatch.setattr(mxfp4, "_TORCH_WORD_CHUNK", 4)
    yt = mxfp4.repack_words(torch.from_numpy(x))
    np.testing.assert_array_equal(yt.numpy(), y)
    np.testing.assert_array_equal(mxfp4.repack_words(yt, inverse=True).numpy(), x)
    with pytest.raises(ValueError, match="16 bytes"):
        mxfp4.repack_words(x[..., :8])


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
    ub2, us2 = mxfp4.untile_from_op(tb2, ts2)
    np.testing.assert_array_equal(ub2.numpy(), blocks)
    np.testing.assert_array_equal(us2.numpy(), scales)
    one = torch.from_numpy(blocks[:, :16, :32].copy())  # one tile, one pair: no block moves
    np.testing.assert_array_equal(mxfp4.tile_blocks(one).numpy(), mxfp4.repack_words(blocks[:, :16, :32]))
    np.testing.assert_array_equal(one.numpy(), blocks[:, :16, :32])  # the caller's tensor untouched


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
        # the prefill GEMM's flags, derived from the same scales (the synthetic ones are all <= 128)
        got_f = np.from_dlpack(state[f"language_model.layers.0.mlp.experts.{part}_big"].data)
        np.testing.assert_array_equal(got_f, mxfp4.big_scale_groups(scales))
        assert got_f.shape == (scales.shape[0], scales.shape[1] // 16) and not got_f.any()


def _big_by_rows(scales):
    """Brute force: per expert and 16-row group, whether any scale byte of the group is above 128."""
    e, rows, _ = scales.shape
    return np.array([[int((scales[x, 16 * g : 16 * g + 16] > 128).any()) for g in range(rows // 16)] for x in range(e)])


def test_big_scale_groups_flag_each_16_row_group_in_either_layout():
    rng = np.random.default_rng(3)
    scales = rng.integers(110, 129, (3, 80, 6), dtype=np.uint8)  # 128 itself is not big
    scales[0, 15, 5] = 129  # the last byte of group 0
    scales[1, 16, 0] = 255  # the first byte of group 1
    scales[2, 79, 3] = 200  # the last group
    want = _big_by_rows(scales)
    assert want.sum() == 3
    np.testing.assert_array_equal(mxfp4.big_scale_groups(scales), want)
    # tiling moves bytes only within a 16-row group: the op's layout gives the same flags
    np.testing.assert_array_equal(mxfp4.big_scale_groups(mxfp4.tile_scales(scales)), want)
    with pytest.raises(ValueError, match="multiple of 16"):
        mxfp4.big_scale_groups(np.zeros((1, 24, 2), np.uint8))
    with pytest.raises(ValueError, match="u8"):
        mxfp4.big_scale_groups(np.zeros((1, 16, 2), np.int32))


def test_graph_big_scale_groups_match_the_loaders():
    """ops.big_scale_groups (what moe_mxfp4 computes in the graph when it is not handed the flags)
    equals mxfp4.big_scale_groups (what the loader derives), on symbolic shapes."""
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    from gptoss_max.kernels import ops

    graph = Graph(
        "big_scale_groups",
        forward=ops.big_scale_groups,
        input_types=[TensorType(DType.uint8, ["E", "R", "B"], DeviceRef.CPU())],
    )
    model = InferenceSession(devices=[CPU()]).load(graph)
    rng = np.random.default_rng(4)
    for shape in [(2, 48, 4), (3, 160, 90)]:
        scales = rng.integers(100, 129, shape, dtype=np.uint8)
        scales[shape[0] - 1, shape[1] - 1, shape[2] - 1] = 130
        scales[0, 17, 1] = 129
        tiled = mxfp4.tile_scales(scales)
        got = model.execute(Buffer.from_numpy(tiled))[0].to_numpy()
        np.testing.assert_array_equal(got, _big_by_rows(scales))


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
    monkeypatch.setattr(mxfp4, "_WORD_CHUNK", 5)  # word steps of one tile, and partial ones
    threaded = mxfp4.tile_for_op(blocks, scales)
    back = mxfp4.untile_from_op(*threaded)
    for got, want in zip((*threaded, *back), (*single, blocks, scales), strict=True):
        assert got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threaded", [False, True])
def test_in_place_repack_rewrites_the_array_itself(monkeypatch, threaded):
    if threaded:
        monkeypatch.setattr(mxfp4, "_THREADED_BYTES", 1)
        monkeypatch.setattr(mxfp4, "_WORD_CHUNK", 200)  # steps of 2 tiles, then a partial one
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
