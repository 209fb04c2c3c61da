// Does loading before griddepcontrol.wait cost time in a CUDA graph? (issue 9 / 4 diagnostic)
// Built and run by scripts/pdl_prewait_probe.py (which documents it); prints one JSON object.
//
// A stand-in for a batch-1 decode layer's last three kernels, chained LAYERS times, each layer
// on its own weights (together far beyond L2):
// k_stream1  like the one-token gate_up: 1440 blocks of 2 warps (one wave), each warp streams
//            its share of a 33 MB weight and writes one float of h.
// k_stream2  like the one-token down: 180 blocks of 12 warps, 44 KB of shared memory each (two
//            per SM), each warp streams its share of a 16.6 MB weight; it reads h (k_stream1's)
//            and writes one float of out. `pre`: each warp issues its first PRE_LOADS 16-byte
//            loads per lane before its griddepcontrol.wait (the v26 down's order); otherwise it
//            waits first (main's).
// k_head     like the qkv head's streaming kernel: one block of 8 warps per SM (held there by
//            120 KB of shared memory), streams a 30 MB weight, reads out.
// Every kernel calls griddepcontrol.wait, then griddepcontrol.launch_dependents (after its
// pre-wait loads, if any) and is launched with programmatic stream serialization when `pdl`.
// Timed: the chain launched on a stream, and the same chain captured once as a CUDA graph and
// replayed; CUDA events, median of REPS. In graph replay also: PDL on some kernels' launches
// only (`mask`), and every kernel signalling its dependents after its weight stream (`late`).
// tests/test_cuda_probe_sources.py compiles the kernels with NVRTC (the host part left out) and
// checks the host part with g++ (-DPROBE_HOST_CHECK: the kernels as declarations).
#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>
#else
typedef unsigned long size_t;
#endif
#include "probe_cuda.h"  // CK, launch, ld_na

#define LAYERS 24
#define W1_BYTES (33u << 20)
#define W2_BYTES (16u << 20)
#define W3_BYTES (30u << 20)
#define G1 1440
#define T1 64
#define G2 180
#define T2 384
#define SMEM2 (44 * 1024)
#define T3 256
#define SMEM3 (120 * 1024)
#define PRE_LOADS 2
#define REPS 15

#ifdef PROBE_HOST_CHECK  // tests: the host part alone, by g++ against the CUDA runtime's headers
__global__ void k_stream1(const uint4* __restrict__ w, const float* __restrict__ x, float* h, int late);
__global__ void k_stream2(const uint4* __restrict__ w, const float* h, float* out, int pre, int late);
__global__ void k_head(const uint4* __restrict__ w, const float* out, float* x, int late);
#else
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ (v.y * 3u) ^ (v.z * 5u) ^ (v.w * 7u); }

// One warp's share [lo, hi) of w (in 16-byte units), 4 loads in flight per lane.
__device__ __forceinline__ unsigned stream(const uint4* w, size_t lo, size_t hi, unsigned acc) {
    unsigned lane = threadIdx.x & 31;
    size_t i = lo + lane;
    for (; i + 96 < hi; i += 128) {
        uint4 a = ld_na(w + i), b = ld_na(w + i + 32), c = ld_na(w + i + 64), d = ld_na(w + i + 96);
        acc += fold(a) + fold(b) + fold(c) + fold(d);
    }
    for (; i < hi; i += 32) acc += fold(ld_na(w + i));
    return acc;
}

