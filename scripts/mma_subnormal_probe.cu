// One warp, one mma.sync.aligned.m16n8k16 (f32 accumulators) on 16-bit operands given as raw
// bits: A [16][16] row-major, B [16][8] (k, n) row-major, D [16][8] f32. F16 picks the operand
// type (f16 when 1, bf16 when 0). scripts/mma_subnormal_probe.py asks whether the tensor cores
// keep subnormal operands (an MXFP4 code 1, 0.5, lands on one when e2m1 bits are placed straight
// into a bf16 or f16 word).
#if F16
#define OPERAND "f16"
#else
#define OPERAND "bf16"
#endif

extern "C" __global__ void mma_probe(const unsigned short* A, const unsigned short* B, float* D) {
  int lane = threadIdx.x;
  int g = lane >> 2, q = lane & 3;
  unsigned a0 = A[g * 16 + 2 * q] | ((unsigned)A[g * 16 + 2 * q + 1] << 16);
  unsigned a1 = A[(g + 8) * 16 + 2 * q] | ((unsigned)A[(g + 8) * 16 + 2 * q + 1] << 16);
  unsigned a2 = A[g * 16 + 2 * q + 8] | ((unsigned)A[g * 16 + 2 * q + 9] << 16);
  unsigned a3 = A[(g + 8) * 16 + 2 * q + 8] | ((unsigned)A[(g + 8) * 16 + 2 * q + 9] << 16);
  unsigned b0 = B[(2 * q) * 8 + g] | ((unsigned)B[(2 * q + 1) * 8 + g] << 16);
  unsigned b1 = B[(2 * q + 8) * 8 + g] | ((unsigned)B[(2 * q + 9) * 8 + g] << 16);
  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." OPERAND "." OPERAND ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  D[g * 8 + 2 * q] = c0;
  D[g * 8 + 2 * q + 1] = c1;
  D[(g + 8) * 8 + 2 * q] = c2;
  D[(g + 8) * 8 + 2 * q + 1] = c3;
}
