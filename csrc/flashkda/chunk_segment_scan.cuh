// chunk_segment_scan: joins the segments of each sequence (RecurrencePass in chunk_params.h). With
// Sᵀ (value rows × key columns) and a segment's affine map Sᵀ ← Sᵀ P_s + Q_s, from the local passes
// of chunk_recurrence:
//     start_0 = initial state,   start_{s+1} = start_s P_s + Q_s,   final state = start_{segments}.
// Value rows evolve independently: one block per (16 value rows, value head, sequence), its rows in
// shared memory, P_s staged in shared memory, fp32 FMAs (about 4 MFLOP per segment and head).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "chunk_common.cuh"
#include "chunk_params.h"
#include "token_math.cuh"

namespace flashkda {
namespace chunk {

constexpr int kScanRows = 16;
constexpr int kScanThreads = 256;
constexpr int kScanCols = kHeadDim * kScanRows / kScanThreads;  // outputs per thread, one row
constexpr int kScanSmemBytes = (kHeadDim * kHeadDim + kScanRows * kHeadDim) * 4;
static_assert(kScanCols == 8, "a thread owns 8 consecutive key columns of one row");

__global__ void __launch_bounds__(kScanThreads) chunk_segment_scan_kernel(const ChunkParams p) {
  extern __shared__ __align__(16) float scan_smem[];
  float* P = scan_smem;                        // [kHeadDim][kHeadDim]: P_s
  float* X = scan_smem + kHeadDim * kHeadDim;  // [kScanRows][kHeadDim]: start_s of this block's rows
  const int hv = blockIdx.y, n = blockIdx.z, tid = threadIdx.x;
  const int row = tid / (kHeadDim / kScanCols), c0 = (tid % (kHeadDim / kScanCols)) * kScanCols;
  const int v = blockIdx.x * kScanRows + row;
  const SeqSpan seq = sequence_span(p, n);
  const int64_t chunks = recorded_chunks(p, seq);
  int64_t segs = (chunks + p.segment_chunks - 1) / p.segment_chunks;
  segs = segs < p.segments_per_seq ? segs : p.segments_per_seq;
  const int64_t state_base = (int64_t(n) * p.HV + hv) * kHeadDim * kHeadDim;

  float x[kScanCols];
#pragma unroll
  for (int e = 0; e < kScanCols; ++e) {
    float val = 0.f;
    if (p.state_in != nullptr) {
      const int64_t i = state_base + state_offset(p.state_v_first, v, c0 + e);
      val = p.state_in_dtype == DType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.state_in)[i])
                                                 : static_cast<const float*>(p.state_in)[i];
    }
    x[e] = val;
  }
  for (int s = 0; s < int(segs); ++s) {
    store_floats(p.seg_states + segment_matrix(p, n, s, SegmentLayout::kStart, hv) + v * kHeadDim + c0, x);
    store_floats(X + row * kHeadDim + c0, x);
    const float* Pg = p.seg_states + segment_matrix(p, n, s, SegmentLayout::kTransition, hv);
    for (int e = tid; e < kHeadDim * kHeadDim / 4; e += kScanThreads)
      reinterpret_cast<float4*>(P)[e] = reinterpret_cast<const float4*>(Pg)[e];
    load_floats(p.seg_states + segment_matrix(p, n, s, SegmentLayout::kLocal, hv) + v * kHeadDim + c0, x);
    __syncthreads();
    for (int k = 0; k < kHeadDim; ++k) {
      const float xk = X[row * kHeadDim + k];
      float pk[kScanCols];
      load_floats(P + k * kHeadDim + c0, pk);
#pragma unroll
      for (int e = 0; e < kScanCols; ++e) x[e] = fmaf(xk, pk[e], x[e]);
    }
    __syncthreads();  // X and P are rewritten next
  }
  if (p.state_out != nullptr) {
#pragma unroll
    for (int e = 0; e < kScanCols; ++e) {
      const int64_t i = state_base + state_offset(p.state_v_first, v, c0 + e);
      if (p.state_out_dtype == DType::kBFloat16)
        static_cast<__nv_bfloat16*>(p.state_out)[i] = __float2bfloat16(x[e]);
      else
        static_cast<float*>(p.state_out)[i] = x[e];
    }
  }
}

}  // namespace chunk

cudaError_t run_chunk_segment_scan(const ChunkParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(chunk::chunk_segment_scan_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, chunk::kScanSmemBytes);
  if (err != cudaSuccess) return err;
  chunk::chunk_segment_scan_kernel<<<dim3(chunk::kHeadDim / chunk::kScanRows, p.HV, p.N), chunk::kScanThreads,
                                     chunk::kScanSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashkda
