// chunk_recurrence: walks the chunks of one sequence in order, carrying the state in fp32
// registers, for one value head and one block of kBlockV value columns (state columns evolve
// independently, so several blocks share a sequence when there are few (sequence, head) chains).
//
// The state is held transposed, Sᵀ [value rows v, key columns d], in the m16n8 accumulator layout
// of mma.sync: warp w owns value rows 16w..16w+15, all 128 key columns (64 fp32 registers per
// thread). That layout doubles as the A operand of the next products, so per chunk
//     Uᵀ = (T v)ᵀ − Sᵀ wᵀ,   Oᵀ = Sᵀ qdᵀ + Uᵀ mqkᵀ,   Sᵀ ← Sᵀ ⊙ decay + Uᵀ kd
// run from registers and shared memory with no data exchanged between warps. The next chunk's
// record streams into a second shared-memory stage (cp.async) while this one is computed.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "chunk_common.cuh"
#include "chunk_params.h"
#include "mma_sm80.cuh"
#include "token_math.cuh"

namespace flashkda {
namespace chunk {

template <int kBlockV_>
struct RecurrenceShape {
  static constexpr int kBlockV = kBlockV_;
  static constexpr int kWarps = kBlockV / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = 2;
  using MatTile = sm80::SwizzledTile<kHeadDim * 2 / 16>;
  using SqTile = sm80::SwizzledTile<kChunk * 2 / 16>;
  using VTile = sm80::SwizzledTile<kBlockV * 2 / 16>;
  struct Stage {
    alignas(16) uint8_t w[kChunk * kHeadDim * 2];
    alignas(16) uint8_t qd[kChunk * kHeadDim * 2];
    alignas(16) uint8_t kd[kChunk * kHeadDim * 2];
    alignas(16) uint8_t mqk[kChunk * kChunk * 2];
    alignas(16) uint8_t tinv[kChunk * kChunk * 2];
    alignas(16) uint8_t v[kChunk * kBlockV * 2];  // v, then this chunk's output (same columns)
    alignas(16) float decay[kHeadDim];
  };
  static constexpr int kSmemBytes = kStages * int(sizeof(Stage));
};

template <typename Elem, int kBlockV>
__device__ __forceinline__ void load_stage(const ChunkParams& p, typename RecurrenceShape<kBlockV>::Stage& st,
                                           const uint8_t* rec, const Elem* vrow0, int len) {
  using Shape = RecurrenceShape<kBlockV>;
  const int tid = threadIdx.x;
  constexpr int kMatChunks = kChunk * kHeadDim * 2 / 16;
  for (int e = tid; e < kMatChunks; e += Shape::kThreads) {
    const int row = e / (kHeadDim / 8), ch = e % (kHeadDim / 8);
    const uint32_t off = Shape::MatTile::chunk_offset(row, ch);
    sm80::cp_async_16(sm80::smem_u32(st.w) + off, rec + WorkspaceLayout::kW + e * 16);
    sm80::cp_async_16(sm80::smem_u32(st.qd) + off, rec + WorkspaceLayout::kQd + e * 16);
    sm80::cp_async_16(sm80::smem_u32(st.kd) + off, rec + WorkspaceLayout::kKd + e * 16);
  }
  constexpr int kSqChunks = kChunk * kChunk * 2 / 16;
  for (int e = tid; e < kSqChunks; e += Shape::kThreads) {
    const int row = e / (kChunk / 8), ch = e % (kChunk / 8);
    const uint32_t off = Shape::SqTile::chunk_offset(row, ch);
    sm80::cp_async_16(sm80::smem_u32(st.mqk) + off, rec + WorkspaceLayout::kMqk + e * 16);
    sm80::cp_async_16(sm80::smem_u32(st.tinv) + off, rec + WorkspaceLayout::kTinv + e * 16);
  }
  for (int e = tid; e < kHeadDim * 4 / 16; e += Shape::kThreads)
    sm80::cp_async_16(sm80::smem_u32(st.decay) + e * 16, rec + WorkspaceLayout::kDecay + e * 16);
  constexpr int kRowChunks = kBlockV / 8;
  for (int e = tid; e < kChunk * kRowChunks; e += Shape::kThreads) {
    const int row = e / kRowChunks, ch = e % kRowChunks;
    const bool valid = row < len;
    const Elem* src = vrow0 + (valid ? int64_t(row) * p.v_token_stride + ch * 8 : 0);
    sm80::cp_async_16(sm80::smem_u32(st.v) + Shape::VTile::chunk_offset(row, ch), src, valid);
  }
}

// Sᵀ[v][d] of element e of n-tile n (m16n8 accumulator layout) <-> state memory.
__device__ __forceinline__ int64_t state_offset(bool v_first, int v, int d) {
  return v_first ? int64_t(v) * kHeadDim + d : int64_t(d) * kHeadDim + v;
}

template <typename Elem, int kBlockV>
__global__ void __launch_bounds__(RecurrenceShape<kBlockV>::kThreads, 1) chunk_recurrence_kernel(const ChunkParams p) {
  using Shape = RecurrenceShape<kBlockV>;
  using Stage = typename Shape::Stage;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Stage* stages = reinterpret_cast<Stage*>(smem_raw);

  const int vblock = blockIdx.x, hv = blockIdx.y, n = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int v_local = 16 * warp;                      // first value row of this warp within the block
  const int v_glob = vblock * kBlockV + v_local;      // ... within the head
  const SeqSpan seq = sequence_span(p, n);
  const int64_t chunks = num_chunks(seq.len);

  // ---- initial state -> registers ---------------------------------------------------------
  float s[kHeadDim / 8][4];
  {
    const int64_t base = (int64_t(n) * p.HV + hv) * kHeadDim * kHeadDim;
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = v_glob + g8 + 8 * (e >> 1), d = 8 * nt + 2 * t4 + (e & 1);
        float x = 0.f;
        if (p.state_in != nullptr) {
          const int64_t i = base + state_offset(p.state_v_first, v, d);
          x = p.state_in_dtype == DType::kBFloat16
                  ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.state_in)[i])
                  : static_cast<const float*>(p.state_in)[i];
        }
        s[nt][e] = x;
      }
  }

  const Elem* vbase = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + hv * p.v_head_stride +
                      vblock * kBlockV;
  Elem* obase = static_cast<Elem*>(p.o) + seq.batch * p.o_batch_stride + hv * p.o_head_stride + vblock * kBlockV;
  auto record = [&](int64_t j) {
    return static_cast<const uint8_t*>(p.workspace) +
           ((seq.first_slot + j) * p.HV + hv) * WorkspaceLayout::kRecordBytes;
  };
  auto chunk_len = [&](int64_t j) {
    const int64_t rest = seq.len - j * kChunk;
    return int(rest < kChunk ? rest : kChunk);
  };
  // Bad cu_seqlens on the device could name more chunks than the workspace has: stop there.
  const int64_t last = p.num_chunk_slots - seq.first_slot;
  const int64_t nchunks = chunks < last ? chunks : (last > 0 ? last : 0);

  if (nchunks > 0) {
    load_stage<Elem, kBlockV>(p, stages[0], record(0), vbase + (seq.bos) * p.v_token_stride, chunk_len(0));
    sm80::cp_async_commit();
  }
  for (int64_t j = 0; j < nchunks; ++j) {
    Stage& st = stages[j & 1];
    __syncthreads();  // every warp is done with the stage that the next load overwrites
    if (j + 1 < nchunks)
      load_stage<Elem, kBlockV>(p, stages[(j + 1) & 1], record(j + 1),
                                vbase + (seq.bos + (j + 1) * kChunk) * p.v_token_stride, chunk_len(j + 1));
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();
    __syncthreads();

    const uint32_t w_s = sm80::smem_u32(st.w), qd_s = sm80::smem_u32(st.qd), kd_s = sm80::smem_u32(st.kd);
    const uint32_t mqk_s = sm80::smem_u32(st.mqk), tinv_s = sm80::smem_u32(st.tinv), v_s = sm80::smem_u32(st.v);

    float u[kChunk / 8][4], o[kChunk / 8][4];
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) u[nt][e] = o[nt][e] = 0.f;

    // Uᵀ = vᵀ Tᵀ (T lower triangular: output tiles np >= kc only)
