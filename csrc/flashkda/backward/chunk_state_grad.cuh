// chunk_state_grad: the gradient of the state at every chunk boundary, walking each sequence's
// chunks backwards from the final state's gradient, on the forward's records (chunk_prepare's
// workspace, WorkspaceLayout) and in chunk_recurrence's shape: one block per (sequence, value head,
// kBlockV value columns), the gradient Gᵀ [value rows v, key columns d] in fp32 registers, warp w
// owning value rows 16 w .. 16 w + 15 and all key columns.
//
// A chunk's forward is U = T v − w S, O = qd S + mqk U, S' = decay ⊙ S + kdᵀ U (chunk_params.h).
// With G' the gradient of S' and dO that of O, the gradient of S is
//     dU = kd G' + mqkᵀ dO,   G = decay ⊙ G' + qdᵀ dO − wᵀ dU,
// which is chunk_recurrence's step with the roles of w and kd exchanged: per chunk, transposed,
//     dUᵀ = Gᵀ kdᵀ + dOᵀ mqk,   Gᵀ ← Gᵀ ⊙ decay + dOᵀ qd − dUᵀ w,
// from registers and shared memory only (bf16/fp16 operands, fp32 accumulation, as the forward's
// products), in chunk_recurrence's two variants: cp.async and mma.sync (the sm_80 family), or the
// record by the copy engine and the dense products on warpgroup MMAs (sm_90a; the triangular
// dOᵀ mqk stays on mma.sync, see below). dO streams into the stage's v tile (record token order, zero rows past the
// chunk's end) with the record. Before a chunk's step, Gᵀ (the gradient of the state after that
// chunk) goes to the chunk's entry of `chunk_states` (dense, as the forward's: the sequence's first
// chunk slot + the chunk); after the first chunk it is the initial state's gradient (state_out).
// The final state's gradient comes in as state_in. Fields of ChunkParams that this kernel reads
// differently from the forward:
//   v (and its strides)  dO [B, T, HV, V] in the token tensors' element type
//   state_in             the final state's gradient (state_in_dtype, state_v_first)
//   state_out            the initial state's gradient (state_out_dtype, state_v_first)
//   chunk_states         the gradients of the states after each chunk (dense entries)
#pragma once

#include "flashkda/prefill/chunk_recurrence.cuh"

namespace flashkda {
namespace chunk {

// acc (16 value rows x kChunk tokens, m16n8 accumulators) += A · L on mma.sync, with A the 16 x kChunk
// operand in A fragments and L a TriTile (record order, nonzero blocks (r, c) with r <= c): output
// slice c takes the contraction blocks r <= c, read transposed (rows of L are the contraction).
template <typename Elem>
__device__ __forceinline__ void times_triangular(float (&acc)[kChunk / 8][4], const uint32_t (&a)[kChunk / 16][4],
                                                 uint32_t l_s, int lane) {
#pragma unroll
  for (int c = 0; c < kChunk / 16; ++c)
#pragma unroll
    for (int r = 0; r <= c; ++r) {
      uint32_t bf[4];
      sm80::ldmatrix_x4_trans(bf, l_s + TriTile::chunk_offset(16 * r + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                              2 * c + (lane >> 4)));
      sm80::mma_16816<Elem>(acc[2 * c], a[r], bf[0], bf[1]);
      sm80::mma_16816<Elem>(acc[2 * c + 1], a[r], bf[2], bf[3]);
    }
}

#ifdef FLASHKDA_WGMMA
// The sm_90 variant's mqk product stays on mma.sync: its B operand (mqk itself, the contraction
// along the TriTile's rows) would be MN-major slices of 16 columns at uneven offsets, one wgmma of
// N = 16 per nonzero block into accumulator tiles past the leading ones, which makes ptxas
// serialize the wgmma pipeline (wgmma_sm90.cuh, leading_tiles). It is 10 of the chunk's 80
// 16 x 16 x 16 blocks of products per warp.
#endif
template <typename Elem, int kBlockV, int kVariant>
__global__ void __launch_bounds__(RecurrenceShape<kBlockV>::kThreads, 1)
    chunk_state_grad_kernel(const ChunkParams p) {
#ifndef FLASHKDA_BULK_COPY
  if constexpr (kVariant != kCpAsyncMma) {
    return;  // the sm_90 variant's image below sm_90: empty, never launched (run_chunk_state_grad)
  } else
#endif
  {
    using Shape = RecurrenceShape<kBlockV>;
    using Stage = typename Shape::Stage;
#ifdef FLASHKDA_WGMMA
    constexpr bool kWgmma = kVariant == kBulkWgmma;
#endif
    constexpr int kKeyTiles = kHeadDim / 8;
    constexpr int kStages = Shape::kStages;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Stage* stages = reinterpret_cast<Stage*>(smem_raw);
    __shared__ uint64_t stage_full[kStages];  // record bytes landed (bulk copies only)
    init_stage_barriers<kVariant>(stage_full);

    // Grid: (value blocks, HV, N from first_grid_row).
    const int hv = blockIdx.y;
    const int z = int(blockIdx.z + uint32_t(p.first_grid_row));
    const int vblock = int(blockIdx.x);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int v_local = 16 * warp, v_glob = vblock * kBlockV + v_local;
    int n;
    const SeqSpan seq = ordered_sequence_span(p, z, n);
    const int64_t nchunks = recorded_chunks(p, seq);
    const int64_t state_base = int64_t(n) * p.state_slot_stride + int64_t(hv) * kHeadDim * kHeadDim;

    // Gᵀ: the final state's gradient.
    float s[kKeyTiles][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = v_glob + g8 + 8 * (e >> 1), d = 8 * nt + 2 * t4 + (e & 1);
        s[nt][e] = p.state_in == nullptr ? 0.f : state_in_element(p, state_base + state_offset(p.state_v_first, v, d));
      }

    const Elem* dobase = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + hv * p.v_head_stride +
                         vblock * kBlockV;
    // Step i takes chunk nchunks − 1 − i.
    auto issue = [&](int64_t i) {
      const int64_t j = nchunks - 1 - i;
      if (j >= 0)
        load_stage<Elem, Shape, kVariant>(p, stages[i % kStages], &stage_full[i % kStages], chunk_record(p, seq, j, hv),
                                          dobase + (seq.bos + j * kChunk) * p.v_token_stride, chunk_tokens(seq, j));
      sm80::cp_async_commit();
    };

#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i);
    for (int64_t i = 0; i < nchunks; ++i) {
      Stage& st = stages[i % kStages];
      __syncthreads();  // every warp is done with the stage that the next load overwrites
      issue(i + kStages - 1);
      wait_stage<kVariant>(stage_full, i);
      __syncthreads();
      // The gradient of the state after chunk nchunks − 1 − i, at that chunk's entry (as the forward's
      // dense chunk states: the sequence's first chunk slot + the chunk). Stored before the step's
      // products: stored while the sm_90 variant's wgmmas ran, its branches on the entry's dtype and
      // layout made ptxas wait for them anyway (C7517).
      if (p.chunk_states != nullptr)
        if (void* dst = chunk_state_at(p, seq.first_slot + nchunks - 1 - i, hv))
          store_state(dst, p.chunk_states_dtype, p.state_v_first, s, v_glob, g8, t4);

      const uint32_t w_s = sm80::smem_u32(st.w), qd_s = sm80::smem_u32(st.qd), kd_s = sm80::smem_u32(st.kd);
      const uint32_t mqk_s = sm80::smem_u32(st.mqk), do_s = sm80::smem_u32(st.v);

      float du[kChunk / 8][4];
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] = 0.f;
      // The A fragments of dOᵀ (this warp's 16 value rows, 16 tokens per k-step); dUᵀ = dOᵀ mqk.
      uint32_t doa[kChunk / 16][4];
#pragma unroll
      for (int kc = 0; kc < kChunk / 16; ++kc)
        sm80::ldmatrix_x4_trans(doa[kc], do_s + Shape::VTile::chunk_offset(16 * kc + (lane & 7) + (lane >> 4) * 8,
                                                                            v_local / 8 + ((lane >> 3) & 1)));
      times_triangular<Elem>(du, doa, mqk_s, lane);
      // dUᵀ += Gᵀ kdᵀ
#ifdef FLASHKDA_WGMMA
      if constexpr (kWgmma) {
        // One warpgroup per 64 value rows; B: kd's rows, K-major, the 128-byte swizzled panels read
        // in place.
        uint32_t a[kHeadDim / 16][4];
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) sm80::accumulators_to_a<Elem>(s[2 * kd], s[2 * kd + 1], a[kd]);
        sm90::fence_operands(du);
        sm90::wgmma_fence();
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) {
          const uint32_t koff = (kd / 4) * MatTile::kPanelBytes + (kd % 4) * 32;
          sm90::wgmma_m64nNk16_rs<Elem, 1>(du, a[kd], sm90::smem_desc(kd_s + koff, 16, 1024), true);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_operands(du);
      } else
#endif
      {
#pragma unroll
        for (int kd = 0; kd < kKeyTiles / 2; ++kd) {
          uint32_t a[4];
          sm80::accumulators_to_a<Elem>(s[2 * kd], s[2 * kd + 1], a);
#pragma unroll
          for (int np = 0; np < kChunk / 16; ++np) {
            uint32_t b[4];
            sm80::ldmatrix_x4(b, kd_s + MatTile::chunk_offset(16 * np + (lane & 7) + (lane >> 4) * 8,
                                                              2 * kd + ((lane >> 3) & 1)));
            sm80::mma_16816<Elem>(du[2 * np], a, b[0], b[1]);
            sm80::mma_16816<Elem>(du[2 * np + 1], a, b[2], b[3]);
          }
        }
      }
      uint32_t dua[kChunk / 16][4];  // −dUᵀ as an A operand
#pragma unroll
      for (int kc = 0; kc < kChunk / 16; ++kc) {
        sm80::accumulators_to_a<Elem>(du[2 * kc], du[2 * kc + 1], dua[kc]);
#pragma unroll
        for (int e = 0; e < 4; ++e) dua[kc][e] = sm80::neg2(dua[kc][e]);
      }
      // Gᵀ ← Gᵀ ⊙ decay + dOᵀ qd − dUᵀ w
      scale_key_columns(s, st.decay, t4);
#ifdef FLASHKDA_WGMMA
      if constexpr (kWgmma) {
        // B: qd's and w's rows, 128 key columns in two 64-column panels, N-major.
        sm90::fence_operands(s);
        sm90::wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < kChunk / 16; ++kc) {
          sm90::wgmma_m64n128k16_rs_mn<Elem>(s, doa[kc], sm90::smem_desc(qd_s + kc * 16 * 128, MatTile::kPanelBytes, 1024));
          sm90::wgmma_m64n128k16_rs_mn<Elem>(s, dua[kc], sm90::smem_desc(w_s + kc * 16 * 128, MatTile::kPanelBytes, 1024));
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();  // before the next step's barrier, after which its load overwrites the other stage
        sm90::fence_operands(s);
      } else
#endif
      {
#pragma unroll
        for (int kc = 0; kc < kChunk / 16; ++kc)
#pragma unroll
          for (int dp = 0; dp < kKeyTiles / 2; ++dp) {
            const uint32_t off = MatTile::chunk_offset(16 * kc + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * dp + (lane >> 4));
            uint32_t bq[4], bw[4];
            sm80::ldmatrix_x4_trans(bq, qd_s + off);
            sm80::ldmatrix_x4_trans(bw, w_s + off);
            sm80::mma_16816<Elem>(s[2 * dp], doa[kc], bq[0], bq[1]);
            sm80::mma_16816<Elem>(s[2 * dp + 1], doa[kc], bq[2], bq[3]);
            sm80::mma_16816<Elem>(s[2 * dp], dua[kc], bw[0], bw[1]);
            sm80::mma_16816<Elem>(s[2 * dp + 1], dua[kc], bw[2], bw[3]);
          }
      }
    }
    if (p.state_out != nullptr)
      store_state(static_cast<char*>(p.state_out) + state_base * dtype_bytes(p.state_out_dtype), p.state_out_dtype,
                  p.state_v_first, s, v_glob, g8, t4);
  }
}

}  // namespace chunk

