// Can the projection after a latency-bound kernel load its weight while that kernel runs?
// Built and run by scripts/pdl_preload_probe.py (which documents it); prints one JSON object.
//
// chain       a latency-bound stand-in for the batch-1 attention: B blocks of 4 warps, each
//             thread `steps` dependent loads at random places of a 256 MB table; at its end it
//             writes x [COLS] (bf16) from what it read, so the projection depends on it; each
//             launch walks from a new start (a counter its last block moves on), so no walk
//             finds its lines in L2. With `trigger` it calls griddepcontrol.launch_dependents
//             first, so a dependent launched with programmatic stream serialization may start.
// gemv_warp   y = W x + b, a warp per row with every 16-byte load in flight (~the copy bandwidth)
// oproj_smem  the same y, one block per RB rows: the block's weight rows (RB x 8 KB) come into
//             shared memory by bulk copies issued at its start, before griddepcontrol.wait; x is
//             read after the wait. Launched with or without programmatic stream serialization.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>

#define ROWS 2880
#define COLS 4096
#define RB 22
#define NBLK ((ROWS + RB - 1) / RB)
#define CH (COLS / 8)  // 16-byte chunks per row
#define PER_LANE (CH / 32)
#define TABLE_WORDS (1u << 26)
#include "probe_cuda.h"  // CK, launch, ld_na

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        s += __uint_as_float(av[q] << 16) * __uint_as_float(bv[q] << 16);
        s += __uint_as_float(av[q] & 0xFFFF0000u) * __uint_as_float(bv[q] & 0xFFFF0000u);
    }
    return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__global__ void __launch_bounds__(128) chain(const unsigned* __restrict__ table, unsigned mask, int steps,
                                             unsigned* ctr, __nv_bfloat16* x, int trigger) {
    if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned c = *(volatile unsigned*)ctr;  // a new walk every launch: its lines are not left in L2
    unsigned i = ((blockIdx.x * blockDim.x + threadIdx.x + c * 7919u) * 2654435761u) & mask;
    for (int s = 0; s < steps; s++) i = table[i] & mask;
    unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned k = t; k < COLS; k += gridDim.x * blockDim.x)
        x[k] = __float2bfloat16((float)((i + k * 40503u + c) & 1023) / 512.f - 1.f);
    __syncthreads();
    if (threadIdx.x == 0) {  // the last block to finish moves the walk counter on
        __threadfence();
        if (atomicAdd(ctr + 1, 1u) == gridDim.x - 1) {
            ctr[1] = 0;
            atomicAdd(ctr, 1u);
        }
    }
}

__global__ void __launch_bounds__(256) gemv_warp(const uint4* __restrict__ w, const uint4* __restrict__ x,
                                                 const __nv_bfloat16* __restrict__ b, float* y) {
    int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= ROWS) return;
    const uint4* wr = w + (long long)row * CH;
    uint4 v[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; j++) v[j] = ld_na(wr + lane + 32 * j);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; j++) acc += dot8(v[j], x[lane + 32 * j]);
    acc = warp_sum(acc);
    if (lane == 0) y[row] = acc + __bfloat162float(b[row]);
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__global__ void __launch_bounds__(256, 1) oproj_smem(const __nv_bfloat16* __restrict__ w, const uint4* __restrict__ x,
                                                     const __nv_bfloat16* __restrict__ b, __nv_bfloat16* y,
                                                     int pieces) {
    extern __shared__ __align__(128) uint4 ws[];
    __shared__ __align__(8) unsigned long long bar;
    int r0 = blockIdx.x * RB;
    int rows = min(RB, ROWS - r0);
    unsigned bytes = rows * COLS * 2;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar)), "r"(bytes)
                     : "memory");
        unsigned per = (bytes / pieces + 15) / 16 * 16;
        for (unsigned off = 0; off < bytes; off += per) {
            unsigned n = min(per, bytes - off);
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32((char*)ws + off)),
                "l"((const char*)(w + (long long)r0 * COLS) + off), "r"(n), "r"(smem_u32(&bar))
                : "memory");
        }
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");  // a no-op without a programmatic dependency
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint4 xv[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; j++) xv[j] = x[lane + 32 * j];
    __syncthreads();  // the barrier's init is visible to every thread
    unsigned done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_u32(&bar))
            : "memory");
    for (int r = warp; r < rows; r += 8) {
        const uint4* wr = ws + r * CH;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < PER_LANE; j++) acc += dot8(wr[lane + 32 * j], xv[j]);
        acc = warp_sum(acc);
        if (lane == 0) y[r0 + r] = __float2bfloat16(acc + __bfloat162float(b[r0 + r]));
    }
}

