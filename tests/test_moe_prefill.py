"""Host-side logic of the MXFP4 prefill path (kernels/moe_prefill_gpu.mojo),
checked on the CPU by running the kernel package's own functions in a small
Mojo program: the path choice both ops make, the weight decode of the tiled
layout's repacked words (each pair the elements the layout puts there, exact)
and the decode kernel's activation order agreeing with it (a dot product
through them equals the plain one, bf16 and f32 activations), and the block ->
tile map of the grouped GEMM grid (every tile once, nothing past the end)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gptoss_max import mxfp4

PROGRAM = """
from gptoss_kernels.moe_prefill_gpu import (
    ABSORB, N_CONFIGS, PREFILL_MIN_PAIRS_PER_EXPERT, PREFILL_MIN_PAIRS, decode_word, expert_tiles, find_tile,
    max_m_tiles, meta_tiles, meta_words, prefill_choice, write_expert_tiles,
)
from gptoss_kernels.moe_gpu import A_BF16, A_F32, _decode_block, _load_a
from std.memory import bitcast

def pair_dot(a: UInt32, b: UInt32) -> Float32:
    var av = bitcast[DType.bfloat16, 2](a).cast[DType.float32]()
    var bv = bitcast[DType.bfloat16, 2](b).cast[DType.float32]()
    return av[0] * bv[0] + av[1] * bv[1]

def lcg(mut s: UInt64) -> UInt32:
    s = s * 6364136223846793005 + 1442695040888963407
    return UInt32(s >> 32)

