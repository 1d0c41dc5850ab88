#include <cstdint>
__global__ void k(const uint32_t* in, uint32_t* out, const float* fin, float* fout) {
  uint32_t x = in[threadIdx.x], y;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  out[threadIdx.x] = y;
  uint32_t z;
  asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(z) : "r"(x));
  out[threadIdx.x+32] = z;
  float f = fin[threadIdx.x], g;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(g) : "f"(f));
  fout[threadIdx.x] = g;
}