struct Bufs {
    unsigned* table;
    unsigned mask;
    std::vector<__nv_bfloat16*> w;
    __nv_bfloat16 *x, *b, *y16;
    float* y32;
    unsigned* ctr;
};

static void launch_oproj(const Bufs& B, int copy, bool pdl, int pieces, cudaStream_t s) {
    launch(oproj_smem, NBLK, 256, RB * COLS * 2, s, pdl, (const __nv_bfloat16*)B.w[copy], (const uint4*)B.x,
           (const __nv_bfloat16*)B.b, B.y16, pieces);
}

// kind: 0 chain only, 1 chain + gemv_warp, 2 chain + oproj_smem, 3 chain + oproj_smem (PDL),
//       4 gemv_warp only, 5 oproj_smem only, 6 chain + gemv_warp + oproj_smem
static void step(const Bufs& B, int kind, int blocks, int steps, int pieces, int it, cudaStream_t s) {
    int copy = it % (int)B.w.size();
    if (kind <= 3 || kind == 6) chain<<<blocks, 128, 0, s>>>(B.table, B.mask, steps, B.ctr, B.x, kind == 3);
    if (kind == 1 || kind == 4 || kind == 6) gemv_warp<<<ROWS / 8, 256, 0, s>>>((const uint4*)B.w[copy], (const uint4*)B.x, B.b, B.y32);
    if (kind == 2 || kind == 3 || kind == 5 || kind == 6) launch_oproj(B, copy, kind == 3, pieces, s);
}

