// chunk_state_scan: the two scans over chunks of the chunked backward, on the maps that
// chunk_local_grad's transitions pass writes (chunk_bwd_params.h):
//   forward  S_{j+1} = D_j S_j + B_j          (the states at chunk starts, S_0 the initial state)
//   reverse  G_{j-1} = D_jᵀ G_j + Y_j         (G_j the gradient of the state after chunk j, G_{J-1}
//                                              the final state's; D_0ᵀ G_0 + Y_0 the initial state's)
// One block per (value slice of kScanCols columns, sequence and head), walking the chunks in order
// with the slice in shared memory; the next chunk's D is copied in (cp.async) while this one's
// product runs. fp32 throughout (no tensor cores): the scans carry the state across every chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {

namespace chunk_scan {

using chunk::kHeadDim;
constexpr int kThreads = 256;
constexpr int kScanCols = 32;  // value columns per block
constexpr int kColsPerThread = kScanCols * kHeadDim / kThreads;
constexpr int kMapStride = kHeadDim + 4;  // floats per row of a staged map: 16-byte rows, fewer bank conflicts
struct Smem {
  float map[2][kHeadDim * kMapStride];  // D_j, double-buffered
  float x[kHeadDim * kScanCols];        // the carried slice [key row][column]
};
static_assert(kColsPerThread == 16 && kThreads == 2 * kHeadDim, "a thread: one row, half the slice's columns");

__device__ __forceinline__ void stage_map(float* dst, const float* src) {
  for (int i = threadIdx.x; i < kHeadDim * kHeadDim / 4; i += kThreads) {
    const int r = i / (kHeadDim / 4), c = (i % (kHeadDim / 4)) * 4;
    sm80::cp_async_16(sm80::smem_u32(dst + r * kMapStride + c), src + r * kHeadDim + c);
  }
  sm80::cp_async_commit();
}

__global__ void __launch_bounds__(kThreads) chunk_state_scan_kernel(const ChunkScanParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, row = tid >> 1, c0 = (tid & 1) * kColsPerThread;
  const int64_t nh = blockIdx.x, col = int64_t(blockIdx.y) * kScanCols + c0;
  constexpr int64_t kMat = int64_t(kHeadDim) * kHeadDim;
  auto matrix = [&](int64_t j) { return (j * p.NH + nh) * kMat; };
  // Chunk order: forward j = 0 .. J-2 writes out[j + 1]; reverse j = J-1 .. 0 writes out[j - 1]
  // (first, for j = 0).
  const int64_t steps = p.reverse ? p.J : p.J - 1;
  auto chunk_of = [&](int64_t s) { return p.reverse ? p.J - 1 - s : s; };
  float acc[kColsPerThread];
  {
    const float* src = p.start + nh * kMat + row * kHeadDim + col;
    float* dst = p.out + matrix(p.reverse ? p.J - 1 : 0) + row * kHeadDim + col;
#pragma unroll
    for (int c = 0; c < kColsPerThread; c += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(src + c));
      *reinterpret_cast<float4*>(dst + c) = v;
      *reinterpret_cast<float4*>(sm.x + row * kScanCols + c0 + c) = v;
    }
  }
  if (steps > 0) stage_map(sm.map[0], p.maps + matrix(chunk_of(0)));
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t j = chunk_of(s);
    const float* map = sm.map[s & 1];
    if (s + 1 < steps) {
      stage_map(sm.map[(s + 1) & 1], p.maps + matrix(chunk_of(s + 1)));
      sm80::cp_async_wait<1>();
    } else {
      sm80::cp_async_wait<0>();
    }
    __syncthreads();  // this chunk's map staged, the slice written
    {
      const float* src = p.offsets + matrix(j) + row * kHeadDim + col;
#pragma unroll
      for (int c = 0; c < kColsPerThread; c += 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(src + c));
        acc[c] = v.x, acc[c + 1] = v.y, acc[c + 2] = v.z, acc[c + 3] = v.w;
      }
    }
#pragma unroll 4
    for (int k = 0; k < kHeadDim; ++k) {
      const float d = p.reverse ? map[k * kMapStride + row] : map[row * kMapStride + k];
      const float4* x = reinterpret_cast<const float4*>(sm.x + k * kScanCols + c0);
#pragma unroll
      for (int c = 0; c < kColsPerThread / 4; ++c) {
        const float4 v = x[c];
        acc[4 * c] = fmaf(d, v.x, acc[4 * c]);
        acc[4 * c + 1] = fmaf(d, v.y, acc[4 * c + 1]);
        acc[4 * c + 2] = fmaf(d, v.z, acc[4 * c + 2]);
        acc[4 * c + 3] = fmaf(d, v.w, acc[4 * c + 3]);
      }
    }
    __syncthreads();  // every read of the slice and of this map done
    float* dst = p.reverse ? (j == 0 ? p.first + nh * kMat : p.out + matrix(j - 1)) : p.out + matrix(j + 1);
    dst += row * kHeadDim + col;
#pragma unroll
    for (int c = 0; c < kColsPerThread; c += 4) {
      const float4 v = make_float4(acc[c], acc[c + 1], acc[c + 2], acc[c + 3]);
      *reinterpret_cast<float4*>(dst + c) = v;
      *reinterpret_cast<float4*>(sm.x + row * kScanCols + c0 + c) = v;
    }
  }
}

}  // namespace chunk_scan

cudaError_t run_chunk_state_scan(const ChunkScanParams& p, cudaStream_t stream) {
  using namespace chunk_scan;
  if (p.J == 0 || p.NH == 0) return cudaSuccess;
  const int bytes = int(sizeof(Smem));
  const cudaError_t err =
      cudaFuncSetAttribute(chunk_state_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  chunk_state_scan_kernel<<<dim3(unsigned(p.NH), kHeadDim / kScanCols), kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashkda
