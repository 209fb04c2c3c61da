"""CPU checks of scripts/fp8_wgmma_probe.py: its packings, its activation image and the arithmetic
of its CUDA kernel's two algorithms, replayed in numpy from the kernel's stated fragment layouts
(mma's m16n8k32 A fragment per warp, K-major core matrices for B). What only the GPU can show is
whether wgmma reads them that way; the probe checks that against the same reference before timing.
The probe's `Stack` runs here with NumPy standing in for CuPy."""

from __future__ import annotations

import numpy as np
import pytest

from script_loader import load_script

torch = pytest.importorskip("torch")
probe = load_script("scripts/fp8_wgmma_probe.py", "fp8_wgmma_probe")


def _e4m3(byte_words: np.ndarray) -> np.ndarray:
    """u32 words of 4 e4m3 bytes -> (..., 4) float64, byte 0 first."""
    b = byte_words.astype("<u4").view(np.uint8).reshape(*byte_words.shape, 4)
    return torch.from_numpy(b.copy()).view(torch.float8_e4m3fn).double().numpy()


def _lo(w):  # fp8_wgmma_probe.cu's lo_e4m3 / hi_e4m3
    return ((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C)


def _hi(w):
    return (w & 0x80808080) | ((w >> 2) & 0x1C1C1C1C)


def _lut_bytes(w, half, d):
    """lut_g (half 0) / lut_g8 (half 1) with the kernel's tables for d (per lane)."""
    lo = (0x14100800 + d * 0x08080800) & 0xFFFFFFFF
    hi = (0x24201C18 + d * 0x08080808) & 0xFFFFFFFF
    table = lo.astype(np.uint64) | (hi.astype(np.uint64) << 32)
    out = np.zeros_like(w)
    for i in range(4):
        mag = (w >> (4 * i + 16 * half)) & 7
        sign = (w >> (8 * i + (7 if half == 0 else 3))) & 1
        byte = ((table >> (8 * mag.astype(np.uint64))) & 0xFF).astype(np.uint32) | (sign << 7)
        out |= byte << (8 * i)
    return out


def _a_matrix(packed, rows, decode):
    """The A operand the kernel feeds wgmma, as a (rows, K) matrix: `decode(words, half, row, blk)`
    gives a register's 4 values per thread from its words (row g's half 0, row g + 8's half 1)."""
    groups = rows // 64
    u = packed.reshape(groups, probe.NJ, 128, 4, 4).astype(np.uint32)
    w4 = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)  # (rg, j, tid, word)
    a = np.zeros((rows, probe.K))
    tid = np.arange(128)
    row = (tid >> 5) * 16 + ((tid & 31) >> 2)
    t = tid & 3
    for rg in range(groups):
        for j in range(probe.NJ):
            for q in range(2):  # the pair's two wgmmas (blocks 2j, 2j + 1): registers a0..a3
                for word, half, dk in ((2 * q, 0, 0), (2 * q, 1, 0), (2 * q + 1, 0, 16), (2 * q + 1, 1, 16)):
                    r = rg * 64 + row + 8 * half
                    vals = decode(w4[rg, j, :, word], half, r, 2 * j + q)
                    for i in range(4):
                        a[r, 32 * (2 * j + q) + 4 * t + dk + i] = vals[:, i]
    return a