def main() raises:
    print("const", N_CONFIGS, PREFILL_MIN_PAIRS_PER_EXPERT, PREFILL_MIN_PAIRS)
    for t in [1, 2, 8, 16, 31, 32, 64, 80, 96, 128, 512, 2048, 16384]:
        for e in [8, 32, 128, 300]:
            for path in [0, 1, 2, 6, 7, 10, 11]:
                var c: Int
                try:
                    c = prefill_choice(t, 4, e, 2880, 2880, path)
                except:
                    c = -9
                print("choice", t, e, path, c)
    print("choice_small", prefill_choice(64, 4, 8, 64, 48, 0), prefill_choice(64, 4, 8, 2880, 2880, 0))
    # K not in whole 64-element stages: p1 configs take it, p2 (wgmma) ones refuse
    var p2_small: Int
    try:
        p2_small = prefill_choice(64, 4, 8, 96, 96, 7)
    except:
        p2_small = -9
    print("choice_k96", prefill_choice(64, 4, 8, 96, 96, 2), p2_small)
    print("choice_auto", prefill_choice(512, 4, 8, 96, 96, 0), prefill_choice(8192, 4, 128, 2880, 2880, 0),
          prefill_choice(512, 4, 128, 2880, 2880, 0), prefill_choice(16384, 4, 128, 2880, 2880, 0),
          prefill_choice(3584, 4, 128, 2880, 2880, 0), prefill_choice(3840, 4, 128, 2880, 2880, 0),
          prefill_choice(4608, 4, 128, 2880, 2880, 0), prefill_choice(5120, 4, 128, 2880, 2880, 0),
          prefill_choice(5152, 4, 128, 2880, 2880, 0), prefill_choice(1024, 4, 32, 2880, 2880, 0),
          prefill_choice(7648, 4, 128, 2880, 2880, 0), prefill_choice(7680, 4, 128, 2880, 2880, 0),
          prefill_choice(2528, 4, 128, 2880, 2880, 0), prefill_choice(2560, 4, 128, 2880, 2880, 0))
    # test_moe_op.py's t288_c9 case (288 tokens, top-4 of 8 experts, H = I = 128) takes c9 on a GPU
    print("choice_t288", prefill_choice(288, 4, 8, 128, 128, 0))
    # and its t2048_c10 case (2048 tokens, top-4 of 64 experts, H = I = 64) takes c10
    print("choice_t2048", prefill_choice(2048, 4, 64, 64, 64, 0))
    var s: UInt64 = 7
    for it in range(300):
        var wv = SIMD[DType.uint32, 4](lcg(s), lcg(s), lcg(s), lcg(s))
        var sc = 100 + lcg(s) % 40
        # p1 / p2: one word's four slots
        for q in range(4):
            var d = decode_word(wv[q], sc)
            print("word", wv[0], wv[1], wv[2], wv[3], sc, q, d[0], d[1], d[2], d[3])
        # the decode kernel: a block's 16 decoded pairs against _load_a's activation words
        var x = List[UInt32]()
        var xf = List[Float32]()
        for _ in range(16):
            var v = (lcg(s) & 0x80FF80FF) | 0x3E003E00  # bf16 pairs, |x| in [2^-4, 2^-2)
            x.append(v)
            var h2 = bitcast[DType.bfloat16, 2](v).cast[DType.float32]()
            xf.append(h2[0] * (1 + Float32(it % 7) * 2.0e-3))  # f32 activations: not bf16-exact
            xf.append(h2[1] * (1 - Float32(it % 5) * 3.0e-3))
        var pairs: SIMD[DType.uint32, 16]
        if sc > 128:
            pairs = _decode_block[True](wv, sc)
        else:
            pairs = _decode_block[False](wv, sc)
        var xb = _load_a[A_BF16](Pointer(to=x[0]), 0, 0)[0]
        var xs = _load_a[A_F32](Pointer(to=xf[0]).bitcast[UInt32](), 0, 0)
        var dot: Float32 = 0
        var fdot: Float32 = 0
        for j in range(16):
            dot += pair_dot(pairs[j], xb[j])
            fdot += pair_dot(pairs[j], xs[0][j]) + pair_dot(pairs[j], xs[1][j])
        # p1 (gemm_kernel): lane q decodes word q and reads activation pair words 4c + q
        var p1dot: Float32 = 0
        for q in range(4):
            var d = decode_word(wv[q], sc)
            for c in range(4):
                p1dot += pair_dot(d[c], x[4 * c + q])
        print("bdot", wv[0], wv[1], wv[2], wv[3], sc, dot, fdot, p1dot)
        var line = String("x")
        for j in range(16):
            line += " " + String(x[j])
        print(line)
        var fline = String("xf")
        for j in range(32):
            fline += " " + String(xf[j])
        print(fline)
    # tiles: counts per expert -> offsets and tile starts as the route kernel's scan over the experts
    # leaves them (computed here in turn), then the tile table by the route's own write_expert_tiles
    # per expert; find_tile reads them back
    var counts = [0, 5, 64, 65, 0, 0, 200, 1, 128, 129, 160, 161, 300, 257]
    var n_experts = len(counts)
    var n_pairs = 0
    for e in range(n_experts):
        n_pairs += counts[e]
    for e in range(n_experts):
        print("count", e, counts[e])
    for spec in [(64, 0, 3), (128, ABSORB, 2), (32, 0, 1)]:
        var bm = spec[0]
        var absorb = spec[1]
        var nt = spec[2]
        var meta = List[Int32](length=meta_words(n_pairs, n_experts), fill=-7)
        var o = 0
        var t = 0
        for e in range(n_experts):
            meta[e] = Int32(o)
            meta[n_experts + 1 + e] = Int32(t)
            o += counts[e]
            t += Int(expert_tiles(counts[e], bm, absorb)[0])
        meta[n_experts] = Int32(o)
        meta[2 * n_experts + 1] = Int32(t)
        var mp = Pointer(to=meta[0])
        for e in range(n_experts):
            write_expert_tiles(
                rebind[Pointer[Int32, MutAnyOrigin]](mp.unsafe_offset(meta_tiles(n_experts, n_pairs))), e,
                Int(meta[n_experts + 1 + e]), Int(meta[n_experts + 2 + e]),
            )
        print("tilecfg", bm, absorb, nt, t, max_m_tiles(n_pairs, n_experts, bm))
        for b in range(max_m_tiles(n_pairs, n_experts, bm) * nt):
            var r = find_tile(mp, n_experts, n_pairs, nt, b)
            print("tile", bm, b, r[0], r[1], r[2], r[3])
    # c10's tiling: (regular 128-row tiles, absorbed tile or not) per count, absorbing <= ABSORB
    print("absorb", ABSORB)
    for c in [0, 1, 128, 129, 160, 161, 256, 257, 288, 289, 300, 512, 544, 545]:
        var et = expert_tiles(c, 128, ABSORB)
        var plain = expert_tiles(c, 128, 0)
        print("etiles", c, et[0], et[1], plain[0], plain[1])
