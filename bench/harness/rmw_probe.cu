// Bandwidth of the simplest in-place read-modify-write of a buffer (what a decode step does to its
// state pool, without the math) beside an out-of-place copy, at the fp32 state-pool sizes of the
// decode rows (H = 32, K = V = 128: N = 64, 256, 1024 sequences) and a few grid sizes: an upper
// bound for the decode kernels that is measured rather than assumed.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/harness/rmw_probe.cu -o rmw_probe && ./rmw_probe
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
__global__ void rmw(float4* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x * 4) {
    float4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { size_t j = i + size_t(u) * gridDim.x * blockDim.x; if (j < n) v[u] = __ldcs(x + j); }
#pragma unroll
    for (int u = 0; u < 4; ++u) { size_t j = i + size_t(u) * gridDim.x * blockDim.x; if (j < n) { v[u].x = v[u].x * 0.999f + 1.f; v[u].y *= 0.999f; v[u].z *= 0.999f; v[u].w *= 0.999f; __stcs(x + j, v[u]); } }
  }
}
__global__ void copyk(const float4* a, float4* b, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) b[i] = __ldcs(a + i);
}
template <class F> float med(F f) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); std::vector<float> t;
  for (int r = 0; r < 25; ++r) { cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms); }
  std::sort(t.begin(), t.end()); return t[t.size() / 2];
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (size_t mb : {134, 537, 2147}) {  // N = 64, 256, 1024
    size_t n = mb * 1000000 / 16; float4 *x, *y; cudaMalloc(&x, n * 16); cudaMalloc(&y, n * 16); cudaMemset(x, 0, n * 16);
    for (int bps : {2, 4, 8, 16}) {
      float t1 = med([&] { rmw<<<sms * bps, 256>>>(x, n); });
      float t2 = med([&] { copyk<<<sms * bps, 256>>>(x, y, n); });
      printf("%5zu MB, blocks/SM %2d: in-place rmw %.4f ms %.2f TB/s | copy %.4f ms %.2f TB/s\n", mb, bps, t1, 2.0 * n * 16 / t1 / 1e9, t2, 2.0 * n * 16 / t2 / 1e9);
    }
    cudaFree(x); cudaFree(y);
  }
}
