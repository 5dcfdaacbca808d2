// Bandwidth of the simplest in-place read-modify-write of a buffer (what a decode step does to its
// state pool, without the math) beside an out-of-place copy, at the fp32 state-pool sizes of the
// decode rows (H = 32, K = V = 128: N = 64, 256, 1024 sequences) and a few grid sizes: an upper
// bound for the decode kernels that is measured rather than assumed. Then the same read-modify-write
// done the way decode_stream.cuh walks the pool (rmw_items): each warp owns a work item of R rows
// of 512 bytes (R * 512 contiguous bytes), items go out with a grid stride, the next item's loads
// right after the current item's stores; the items of one head's 64 KB slice are neighbours, and
// with shuffling the slices are visited in a permuted order (an arithmetic bijection, no index
// loads), as with the benchmark's shuffled slots. Where the two differ is what the decode kernel's
// access pattern costs.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/harness/rmw_probe.cu -o rmw_probe && ./rmw_probe
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <numeric>
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
constexpr uint32_t kSliceFloat4 = 65536 / 16;  // one head's 64 KB slice of an fp32 state
template <int R, bool kShuffle>
__global__ void __launch_bounds__(256) rmw_items(float4* x, uint32_t items, uint32_t slices, uint32_t mult) {
  constexpr uint32_t kPerSlice = kSliceFloat4 / (R * 32);
  const int lane = threadIdx.x & 31;
  const uint32_t stride = gridDim.x * (blockDim.x / 32);
  for (uint32_t it = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; it < items; it += stride) {
    uint32_t s = it / kPerSlice;
    if (kShuffle) s = uint32_t(uint64_t(s) * mult % slices);
    float4* base = x + size_t(s) * kSliceFloat4 + size_t(it % kPerSlice) * R * 32 + lane;
    float4 v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = __ldcs(base + r * 32);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      v[r].x = v[r].x * 0.999f + 1.f, v[r].y *= 0.999f, v[r].z *= 0.999f, v[r].w *= 0.999f;
      __stcs(base + r * 32, v[r]);
    }
  }
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
  for (uint32_t N : {64u, 256u, 1024u}) {  // the decode kernel's walk
    const uint32_t slices = N * 32;
    const size_t n = size_t(slices) * kSliceFloat4;
    float4* x;
    if (cudaMalloc(&x, n * 16) != cudaSuccess) return 1;
    cudaMemset(x, 0, n * 16);
    uint32_t mult = 40503;
    while (std::gcd(mult, slices) != 1) mult += 2;
    for (int bps : {2, 3, 4}) {
      const unsigned grid = sms * bps;
      const float r8 = med([&] { rmw_items<8, false><<<grid, 256>>>(x, uint32_t(n / 256), slices, mult); });
      const float r8s = med([&] { rmw_items<8, true><<<grid, 256>>>(x, uint32_t(n / 256), slices, mult); });
      const float r4 = med([&] { rmw_items<4, false><<<grid, 256>>>(x, uint32_t(n / 128), slices, mult); });
      const float r4s = med([&] { rmw_items<4, true><<<grid, 256>>>(x, uint32_t(n / 128), slices, mult); });
      const float r16 = med([&] { rmw_items<16, false><<<grid, 256>>>(x, uint32_t(n / 512), slices, mult); });
      printf("N=%4u, items, blocks/SM %d: 4 KB %.4f ms, shuffled %.4f | 2 KB %.4f, shuffled %.4f | 8 KB %.4f\n", N, bps,
             r8, r8s, r4, r4s, r16);
    }
    cudaFree(x);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