"""


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> list[list[str]]:
    from mojo.run import subprocess_run_mojo

    from gptoss_max.kernels import kernels_path

    src = tmp_path_factory.mktemp("prefill") / "probe.mojo"
    src.write_text(PROGRAM)
    done = subprocess_run_mojo(["run", "-I", str(kernels_path().parent), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return [ln.split() for ln in done.stdout.splitlines() if ln.strip()]


def _rows(lines, tag):
    return [r[1:] for r in lines if r[0] == tag]


def test_path_choice(lines) -> None:
    n_configs, min_ppe, min_pairs = map(int, _rows(lines, "const")[0])
    for t, e, path, got in (map(int, r) for r in _rows(lines, "choice")):
        if e > 256:  # over the kernel's expert limit: decode, or an error when forced
            want = -9 if path >= 2 else -1
        elif path == 1:
            want = -1
        elif path >= 2:
            want = path - 2 if path - 2 < n_configs else -9
        else:
            want = -1 if t * 4 < min_ppe * e or t * 4 < min_pairs else None
        if want is None:
            assert 0 <= got < n_configs, (t, e, path, got)
        else:
            assert got == want, (t, e, path, got)
    # 64 tokens x 4 over 8 experts with I = 48 (not a multiple of 32): decode kernel
    small, real = map(int, _rows(lines, "choice_small")[0])
    assert small == -1 and real >= 0
    p1_k96, p2_k96 = map(int, _rows(lines, "choice_k96")[0])
    assert p1_k96 == 0 and p2_k96 == -9
    # auto: the measured p2 configs on gpt-oss shapes, p1 where K is not in 64-element stages
    k96, mid, low, high, *band = map(int, _rows(lines, "choice_auto")[0])
    # 120b T = 8192 / 16384 (256 / 512 pairs per expert): c10; T = 512 (16): c7
    assert (k96, mid, low, high) == (4, 10, 7, 10)
    # the measured crossover (bench/NOTES.md p8): 120b T = 64 (2 pairs per expert) decode, T = 96 (3) prefill
    choice = {(int(t), int(e), int(p)): int(c) for t, e, p, c in _rows(lines, "choice")}
    assert choice[(64, 128, 0)] == -1 and choice[(96, 128, 0)] >= 0
    # 120b (128 experts) 112 -> c5, 120, 144, 160 -> c10, 161 -> c5; 20b (32 experts) at 128 -> c9;
    # 120b 239 -> c5, 240 -> c10; 120b 79 -> c7, 80 -> c5 (C7_MAX_PAIRS)
    assert band == [5, 10, 10, 10, 5, 9, 5, 10, 7, 5]
    assert _rows(lines, "choice_t288") == [["9"]]
    assert _rows(lines, "choice_t2048") == [["10"]]


def test_absorbed_tiles_cover_every_pair_once(lines) -> None:
    """c10's route: 128-row tiles, except that a last tile of <= ABSORB pairs joins the full
    tile before it as one tile of 129 .. 128 + ABSORB rows (the two-part kind); absorb 0 keeps
    ceil(count / 128)."""
    absorb = int(_rows(lines, "absorb")[0][0])
    assert absorb == 32
    for c, reg, has_abs, plain, plain_abs in (map(int, r) for r in _rows(lines, "etiles")):
        assert plain == -(-c // 128) and plain_abs == 0
        if has_abs:  # full regular tiles, then the absorbed one
            rows = [128] * reg + [c - 128 * reg]
            assert 128 < rows[-1] <= 128 + absorb, (c, rows)
        else:  # full tiles and a last, possibly partial one
            rows = [128] * (reg - 1) + [c - 128 * (reg - 1)] if reg else []
            assert all(0 < r <= 128 for r in rows), (c, rows)
        assert sum(rows) == c
        # absorbed exactly when there are >= 2 tiles of 128 and the last holds <= absorb pairs
        last = c - 128 * (plain - 1) if plain else 0
        assert has_abs == (plain >= 2 and last <= absorb), (c, reg, has_abs)


def test_prefill_tiles_script_follows_the_kernels(lines) -> None:
    """scripts/prefill_tiles.py mirrors auto_config and expert_tiles in Python (its padding
    counts rest on them): the kernel package's own choices and c10 tilings, printed above, must
    come out of the mirrors unchanged, so a retune of either side fails here."""
    from script_loader import load_script

    pt = load_script("scripts/prefill_tiles.py", "prefill_tiles")
    auto = [(t, e, c) for t, e, path, c in (map(int, r) for r in _rows(lines, "choice")) if path == 0 and c >= 0]
    # the band edges of "choice_auto" (its first value is a K = 96 shape, p1: not mirrored)
    edges = [(8192, 128), (512, 128), (16384, 128), (3584, 128), (3840, 128), (4608, 128), (5120, 128),
             (5152, 128), (1024, 32), (7648, 128), (7680, 128), (2528, 128), (2560, 128)]  # fmt: skip
    auto += [(t, e, int(c)) for (t, e), c in zip(edges, _rows(lines, "choice_auto")[0][1:], strict=True)]
    assert len({c for _, _, c in auto}) >= 4  # c5, c7, c9 and c10 among them
    for t, e, c in auto:
        assert pt.auto_config(t * 4 // e, e) == c, (t, e, c)
    for c, reg, has_abs, plain, _ in (map(int, r) for r in _rows(lines, "etiles")):
        rows = pt.mma_rows(c, 10)
        assert (rows["two_part"] > 0) == bool(has_abs), c
        # wgmma tiles: the regular ones (full, or one partial) and the absorbed one
        tiles = rows["full"] // 128 + (rows["partial"] > 0) + (rows["two_part"] > 0)
        assert tiles == reg + has_abs, (c, rows, reg, has_abs)
        assert pt.mma_rows(c, 5)["full"] // 128 + (pt.mma_rows(c, 5)["partial"] > 0) == plain, c


def test_bench_sweeps_every_config(lines) -> None:
    """bench/moe_prefill.py's N_CONFIGS (its default sweep and correctness
    check) is the kernel package's."""
    import re
    from pathlib import Path

    n_configs = int(_rows(lines, "const")[0][0])
    bench = (Path(__file__).resolve().parents[1] / "bench" / "moe_prefill.py").read_text()
    assert int(re.search(r"^N_CONFIGS = (\d+)", bench, re.M).group(1)) == n_configs


