// Shared pieces of the standalone timing programs in bench/harness/ (no PyTorch): error checks in
// main(), random bf16 inputs, median times of a launch sequence from CUDA events.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

// In main(): print the failing call and return 1.
#define CHECK(x)                                                        \
  do {                                                                  \
    cudaError_t e_ = (x);                                               \
    if (e_ != cudaSuccess) {                                            \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));     \
      return 1;                                                         \
    }                                                                   \
  } while (0)

// Normal(0, sd) bf16 values from a hash of the index (Box-Muller), reproducible per seed.
__global__ void fill_normal_bf16(__nv_bfloat16* x, size_t n, uint32_t seed, float sd) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    uint32_t h2 = h * 747796405u + 2891336453u;
    const float u1 = (h & 0xffffff) / 16777216.f + 1e-7f, u2 = (h2 & 0xffffff) / 16777216.f;
    x[i] = __float2bfloat16(sd * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// Median of `reps` timings of launch() on the default stream, after three warm-up rounds.
template <typename F>
float median_ms(F&& launch, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int i = 0; i < reps + 3; ++i) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (i >= 3) t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Relative L2 difference of two device arrays of T (read back to the host); -1 if a copy fails.
template <typename T>
double rel_diff(const T* a, const T* b, size_t n) {
  std::vector<T> ha(n), hb(n);
  if (cudaMemcpy(ha.data(), a, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(hb.data(), b, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
    return -1.0;
  double d = 0, r = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = float(ha[i]), y = float(hb[i]);
    d += (x - y) * (x - y), r += x * x;
  }
  return std::sqrt(d / r);
}

// Appends `bytes` bytes of device memory to f; false if the copy or the write fails.
inline bool append_device_bytes(FILE* f, const void* device, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  return f != nullptr && cudaMemcpy(h.data(), device, bytes, cudaMemcpyDeviceToHost) == cudaSuccess &&
         std::fwrite(h.data(), 1, bytes, f) == bytes;
}

// The phase clocks of phase_clocks.py's marks (cycles summed over every block of `launches`
// launches of `blocks` blocks): each phase's share and its cycles per block.
inline void print_phase_cycles(const unsigned long long* cycles, int phases, double launches, double blocks) {
  unsigned long long total = 0;
  for (int i = 0; i < phases; ++i) total += cycles[i];
  for (int i = 0; i < phases; ++i)
    if (cycles[i]) std::printf("  phase %2d: %5.1f%%  %8.0f cycles per block\n", i, 100.0 * cycles[i] / total,
                               double(cycles[i]) / (launches * blocks));
}
