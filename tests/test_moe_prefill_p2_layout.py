"""The p2 (wgmma) prefill GEMM's data layout, replayed on the CPU.

A small Mojo program runs the kernel package's own p2 helpers (moe_prefill_gpu.mojo: the
cp.async chunk -> shared-memory mapping of the token tile with its 128-byte swizzle, the packed
code and scale-window staging, each thread's rows, the MXFP4 -> A-fragment decode, the wgmma
matrix descriptors, the accumulator -> (row, token) map of the epilogue) for one block of 256
threads over three 64-k stages, on a host array standing in for shared memory. NumPy then plays
the tensor cores as the PTX ISA describes wgmma .m64nNk16 (B from shared memory through the
descriptor: start address, stride byte offset, 128-byte swizzle on address bits 4-6 ^ 7-9; A
and D in registers, per warp the mma.sync m16n8k16 fragment layout) and checks that every
accumulator the epilogue stores is the dot product of its weight row and its token row.

What this cannot check: that the hardware layouts are the documented ones (the GPU run of
bench/moe.py --prefill does), and the pipelining (which stage is in flight when)."""

from __future__ import annotations

import numpy as np
import pytest

from gptoss_max import mxfp4

NWG, K = 2, 192
THREADS, BN, NKB = 128 * NWG, 64 * NWG, K // 64
# (BM, NT, NT2, ROWS_VALID): a partly filled 128-token tile (wgmma N = 64), c9's 160-token
# tile run as two wgmma parts of N = 128 and 32 over the same A fragment, and the same layout
# with a narrow second part of N = 8 or 16 for a tile of 133 or 142 rows (bench/patches/v44).
CASES = {
    "n64": (128, 64, 0, 61),
    "n128+32": (160, 128, 32, 150),
    "n128+8": (160, 128, 8, 133),
    "n128+16": (160, 128, 16, 142),
}

