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


def _fill_byte(name: String) -> Int:
    """The fill byte the variable `name` names, -1 when unset (or empty), -2 when unknown."""
    var v = getenv(name, "")
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


def poison_byte() -> Int:
    """The fill byte GPTOSS_MAX_POISON names, -1 when unset (or empty)."""
    return _fill_byte("GPTOSS_MAX_POISON")


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
    _fill[target](ctx, p, count, "GPTOSS_MAX_POISON")


def scrub[
    dtype: DType, //, target: StaticString
](ctx: DeviceContext, p: Pointer[Scalar[dtype], MutAnyOrigin], count: Int) raises:
    """GPTOSS_MAX_SCRUB, the other side of GPTOSS_MAX_POISON: after an op's own
    launches, fill `count` elements at p, memory the op leaves behind that no
    later op reads as such (its scratch, an input it was the last reader of),
    with the named byte. MAX hands that memory to later tensors, so what an op
    leaves there reaches any later kernel that reads memory it did not write;
    the MXFP4 prefill MoE leaves rows and ids in an order set by its atomics.
    If a model repeats with it and not without, such a read is the cause."""
    _fill[target](ctx, p, count, "GPTOSS_MAX_SCRUB")


def _fill[
    dtype: DType, //, target: StaticString
](ctx: DeviceContext, p: Pointer[Scalar[dtype], MutAnyOrigin], count: Int, name: String) raises:
    var b = _fill_byte(name)
    if b == -1 or count <= 0:
        return
    if b == -2:
        raise Error(name + " must be zero, small, big or nan")
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
