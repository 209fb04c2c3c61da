# gptoss_tap: an identity op that prints a hash of its input's bits, for
# finding where two runs of the same step first differ (GPTOSS_MAX_TAP, a
# check: arch code inserts it only when that setting is on at graph build).
#
# The hash is a wrapping sum over elements of a mix of (index, bits), so it
# does not depend on the order the GPU adds the terms in: equal tensors give
# equal hashes, and a single changed bit changes the hash (almost surely).
# Printed as `gptoss_tap <tag> <elements> <hash>` (the tag: the graph's tap
# number in build order; scripts/gpu_repeat.py's taps_summary reads it).

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu import barrier, thread_idx
from max.gpu.host import DeviceContext
from std.memory import bitcast, stack_allocation
from max.gpu.memory import AddressSpace

comptime TAP_THREADS = 1024


@always_inline
def tap_mix(i: Int, bits: UInt64) -> UInt64:
    """The splitmix64 finalizer over the element's bits and index."""
    var z = bits ^ (UInt64(i) * 0x9E3779B97F4A7C15)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@always_inline
def tap_bits[dtype: DType](p: Pointer[Scalar[dtype], _], i: Int) -> UInt64:
    comptime if dtype == DType.bfloat16:
        return UInt64(bitcast[DType.uint16](p[unsafe_offset=i]))
    else:
        return UInt64(bitcast[DType.uint32](p[unsafe_offset=i].cast[DType.float32]()))


def tap_kernel[
    dtype: DType
](dst: Pointer[Scalar[dtype], MutAnyOrigin], x: Pointer[Scalar[dtype], ImmutAnyOrigin], n_: Int64, tag: Int64):
    """One block: copies x to dst and prints the hash of x."""
    var n = Int(n_)
    var tid = Int(thread_idx.x)
    var sums = stack_allocation[TAP_THREADS, UInt64, address_space=AddressSpace.SHARED]()
    var s = UInt64(0)
    var i = tid
    while i < n:
        dst[unsafe_offset=i] = x[unsafe_offset=i]
        s += tap_mix(i, tap_bits[dtype](x, i))
        i += TAP_THREADS
    sums[unsafe_offset=tid] = s
    barrier()
    var width = TAP_THREADS // 2
    while width > 0:
        if tid < width:
            sums[unsafe_offset=tid] = sums[unsafe_offset=tid] + sums[unsafe_offset=tid + width]
        barrier()
        width //= 2
    if tid == 0:
        print("gptoss_tap", tag, n, sums[unsafe_offset=0])


@extensibility.register("gptoss_tap")
struct Tap:
    """Identity, output = x ([N, M], float32 | bfloat16), that prints `gptoss_tap <tag> <elements> <hash>`.
    tag: CPU int32 scalar. after: any rank-2 tensor, not read: a weight's tap given the step's
    input runs at every step instead of once at load (the graph compiler hoists ops of weights
    alone)."""

    @staticmethod
    def execute[
        target: StaticString,
    ](
        output: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=output.dtype, rank=2, ...],
        tag: Int32,
        after: InputTensor[rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime dtype = output.dtype
        var n = x.size()
        var op = output.unsafe_ptr()
        var xp = x.unsafe_ptr()
        comptime if target == "gpu":
            ctx.enqueue_function[tap_kernel[dtype]](op, xp, Int64(n), Int64(tag), grid_dim=1, block_dim=TAP_THREADS)
            return
        var s = UInt64(0)
        for i in range(n):
            op[unsafe_offset=i] = xp[unsafe_offset=i]
            s += tap_mix(i, tap_bits[dtype](xp, i))
        print("gptoss_tap", tag, n, s)
