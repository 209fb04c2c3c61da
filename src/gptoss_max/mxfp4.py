"""MXFP4 (OCP microscaling, e2m1 elements + E8M0 block scale) in NumPy.

Checkpoint layout (openai/gpt-oss): `*_blocks [..., n_blocks, 16]` uint8 and
`*_scales [..., n_blocks]` uint8. Byte j of a block holds element 2j in its low
nibble and element 2j+1 in its high nibble; the scale byte s means 2**(s - 127).
"""

from __future__ import annotations

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
TILE_ROWS = 16
_THREADED_BYTES = 1 << 26


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


def _tile(a, rows: int, nb: int, unit: int, inverse: bool, in_place: bool):
    e = int(a.shape[0])
    check_tileable(rows, nb)
    t = rows // TILE_ROWS
    src = (e, t, nb // 2, TILE_ROWS, 2 * unit) if inverse else (e, t, TILE_ROWS, nb // 2, 2 * unit)
    if not isinstance(a, np.ndarray):  # torch (the benches)
        return _contig(_permute(a.reshape(*src), (0, 1, 3, 2, 4))).reshape(a.shape)
    if in_place and not (a.flags.writeable and a.flags.c_contiguous):
        raise ValueError("an in-place MXFP4 repack needs a writeable C-contiguous array")
    # NumPy: each row's pair of blocks (or scales) moves as one opaque item, so the copy loop
    # moves 2 * unit bytes per step instead of one byte.
    item = np.dtype((np.void, 2 * unit))
    flat = np.ascontiguousarray(a).reshape(*src).view(item)[..., 0]
    view = flat.transpose(0, 1, 3, 2)
    if in_place:
        # each expert goes through a per-thread scratch copy and back into `a`'s own pages; a fresh
        # array's first-touch page faults cost more than the copy itself (~60 GB at 120b).
        out = flat.reshape(view.shape)
        scratch = threading.local()

        def copy(i: int) -> None:
            buf = getattr(scratch, "buf", None)
            if buf is None:
                buf = scratch.buf = np.empty(view.shape[1:], dtype=item)
            buf[...] = view[i]
            out[i] = buf

    else:
        out = np.empty(view.shape, dtype=item)

        def copy(i: int) -> None:
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
    checkpoint's layout and the op's tiled one (`inverse`: back), same shape. `in_place`
    (NumPy, an array nothing else reads): rewrite `blocks` itself and return it."""
    rows = int(blocks.shape[1])
    nb = int(blocks.shape[2]) if blocks.ndim == 4 else int(blocks.shape[2]) // (BLOCK // 2)
    return _tile(blocks, rows, nb, BLOCK // 2, inverse, in_place)


def tile_scales(scales, inverse: bool = False, in_place: bool = False):
    """`scales [E, rows, nb]` u8 between the checkpoint's layout and the op's tiled one."""
    return _tile(scales, int(scales.shape[1]), int(scales.shape[2]), 1, inverse, in_place)


def tile_for_op(blocks, scales):
    """Checkpoint layout -> the MoE op's tiled layout, both tensors (shapes kept)."""
    return tile_blocks(blocks), tile_scales(scales)


def untile_from_op(blocks, scales):
    """Inverse of `tile_for_op`."""
    return tile_blocks(blocks, inverse=True), tile_scales(scales, inverse=True)