PROGRAM = """
from gptoss_kernels.moe_prefill_gpu import (
    P2_BK, P2_B_STRIDE, p2_acc_gate, p2_acc_up, p2_b_src, p2_frag, p2_nt_variant, p2_row0,
    p2_part_desc, p2_row_mults, p2_rows_big, p2_s_row, p2_scale_window, p2_stage_bytes, p2_x_dst, p2_x_row,
    packed_unit, wgmma_desc_sw128,
)
from gptoss_kernels.moe_common import scale_bytes_above_128
from std.memory import bitcast

comptime BM = @BM@
comptime NT = @NT@
comptime NT2 = @NT2@
comptime ROWS = NT + NT2
comptime NWG = @NWG@
comptime K = @K@
comptime ROWS_VALID = @ROWS_VALID@
comptime THREADS = 128 * NWG
comptime BN = 64 * NWG
comptime STAGE = p2_stage_bytes(BM, BN)
comptime BASE = 1024
comptime CPT = (BM * 8 + THREADS - 1) // THREADS


def lcg(mut s: UInt64) -> UInt32:
    s = s * 6364136223846793005 + 1442695040888963407
    return UInt32(s >> 32)


def ld32(m: List[UInt8], a: Int) -> UInt32:
    return UInt32(m[a]) | (UInt32(m[a + 1]) << 8) | (UInt32(m[a + 2]) << 16) | (UInt32(m[a + 3]) << 24)


def main() raises:
    var s: UInt64 = 12345
    # token rows (bf16 bits, |x| in [2^-3, 2^0)), codes, scales (some > 128: the two-multiply path)
    var x = List[UInt16]()
    for _ in range(ROWS * K):
        x.append(UInt16((lcg(s) & 0x807F) | 0x3E00 | ((lcg(s) & 3) << 7)))
    var codes = List[UInt8]()
    for _ in range(BN * K // 2):
        codes.append(UInt8(lcg(s) & 0xFF))
    var scales = List[UInt8]()
    for r in range(BN * K // 32):  # tiled order: 16-row groups of K / 2 bytes
        var v = 112 + lcg(s) % 16
        var grp = r // (K // 2)
        if (grp == 2 or grp == 3) and r % 7 == 3:  # warpgroup 0's rows take the two-multiply path
            v = 129 + lcg(s) % 4
        scales.append(UInt8(v))
    # the op's `big` input for these rows (mxfp4.big_scale_groups): one flag per 16-row group
    var flags = List[UInt8]()
    for g in range(BN // 16):
        var any = UInt8(0)
        for j in range(K // 2):
            if scales[g * (K // 2) + j] > 128:
                any = 1
        flags.append(any)
    var fp = Pointer[UInt8, ImmutAnyOrigin](unsafe_from_address=Int(flags.unsafe_ptr()))
    print("variant", p2_nt_variant(ROWS_VALID, BM))
    for i in range(ROWS * K):
        print("x", i, x[i])
    for i in range(BN * K // 2):
        print("c", i, codes[i])
    for i in range(BN * K // 32):
        print("s", i, scales[i])

    var smem = List[UInt8](length=BASE + 4 * STAGE, fill=0)
    for kb in range(K // P2_BK):
        var st = BASE + (kb % 4) * STAGE
        # cp.async roles (the kernel's _p2_issue with row0 = 0, e = 0, n0 = 0, down-style rows)
        for tid in range(THREADS):
            for u in range(CPT):
                if p2_x_row(tid, u, THREADS) < ROWS:
                    var r = min(p2_x_row(tid, u, THREADS), ROWS_VALID - 1)
                    var src = r * K + (tid & 7) * 8 + kb * P2_BK
                    for j in range(8):
                        var v = x[src + j]
                        smem[st + p2_x_dst(tid, u, THREADS) + 2 * j] = UInt8(v & 0xFF)
                        smem[st + p2_x_dst(tid, u, THREADS) + 2 * j + 1] = UInt8(v >> 8)
            var b = p2_b_src(0, BN, 0, tid, K) + kb * P2_B_STRIDE
            for j in range(16):
                smem[st + BM * 128 + packed_unit(tid) * 16 + j] = codes[b + j]
            if tid < BN:
                var w = p2_scale_window(p2_s_row(0, BN, 0, tid, K), kb)
                for j in range(4):
                    smem[st + BM * 128 + BN * 32 + tid * 4 + j] = scales[w + j] if w + j < BN * K // 32 else 0
        for a in range(0, BM * 128, 64):
            var line = String("m ", kb, " ", a)
            for j in range(64):
                line += " " + String(Int(smem[st + a + j]))
            print(line)
        # compute roles: the warpgroup's path from the `big` flags (as _p2_tile reads them), the
        # stage's scale window, the A fragments, the descriptors
        for tid in range(THREADS):
            var r0 = p2_row0(tid)
            var big = p2_rows_big(fp, 0, BN, r0 & ~63)
            if kb == 0:
                print("big", tid, 1 if big else 0)
            var win = ld32(smem, st + BM * 128 + BN * 32 + r0 * 4)
            var q = tid & 3
            for blk in range(2):
                var m0 = p2_row_mults[True](win, blk) if big else p2_row_mults[False](win, blk)
                var m1 = p2_row_mults[True](win, 2 + blk) if big else p2_row_mults[False](win, 2 + blk)
                # word q of rows R0 and R1's block, as _p2_loop reads them
                var wa = ld32(smem, st + BM * 128 + packed_unit(2 * r0 + blk) * 16 + 4 * q)
                var wb = ld32(smem, st + BM * 128 + packed_unit(2 * r0 + 2 + blk) * 16 + 4 * q)
                comptime for s2 in range(2):
                    var f: SIMD[DType.bfloat16, 8]
                    if big:
                        f = p2_frag[True, s2](wa, wb, m0, m1)
                    else:
                        f = p2_frag[False, s2](wa, wb, m0, m1)
                    var fb = bitcast[DType.uint16, 8](f)
                    var line = String("f ", tid, " ", kb, " ", 2 * blk + s2)
                    for j in range(8):
                        line += " " + String(Int(fb[j]))
                    print(line)
        for step in range(4):
            print("d", kb, step, wgmma_desc_sw128(st + 32 * step), st)
            if NT2 > 0:  # the second part's descriptor, as _p2_loop builds it
                print("d2", kb, step, p2_part_desc(wgmma_desc_sw128(st + 32 * step), NT))
    for tid in range(THREADS):
        print("row", tid, p2_row0(tid))
    # the tile-wide scan's byte test: byte v at position p among fillers (0 / the bound 128)
    for v in range(256):
        for p in range(16):
            var sv = SIMD[DType.uint8, 16](UInt8(128 * (p & 1)))
            sv[p] = UInt8(v)
            var bits = scale_bytes_above_128(bitcast[DType.uint32, 4](sv))
            print("bigbyte", v, p, bits[0], bits[1], bits[2], bits[3])
    for i in range(NT // 8):
        for b in range(2):
            print("acc", i, b, p2_acc_gate(i, b), p2_acc_up(i, b))
"""


