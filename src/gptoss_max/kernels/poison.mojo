# GPTOSS_MAX_POISON: a check that an op reads nothing of its outputs before it
# writes them.
#
# MAX hands an op its output (and scratch output) tensors in memory that held
# other tensors a moment ago. An op that reads a byte of its outputs (a
# workspace it assumed zeroed, a tile row it never stored) before writing it
# gives results that depend on whatever ran before it: not repeatable, and
# invisible in an op test, which sees the same leftovers every run. With
# GPTOSS_MAX_POISON set, each op fills its outputs with one byte first:
#   zero   0x00
#   small  0x3c   (bf16 0.0115, f32 0.0115)
#   big    0x7b   (bf16 / f32 ~1.3e36)
#   nan    0xff   (a NaN in every float)
# and must then give the same bits as without it (tests/test_poison.py, the op
# tests' `memory_held` checks). Read at each launch; unset (the default) costs one
# getenv per op.

from max.gpu import block_idx, grid_dim, thread_idx
from max.gpu.host import DeviceContext
from std.os import getenv
from std.sys import size_of

comptime POISON_THREADS = 256


def poison_byte() -> Int:
    """The fill byte GPTOSS_MAX_POISON names, -1 when unset (or empty)."""
    var v = getenv("GPTOSS_MAX_POISON", "")
    if v == "":
        return -1
    if v == "zero":
        return 0x00
    if v == "small":
        return 0x3C
    if v == "big":
        return 0x7B
    if v == "nan":
        return 0xFF
    return -2


def poison_kernel(p: Pointer[UInt8, MutAnyOrigin], n_: Int64, value: UInt8):
    var n = Int(n_)
    var i = Int(block_idx.x) * POISON_THREADS + Int(thread_idx.x)
    var stride = Int(grid_dim.x) * POISON_THREADS
    while i < n:
        p[unsafe_offset=i] = value
        i += stride


def poison[
    dtype: DType, //, target: StaticString
](ctx: DeviceContext, p: Pointer[Scalar[dtype], MutAnyOrigin], count: Int) raises:
    """Fill `count` elements at p with GPTOSS_MAX_POISON's byte, if it is set;
    on the GPU as a launch before the op's own (same stream)."""
    var b = poison_byte()
    if b == -1 or count <= 0:
        return
    if b == -2:
        raise Error("GPTOSS_MAX_POISON must be zero, small, big or nan")
    var n = count * size_of[dtype]()
    var bytes = p.unsafe_bitcast[UInt8]()
    comptime if target == "gpu":
        ctx.enqueue_function[poison_kernel](
            bytes, Int64(n), UInt8(b),
            grid_dim=min((n + POISON_THREADS - 1) // POISON_THREADS, 8192), block_dim=POISON_THREADS,
        )
    else:
        for i in range(n):
            bytes[unsafe_offset=i] = UInt8(b)