def _bf16(words: np.ndarray) -> np.ndarray:
    """u32 words -> their two bf16 halves (low first) as float64."""
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint32) << 16
    return halves.view(np.float32).astype(np.float64).reshape(-1)


def _block_values(words, sc) -> np.ndarray:
    """A tiled block's 4 repacked u32 words and its scale -> its 32 values (the word repack undone
    by gptoss_max.mxfp4, which test_mxfp4_tiled.py checks against a restatement of the layout)."""
    blk = mxfp4.repack_words(np.array([int(v) for v in words], dtype="<u4").view(np.uint8), inverse=True)
    blk = blk.reshape(1, 1, 16)
    return mxfp4.decode(blk, np.array([[int(sc)]], dtype=np.uint8)).reshape(-1).astype(np.float64)


def test_word_decode_gives_each_slot_its_elements(lines) -> None:
    """decode_word's slot c of word q is elements (8c + 2q, 8c + 2q + 1), exactly (scales on
    both sides of 128)."""
    rows = _rows(lines, "word")
    assert len(rows) == 1200
    scales = set()
    for *ws, sc, q, d0, d1, d2, d3 in rows:
        vals = _block_values(ws, sc)
        q = int(q)
        got = _bf16(np.array([int(d0), int(d1), int(d2), int(d3)], dtype=np.uint64))
        want = np.array([vals[8 * c + 2 * q + b] for c in range(4) for b in range(2)])
        np.testing.assert_array_equal(got, want)
        scales.add(int(sc) > 128)
    assert scales == {False, True}


def test_decode_kernel_activation_order_matches_its_pairs(lines) -> None:
    """A block decoded by the decode kernel and x loaded by its _load_a (bf16, and f32 split
    into hi + lo) give the plain dot product: the k orders agree; so do p1's lanes (word q
    against activation words 4c + q)."""
    bdots, xs, xfs = _rows(lines, "bdot"), _rows(lines, "x"), _rows(lines, "xf")
    assert len(bdots) == len(xs) == len(xfs) == 300
    for (*ws, sc, dot, fdot, p1dot), xw, xf in zip(bdots, xs, xfs, strict=True):
        wv = _block_values(ws, sc)
        xv = _bf16(np.array([int(v) for v in xw], dtype=np.uint64))
        want = float(np.dot(xv, wv))
        tol = 1e-6 * np.abs(xv * wv).sum()
        assert math.isclose(float(dot), want, rel_tol=1e-5, abs_tol=tol), (ws, sc)
        assert math.isclose(float(p1dot), want, rel_tol=1e-5, abs_tol=tol), (ws, sc)  # p1's lanes
        xfv = np.array([float(v) for v in xf])
        want_f = float(np.dot(xfv, wv))
        # hi + lo carries x to ~2^-16 relative
        assert math.isclose(float(fdot), want_f, rel_tol=1e-4, abs_tol=1e-5 * np.abs(xfv * wv).sum()), (ws, sc)


def test_tiles_cover_each_expert_tile_once(lines) -> None:
    """The route's tile table read back by find_tile: over the whole grid (max_m_tiles m tiles, so
    no entry past the table is read), every (expert, m tile, n tile) of the tiling the route counts
    once (c10's: an absorbed expert's last two tiles left to the second launch); blocks past the
    last tile report none."""
    counts = {int(e): int(c) for e, c in _rows(lines, "count")}
    cfgs = _rows(lines, "tilecfg")
    assert len(cfgs) == 3
    tiles = _rows(lines, "tile")
    for bm, absorb, nt, total, bound in (map(int, r) for r in cfgs):
        want = set()
        for e, c in counts.items():
            m = -(-c // bm)
            if absorb and m >= 2 and c - bm * (m - 1) <= absorb:
                m -= 2
            for mt in range(m):
                for n in range(nt):
                    want.add((e, mt, n))
        assert total == len(want) // nt and total <= bound
        rows = [list(map(int, r[1:])) for r in tiles if int(r[0]) == bm]
        assert [r[0] for r in rows] == list(range(bound * nt))
        seen = []
        for b, e, m, n, ok in rows:
            if b < total * nt:
                assert ok == 1, (bm, b)
                assert (e, m, n) in want, (bm, b, e, m, n)
                seen.append((e, m, n))
            else:
                assert (e, m, n, ok) == (0, 0, 0, 0), (bm, b)
        assert sorted(seen) == sorted(want) and len(seen) == len(want)
        # blocks run expert-major, and the m tiles of one expert are adjacent for each n tile
        # (they share its weights in L2)
        assert [t[0] for t in seen] == sorted(t[0] for t in seen)
        for e in counts:
            mine = [t for t in seen if t[0] == e]
            assert mine == sorted(mine, key=lambda t: (t[2], t[1]))
    assert any(int(c) > 1 for *_, c in (r for r in cfgs))  # some config has several n tiles