#pragma unroll
    for (int kc = 0; kc < kChunk / 16; ++kc) {
      uint32_t af[4];
      sm80::ldmatrix_x4_trans(af, v_s + Shape::VTile::chunk_offset(16 * kc + (lane & 7) + (lane >> 4) * 8,
                                                                   v_local / 8 + ((lane >> 3) & 1)));
#pragma unroll
      for (int np = kc; np < kChunk / 16; ++np) {
        uint32_t bf[4];
        sm80::ldmatrix_x4(bf, tinv_s + Shape::SqTile::chunk_offset(16 * np + (lane & 7) + (lane >> 4) * 8,
                                                                   2 * kc + ((lane >> 3) & 1)));
        sm80::mma_16816<Elem>(u[2 * np], af, bf[0], bf[1]);
        sm80::mma_16816<Elem>(u[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    // Uᵀ −= Sᵀ wᵀ,  Oᵀ = Sᵀ qdᵀ
#pragma unroll
    for (int kd = 0; kd < kHeadDim / 16; ++kd) {
      const uint32_t a[4] = {sm80::pack2<Elem>(s[2 * kd][0], s[2 * kd][1]), sm80::pack2<Elem>(s[2 * kd][2], s[2 * kd][3]),
                             sm80::pack2<Elem>(s[2 * kd + 1][0], s[2 * kd + 1][1]),
                             sm80::pack2<Elem>(s[2 * kd + 1][2], s[2 * kd + 1][3])};
      const uint32_t na[4] = {sm80::neg2(a[0]), sm80::neg2(a[1]), sm80::neg2(a[2]), sm80::neg2(a[3])};
#pragma unroll
      for (int np = 0; np < kChunk / 16; ++np) {
        const uint32_t off = Shape::MatTile::chunk_offset(16 * np + (lane & 7) + (lane >> 4) * 8,
                                                          2 * kd + ((lane >> 3) & 1));
        uint32_t bw[4], bq[4];
        sm80::ldmatrix_x4(bw, w_s + off);
        sm80::ldmatrix_x4(bq, qd_s + off);
        sm80::mma_16816<Elem>(u[2 * np], na, bw[0], bw[1]);
        sm80::mma_16816<Elem>(u[2 * np + 1], na, bw[2], bw[3]);
        sm80::mma_16816<Elem>(o[2 * np], a, bq[0], bq[1]);
        sm80::mma_16816<Elem>(o[2 * np + 1], a, bq[2], bq[3]);
      }
    }
    uint32_t ua[kChunk / 16][4];
#pragma unroll
    for (int kc = 0; kc < kChunk / 16; ++kc) {
      ua[kc][0] = sm80::pack2<Elem>(u[2 * kc][0], u[2 * kc][1]);
      ua[kc][1] = sm80::pack2<Elem>(u[2 * kc][2], u[2 * kc][3]);
      ua[kc][2] = sm80::pack2<Elem>(u[2 * kc + 1][0], u[2 * kc + 1][1]);
      ua[kc][3] = sm80::pack2<Elem>(u[2 * kc + 1][2], u[2 * kc + 1][3]);
    }
    // Oᵀ += Uᵀ mqkᵀ (mqk lower triangular)
#pragma unroll
    for (int kc = 0; kc < kChunk / 16; ++kc)
#pragma unroll
      for (int np = kc; np < kChunk / 16; ++np) {
        uint32_t bf[4];
        sm80::ldmatrix_x4(bf, mqk_s + Shape::SqTile::chunk_offset(16 * np + (lane & 7) + (lane >> 4) * 8,
                                                                  2 * kc + ((lane >> 3) & 1)));
        sm80::mma_16816<Elem>(o[2 * np], ua[kc], bf[0], bf[1]);
        sm80::mma_16816<Elem>(o[2 * np + 1], ua[kc], bf[2], bf[3]);
      }
    // Output: through this warp's own columns of the v tile, then 16-byte stores.
    __syncwarp();  // every lane's ldmatrix reads of these columns are done
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * nt + 2 * t4 + (e & 1), v = v_local + g8 + 8 * (e >> 1);
        *reinterpret_cast<Elem*>(st.v + Shape::VTile::offset(c, v)) = from_float<Elem>(o[nt][e]);
      }
    __syncwarp();
    {
      const int len = chunk_len(j);
      Elem* orow0 = obase + (seq.bos + j * kChunk) * p.o_token_stride + v_local;
#pragma unroll
      for (int it = 0; it < kChunk / 16; ++it) {
        const int c = 16 * it + (lane >> 1), half = lane & 1;
        if (c < len)
          *reinterpret_cast<uint4*>(orow0 + int64_t(c) * p.o_token_stride + 8 * half) =
              *reinterpret_cast<const uint4*>(st.v + Shape::VTile::chunk_offset(c, v_local / 8 + half));
      }
    }
    // Sᵀ ← Sᵀ ⊙ decay + Uᵀ kd
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      const float2 dec = *reinterpret_cast<const float2*>(&st.decay[8 * nt + 2 * t4]);
      s[nt][0] *= dec.x, s[nt][1] *= dec.y, s[nt][2] *= dec.x, s[nt][3] *= dec.y;
    }
#pragma unroll
    for (int kc = 0; kc < kChunk / 16; ++kc)
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t bf[4];
        sm80::ldmatrix_x4_trans(bf, kd_s + Shape::MatTile::chunk_offset(16 * kc + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                        2 * dp + (lane >> 4)));
        sm80::mma_16816<Elem>(s[2 * dp], ua[kc], bf[0], bf[1]);
        sm80::mma_16816<Elem>(s[2 * dp + 1], ua[kc], bf[2], bf[3]);
      }
  }

  // ---- final state ------------------------------------------------------------------------
  if (p.state_out != nullptr) {
    const int64_t base = (int64_t(n) * p.HV + hv) * kHeadDim * kHeadDim;
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = v_glob + g8 + 8 * (e >> 1), d = 8 * nt + 2 * t4 + (e & 1);
        const int64_t i = base + state_offset(p.state_v_first, v, d);
        if (p.state_out_dtype == DType::kBFloat16)
          static_cast<__nv_bfloat16*>(p.state_out)[i] = __float2bfloat16(s[nt][e]);
        else
          static_cast<float*>(p.state_out)[i] = s[nt][e];
      }
  }
}

template <typename Elem, int kBlockV>
cudaError_t launch_recurrence(const ChunkParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  using Shape = RecurrenceShape<kBlockV>;
  auto kernel = chunk_recurrence_kernel<Elem, kBlockV>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(kHeadDim / kBlockV, p.HV, p.N), Shape::kThreads, Shape::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace chunk

template <typename Elem, int kBlockV>
cudaError_t run_chunk_recurrence(const ChunkParams& params, cudaStream_t stream) {
  return chunk::launch_recurrence<Elem, kBlockV>(params, stream);
}

}  // namespace flashkda
