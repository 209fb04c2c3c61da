"""MXFP4 (OCP microscaling, e2m1 elements + E8M0 block scale) in NumPy.

Checkpoint layout (openai/gpt-oss): `*_blocks [..., n_blocks, 16]` uint8 and
`*_scales [..., n_blocks]` uint8. Byte j of a block holds element 2j in its low
nibble and element 2j+1 in its high nibble; the scale byte s means 2**(s - 127).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK = 32
E8M0_BIAS = 127
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`blocks [..., nb, 16] u8`, `scales [..., nb] u8` -> float32 `[..., nb * 32]`."""
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 shapes disagree: blocks {blocks.shape}, scales {scales.shape}")
    lo = E2M1_VALUES[blocks & 0x0F]
    hi = E2M1_VALUES[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    vals = vals * scale[..., None]
    return vals.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float `[..., n]` (n % 32 == 0) -> (`blocks [..., n/32, 16] u8`, `scales [..., n/32] u8`).

    Round-to-nearest onto the e2m1 grid; the block exponent is the smallest that
    brings the block's largest magnitude to 6 or below, so nothing is clipped.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of {BLOCK}")
    x = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(x).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 6.0)), -E8M0_BIAS)
    exp = np.clip(exp, -E8M0_BIAS, 127).astype(np.int32)
    scaled = x / np.ldexp(np.float32(1.0), exp)[..., None]
    grid = E2M1_VALUES[:8]
    idx = np.abs(np.abs(scaled)[..., None] - grid).argmin(axis=-1).astype(np.uint8)
    codes = idx | np.where(np.signbit(scaled) & (idx > 0), 8, 0).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + E8M0_BIAS).astype(np.uint8)


# The MoE op's layout ("tiled"): per expert, rows in tiles of 16 and blocks in
# pairs, `[rows/16][nb/2][16 rows][2 blocks x 16 bytes]` and scales
# `[rows/16][nb/2][16 rows][2]`, in tensors of the checkpoint's shapes
# (`[E, rows, nb * 16]`, `[E, rows, nb]`). A GPU decode warp's step then reads
# 1 KB of contiguous bytes (whole 128-byte lines) instead of 16 pieces of 64
# bytes, and the prefill kernels keep 32 contiguous bytes per row and k-step
# (bench/NOTES.md, "v8 and the layout probe").
#
# The word repack: each block keeps its place and its 16 bytes; only the bits
# inside it move. The kernels read a block as 4 little-endian u32 words W[0..3].
# Element e = 8c + 2q + b (slot c 0..3, word q 0..3, half b 0..1) lives in word
# q, slot c, half b: checkpoint byte p goes whole into word p % 4, slot p // 4,
# its low nibble as half 0 and its high nibble as half 1. Code bit i (0 = m,
# 1 = e0, 2 = e1, 3 = sign) of (slot c, half b) sits at WORD_BIT_BASE[b][i] (where
# a bf16 pair's low / high half wants it: sign at bf16 bit 15, magnitude at bits
# 8..6) moved up by 6 * c for c = 0, 1, 2, and for c = 3 by 10 (bit 0) or 2
# (bits 1..3), mod 32 (`word_bit_positions`). The kernels decode slot c of a
# word w to a bf16 pair (low half: half 0) as `rotr(w, 6c) & WORD_DECODE_MASK`
# for c < 3 and `(rotr(w, 10) & 0x00400040) | (rotr(w, 2) & 0x81808180)` for
# c = 3: the e2m1 values times 2**-126 (code 1, 0.5, lands on the bf16 subnormal
# 2**-127), so times 2**(s - 1) gives value * 2**(s - 127) for scale byte s.
TILE_ROWS = 16
_THREADED_BYTES = 1 << 26
WORD_BIT_BASE = ((6, 7, 8, 15), (22, 23, 24, 31))  # [half b][code bit i], before the slot's move
WORD_SLOT_ROTATIONS = (0, 6, 12)  # slots 0..2: all four code bits move up by this (mod 32)
WORD_SLOT3_SHIFTS = (10, 2)  # slot 3: code bit 0 (m) moves up by 10, bits 1..3 by 2 (mod 32)
WORD_DECODE_MASK = 0x81C081C0  # slots 0..2 after a rotation right by 6 * c
WORD_SLOT3_DECODE = ((10, 0x00400040), (2, 0x81808180))  # slot 3: (rotation right, mask), or-ed
_WORD_CHUNK = 1 << 16  # blocks per NumPy word-repack step: ~1 MB buffers, few GIL-held calls a step
_TORCH_WORD_CHUNK = 1 << 21  # blocks per step of the torch one (32 MB; bounds its temporaries)


def word_bit_positions() -> np.ndarray:
    """`[slot c, half b, code bit i]` -> the bit (0..31) of its word the word repack stores it at:
    element 8c + 2q + b's code bit i is bit `word_bit_positions()[c, b, i]` of word q."""
    pos = np.empty((4, 2, 4), dtype=np.int64)
    for c in range(4):
        for b in range(2):
            for i in range(4):
                move = WORD_SLOT_ROTATIONS[c] if c < 3 else WORD_SLOT3_SHIFTS[min(i, 1)]
                pos[c, b, i] = (WORD_BIT_BASE[b][i] + move) % 32
    return pos


@functools.cache
def _byte_words() -> np.ndarray:
    """`[slot c, byte]` u64: checkpoint byte (c, q)'s bits in word q of the repacked block."""
    pos = word_bit_positions()
    byte = np.arange(256, dtype=np.uint64)
    out = np.zeros((4, 256), dtype=np.uint64)
    for c in range(4):
        for b in range(2):
            for i in range(4):
                out[c] |= ((byte >> np.uint64(4 * b + i)) & np.uint64(1)) << np.uint64(pos[c, b, i])
    return out


@functools.cache
def _pair_words() -> tuple[np.ndarray, ...]:
    """Per slot c, 65536 u64: a little-endian u16 of checkpoint bytes (c, q), (c, q + 1), q even,
    -> their bits in words q (low half) and q + 1 (high half), a u64 of the repacked block."""
    v = np.arange(1 << 16, dtype=np.uint64)
    return tuple(w[v & np.uint64(255)] | (w[v >> np.uint64(8)] << np.uint64(32)) for w in _byte_words())


def _rotr32(w, r: int):
    """NumPy u32, or torch int64 holding u32 values."""
    return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF


def _slot_bits(w, c: int):
    """The kernels' decode of slot c of words `w`: a bf16 pair's bits."""
    if c < 3:
        return (_rotr32(w, 6 * c) if c else w) & WORD_DECODE_MASK
    (r0, m0), (r1, m1) = WORD_SLOT3_DECODE
    return (_rotr32(w, r0) & m0) | (_rotr32(w, r1) & m1)


def _slot_byte(p):
    """A decoded slot's bf16-pair bits -> its checkpoint byte (values 0..255)."""
    return ((p >> 6) & 0x07) | ((p >> 12) & 0x08) | ((p >> 18) & 0x70) | ((p >> 24) & 0x80)


def _scratch(scratch, name: str, size: int, dtype) -> np.ndarray:
    """A flat buffer of at least `size` items kept on `scratch` (a thread's `threading.local`)."""
    buf = getattr(scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=dtype)
        setattr(scratch, name, buf)
    return buf[:size]


def _lookup_words(w: np.ndarray, out: np.ndarray, scratch) -> None:
    """`w [4, *S]` u32: checkpoint word c of blocks S (bytes (c, q), q = 0..3) -> `out [*S, 2]`
    (contiguous little-endian u64: words 0, 1 and 2, 3 of the repacked blocks). Word c's two u16s
    index slot c's table; a take is NumPy's cheapest per-element gather ('wrap' skips the bounds
    check's branches: every index is in range)."""
    tables = _pair_words()
    idx = _scratch(scratch, "word_idx", out.size, np.intp).reshape(out.shape)
    part = _scratch(scratch, "word_part", out.size, "<u8").reshape(out.shape)
    for c in range(4):
        np.copyto(idx, w[c].view("<u2").reshape(out.shape))
        np.take(tables[c], idx, out=part if c else out, mode="wrap")
        if c:
            np.bitwise_or(out, part, out=out)


def _words_np(src: np.ndarray, dst: np.ndarray, inverse: bool, scratch=None) -> None:
    """The word repack (`inverse`: back) of the contiguous bytes `src` into `dst` (the same size, a
    multiple of 16; `dst` may be `src`), `_WORD_CHUNK` blocks a step. `scratch`: where the steps'
    buffers are kept between calls (a thread's `threading.local`)."""
    n = src.size // 16
    s32 = src.reshape(-1).view("<u4").reshape(n, 4)
    d32 = dst.reshape(-1).view("<u4").reshape(n, 4)
    step = min(n, _WORD_CHUNK)
    scratch = threading.local() if scratch is None else scratch
    for s in range(0, n, step):
        m = min(step, n - s)
        w = _scratch(scratch, "word_w", 4 * m, "<u4").reshape(4, m)
        for c in range(4):  # every word of the step read before any is written
            np.copyto(w[c], s32[s : s + m, c])
        if not inverse:
            _lookup_words(w, d32[s : s + m].view("<u8"), scratch)
            continue
        for c in range(4):  # back: the kernels' decode of slot c of words q = 0..3, one byte each,
            b = _slot_byte(_slot_bits(w, c))  # [q, m], into checkpoint word c
            d32[s : s + m, c] = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)


def _tile_words(src: np.ndarray, dst: np.ndarray, rows: int, nb: int, scratch) -> None:
    """One expert's checkpoint-layout bytes `src` -> the op's layout in `dst` (tiled and word-
    repacked; `dst` may be `src`): a step's checkpoint words are gathered straight from their tiled
    positions (no separate tiling copy), then looked up into `dst`'s same bytes."""
    t, p = rows // TILE_ROWS, nb // 2
    tiled = src.reshape(-1).view("<u4").reshape(t, TILE_ROWS, p, 2, 4).transpose(0, 2, 1, 3, 4)
    out = dst.reshape(-1).view("<u8").reshape(t, p, TILE_ROWS, 2, 2)
    step = max(1, _WORD_CHUNK // (TILE_ROWS * nb))  # whole tiles: a step reads and writes only them
    for t0 in range(0, t, step):
        m = min(step, t - t0)
        w = _scratch(scratch, "word_w", 4 * m * p * TILE_ROWS * 2, "<u4").reshape(4, m, p, TILE_ROWS, 2)
        for c in range(4):
            for k in range(2):  # the pair's block k
                np.copyto(w[c, ..., k], tiled[t0 : t0 + m, :, :, k, c])
        _lookup_words(w, out[t0 : t0 + m], scratch)


def _words_torch_(t, inverse: bool) -> None:
    """The word repack (`inverse`: back) of a contiguous uint8 torch tensor, in place, a bounded
    chunk at a time (int64 arithmetic: no uint32 operations needed)."""
    import torch

    flat = t.view(-1, 16)
    table = torch.from_numpy(_byte_words().astype(np.int64)).to(t.device)
    for s in range(0, flat.shape[0], _TORCH_WORD_CHUNK):
        blk = flat[s : s + _TORCH_WORD_CHUNK]
        m = blk.shape[0]
        if inverse:
            w = blk.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [m, word q]
            out = torch.stack([_slot_byte(_slot_bits(w, c)) for c in range(4)], dim=1)  # [m, c, q]
            blk.copy_(out.reshape(m, 16))
            continue
        b = blk.view(m, 4, 4)  # [m, slot c, word q]
        w = table[0][b[:, 0].long()]
        for c in range(1, 4):
            w |= table[c][b[:, c].long()]
        blk.copy_(((w ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.uint8))  # as int32, exactly


def repack_words(blocks, inverse: bool = False):
    """The word repack alone (see the layout comment above; `inverse`: back) of MXFP4 blocks:
    any contiguous-able uint8 array or torch tensor whose size is a multiple of 16 (`[..., 16]`,
    `[E, rows, nb * 16]`), read as consecutive 16-byte blocks. A new array, same shape."""
    if str(blocks.dtype) not in ("uint8", "torch.uint8"):
        raise TypeError(f"MXFP4 blocks are uint8, got {blocks.dtype}")
    if not isinstance(blocks, np.ndarray):
        out = blocks.contiguous().clone()
        _check_words(out.numel())
        _words_torch_(out, inverse)
        return out
    src = np.ascontiguousarray(blocks)
    _check_words(src.size)
    out = np.empty_like(src)
    _words_np(src, out, inverse)
    return out


def _check_words(size: int) -> None:
    if size % 16:
        raise ValueError(f"MXFP4 blocks are 16 bytes; got {size} bytes")


def check_tileable(rows: int, n_blocks: int) -> None:
    if rows % TILE_ROWS or n_blocks % 2:
        raise ValueError(
            f"the MoE op's tiled MXFP4 layout needs rows % {TILE_ROWS} == 0 and an even number of "
            f"32-element blocks per row (K % 64 == 0); got rows {rows}, blocks {n_blocks}"
        )


def _permute(a, axes):
    return a.permute(*axes) if hasattr(a, "permute") else a.transpose(*axes)


def _contig(a):
    return a.contiguous() if hasattr(a, "contiguous") else np.ascontiguousarray(a)


def _tile(a, rows: int, nb: int, unit: int, inverse: bool, in_place: bool, words: bool = False):
    """`words`: also the word repack of every 16-byte block (blocks, not scales). It commutes with
    the tiling, which moves whole blocks, so each path does it where it is cheapest."""
    e = int(a.shape[0])
    check_tileable(rows, nb)
    t = rows // TILE_ROWS
    src = (e, t, nb // 2, TILE_ROWS, 2 * unit) if inverse else (e, t, TILE_ROWS, nb // 2, 2 * unit)
    if not isinstance(a, np.ndarray):  # torch (the benches)
        out = _contig(_permute(a.reshape(*src), (0, 1, 3, 2, 4))).reshape(a.shape)
        if words:
            if out.data_ptr() == a.data_ptr():  # nothing moved (one tile, one pair): a copy to rewrite
                out = out.clone()
            _words_torch_(out, inverse)
        return out
    if in_place and not (a.flags.writeable and a.flags.c_contiguous):
        raise ValueError("an in-place MXFP4 repack needs a writeable C-contiguous array")
    # NumPy: each row's pair of blocks (or scales) moves as one opaque item, so the copy loop
    # moves 2 * unit bytes per step instead of one byte.
    item = np.dtype((np.void, 2 * unit))
    base = np.ascontiguousarray(a)
    src_bytes = base.reshape(e, -1).view(np.uint8)
    flat = base.reshape(*src).view(item)[..., 0]
    view = flat.transpose(0, 1, 3, 2)
    # In place, each expert goes through a per-thread scratch copy and back into `a`'s own pages (a
    # fresh array's first-touch page faults cost more than the copy itself, ~60 GB at 120b). With
    # `words`, the word repack runs in the same per-expert task: forward, straight from the
    # expert's tiled view into the output, whole tiles a step; back, on the scratch's way out.
    out = flat.reshape(view.shape) if in_place else np.empty(view.shape, dtype=item)
    scratch = threading.local()
    if words:
        _pair_words()  # the tables, built once before any thread needs them

    def copy(i: int) -> None:
        if words and not inverse:  # tiling and word repack in one pass over the expert
            _tile_words(src_bytes[i], out[i].view(np.uint8), rows, nb, scratch)
        elif in_place or words:
            buf = getattr(scratch, "buf", None)
            if buf is None:
                buf = scratch.buf = np.empty(view.shape[1:], dtype=item)
            buf[...] = view[i]
            if words:  # back: untiled, then the word repack undone on the way into the output
                _words_np(buf.view(np.uint8), out[i].view(np.uint8), True, scratch)
            else:
                out[i] = buf
        else:
            out[i] = view[i]

    if a.nbytes < _THREADED_BYTES:
        for i in range(e):
            copy(i)
    else:  # a full-size layer (~1 GB at 120b): one expert per task, NumPy's copy releases the GIL
        with ThreadPoolExecutor(min(e, os.cpu_count() or 1)) as pool:
            list(pool.map(copy, range(e)))
    return a if in_place else out.view(a.dtype).reshape(a.shape)


def tile_blocks(blocks, inverse: bool = False, in_place: bool = False):
    """`blocks [E, rows, nb, 16]` or `[E, rows, nb * 16]` u8 (NumPy or torch) between the
    checkpoint's layout and the op's (`inverse`: back), same shape: the blocks tiled, and the
    bits inside each block word-repacked (the layout comment above; `inverse` undoes the word
    repack, then the tiling). `in_place` (NumPy, an array nothing else reads): rewrite `blocks`
    itself and return it. Large NumPy layers go one expert per thread, tiling and word repack in
    the same task; torch tensors (any device) are repacked a bounded chunk at a time."""
    rows = int(blocks.shape[1])
    nb = int(blocks.shape[2]) if blocks.ndim == 4 else int(blocks.shape[2]) // (BLOCK // 2)
    return _tile(blocks, rows, nb, BLOCK // 2, inverse, in_place, words=True)


def tile_scales(scales, inverse: bool = False, in_place: bool = False):
    """`scales [E, rows, nb]` u8 between the checkpoint's layout and the op's tiled one."""
    return _tile(scales, int(scales.shape[1]), int(scales.shape[2]), 1, inverse, in_place)


# Scale bytes above this take the prefill GEMM's two-multiply decode (2^(s-1) overflows bf16).
BIG_SCALE = 128


def big_scale_groups(scales) -> np.ndarray:
    """`scales [E, rows, nb]` u8, in the checkpoint's layout or the op's tiled one (tiling moves
    bytes only within a 16-row group, so a group holds the same bytes in both) ->
    `[E, rows / 16]` u8, the MoE ops' `big` input: 1 where a scale byte of rows
    16g .. 16g + 15 is above 128, else 0."""
    a = np.asarray(scales)
    if a.dtype != np.uint8 or a.ndim != 3:
        raise ValueError(f"scales must be [E, rows, nb] u8, got {a.dtype} {a.shape}")
    e, rows, nb = (int(d) for d in a.shape)
    if rows % TILE_ROWS:
        raise ValueError(f"scales rows must be a multiple of {TILE_ROWS}, got {rows}")
    return (a.reshape(e, rows // TILE_ROWS, TILE_ROWS * nb).max(axis=2) > BIG_SCALE).astype(np.uint8)


def tile_for_op(blocks, scales):
    """Checkpoint layout -> the MoE op's layout (tiled, word-repacked blocks), both tensors
    (shapes kept)."""
    return tile_blocks(blocks), tile_scales(scales)


def untile_from_op(blocks, scales):
    """Inverse of `tile_for_op`."""
    return tile_blocks(blocks, inverse=True), tile_scales(scales, inverse=True)