__device__ __forceinline__ unsigned warp_xor(unsigned v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v ^= __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__global__ void __launch_bounds__(T1) k_stream1(const uint4* __restrict__ w, const float* __restrict__ x, float* h, int late) {
    pdl_wait();
    if (!late) pdl_launch();
    unsigned warps = gridDim.x * (T1 / 32), wid = blockIdx.x * (T1 / 32) + threadIdx.x / 32;
    size_t n = W1_BYTES / 16, lo = n * wid / warps, hi = n * (wid + 1) / warps;
    unsigned acc = stream(w, lo, hi, __float_as_uint(x[wid & 255]));
    if (late) pdl_launch();
    acc = warp_xor(acc);
    if ((threadIdx.x & 31) == 0) h[wid] = (float)(acc & 1023);
}

__global__ void __launch_bounds__(T2, 2) k_stream2(const uint4* __restrict__ w, const float* h, float* out, int pre, int late) {
    extern __shared__ unsigned sm2[];
    unsigned warps = gridDim.x * (T2 / 32), wid = blockIdx.x * (T2 / 32) + threadIdx.x / 32;
    size_t n = W2_BYTES / 16, lo = n * wid / warps, hi = n * (wid + 1) / warps;
    unsigned lane = threadIdx.x & 31, acc = 0;
    size_t start = lo;
    if (pre) {  // the first PRE_LOADS loads per lane before the wait, as v26's down
        uint4 v[PRE_LOADS];
#pragma unroll
        for (int k = 0; k < PRE_LOADS; k++) v[k] = ld_na(w + lo + lane + 32 * k);
        start = lo + 32 * PRE_LOADS;
        pdl_wait();
        if (!late) pdl_launch();
#pragma unroll
        for (int k = 0; k < PRE_LOADS; k++) acc += fold(v[k]);
    } else {
        pdl_wait();
        if (!late) pdl_launch();
    }
    acc += __float_as_uint(h[wid % (G1 * (T1 / 32))]);
    acc = stream(w, start, hi, acc);
    if (late) pdl_launch();
    acc = warp_xor(acc);
    sm2[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned s = 0;
        for (int i = 0; i < T2; i += 32) s ^= sm2[i];
        out[blockIdx.x] = (float)(s & 1023);
    }
}

__global__ void __launch_bounds__(T3, 1) k_head(const uint4* __restrict__ w, const float* out, float* x, int late) {
    extern __shared__ unsigned sm3[];
    pdl_wait();
    if (!late) pdl_launch();
    unsigned warps = gridDim.x * (T3 / 32), wid = blockIdx.x * (T3 / 32) + threadIdx.x / 32;
    size_t n = W3_BYTES / 16, lo = n * wid / warps, hi = n * (wid + 1) / warps;
    unsigned acc = stream(w, lo, hi, __float_as_uint(out[wid % G2]));
    if (late) pdl_launch();
    acc = warp_xor(acc);
    sm3[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) x[blockIdx.x & 255] = (float)(sm3[0] & 1023);
}

#endif

#ifndef __CUDACC_RTC__
struct Bufs {
    uint4 *w1, *w2, *w3;
    float *x, *h, *out;
};

// mask: which kernels launch with the PDL attribute (1 the gate_up stand-in, 2 the down, 4 the
// head); late: every kernel signals its dependents after its weight stream, not at its start.
static void chain(const Bufs& b, cudaStream_t s, int mask, int pre, int late, bool head, int sms) {
    for (int l = 0; l < LAYERS; l++) {
        const uint4* w1 = b.w1 + (size_t)l * (W1_BYTES / 16);
        const uint4* w2 = b.w2 + (size_t)l * (W2_BYTES / 16);
        const uint4* w3 = b.w3 + (size_t)l * (W3_BYTES / 16);
        launch(k_stream1, G1, T1, 0, s, mask & 1, w1, (const float*)b.x, b.h, late);
        launch(k_stream2, G2, T2, SMEM2, s, mask & 2, w2, (const float*)b.h, b.out, pre, late);
        if (head) launch(k_head, sms, T3, SMEM3, s, mask & 4, w3, (const float*)b.out, b.x, late);
    }
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    // `soak N`: the chain with the head, PDL on every launch, replayed N times as one graph; prints
    // every replay's µs per layer (are replay times bimodal on this GPU, without MAX?)
    int soak = argc > 2 && std::string(argv[1]) == "soak" ? atoi(argv[2]) : 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int sms = prop.multiProcessorCount;
    Bufs b;
    CK(cudaMalloc(&b.w1, (size_t)LAYERS * W1_BYTES));
    CK(cudaMalloc(&b.w2, (size_t)LAYERS * W2_BYTES));
    CK(cudaMalloc(&b.w3, (size_t)LAYERS * W3_BYTES));
    CK(cudaMemset(b.w1, 1, (size_t)LAYERS * W1_BYTES));
    CK(cudaMemset(b.w2, 2, (size_t)LAYERS * W2_BYTES));
    CK(cudaMemset(b.w3, 3, (size_t)LAYERS * W3_BYTES));
    CK(cudaMalloc(&b.x, 256 * sizeof(float)));
    CK(cudaMalloc(&b.h, G1 * (T1 / 32) * sizeof(float)));
    CK(cudaMalloc(&b.out, G2 * sizeof(float)));
    CK(cudaMemset(b.x, 0, 256 * sizeof(float)));
    CK(cudaFuncSetAttribute((const void*)k_stream2, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM2));
    CK(cudaFuncSetAttribute((const void*)k_head, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM3));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    if (soak > 0) {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        chain(b, s, 7, 0, 0, true, sms);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&exec, g, 0));
        CK(cudaGraphDestroy(g));
        std::vector<cudaEvent_t> ev(soak + 1);
        for (auto& e : ev) CK(cudaEventCreate(&e));
        CK(cudaEventRecord(ev[0], s));
        for (int r = 0; r < soak; r++) {  // back to back, as decode steps replay
            CK(cudaGraphLaunch(exec, s));
            CK(cudaEventRecord(ev[r + 1], s));
        }
        CK(cudaStreamSynchronize(s));
        printf("{\"device\": \"%s\", \"sms\": %d, \"layers\": %d, \"soak_us_per_layer\": [", prop.name, sms, LAYERS);
        for (int r = 0; r < soak; r++) {
            float ms;
            CK(cudaEventElapsedTime(&ms, ev[r], ev[r + 1]));
            printf("%s%.3f", r ? ", " : "", ms * 1000.f / LAYERS);
        }
        printf("]}\n");
        CK(cudaGraphExecDestroy(exec));
        return 0;
    }
    printf("{\"device\": \"%s\", \"sms\": %d, \"layers\": %d, \"rows\": [\n", prop.name, sms, LAYERS);
    struct Variant {
        int head, graph, mask, pre, late;
    };
    std::vector<Variant> vs;
    for (int head = 1; head >= 0; head--)
        for (int graph = 1; graph >= 0; graph--)
            for (int pdl = 1; pdl >= 0; pdl--)
                for (int pre = 0; pre <= pdl; pre++)  // without PDL the order inside k_stream2 is moot
                    vs.push_back({head, graph, pdl ? 7 : 0, pre, 0});
    // In graph replay: PDL on some edges only, and every kernel signalling late.
    for (int head = 1; head >= 0; head--) {
        for (int mask = 1; mask < (head ? 7 : 3); mask++) vs.push_back({head, 1, mask, 0, 0});
        vs.push_back({head, 1, 7, 0, 1});
    }
    bool first = true;
    for (const Variant& v : vs) {
        cudaGraphExec_t exec = nullptr;
        if (v.graph) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            chain(b, s, v.mask, v.pre, v.late, v.head, sms);
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&exec, g, 0));
            CK(cudaGraphDestroy(g));
        }
        std::vector<float> ts;
        for (int r = 0; r < REPS + 2; r++) {
            CK(cudaEventRecord(e0, s));
            if (v.graph)
                CK(cudaGraphLaunch(exec, s));
            else
                chain(b, s, v.mask, v.pre, v.late, v.head, sms);
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) ts.push_back(ms * 1000.f / LAYERS);
        }
        if (exec) CK(cudaGraphExecDestroy(exec));
        int mask = v.head ? v.mask : v.mask & 3;
        printf("%s  {\"head\": %d, \"graph\": %d, \"pdl\": %d, \"mask\": %d, \"pre\": %d, \"late\": %d, "
               "\"us_per_layer\": %.2f, \"min_us\": %.2f, \"max_us\": %.2f}",
               first ? "" : ",\n", v.head, v.graph, mask != 0, mask, v.pre, v.late, median(ts),
               *std::min_element(ts.begin(), ts.end()), *std::max_element(ts.begin(), ts.end()));
        first = false;
    }
    CK(cudaGetLastError());
    printf("\n]}\n");
    return 0;
}
#endif
