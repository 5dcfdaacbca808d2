// chunk_segment_scan: joins the segments of each sequence (RecurrencePass in chunk_params.h). With
// Sᵀ (value rows × key columns) and a segment's affine map Sᵀ ← Sᵀ P_s + Q_s, from the local passes
// of chunk_recurrence:
//     start_0 = initial state,   start_{s+1} = start_s P_s + Q_s,   final state = start_{segments}.
// Value rows evolve independently: one block per (ScanLayout::kRows value rows, value head,
// sequence), so a few heads still give a grid of a hundred blocks. The chain over segments is the
// only serial part: P_{s+1} (64 KB, independent of the chain) streams into shared memory with
// cp.async while step s runs, and the four warps split the product's key index (each lane 8 rows ×
// 4 columns, its P row read once per 32 FMAs): about 2 µs a step on the H200. fp32 throughout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/common/token_math.cuh"
#include "flashkda/prefill/chunk_common.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {
namespace chunk {

struct ScanLayout {
  static constexpr int kRows = 8;                        // value rows per block
  static constexpr int kWarps = 4;                       // split the key (reduction) index
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeysPerWarp = kHeadDim / kWarps;
  static constexpr int kLaneCols = kHeadDim / 32;        // product columns per lane
  static constexpr int kOwnCols = kRows * kHeadDim / kThreads;  // state elements a thread keeps
  // Shared memory, in floats: P double-buffered, start_s transposed ([key][row], so a key's rows
  // are two float4 broadcasts), and the warps' partial products.
  static constexpr int kP = 0;
  static constexpr int kXt = 2 * kHeadDim * kHeadDim;
  static constexpr int kPartial = kXt + kHeadDim * kRows;
  static constexpr int kBytes = (kPartial + kWarps * kRows * kHeadDim) * 4;
};
static_assert(ScanLayout::kRows == 8 && ScanLayout::kLaneCols == 4 && ScanLayout::kOwnCols == 8,
              "the product loop reads a key's 8 rows as two float4 and a lane's 4 columns as one");

__global__ void __launch_bounds__(ScanLayout::kThreads) chunk_segment_scan_kernel(const ChunkParams p) {
  using L = ScanLayout;
  extern __shared__ __align__(16) float scan_smem[];
  float* const Xt = scan_smem + L::kXt;
  float* const partial = scan_smem + L::kPartial;
  const int hv = blockIdx.y, n = blockIdx.z, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // The state elements this thread keeps: row `row`, columns c0 .. c0 + 7.
  const int row = tid / (kHeadDim / L::kOwnCols), c0 = (tid % (kHeadDim / L::kOwnCols)) * L::kOwnCols;
  const int v = blockIdx.x * L::kRows + row;
  const SeqSpan seq = sequence_span(p, n);
  const int64_t chunks = recorded_chunks(p, seq);
  int64_t segs = (chunks + p.segment_chunks - 1) / p.segment_chunks;
  segs = segs < p.segments_per_seq ? segs : p.segments_per_seq;
  const int64_t slot = sequence_state_slot(p, n);
  if (slot < 0) return;  // serving mode, a padding slot: the output pass skips the sequence too
  const int64_t state_base = slot * p.state_slot_stride + int64_t(hv) * kHeadDim * kHeadDim;

  auto prefetch_transition = [&](int s) {  // P_s into buffer s % 2
    const float* src = p.seg_states + segment_matrix(p, n, seq, s, SegmentLayout::kTransition, hv);
    const uint32_t dst = sm80::smem_u32(scan_smem + L::kP + (s & 1) * kHeadDim * kHeadDim);
    for (int e = tid; e < kHeadDim * kHeadDim / 4; e += L::kThreads) sm80::cp_async_16(dst + e * 16, src + 4 * e);
  };
  auto set_transposed = [&](const float (&x)[L::kOwnCols]) {
#pragma unroll
    for (int e = 0; e < L::kOwnCols; ++e) Xt[(c0 + e) * L::kRows + row] = x[e];
  };

  float x[L::kOwnCols];
#pragma unroll
  for (int e = 0; e < L::kOwnCols; ++e) {
    float val = 0.f;
    if (reads_initial_state(p, n)) {
      const int64_t i = state_base + state_offset(p.state_v_first, v, c0 + e);
      val = p.state_in_dtype == DType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.state_in)[i])
                                                 : static_cast<const float*>(p.state_in)[i];
    }
    x[e] = val;
  }
  if (segs > 0) prefetch_transition(0);
  sm80::cp_async_commit();
  set_transposed(x);
  for (int s = 0; s < int(segs); ++s) {
    store_floats(p.seg_states + segment_matrix(p, n, seq, s, SegmentLayout::kStart, hv) + v * kHeadDim + c0, x);
    float q[L::kOwnCols];  // consumed after the product: its latency hides behind it
    load_floats(p.seg_states + segment_matrix(p, n, seq, s, SegmentLayout::kLocal, hv) + v * kHeadDim + c0, q);
    // Buffer (s + 1) % 2 was last read in step s - 1, before that step's barrier below.
    if (s + 1 < segs) prefetch_transition(s + 1);
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();
    __syncthreads();  // P_s and start_s (Xt) visible to every warp
    const float* P = scan_smem + L::kP + (s & 1) * kHeadDim * kHeadDim;
    float acc[L::kRows][L::kLaneCols] = {};
#pragma unroll 8
    for (int kk = 0; kk < L::kKeysPerWarp; ++kk) {
      const int k = warp * L::kKeysPerWarp + kk;
      const float4 pk = *reinterpret_cast<const float4*>(P + k * kHeadDim + lane * L::kLaneCols);
      const float4 xa = *reinterpret_cast<const float4*>(Xt + k * L::kRows);
      const float4 xb = *reinterpret_cast<const float4*>(Xt + k * L::kRows + 4);
      const float xr[L::kRows] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int r = 0; r < L::kRows; ++r) {
        acc[r][0] = fmaf(xr[r], pk.x, acc[r][0]);
        acc[r][1] = fmaf(xr[r], pk.y, acc[r][1]);
        acc[r][2] = fmaf(xr[r], pk.z, acc[r][2]);
        acc[r][3] = fmaf(xr[r], pk.w, acc[r][3]);
      }
    }
#pragma unroll
    for (int r = 0; r < L::kRows; ++r)
      *reinterpret_cast<float4*>(partial + (warp * L::kRows + r) * kHeadDim + lane * L::kLaneCols) =
          make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    __syncthreads();  // partial products complete; every warp is done with Xt and P_s
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) {
      float part[L::kOwnCols];
      load_floats(partial + (w * L::kRows + row) * kHeadDim + c0, part);
#pragma unroll
      for (int e = 0; e < L::kOwnCols; ++e) q[e] += part[e];
    }
#pragma unroll
    for (int e = 0; e < L::kOwnCols; ++e) x[e] = q[e];
    set_transposed(x);  // read after the next step's first barrier
  }
  if (p.state_out != nullptr) {
#pragma unroll
    for (int e = 0; e < L::kOwnCols; ++e) {
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
  using L = chunk::ScanLayout;
  if (p.N == 0) return cudaSuccess;
  cudaError_t err =
      cudaFuncSetAttribute(chunk::chunk_segment_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  chunk::chunk_segment_scan_kernel<<<dim3(chunk::kHeadDim / L::kRows, p.HV, p.N), L::kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashkda
