# MXFP4 (OCP microscaling): e2m1 element codes with an E8M0 block scale.
# Byte j of a 16-byte block holds element 2j in its low nibble and element
# 2j+1 in its high nibble; scale byte s means 2^(s - 127).

from std.bit import rotate_bits_right
from std.memory import bitcast

comptime MXFP4_BLOCK = 32
comptime MXFP4_BLOCK_BYTES = 16


@always_inline
def mxfp4_value(code: UInt8, scale: UInt8) -> Float32:
    """Returns e2m1 `code` times 2^(scale - 127), built from bits.

    The float is assembled with integer exponent arithmetic rather than a
    multiply, so subnormal results (tiny scales) are exact whatever the
    device's flush-to-zero mode; overflow gives +-inf like an f32 multiply.
    """
    var c = UInt32(code)
    var sign = (c & 8) << 28
    var e = (c >> 1) & 3
    # Nonzero magnitudes are (1 + mbit/2) * 2^exp2: 0.5 has exp2 -1, mbit 0.
    var mbit = c & 1 if e != 0 else UInt32(0)
    var biased = Int32(e) - 1 + Int32(scale)
    var mag: UInt32 = 0
    if (c & 7) == 0:
        pass
    elif biased >= 255:
        mag = 0x7F800000
    elif biased >= 1:
        mag = (UInt32(biased) << 23) | (mbit << 22)
    else:
        # Subnormal: (2 + mbit) * 2^(biased - 128) = m * 2^-149.
        mag = (2 + mbit) << UInt32(biased + 21)
    return bitcast[DType.float32](sign | mag)


@always_inline
def mxfp4_element(
    blocks: Pointer[UInt8, _],
    scales: Pointer[UInt8, _],
    j: Int,
) -> Float32:
    """Element j of one MXFP4 row (`blocks` [n/2], `scales` [n/32])."""
    var byte = blocks[unsafe_offset=j // 2]
    var code = (byte >> 4) if (j & 1) != 0 else (byte & 0x0F)
    return mxfp4_value(code, scales[unsafe_offset=j // MXFP4_BLOCK])


@always_inline
def mxfp4_block_dot[
    dtype: DType
](codes: SIMD[DType.uint8, MXFP4_BLOCK_BYTES], scale: UInt8, x: Pointer[Scalar[dtype], _]) -> Float32:
    """Dot product of one MXFP4 block (its 16 code bytes in the checkpoint's
    order, its scale byte) with `x` [32], in f32."""
    var acc: Float32 = 0
    for j in range(MXFP4_BLOCK_BYTES):
        var byte = codes[j]
        acc += mxfp4_value(byte & 0x0F, scale) * x[unsafe_offset=2 * j].cast[DType.float32]()
        acc += mxfp4_value(byte >> 4, scale) * x[unsafe_offset=2 * j + 1].cast[DType.float32]()
    return acc


# The MoE op's tiled expert layout (gptoss_max.mxfp4.tile_for_op): per expert,
# [rows/16][nb/2][16 rows][2 blocks x 16 bytes], scales [rows/16][nb/2][16 rows][2];
# inside each block the bits are word-repacked (slot_bits below).
comptime TILE_ROWS = 16


@always_inline
def tiled_block_offset(r: Int, c: Int, nb: Int) -> Int:
    """Byte offset, within an expert, of block c of row r (nb blocks per row)."""
    return (r >> 4) * (nb * 256) + (c >> 1) * 512 + (r & 15) * 32 + (c & 1) * 16


@always_inline
def tiled_scale_offset(r: Int, c: Int, nb: Int) -> Int:
    """Byte offset, within an expert, of the scale of block c of row r."""
    return (r >> 4) * (nb * 16) + (c >> 1) * 32 + (r & 15) * 2 + (c & 1)


# The tiled layout's word repack (gptoss_max/mxfp4.py): inside each 16-byte
# block (32 elements of one row, one scale), u32 word q holds the four pairs
# (8c + 2q, 8c + 2q + 1), slot c = 0..3, each pair's two codes with their bits
# where a bf16 pair wants them (signs at 15 / 31, magnitudes e1 e0 m at 8..6 /
# 24..22), rotated left by 0, 6, 12 for slots 0-2 and split for slot 3 (bits 6
# and 22 rotated by 10, the rest by 2). So a pair decodes with at most a
# rotate and a mask (slot 3: two of each) and the scale multiply, and the
# pair order is the natural one: pair (q, c) is activation pair word 4c + q.
comptime PAIR_BITS: UInt32 = 0x81C081C0


@always_inline
def slot_bits[c: Int](w: UInt32) -> UInt32:
    """Slot c's pair of a repacked word as bf16 pair bits (low half: element
    8c + 2q, high half: + 1): the e2m1 values times 2^-126 (code 1 lands on
    the bf16 subnormal 2^-127)."""
    comptime if c == 0:
        return w & PAIR_BITS
    elif c == 1:
        return rotate_bits_right[6](w) & PAIR_BITS
    elif c == 2:
        return rotate_bits_right[12](w) & PAIR_BITS
    else:
        return (rotate_bits_right[10](w) & 0x00400040) | (rotate_bits_right[2](w) & 0x81808180)


@always_inline
def slot_byte(p: UInt32) -> UInt32:
    """slot_bits' bf16 pair bits -> the pair's checkpoint byte (low nibble:
    the low half's code, high nibble: the high half's)."""
    return ((p >> 6) & 0x07) | ((p >> 12) & 0x08) | ((p >> 18) & 0x70) | ((p >> 24) & 0x80)


@always_inline
def unpack_tiled_block(blocks: Pointer[UInt8, _]) -> SIMD[DType.uint8, 16]:
    """The 16 bytes of one tiled (word-repacked) block in the checkpoint's
    order (byte j holds element 2j in its low nibble, 2j + 1 in its high),
    by the kernels' own slot decode: slot c of word q is byte 4c + q."""
    var out = SIMD[DType.uint8, 16](0)
    for q in range(4):
        var w = (
            UInt32(blocks[unsafe_offset=4 * q])
            | (UInt32(blocks[unsafe_offset=4 * q + 1]) << 8)
            | (UInt32(blocks[unsafe_offset=4 * q + 2]) << 16)
            | (UInt32(blocks[unsafe_offset=4 * q + 3]) << 24)
        )
        comptime for c in range(4):
            out[4 * c + q] = UInt8(slot_byte(slot_bits[c](w)))
    return out


@always_inline
def mxfp4_tiled_row_dot[
    dtype: DType
](
    blocks: Pointer[UInt8, _],
    scales: Pointer[UInt8, _],
    r: Int,
    x: Pointer[Scalar[dtype], _],
    n: Int,
) -> Float32:
    """Dot product of row r of one expert in the tiled layout (`blocks`,
    `scales`: the expert's first byte; n elements per row; each block's bits
    word-repacked)."""
    var nb = n // MXFP4_BLOCK
    var acc: Float32 = 0
    for c in range(nb):
        acc += mxfp4_block_dot(
            unpack_tiled_block(blocks.unsafe_offset(tiled_block_offset(r, c, nb))),
            scales[unsafe_offset=tiled_scale_offset(r, c, nb)],
            x.unsafe_offset(c * MXFP4_BLOCK),
        )
    return acc