@pytest.fixture(scope="module", params=list(CASES))
def probe(request, tmp_path_factory) -> dict:
    """The program's output for one case, with the case under "case": (BM, NT, NT2, ROWS_VALID)."""
    from mojo.run import subprocess_run_mojo

    from gptoss_max.kernels import kernels_path

    bm, nt, nt2, rows_valid = CASES[request.param]
    program = PROGRAM
    for k, v in dict(BM=bm, NT=nt, NT2=nt2, NWG=NWG, K=K, ROWS_VALID=rows_valid).items():
        program = program.replace(f"@{k}@", str(v))
    src = tmp_path_factory.mktemp("p2") / "probe.mojo"
    src.write_text(program)
    done = subprocess_run_mojo(["run", "-I", str(kernels_path().parent), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict = {"case": (bm, nt, nt2, rows_valid)}
    for ln in done.stdout.splitlines():
        parts = ln.split()
        if parts:
            out.setdefault(parts[0], []).append([int(v) for v in parts[1:]])
    return out


def _bf16(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def _swizzle128(addr: np.ndarray) -> np.ndarray:
    return addr ^ (((addr >> 7) & 7) << 4)


def _b_operand(smem: np.ndarray, desc: int, n: int, swizzle=_swizzle128) -> np.ndarray:
    """B [16 k, n] of wgmma .m64nNk16 (bf16, K-major) as the tensor cores read it."""
    start = (desc & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    assert (desc >> 62) & 3 == 1, "descriptor swizzle mode is not 128B"
    assert (desc >> 49) & 7 == 0, "descriptor base offset must be 0 (1024-aligned atoms)"
    k = np.arange(16)[:, None]
    col = np.arange(n)[None, :]
    addr = start + (col // 8) * sbo + (col % 8) * 128 + (k // 8) * 16 + (k % 8) * 2
    addr = swizzle(addr)
    lo, hi = smem[addr].astype(np.uint32), smem[addr + 1].astype(np.uint32)
    return _bf16(lo | (hi << 8))


def _replay(probe: dict, swizzle=_swizzle128) -> tuple[np.ndarray, np.ndarray]:
    """(D as the epilogue reads it [rows, tokens], the reference W X^T). With a second part
    (NT2 > 0) the same A fragments meet the B of its own descriptor, into accumulators that
    the epilogue maps to tokens NT + 8i + 2q + b (_p2_store's t0)."""
    _bm, nt, nt2, rows_valid = probe["case"]
    n_tok = nt + nt2
    x = _bf16([v for _, v in sorted(probe["x"])]).reshape(n_tok, K)
    codes = np.array([v for _, v in sorted(probe["c"])], dtype=np.uint8).reshape(1, BN, K // 32, 16)
    scales = np.array([v for _, v in sorted(probe["s"])], dtype=np.uint8).reshape(1, BN, K // 32)
    codes, scales = (a[0] for a in mxfp4.untile_from_op(codes, scales))  # the op's tiled byte order
    w = mxfp4.decode(codes, scales).astype(np.float64).reshape(BN, K)
    src = np.minimum(np.arange(n_tok), rows_valid - 1)
    ref = w @ x[src].T

    descs = {(kb, step): (d, st) for kb, step, d, st in probe["d"]}
    descs2 = {(kb, step): d for kb, step, d in probe.get("d2", [])}
    frags = {(tid, kb, step): np.array(f) for tid, kb, step, *f in probe["f"]}
    d = np.zeros((NWG, 64, n_tok))
    for kb in range(NKB):
        smem = np.zeros(1024 + 4 * 1024 * 64, dtype=np.uint8)
        for m in probe["m"]:
            if m[0] == kb:
                st = descs[(kb, 0)][1]
                smem[st + m[1] : st + m[1] + 64] = m[2:]
        for step in range(4):
            b = _b_operand(smem, descs[(kb, step)][0], nt, swizzle)
            if nt2:
                b = np.concatenate([b, _b_operand(smem, descs2[(kb, step)], nt2, swizzle)], axis=1)
            for wg in range(NWG):
                a = np.zeros((64, 16))
                for t in range(128):
                    tid, warp, g, q = 128 * wg + t, t >> 5, (t & 31) >> 2, t & 3
                    f = _bf16(frags[(tid, kb, step)])
                    m = 16 * warp + g
                    a[m, 2 * q : 2 * q + 2] = f[0:2]
                    a[m + 8, 2 * q : 2 * q + 2] = f[2:4]
                    a[m, 2 * q + 8 : 2 * q + 10] = f[4:6]
                    a[m + 8, 2 * q + 8 : 2 * q + 10] = f[6:8]
                d[wg] += a @ b
    # accumulator registers (per warp the m16n8 C layout per 8 columns), then the epilogue map
    rows = dict(probe["row"])
    got = np.full((BN, n_tok), np.nan)
    for tid in range(THREADS):
        wg, warp, g, q = tid >> 7, (tid >> 5) & 3, (tid & 31) >> 2, tid & 3
        for t0, n in ((0, nt), (nt, nt2)):  # each part's registers, then the epilogue's map
            if not n:
                continue
            acc = np.zeros(n // 2)
            for i in range(n // 8):
                for j in range(2):
                    acc[4 * i + j] = d[wg, 16 * warp + g, t0 + 8 * i + 2 * q + j]
                    acc[4 * i + 2 + j] = d[wg, 16 * warp + g + 8, t0 + 8 * i + 2 * q + j]
            for i, bb, gate, up in probe["acc"]:
                if 4 * i + 3 < n // 2:
                    tok = t0 + 8 * i + 2 * q + bb
                    got[rows[tid], tok] = acc[gate]
                    got[rows[tid] + 1, tok] = acc[up]
    return got, ref


def test_variant_for_the_tile(probe):
    bm, nt, nt2, rows_valid = probe["case"]
    if nt2 == 0:
        assert probe["variant"] == [[1]]  # 61 rows of a 128-row tile run wgmma N = 64
    else:  # two parts over the tile's power-of-two base, 128: the second covers the rows past it
        assert nt == 128 and 0 < rows_valid - nt <= nt2 <= bm - nt


def test_every_quad_owns_a_gate_up_row_pair_once(probe):
    """The 4 lanes of a quad (q = 0..3, different k) share a row pair; each
    pair (even gate row, odd up row) belongs to one quad."""
    row = dict(probe["row"])
    assert all(row[t] == row[t & ~3] for t in row)
    rows = sorted(row[t] for t in row if t % 4 == 0)
    assert all(r % 2 == 0 for r in rows)
    assert sorted(rows + [r + 1 for r in rows]) == list(range(BN))


def test_token_tile_copies_cover_each_chunk_once(probe):
    # every 16-byte chunk of the tile's rows written exactly once: distinct swizzled offsets
    bm, nt, nt2, _ = probe["case"]
    offs = set()
    for tid in range(THREADS):
        for u in range(-(-bm * 8 // THREADS)):
            c = tid + u * THREADS
            if c >> 3 < nt + nt2:
                r, cc = c >> 3, c & 7
                offs.add(r * 128 + ((cc ^ (r & 7)) << 4))
    assert len(offs) == (nt + nt2) * 8


def test_wgmma_replay_equals_the_reference(probe):
    rows_valid = probe["case"][3]
    got, ref = _replay(probe)
    valid = got[:, :rows_valid]
    assert not np.isnan(valid).any()
    err = np.abs(valid - ref[:, :rows_valid]).max() / np.abs(ref).max()
    assert err < 1e-6, err


def test_scale_scan_flags_exactly_the_bytes_above_128(probe):
    """moe_common.scale_bytes_above_128, the test behind each prefill tile's (and decode tile's)
    choice of the two-multiply path: bit 7 of byte p where, and only where, that byte is above
    128, every other bit 0 (no carry into a neighbour)."""
    rows = probe["bigbyte"]
    assert len(rows) == 256 * 16
    for v, p, *words in rows:
        got = int.from_bytes(b"".join(w.to_bytes(4, "little") for w in words), "little")
        want = (0x80 << (8 * p)) if v > 128 else 0
        assert got == want, (v, p, hex(got))


def test_each_warpgroup_takes_its_rows_path_from_the_flags(probe):
    """_p2_tile's choice (moe_prefill_gpu.p2_rows_big over the `big` input): the two-multiply
    path exactly for the warpgroups whose 64 rows hold a scale byte above 128 (the program puts
    some in 16-row groups 2 and 3: warpgroup 0 takes it, warpgroup 1 not), the same for every
    thread of a warpgroup."""
    scales = np.array([v for _, v in sorted(probe["s"])], dtype=np.uint8).reshape(1, BN, K // 32)
    groups = mxfp4.big_scale_groups(scales)[0]  # either layout: the same bytes per group
    assert groups.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    big = dict(probe["big"])
    for tid in range(THREADS):
        wg = tid // 128
        assert big[tid] == int(groups[4 * wg : 4 * wg + 4].any()), tid


def test_replay_notices_a_wrong_swizzle(probe):
    """The check can fail: reading B without the 128-byte swizzle breaks it."""
    rows_valid = probe["case"][3]
    got, ref = _replay(probe, swizzle=lambda a: a)
    err = np.abs(got[:, :rows_valid] - ref[:, :rows_valid]).max() / np.abs(ref).max()
    assert err > 1e-2