def _b_matrix(img):
    b = torch.from_numpy(img.copy()).view(torch.float8_e4m3fn).double().numpy()
    return b.reshape(probe.K // 32, 2, 8, 16).transpose(0, 1, 3, 2).reshape(probe.K, 8)  # (k, n)


def _block_products(a, img, rows):
    """Each block's (rows, blocks, 8 columns) product: what one k32 wgmma gives."""
    return np.einsum("rbk,bkn->rbn", a.reshape(rows, -1, 32), _b_matrix(img).reshape(-1, 32, 8))


def _scales_from_words(words, rows):
    # scale words: (rg, j, w, g, [s(row, 2j), s(row + 8, 2j), s(row, 2j + 1), s(row + 8, 2j + 1)])
    return words.reshape(rows // 64, probe.NJ, 4, 8, 2, 2).transpose(0, 2, 5, 3, 1, 4).reshape(rows, -1)


def _replay_blockscale(packed, words, img, post, rows):
    a = _a_matrix(packed, rows, lambda w, half, r, blk: _e4m3(_hi(w) if half else _lo(w)))
    d = _block_products(a, img, rows)
    s = _scales_from_words(words, rows).astype(np.float64)
    return ((d[..., 0] + d[..., 1] / 16) * np.exp2(s - 127)).sum(axis=1) * post


def _replay_lut(packed, words, sref, img, post, rows):
    s = _scales_from_words(words, rows).astype(np.int64)
    a = _a_matrix(packed, rows, lambda w, half, r, blk: _e4m3(_lut_bytes(w, half, s[r, blk] - sref[r])))
    d = _block_products(a, img, rows).sum(axis=1)  # one accumulator over every block
    return (d[:, 0] + d[:, 1] / 16) * np.exp2(sref.astype(np.float64) - 127) * 0.5 * post


def _case(rows=128, seed=1, spread=(117, 125)):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (rows, probe.K), dtype=np.uint8)
    scales = rng.integers(*spread, (rows, probe.K // 32), dtype=np.uint8)
    x = torch.tensor(rng.standard_normal(probe.K)).to(torch.bfloat16).double().numpy()
    return codes, scales, x


def _rel(got, ref):
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def test_blockscale_replay_matches_the_mxfp4_reference():
    codes, scales, x = _case()
    packed, words = probe.pack(codes, scales)
    assert packed.shape == (2, probe.NJ, 128, 16) and packed.nbytes == 128 * probe.K // 2
    assert words.nbytes == 128 * probe.K // 32
    img, post = probe.activation_image(x, torch)
    assert img.nbytes == probe.K // 32 * 256
    ref = probe.reference(codes, scales, x)
    # a bf16 x is (nearly) exact as two e4m3 parts, so only the f32 sums round: far under the 3e-3
    assert _rel(_replay_blockscale(packed, words, img, post, 128), ref) < 1e-6
    # a wrong layout is caught: the words of rows g and g + 8 swapped
    swapped = probe.pack(codes[np.arange(128).reshape(-1, 16)[:, np.r_[8:16, 0:8]].reshape(-1)], scales)[0]
    assert _rel(_replay_blockscale(swapped, words, img, post, 128), ref) > 0.1


def test_lut_replay_matches_the_mxfp4_reference():
    codes, scales, x = _case(spread=(110, 122))  # a row's scales spread up to 11 apart
    packed, words, sref = probe.pack_lut(codes, scales)
    assert packed.shape == (2, probe.NJ, 128, 16)
    np.testing.assert_array_equal(sref, scales.min(axis=1))
    img, post = probe.activation_image(x, torch)
    ref = probe.reference(codes, scales, x)
    assert _rel(_replay_lut(packed, words, sref, img, post, 128), ref) < 1e-6
    # the same words read as blockscale's layout are wrong
    assert _rel(_replay_blockscale(packed, words, img, post, 128), ref) > 0.1


def test_lut_refuses_a_scale_spread_it_cannot_hold():
    codes, scales, _ = _case(rows=64)
    scales[5, 7] = scales[5].min() + probe.LUT_MAX_D + 1
    with pytest.raises(ValueError, match="span more than 11"):
        probe.pack_lut(codes, scales)


def test_e2m1_nibble_as_e4m3_byte_is_its_value_over_64():
    codes = np.arange(16, dtype=np.uint32)
    for fn, word in ((_lo, codes), (_hi, codes << 4)):
        np.testing.assert_array_equal(_e4m3(fn(word))[:, 0] * 64, probe.E2M1)


def test_lut_tables_give_every_code_times_2_to_d_minus_5():
    codes = np.arange(16, dtype=np.uint32)
    for d in range(probe.LUT_MAX_D + 1):
        dd = np.full(16, d, dtype=np.int64)
        # code c as row g's value 0: magnitude in nibble 0, sign at bit 7
        got = _e4m3(_lut_bytes((codes & 7) | ((codes >> 3) << 7), 0, dd))[:, 0]
        np.testing.assert_array_equal(got, probe.E2M1 * 2.0 ** (d - 5))


def test_stack_loads_the_checked_experts_in_either_layout():
    """The probe's GPU-side bookkeeping with NumPy as the array module: the checked experts' bytes
    at their places, and their replay equal to the reference the probe compares with."""
    rng = np.random.default_rng(0)
    _, _, x = _case()
    img, post = probe.activation_image(x, torch)
    stack = probe.Stack(np, 64, 1, 20, x, rng)
    per_w = stack.wbytes // stack.EXPERTS
    per_s = stack.sbytes // stack.EXPERTS
    for algo in (0, 1, 2):
        stack.load_checked(algo)
        for slot, e in enumerate(stack.CHECKED[: 1 if algo == 2 else None]):  # bf16's replay is slow
            packed = stack.wq[e * per_w : (e + 1) * per_w]
            words = stack.sq[e * per_s : (e + 1) * per_s]
            if algo == 0:
                got = _replay_blockscale(packed.reshape(1, probe.NJ, 128, 16), words, img, post, 64)
            elif algo == 1:
                sref = stack.sref[e * 64 : (e + 1) * 64]
                got = _replay_lut(packed.reshape(1, probe.NJ, 128, 16), words, sref, img, post, 64)
            else:
                got = _replay_bf16(packed, words, probe.bf16_image(x), 64)
            assert _rel(got, stack.ref[slot]) < 1e-6
    args = stack.args(img, post, 3)
    assert len(args) == 9 and args[3] is stack.sref and args[5] == 1


def _rotr(w, r):
    return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w


def _slot_bits(w, c):  # fp8_wgmma_probe.cu's slot_bits
    if c < 3:
        return _rotr(w, 6 * c) & 0x81C081C0
    return (_rotr(w, 10) & 0x00400040) | (_rotr(w, 2) & 0x81808180)


def _bf16_pair(bits):
    """u32 bf16 pairs -> (..., 2) float64, low half first."""
    halves = np.stack([bits & 0xFFFF, bits >> 16], axis=-1).astype(np.uint32) << 16
    return halves.view(np.float32).astype(np.float64)


def _replay_bf16(blocks, scales, img, rows):
    """bf16_matvec for one expert from the op's tiled bytes: lane (g, q) of warp w decodes block
    4 b + q of its tile's rows g, g + 8 (clamped past the last), pairs 2t and 2t + 1 per k16 step,
    each scaled by 2^(s - 1), against the image's column 0 of that batch and step."""
    words = blocks.reshape(-1).view("<u4").astype(np.uint64)
    b_img = torch.from_numpy(img.view(np.uint16).astype(np.int32) << 16).view(torch.float32).double().numpy()
    b_img = b_img.reshape(probe.NBATCH, 8, 2, 8, 8)[:, :, :, 0, :].reshape(probe.NBATCH, 8, 16)  # (b, t, k)
    out = np.zeros(rows)
    for r in range(rows):
        for b in range(probe.NBATCH):
            for q in range(4):
                blk = min(4 * b + q, probe.NB - 1)
                off = (r >> 4) * probe.NB * 256 + (blk >> 1) * 512 + (r & 15) * 32 + (blk & 1) * 16
                s = scales.reshape(-1)[(r >> 4) * probe.NB * 16 + (blk >> 1) * 32 + (r & 15) * 2 + (blk & 1)]
                w = words[off // 4 : off // 4 + 4]
                for t in range(8):
                    for p, dk in ((2 * t, 0), (2 * t + 1, 8)):
                        vals = _bf16_pair(np.array([_slot_bits(int(w[p & 3]), p >> 2)], dtype=np.uint64))[0]
                        vals = vals * 2.0 ** (int(s) - 1)
                        out[r] += vals @ b_img[b, t, dk + 2 * q : dk + 2 * q + 2]
    return out


def test_bf16_replay_on_the_op_layout_matches_the_mxfp4_reference():
    rows = 16
    codes, scales, x = _case(rows=rows, spread=(100, 128))
    ckpt = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(1, rows, probe.NB, 16)
    blocks, tscales = probe.mxfp4.tile_for_op(ckpt, scales[None])
    img = probe.bf16_image(x)
    assert img.nbytes == probe.NBATCH * 8 * 256
    ref = probe.reference(codes, scales, x)
    assert _rel(_replay_bf16(blocks, tscales, img, rows), ref) < 1e-6
    # the untiled checkpoint bytes read as the op's layout are wrong
    assert _rel(_replay_bf16(ckpt, scales[None], img, rows), ref) > 0.1


def test_variants_fit_their_splits():
    for algo, ks, depth, _minb, _pipe in probe.VARIANTS:
        assert probe.splits_fit(algo, ks, depth), (algo, ks, depth)
    assert not probe.splits_fit(2, 9, 2)  # 23 batches in 9 splits of 3 leave the last one empty


def test_only_names_one_of_the_variants():
    assert probe.variant_spec("bf16:6:2:4:1") == (2, 6, 2, 4, 1)
    assert probe.variant_spec("blockscale:9:2:8:0") == (0, 9, 2, 8, 0)
    for bad in ("bf16:6:2:4", "fp4:6:2:4:1", "bf16:7:2:4:1", "bf16:x:2:4:1"):
        with pytest.raises(probe.argparse.ArgumentTypeError):
            probe.variant_spec(bad)
