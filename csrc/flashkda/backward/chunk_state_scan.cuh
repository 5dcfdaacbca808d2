// chunk_state_scan: the two scans over chunks of the chunked backward, on the maps that
// chunk_local_grad's transitions pass writes (chunk_bwd_params.h):
//   forward  S_{j+1} = D_j S_j + B_j          (the states at chunk starts, S_0 the initial state)
//   reverse  G_{j-1} = D_jᵀ G_j + Y_j         (G_j the gradient of the state after chunk j, G_{J-1}
//                                              the final state's; D_0ᵀ G_0 + Y_0 the initial state's)
// One block per (value slice of kScanCols columns, sequence and head), walking the chunks in order
// with the slice in shared memory; the next chunk's D is copied in (cp.async) while this one's
// product runs. The products on the tf32 tensor cores with both operands split in two ("3xTF32",
// mma_sm80.cuh): about fp32's precision, which the scans need as they carry the state across every
// chunk, at a third of the instructions of fp32 FMAs. A warp owns 16 rows of the slice.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {

namespace chunk_scan {

using chunk::kHeadDim;
constexpr int kWarps = kHeadDim / 16;  // a warp: one m16 row tile of the slice
constexpr int kThreads = kWarps * 32;
constexpr int kScanCols = 32;  // value columns per block
constexpr int kColTiles = kScanCols / 8;
// Floats per row of a staged map and of the slice, so that a warp's fragment loads hit 32 banks:
// the forward reads D by rows (lane (g, t) at row g, column t: stride ≡ 4 mod 32), the reverse by
// columns (row t, column g: stride ≡ 8 mod 32), the slice by columns (stride ≡ 8 mod 32); every
// row stays 16-byte aligned for cp.async.
template <bool kReverse>
constexpr int kMapStride = kReverse ? kHeadDim + 8 : kHeadDim + 4;
constexpr int kSliceStride = kScanCols + 8;
template <bool kReverse>
struct Smem {
  float map[2][kHeadDim * kMapStride<kReverse>];  // D_j, double-buffered
  float x[kHeadDim * kSliceStride];               // the carried slice [key row][column]
};

template <bool kReverse>
__device__ __forceinline__ void stage_map(float* dst, const float* src) {
  for (int i = threadIdx.x; i < kHeadDim * kHeadDim / 4; i += kThreads) {
    const int r = i / (kHeadDim / 4), c = (i % (kHeadDim / 4)) * 4;
    sm80::cp_async_16(sm80::smem_u32(dst + r * kMapStride<kReverse> + c), src + r * kHeadDim + c);
  }
  sm80::cp_async_commit();
}

template <bool kReverse>
__global__ void __launch_bounds__(kThreads) chunk_state_scan_kernel(const ChunkScanParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem<kReverse>& sm = *reinterpret_cast<Smem<kReverse>*>(smem_raw);
  using F = sm80::Frag1688Tf32;
  using Acc = sm80::FragAcc;
  constexpr int kStride = kMapStride<kReverse>;
  const int lane = threadIdx.x & 31, m0 = (threadIdx.x >> 5) * 16;
  const int64_t nh = blockIdx.x, seq = nh / p.HV, col0 = int64_t(blockIdx.y) * kScanCols;
  const int hv = int(nh - seq * p.HV);
  constexpr int64_t kMat = int64_t(kHeadDim) * kHeadDim;
  const int64_t first_chunk = p.seq_first[seq], J = p.seq_chunks[seq];
  auto matrix = [&](int64_t j) { return ((first_chunk + j) * p.HV + hv) * kMat; };  // the sequence's j-th
  // The element (row, column) of the slice that accumulator value i of column tile n holds.
  auto acc_row = [&](int i) { return m0 + Acc::m(lane, i); };
  auto acc_col = [&](int n, int i) { return n * 8 + Acc::n(lane, i); };
  // Chunk order: forward j = 0 .. J-2 writes out[j + 1]; reverse j = J-1 .. 0 writes out[j - 1]
  // (first, for j = 0). A sequence without chunks passes its start through (reverse: to first).
  if (J == 0 && !kReverse) return;
  const int64_t steps = kReverse ? J : J - 1;
  auto chunk_of = [&](int64_t s) { return kReverse ? J - 1 - s : s; };
  float* start_dst = J == 0 ? p.first + nh * kMat : p.out + matrix(kReverse ? J - 1 : 0);
  for (int i = threadIdx.x; i < kHeadDim * kScanCols / 4; i += kThreads) {
    const int r = i / (kScanCols / 4), c = (i % (kScanCols / 4)) * 4;
    const float4 v = __ldg(reinterpret_cast<const float4*>(p.start + nh * kMat + r * kHeadDim + col0 + c));
    *reinterpret_cast<float4*>(start_dst + r * kHeadDim + col0 + c) = v;
    *reinterpret_cast<float4*>(sm.x + r * kSliceStride + c) = v;
  }
  if (steps > 0) stage_map<kReverse>(sm.map[0], p.maps + matrix(chunk_of(0)));
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t j = chunk_of(s);
    const float* map = sm.map[s & 1];
    if (s + 1 < steps) {
      stage_map<kReverse>(sm.map[(s + 1) & 1], p.maps + matrix(chunk_of(s + 1)));
      sm80::cp_async_wait<1>();
    } else {
      sm80::cp_async_wait<0>();
    }
    float acc[kColTiles][4];
    {
      const float* src = p.offsets + matrix(j) + col0;
#pragma unroll
      for (int n = 0; n < kColTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          const float2 v = __ldg(reinterpret_cast<const float2*>(src + acc_row(i) * kHeadDim + acc_col(n, i)));
          acc[n][i] = v.x, acc[n][i + 1] = v.y;
        }
    }
    __syncthreads();  // this chunk's map staged, the slice written
#pragma unroll 2
    for (int k0 = 0; k0 < kHeadDim; k0 += 8) {
      uint32_t a_hi[4], a_lo[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // A = D (forward) or Dᵀ (reverse), rows m, columns k
        const int m = m0 + F::a_m(lane, r), k = k0 + F::a_k(lane, r);
        sm80::split_tf32(kReverse ? map[k * kStride + m] : map[m * kStride + k], a_hi[r], a_lo[r]);
      }
#pragma unroll
      for (int n = 0; n < kColTiles; ++n) {
        uint32_t b_hi[2], b_lo[2];
#pragma unroll
        for (int r = 0; r < 2; ++r)
          sm80::split_tf32(sm.x[(k0 + F::b_k(lane, r)) * kSliceStride + n * 8 + F::b_n(lane)], b_hi[r], b_lo[r]);
        sm80::mma_1688_tf32(acc[n], a_lo, b_hi[0], b_hi[1]);  // the small terms first
        sm80::mma_1688_tf32(acc[n], a_hi, b_lo[0], b_lo[1]);
        sm80::mma_1688_tf32(acc[n], a_hi, b_hi[0], b_hi[1]);
      }
    }
    __syncthreads();  // every read of the slice and of this map done
    float* dst = (kReverse ? (j == 0 ? p.first + nh * kMat : p.out + matrix(j - 1)) : p.out + matrix(j + 1)) + col0;
#pragma unroll
    for (int n = 0; n < kColTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const float2 v = make_float2(acc[n][i], acc[n][i + 1]);
        *reinterpret_cast<float2*>(dst + acc_row(i) * kHeadDim + acc_col(n, i)) = v;
        *reinterpret_cast<float2*>(sm.x + acc_row(i) * kSliceStride + acc_col(n, i)) = v;
      }
  }
}

}  // namespace chunk_scan

namespace {

template <bool kReverse>
cudaError_t launch_chunk_state_scan(const ChunkScanParams& p, cudaStream_t stream) {
  using namespace chunk_scan;
  const int bytes = int(sizeof(Smem<kReverse>));
  const cudaError_t err =
      cudaFuncSetAttribute(chunk_state_scan_kernel<kReverse>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  chunk_state_scan_kernel<kReverse><<<dim3(unsigned(p.N * p.HV), kHeadDim / kScanCols), kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t run_chunk_state_scan(const ChunkScanParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.HV == 0) return cudaSuccess;
  return p.reverse ? launch_chunk_state_scan<true>(p, stream) : launch_chunk_state_scan<false>(p, stream);
}

}  // namespace flashkda