int main(int argc, char** argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 30, chain_len = argc > 2 ? atoi(argv[2]) : 20, copies = 8;
    unsigned table_mb = argc > 3 ? atoi(argv[3]) : 256;  // a power of two: the chain's random reads span it
    Bufs B;
    B.mask = table_mb * (1u << 18) - 1;
    CK(cudaMalloc(&B.table, (size_t)TABLE_WORDS * 4));
    {
        std::vector<unsigned> h(TABLE_WORDS);
        uint64_t r = 88172645463325252ull;
        for (auto& v : h) { r ^= r << 13; r ^= r >> 7; r ^= r << 17; v = (unsigned)r & (TABLE_WORDS - 1); }
        CK(cudaMemcpy(B.table, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<__nv_bfloat16> hw((size_t)ROWS * COLS), hb(ROWS);
    uint64_t r = 1;
    auto rnd = [&]() { r = r * 6364136223846793005ull + 1442695040888963407ull; return (float)((r >> 40) & 0xFFFF) / 32768.f - 1.f; };
    for (int c = 0; c < copies; c++) {
        for (auto& v : hw) v = __float2bfloat16(rnd());
        __nv_bfloat16* d;
        CK(cudaMalloc(&d, hw.size() * 2));
        CK(cudaMemcpy(d, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
        B.w.push_back(d);
    }
    for (auto& v : hb) v = __float2bfloat16(rnd());
    CK(cudaMalloc(&B.x, COLS * 2));
    CK(cudaMalloc(&B.b, ROWS * 2));
    CK(cudaMemcpy(B.b, hb.data(), ROWS * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&B.y16, ROWS * 2));
    CK(cudaMalloc(&B.y32, ROWS * 4));
    CK(cudaMalloc(&B.ctr, 8));
    CK(cudaMemset(B.ctr, 0, 8));
    CK(cudaFuncSetAttribute(oproj_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, RB * COLS * 2));
    int carveout = argc > 4 ? atoi(argv[4]) : -1;  // the chain's preferred shared-memory carveout (%), -1: unset
    if (carveout >= 0) CK(cudaFuncSetAttribute(chain, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    struct V { const char* label; int kind, blocks, steps, pieces; };
    const V vs[] = {
        {"gemv_warp alone", 4, 0, 0, 1},
        {"oproj_smem alone (1 bulk copy)", 5, 0, 0, 1},
        {"oproj_smem alone (4 bulk copies)", 5, 0, 0, 4},
        {"chain 8 x 24 steps alone", 0, 8, 24, 1},
        {"chain 8 x 24, gemv_warp", 1, 8, 24, 1},
        {"chain 8 x 24, oproj_smem", 2, 8, 24, 4},
        {"chain 8 x 24, oproj_smem PDL", 3, 8, 24, 4},
        {"chain 8 x 24, oproj_smem PDL (1 bulk copy)", 3, 8, 24, 1},
        {"chain 128 x 24 steps alone", 0, 128, 24, 1},
        {"chain 128 x 24, gemv_warp", 1, 128, 24, 1},
        {"chain 128 x 24, oproj_smem PDL", 3, 128, 24, 4},
        {"chain 8 x 8 steps alone", 0, 8, 8, 1},
        {"chain 8 x 8, gemv_warp", 1, 8, 8, 1},
        {"chain 8 x 8, oproj_smem PDL", 3, 8, 8, 4},
        {"chain 8 x 0 steps alone", 0, 8, 0, 1},
        {"chain 8 x 0, oproj_smem", 2, 8, 0, 4},
        {"chain 8 x 0, oproj_smem PDL", 3, 8, 0, 4},
        {"chain 8 x 24, gemv_warp, oproj_smem", 6, 8, 24, 4},
        {"chain 8 x 40 steps alone", 0, 8, 40, 1},
        {"chain 8 x 40, gemv_warp", 1, 8, 40, 1},
        {"chain 8 x 40, oproj_smem PDL", 3, 8, 40, 4},
    };
    printf("{\"table_mb\": %u, \"chain_carveout\": %d, \"rows\": [", table_mb, carveout);
    bool first = true;
    double worst = 0;
    for (const V& v : vs) {
        for (int i = 0; i < copies; i++) step(B, v.kind, v.blocks, v.steps, v.pieces, i, s);
        CK(cudaStreamSynchronize(s));
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < chain_len; i++) step(B, v.kind, v.blocks, v.steps, v.pieces, i, s);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        std::vector<float> per;
        for (int k = 0; k < reps; k++) {
            CK(cudaEventRecord(e0, s));
            CK(cudaGraphLaunch(ge, s));
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            per.push_back(ms * 1000.f / chain_len);
        }
        std::sort(per.begin(), per.end());
        double err = -1;
        if (v.kind == 2 || v.kind == 3 || v.kind >= 5) {
            // the last launch's y against gemv_warp on the same x and weight copy
            gemv_warp<<<ROWS / 8, 256, 0, s>>>((const uint4*)B.w[(chain_len - 1) % copies], (const uint4*)B.x, B.b, B.y32);
            CK(cudaStreamSynchronize(s));
            std::vector<float> ref(ROWS);
            std::vector<__nv_bfloat16> got(ROWS);
            CK(cudaMemcpy(ref.data(), B.y32, ROWS * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(got.data(), B.y16, ROWS * 2, cudaMemcpyDeviceToHost));
            double mx = 0, num = 0;
            for (int i = 0; i < ROWS; i++) {
                mx = std::max(mx, (double)fabsf(ref[i]));
                num = std::max(num, (double)fabsf(ref[i] - __bfloat162float(got[i])));
            }
            err = num / mx;
            worst = std::max(worst, err);
        }
        printf("%s{\"variant\": \"%s\", \"us\": %.2f, \"us_p10\": %.2f, \"us_p90\": %.2f, \"rel_err\": %.2e}",
               first ? "" : ", ", v.label, per[per.size() / 2], per[per.size() / 10], per[per.size() * 9 / 10], err);
        first = false;
        fflush(stdout);
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
    }
    printf("], \"worst_rel_err\": %.2e}\n", worst);
    return 0;
}