// Launches chunk_state_grad over the N sequences of a planned chunked forward whose records are in
// p.workspace (same plan, same workspace), with the fields above in place of the forward's: the
// sm_90 variant where the image has it and the sm_80 family is not forced, as chunk_recurrence.
template <typename Elem, int kBlockV, int kVariant>
cudaError_t launch_chunk_state_grad(const ChunkParams& p, cudaStream_t stream) {
  using Shape = chunk::RecurrenceShape<kBlockV>;
  auto kernel = chunk::chunk_state_grad_kernel<Elem, kBlockV, kVariant>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (err != cudaSuccess) return err;
  ChunkParams rows = p;
  for (int64_t first = 0; first < p.N; first += chunk::kMaxGridRows) {
    rows.first_grid_row = int32_t(first);
    const int64_t count = std::min<int64_t>(p.N - first, chunk::kMaxGridRows);
    kernel<<<dim3(chunk::kHeadDim / kBlockV, p.HV, uint32_t(count)), Shape::kThreads, Shape::kSmemBytes, stream>>>(rows);
  }
  return cudaGetLastError();
}

template <typename Elem, int kBlockV>
cudaError_t run_chunk_state_grad(const ChunkParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  // One driver call per process and instantiation, as launch_recurrence's.
  static const bool sm90_image = has_sm90_image(chunk::chunk_state_grad_kernel<Elem, kBlockV, chunk::kBulkWgmma>);
  if (p.kernel_family != KernelFamily::kSm80 && sm90_image)
    return launch_chunk_state_grad<Elem, kBlockV, chunk::kBulkWgmma>(p, stream);
  return launch_chunk_state_grad<Elem, kBlockV, chunk::kCpAsyncMma>(p, stream);
}

}  // namespace flashkda
