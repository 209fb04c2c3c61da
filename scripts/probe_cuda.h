// What the nvcc-built GPU probes under scripts/ share (pdl_preload_probe.cu, pdl_prewait_probe.cu).
// Under NVRTC (tests/test_cuda_probe_sources.py) only the device part is compiled; under g++ with
// -DPROBE_HOST_CHECK (the host-code check of the same tests) only the host part.
#pragma once

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

// A CUDA runtime call that must succeed: on failure, where and why, then exit(1).
#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)
#endif

#ifndef PROBE_HOST_CHECK
// 16 bytes of a weight streamed once: the read-only path, not kept in L1.
__device__ __forceinline__ uint4 ld_na(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
#endif
