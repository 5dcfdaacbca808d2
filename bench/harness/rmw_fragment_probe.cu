// What the lane layout of decode_stream_tc.cuh costs the memory system: the in-place
// read-modify-write of a bf16 state pool (H = 32, K = V = 128; N = 64, 256, 1024 sequences) walked
// as that kernel walks it (a warp takes a unit of four consecutive 4 KB items of one head, items in
// order, one L2 prefetch line per lane for the next item, units with a grid stride, head slices in a
// permuted order as with shuffled slots), with no math, in two lane layouts of the same 16-byte
// accesses:
//   fragment: the mma.sync A-operand layout: lane (g = lane / 4, t = lane % 4) holds rows g and
//             g + 8 at bytes 64c + 16t of each 256-byte row, so an instruction covers 64 bytes of
//             each of 8 rows (half of a 128-byte line each);
//   lines:    lane l at bytes 512i + 16l of the item, so an instruction covers 512 contiguous bytes
//             (four whole lines).
// Where the two differ is what the fragment layout's half-line accesses cost; the mixed forms (loads
// in one layout, stores in the other) split that cost between loads and stores.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/harness/rmw_fragment_probe.cu -o rfp && ./rfp
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

constexpr uint32_t kItemBytes = 4096, kItemsPerUnit = 4, kSliceBytes = 128 * 128 * 2;  // bf16 head slice

template <bool kFragmentLoads, bool kFragmentStores, bool kPrefetch>
__global__ void __launch_bounds__(256, 2) rmw_units(uint8_t* x, uint32_t units, uint32_t slices, uint32_t mult) {
  constexpr uint32_t kUnitsPerSlice = kSliceBytes / (kItemBytes * kItemsPerUnit);
  const int lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
  const uint32_t stride = gridDim.x * (blockDim.x / 32);
  // Byte offset of access i (0..7) of this lane within an item, in either layout (the mixed forms
  // store other bytes than they loaded: the traffic is what is measured).
  auto offset = [&](int i, bool fragment) -> uint32_t {
    if (fragment) return (g + 8 * (i / 4)) * 256 + 64 * (i % 4) + 16 * t;  // row g or g + 8, chunk i % 4
    return 512 * i + 16 * lane;
  };
  for (uint32_t u = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; u < units; u += stride) {
    const uint32_t s = uint32_t(uint64_t(u / kUnitsPerSlice) * mult % slices);
    uint8_t* unit = x + size_t(s) * kSliceBytes + size_t(u % kUnitsPerSlice) * kItemBytes * kItemsPerUnit;
    for (uint32_t m = 0; m < kItemsPerUnit; ++m) {
      uint8_t* item = unit + m * kItemBytes;
      uint4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __ldcs(reinterpret_cast<const uint4*>(item + offset(i, kFragmentLoads)));
      if (kPrefetch && m + 1 < kItemsPerUnit) asm volatile("prefetch.global.L2 [%0];" ::"l"(item + kItemBytes + 128 * lane));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i].x ^= 0x00010001u, v[i].w += 1u;
        __stcs(reinterpret_cast<uint4*>(item + offset(i, kFragmentStores)), v[i]);
      }
    }
  }
}

template <class F>
float med(F f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < 25; ++r) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (uint32_t N : {64u, 256u, 1024u}) {
    const uint32_t slices = N * 32;
    const size_t bytes = size_t(slices) * kSliceBytes;
    uint8_t* x;
    if (cudaMalloc(&x, bytes) != cudaSuccess) return 1;
    cudaMemset(x, 0, bytes);
    uint32_t mult = 40503;
    while (std::gcd(mult, slices) != 1) mult += 2;
    const uint32_t units = uint32_t(bytes / (kItemBytes * kItemsPerUnit));
    const unsigned grid = sms * 2;
    const float f0 = med([&] { rmw_units<true, true, false><<<grid, 256>>>(x, units, slices, mult); });
    const float f1 = med([&] { rmw_units<true, true, true><<<grid, 256>>>(x, units, slices, mult); });
    const float l0 = med([&] { rmw_units<false, false, false><<<grid, 256>>>(x, units, slices, mult); });
    const float l1 = med([&] { rmw_units<false, false, true><<<grid, 256>>>(x, units, slices, mult); });
    const float lf0 = med([&] { rmw_units<false, true, false><<<grid, 256>>>(x, units, slices, mult); });
    const float lf1 = med([&] { rmw_units<false, true, true><<<grid, 256>>>(x, units, slices, mult); });
    const float fl0 = med([&] { rmw_units<true, false, false><<<grid, 256>>>(x, units, slices, mult); });
    const float fl1 = med([&] { rmw_units<true, false, true><<<grid, 256>>>(x, units, slices, mult); });
    std::printf("bf16 pool N=%4u (%4zu MB), ms without / with the L2 prefetch: fragment layout %.4f / %.4f | whole lines "
                "%.4f / %.4f | line loads, fragment stores %.4f / %.4f | fragment loads, line stores %.4f / %.4f\n",
                N, bytes / 1000000, f0, f1, l0, l1, lf0, lf1, fl0, fl1);
    cudaFree(x);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
