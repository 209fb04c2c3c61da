# MXFP4 (OCP microscaling): e2m1 element codes with an E8M0 block scale.
# Byte j of a 16-byte block holds element 2j in its low nibble and element
# 2j+1 in its high nibble; scale byte s means 2^(s - 127).

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
def mxfp4_row_dot[
    dtype: DType
](
    blocks: Pointer[UInt8, _],
    scales: Pointer[UInt8, _],
    x: Pointer[Scalar[dtype], _],
    n: Int,
) -> Float32:
    """Dot product of one MXFP4 row (`blocks` [n/2], `scales` [n/32]) with
    `x` [n], decoding on the fly, accumulated in f32."""
    var acc: Float32 = 0
    for b in range(n // MXFP4_BLOCK):
        var s = scales[unsafe_offset=b]
        var base = b * MXFP4_BLOCK
        for j in range(MXFP4_BLOCK_BYTES):
            var byte = blocks[unsafe_offset=b * MXFP4_BLOCK_BYTES + j]
            var x0 = x[unsafe_offset=base + 2 * j].cast[DType.float32]()
            var x1 = x[unsafe_offset=base + 2 * j + 1].cast[DType.float32]()
            acc += mxfp4_value(byte & 0x0F, s) * x0
            acc += mxfp4_value(byte >> 4, s) * x1
    return acc


# The MoE op's tiled expert layout (gptoss_max.mxfp4.tile_for_op): per expert,
# [rows/16][nb/2][16 rows][2 blocks x 16 bytes], scales [rows/16][nb/2][16 rows][2].
comptime TILE_ROWS = 16


@always_inline
def tiled_block_offset(r: Int, c: Int, nb: Int) -> Int:
    """Byte offset, within an expert, of block c of row r (nb blocks per row)."""
    return (r >> 4) * (nb * 256) + (c >> 1) * 512 + (r & 15) * 32 + (c & 1) * 16


@always_inline
def tiled_scale_offset(r: Int, c: Int, nb: Int) -> Int:
    """Byte offset, within an expert, of the scale of block c of row r."""
    return (r >> 4) * (nb * 16) + (c >> 1) * 32 + (r & 15) * 2 + (c & 1)


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
    """mxfp4_row_dot of row r of one expert in the tiled layout (`blocks`,
    `scales`: the expert's first byte; n elements per row)."""
    var nb = n // MXFP4_BLOCK
    var acc: Float32 = 0
    for c in range(nb):
        acc += mxfp4_row_dot(
            blocks.unsafe_offset(tiled_block_offset(r, c, nb)),
            scales.unsafe_offset(tiled_scale_offset(r, c, nb)),
            x.unsafe_offset(c * MXFP4_BLOCK),
            MXFP4_BLOCK,
        )
    return acc
