// What the GPU probes under scripts/ share (pdl_preload_probe.cu, pdl_prewait_probe.cu, built by nvcc;
// fp8_wgmma_probe.cu, by NVRTC through CuPy, device part only): a checked runtime call, a launch with
// or without PDL, and a 16-byte streaming load.
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

// `kernel<<<grid, block, smem, s>>>(args...)`, with programmatic stream serialization (PDL) when
// `pdl`: the kernel may then start while the one before it in `s` still runs.
template <typename K, typename... A>
static void launch(K kernel, int grid, int block, int smem, cudaStream_t s, bool pdl, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
#endif

#ifndef PROBE_HOST_CHECK
// 16 bytes of a weight streamed once: the read-only path, not kept in L1.
__device__ __forceinline__ uint4 ld_na(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
#endif
