"""CPU checks of scripts/fp8_wgmma_probe.py: its packing, its activation image and the arithmetic
its CUDA kernel does, replayed in numpy from the kernel's stated fragment layouts (mma's m16n8k32
A fragment per warp, K-major core matrices for B). What only the GPU can show is whether wgmma
reads them that way; the probe checks that against the same reference before timing."""

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


def _lo(w):
    return ((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C)


def _hi(w):
    return (w & 0x80808080) | ((w >> 2) & 0x1C1C1C1C)


def _replay(packed, words, img, post, rows):
    """What expert_matvec computes for one expert, from the layouts its header states."""
    groups = rows // 64
    u32 = packed.reshape(groups, probe.NJ, 128, 4, 4).astype(np.uint32)
    w4 = u32[..., 0] | (u32[..., 1] << 8) | (u32[..., 2] << 16) | (u32[..., 3] << 24)  # (rg, j, tid, word)
    a = np.zeros((rows, probe.K))
    tid = np.arange(128)
    row = (tid >> 5) * 16 + ((tid & 31) >> 2)
    t = tid & 3
    for rg in range(groups):
        for j in range(probe.NJ):
            for q in range(2):  # the pair's two wgmmas (blocks 2j, 2j + 1)
                k0 = 32 * (2 * j + q) + 4 * t
                regs = [(_lo, 2 * q, 0, 0), (_hi, 2 * q, 8, 0), (_lo, 2 * q + 1, 0, 16), (_hi, 2 * q + 1, 8, 16)]
                for fn, word, drow, dk in regs:
                    vals = _e4m3(fn(w4[rg, j, :, word]))  # (128, 4)
                    for i in range(4):
                        a[rg * 64 + row + drow, k0 + dk + i] = vals[:, i]
    b = torch.from_numpy(img.copy()).view(torch.float8_e4m3fn).double().numpy()
    b = b.reshape(probe.K // 32, 2, 8, 16).transpose(0, 1, 3, 2).reshape(probe.K, 8)  # (k, n)
    d = np.einsum("rbk,bkn->rbn", a.reshape(rows, -1, 32), b.reshape(-1, 32, 8))  # per block
    # scale words: (rg, j, w, g, [s(row, 2j), s(row + 8, 2j), s(row, 2j + 1), s(row + 8, 2j + 1)])
    s = words.reshape(groups, probe.NJ, 4, 8, 2, 2).transpose(0, 2, 5, 3, 1, 4).reshape(rows, -1)
    return ((d[..., 0] + d[..., 1] / 16) * np.exp2(s.astype(np.float64) - 127)).sum(axis=1) * post


def test_replayed_kernel_matches_the_mxfp4_reference():
    rng = np.random.default_rng(1)
    rows = 128
    codes = rng.integers(0, 16, (rows, probe.K), dtype=np.uint8)
    scales = rng.integers(117, 125, (rows, probe.K // 32), dtype=np.uint8)
    x = torch.tensor(rng.standard_normal(probe.K)).to(torch.bfloat16).double().numpy()
    packed, words = probe.pack(codes, scales)
    assert packed.shape == (rows // 64, probe.NJ, 128, 16) and packed.nbytes == rows * probe.K // 2
    assert words.nbytes == rows * probe.K // 32
    img, post = probe.activation_image(x, torch)
    assert img.nbytes == probe.K // 32 * 256
    got = _replay(packed, words, img, post, rows)
    ref = probe.reference(codes, scales, x)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # a bf16 x is (nearly) exact as two e4m3 parts, so only the f32 sums round: far under the 3e-3
    assert rel < 1e-6
    # a wrong layout is caught: the same words read as if the nibbles of rows g and g + 8 swapped
    swapped = probe.pack(codes[np.r_[np.arange(rows)].reshape(-1, 16)[:, np.r_[8:16, 0:8]].reshape(-1)], scales)[0]
    bad = _replay(swapped, words, img, post, rows)
    assert np.linalg.norm(bad - ref) / np.linalg.norm(ref) > 0.1


def test_e2m1_nibble_as_e4m3_byte_is_its_value_over_64():
    codes = np.arange(16, dtype=np.uint32)
    for fn, word in ((_lo, codes), (_hi, codes << 4)):
        got = _e4m3(fn(word))[:, 0]
        np.testing.assert_array_equal(got * 64, probe.E2M1)
