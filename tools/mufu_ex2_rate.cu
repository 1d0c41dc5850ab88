// Special-function (MUFU) rate of exp2 on the GPU: ex2.approx.ftz.f32 against the packed
// ex2.approx.f16x2 / .bf16x2 forms, thread-instructions per clock per SM at the nominal clock.
// Session 8 measured on an H100 (docs/results/mufu_ex2_h100.txt): f32 16, packed 8 (each packed
// instruction is two MUFU.EX2.F16/BF16 in SASS), so packing halves no softmax exponentials.
//   nvcc -arch=sm_90a -o mufu tools/mufu_ex2_rate.cu && ./mufu
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
// 16 independent chains per thread (no latency bound), n iterations.
template <int MODE>
__global__ void k(uint32_t* out, int n) {
  uint32_t r[16];
  for (int i = 0; i < 16; ++i) r[i] = 0x3c00u * (threadIdx.x + i) ;
  for (int it = 0; it < n; ++it) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (MODE == 0) { float f = __uint_as_float(r[i]), g; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(g) : "f"(f)); r[i] = __float_as_uint(g); }
      if (MODE == 1) { uint32_t y; asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(r[i])); r[i] = y; }
      if (MODE == 2) { uint32_t y; asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(r[i])); r[i] = y; }
    }
  }
  uint32_t s = 0; for (int i = 0; i < 16; ++i) s ^= r[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
template <int MODE> void run(const char* name) {
  uint32_t* out; cudaMalloc(&out, 132 * 8 * 1024 * 4);
  int n = 4096;
  k<MODE><<<132*8, 1024>>>(out, 16); cudaDeviceSynchronize();
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a); k<MODE><<<132*8, 1024>>>(out, n); cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  double instr = 132.0 * 8 * 1024 * 16 * n;  // per-thread instructions
  double per_clk_sm = instr / (ms * 1e-3) / (clk * 1e3) / 132;
  printf("%s: %.3f ms, %.2f thread-instructions/clk/SM (at the %d MHz nominal clock)\n", name, ms, per_clk_sm, clk / 1000);
}
int main() { run<0>("ex2.f32"); run<1>("ex2.f16x2"); run<2>("ex2.bf16x2"); }
