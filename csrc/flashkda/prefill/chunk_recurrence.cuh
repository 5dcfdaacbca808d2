// chunk_recurrence: walks the chunks of one sequence in order, carrying the state in fp32
// registers, for one value head and one block of kBlockV value columns (state columns evolve
// independently, so several blocks share a sequence when there are few (sequence, head) chains).
//
// The state is held transposed, Sᵀ [value rows v, key columns d], in the m16n8 accumulator layout
// of mma.sync (which is also that of wgmma): warp w owns value rows 16w..16w+15, all 128 key columns
// (64 fp32 registers per thread). That layout doubles as the A operand of the next products (on
// mma.sync in the sm_80 family, on warpgroup MMAs of 64 value rows in the sm_90 family), so per chunk
//     Uᵀ = (T v)ᵀ − Sᵀ wᵀ,   Oᵀ = Sᵀ qdᵀ + Uᵀ mqkᵀ,   Sᵀ ← Sᵀ ⊙ decay + Uᵀ kd
// run from registers and shared memory with no data exchanged between warps. The next chunk's
// record streams into a second shared-memory stage while this one is computed. Tokens (the columns
// of Uᵀ and Oᵀ, the rows of every stage tile) are in the record's order (record_row): the products
// with the triangular T and mqk then skip their zero blocks on leading accumulator tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "flashkda/common/bulk_sm90.cuh"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/common/token_math.cuh"
#include "flashkda/common/wgmma_sm90.cuh"
#include "flashkda/prefill/chunk_common.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {
namespace chunk {

// How chunk_recurrence loads its records and runs the products: the sm_80 family with cp.async and
// mma.sync (ldmatrix operands), the sm_90 family with the copy engine (cp.async.bulk on an mbarrier)
// and warpgroup MMAs (wgmma: A from registers, B read in place from the stage).
enum RecurrenceVariant : int { kCpAsyncMma = 0, kBulkWgmma = 1 };

template <int kBlockV_>
struct RecurrenceShape {
  static constexpr int kBlockV = kBlockV_;
  static constexpr int kWarps = kBlockV / 16;
  static constexpr int kThreads = 32 * kWarps;
  // Two records in flight: a third stage (it fits for 64 columns on sm_90) measured no faster on the
  // H200, and A100 blocks get at most 163 KB of shared memory.
  static constexpr int kStages = 2;
  using VTile = sm80::SwizzledTile<kBlockV * 2 / 16>;
  struct alignas(1024) Stage {  // 1024-byte aligned: wgmma reads the 128-byte swizzled tiles in place
    alignas(16) uint8_t w[kChunk * kHeadDim * 2];
    alignas(16) uint8_t qd[kChunk * kHeadDim * 2];
    alignas(16) uint8_t kd[kChunk * kHeadDim * 2];
    alignas(256) uint8_t mqk[TriTile::kBytes];  // 256-byte aligned: wgmma's 32-byte swizzle atoms
    alignas(256) uint8_t tinv[TriTile::kBytes];
    alignas(16) float decay[kHeadDim];            // everything up to here: the workspace record's image
    alignas(16) uint8_t v[kChunk * kBlockV * 2];  // v, then this chunk's output (same columns; record_row order)
  };
  static constexpr int kSmemBytes = kStages * int(sizeof(Stage));
};

// The record is the image of the stage's first kRecordBytes (chunk_params.h): one linear copy.
template <typename Stage>
constexpr bool record_is_stage_image() {
  return offsetof(Stage, w) == WorkspaceLayout::kW && offsetof(Stage, qd) == WorkspaceLayout::kQd &&
         offsetof(Stage, kd) == WorkspaceLayout::kKd && offsetof(Stage, mqk) == WorkspaceLayout::kMqk &&
         offsetof(Stage, tinv) == WorkspaceLayout::kTinv && offsetof(Stage, decay) == WorkspaceLayout::kDecay &&
         offsetof(Stage, v) == WorkspaceLayout::kRecordBytes;
}

// Transposes a 4 x 4 matrix of 32-bit words held by the four lanes of a quad: lane t4 holds row t4
// in w[0..3], and afterwards column t4. Two butterfly stages (lanes t4 ^ 1, then t4 ^ 2), each
// swapping the elements whose lane and index differ in that bit.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t4) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit <<= 1) {
    const bool upper = t4 & bit;  // this lane keeps the indices with the bit set, sends the others
    const int i1 = bit ^ 3;  // the indices without the bit: 0 and i1
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, upper ? w[0] : w[bit], bit);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, upper ? w[i1] : w[i1 + bit], bit);
    if (upper) w[0] = r0, w[i1] = r1;
    else w[bit] = r0, w[i1 + bit] = r1;
  }
}

// Stores this warp's slice of the state Sᵀ (value rows v_glob + g8 (+ 8), key columns 8 nt + 2 t4
// (+ 1), m16n8 accumulators) as element (v, d) of a [kHeadDim][kHeadDim] state of either layout at
// `dst` (16-byte aligned), in dtype dt, in 16-byte stores: a quad's lanes exchange their pairs
// (quad_transpose) until each holds 16 consecutive bytes of one row of the destination. The key-first
// layout first transposes each 8 x 8 tile (movmatrix; 16-bit elements only, fp32 goes out in pairs).
// A warp then writes 8 (v-first) or 16 (key-first) rows per instruction instead of 8 rows of 16
// bytes with 4-byte stores (H200: the stores of every chunk's state took the 8k-token prefill from
// 0.800 to 1.129 ms with 4-byte stores).
template <typename Half, int kKeyTiles>
__device__ __forceinline__ void store_state_16bit(Half* dst, bool v_first, const float (&s)[kKeyTiles][4], int v_glob,
                                                  int g8, int t4) {
  if (v_first) {
    // Rows v: word k of group a is key columns 8 (4 a + k) + 2 t4 (+ 1); after the transpose, key
    // columns 32 a + 8 t4 ... + 7.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int a = 0; a < kKeyTiles / 4; ++a) {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = sm80::pack2<Half>(s[4 * a + k][2 * h], s[4 * a + k][2 * h + 1]);
        quad_transpose(w, t4);
        *reinterpret_cast<uint4*>(dst + state_offset(true, v_glob + g8 + 8 * h, 32 * a + 8 * t4)) =
            make_uint4(w[0], w[1], w[2], w[3]);
      }
  } else {
    // Rows d: after movmatrix, word (nt, h) is key column 8 nt + g8, value rows v_glob + 8 h + 2 t4
    // (+ 1); word k = 2 (nt % 2) + h of a tile pair, transposed, gives value rows v_glob + 8 h ... + 7
    // of key column 8 nt + g8 with nt = 2 b + t4 / 2, h = t4 % 2.
#pragma unroll
    for (int b = 0; b < kKeyTiles / 2; ++b) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int nt = 2 * b + k / 2, h = k % 2;
        w[k] = sm80::movmatrix_trans(sm80::pack2<Half>(s[nt][2 * h], s[nt][2 * h + 1]));
      }
      quad_transpose(w, t4);
      const int nt = 2 * b + t4 / 2, h = t4 % 2;
      *reinterpret_cast<uint4*>(dst + state_offset(false, v_glob + 8 * h, 8 * nt + g8)) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <int kKeyTiles>
__device__ __forceinline__ void store_state(void* dst, DType dt, bool v_first, const float (&s)[kKeyTiles][4],
                                            int v_glob, int g8, int t4) {
  if (dt == DType::kBFloat16) {
    store_state_16bit(static_cast<__nv_bfloat16*>(dst), v_first, s, v_glob, g8, t4);
  } else if (dt == DType::kFloat16) {
    store_state_16bit(static_cast<__half*>(dst), v_first, s, v_glob, g8, t4);
  } else if (v_first) {
    // fp32 rows v: the low and high words of the pairs transposed separately, two 16-byte stores.
    float* f = static_cast<float*>(dst);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int a = 0; a < kKeyTiles / 4; ++a) {
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          lo[k] = __float_as_uint(s[4 * a + k][2 * h]), hi[k] = __float_as_uint(s[4 * a + k][2 * h + 1]);
        quad_transpose(lo, t4);
        quad_transpose(hi, t4);
        float* row = f + state_offset(true, v_glob + g8 + 8 * h, 32 * a + 8 * t4);
        *reinterpret_cast<uint4*>(row) = make_uint4(lo[0], hi[0], lo[1], hi[1]);
        *reinterpret_cast<uint4*>(row + 4) = make_uint4(lo[2], hi[2], lo[3], hi[3]);
      }
  } else {
    float* f = static_cast<float*>(dst);
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) f[state_offset(false, v_glob + g8 + 8 * (e >> 1), 8 * nt + 2 * t4 + (e & 1))] = s[nt][e];
  }
}

// Element i of the initial state state_in (fp32 or bf16, ChunkParams::state_in_dtype).
__device__ __forceinline__ float state_in_element(const ChunkParams& p, int64_t i) {
  return p.state_in_dtype == DType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.state_in)[i])
                                              : static_cast<const float*>(p.state_in)[i];
}

// Tokens of chunk j of a sequence (kChunk but in its last chunk).
__device__ __forceinline__ int chunk_tokens(const SeqSpan& seq, int64_t j) {
  const int64_t rest = seq.len - j * kChunk;
  return int(rest < kChunk ? rest : kChunk);
}

// chunk_prepare's record of chunk j of a sequence for value head hv.
__device__ __forceinline__ const uint8_t* chunk_record(const ChunkParams& p, const SeqSpan& seq, int64_t j, int hv) {
  return static_cast<const uint8_t*>(p.workspace) + ((seq.first_slot + j) * p.HV + hv) * WorkspaceLayout::kRecordBytes;
}

// Value head hv's matrix at entry (dense) or slot (pool) `entry` of chunk_states, or nullptr outside it.
__device__ __forceinline__ void* chunk_state_at(const ChunkParams& p, int64_t entry, int hv) {
  if (entry < 0 || entry >= p.chunk_state_entries) return nullptr;
  return static_cast<char*>(p.chunk_states) +
         (entry * p.chunk_state_stride + int64_t(hv) * kHeadDim * kHeadDim) * dtype_bytes(p.chunk_states_dtype);
}

// The pool slots (ChunkParams::chunk_state_slots) of a block of kChunks consecutive chunks, lane c
// holding chunk c's, with the next block's already in flight: loaded raw (int32 or int64) and read
// only kChunks steps later, so no step waits for a load.
struct SlotBlock {
  static constexpr int kChunks = 32;
  int32_t next32 = -1, cur32 = -1;
  int64_t next64 = -1, cur64 = -1;
  uint32_t mask = 0;  // bit c: chunk c of the current block has a slot in the pool

  // Starts the loads of the block at chunk `first` (chunks past `end` or the table have none).
  __device__ __forceinline__ void load(const ChunkParams& p, int n, int64_t first, int64_t end, int lane) {
    const int64_t j = first + lane;
    next32 = -1, next64 = -1;
    if (j >= end || j >= p.chunk_slot_cols) return;
    const int64_t i = int64_t(n) * p.chunk_slot_row_stride + j;
    if (p.chunk_slot_type == IndexType::kInt64) next64 = static_cast<const int64_t*>(p.chunk_state_slots)[i];
    else next32 = static_cast<const int32_t*>(p.chunk_state_slots)[i];
  }
  // At the block starting at chunk `first`: takes the loaded block, starts the next one.
  __device__ __forceinline__ void next(const ChunkParams& p, int n, int64_t first, int64_t end, int lane) {
    cur32 = next32, cur64 = next64;
    const int64_t slot = p.chunk_slot_type == IndexType::kInt64 ? cur64 : int64_t(cur32);
    mask = __ballot_sync(0xffffffffu, slot >= 0 && slot < p.chunk_state_entries);
    load(p, n, first + kChunks, end, lane);
  }
  __device__ __forceinline__ bool has(int64_t i) const { return (mask >> (i % kChunks)) & 1; }
  __device__ __forceinline__ int64_t slot(const ChunkParams& p, int64_t i) const {
    const int c = int(i % kChunks);
    return p.chunk_slot_type == IndexType::kInt64 ? int64_t(__shfl_sync(0xffffffffu, cur64, c))
                                                  : int64_t(__shfl_sync(0xffffffffu, cur32, c));
  }
};

// Starts the loads of one chunk into a stage: the record with the copy engine (sm_90 variants: bulk
// copies counted on `bar`) or with cp.async (sm_80 family); the v tile with cp.async (one group).
template <typename Elem, typename Shape, int kVariant>
__device__ __forceinline__ void load_stage(const ChunkParams& p, typename Shape::Stage& st, uint64_t* bar,
                                           const uint8_t* rec, const Elem* vrow0, int len) {
  constexpr int kBlockV = Shape::kBlockV;
  static_assert(record_is_stage_image<typename Shape::Stage>(), "stage layout = record layout");
  const int tid = threadIdx.x;
  if constexpr (kVariant != kCpAsyncMma) {
#ifdef FLASHKDA_BULK_COPY
    // One copy: every bulk copy adds a fixed cost to the step (H200, chunk_kda at T = 32768, H = 8:
    // 0.476 ms with one copy, 0.481 with 32 KB pieces, 0.490 with 16 KB, 0.508 with 8 KB).
    if (tid == 0) {
      sm90::mbarrier_arrive_expect_tx(bar, uint32_t(WorkspaceLayout::kRecordBytes));
      sm90::bulk_copy_to_shared(&st, rec, uint32_t(WorkspaceLayout::kRecordBytes), bar);
    }
#endif
  } else {
    (void)bar;
    for (int e = tid; e < int(WorkspaceLayout::kRecordBytes / 16); e += Shape::kThreads)
      sm80::cp_async_16(sm80::smem_u32(&st) + e * 16, rec + e * 16);
  }
  constexpr int kRowChunks = kBlockV / 8;
  for (int e = tid; e < kChunk * kRowChunks; e += Shape::kThreads) {
    const int row = e / kRowChunks, ch = e % kRowChunks;
    const bool valid = row < len;
    const Elem* src = vrow0 + (valid ? int64_t(row) * p.v_token_stride + ch * 8 : 0);
    sm80::cp_async_16(sm80::smem_u32(st.v) + Shape::VTile::chunk_offset(record_row(row), ch), src, valid);
  }
}

// The stages' mbarriers (sm_90 variants: one per stage, counting the record's bulk copy), set up
// before any copy is issued; the block's barrier makes them visible.
template <int kVariant, int kStages>
__device__ __forceinline__ void init_stage_barriers(uint64_t (&stage_full)[kStages]) {
#ifdef FLASHKDA_BULK_COPY
  if constexpr (kVariant != kCpAsyncMma) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < kStages; ++i) sm90::mbarrier_init(&stage_full[i], 1);
      sm90::fence_mbarrier_init();
    }
    __syncthreads();
  }
#else
  (void)stage_full;
#endif
}

// Waits for the loads of step i (issued kStages − 1 steps ahead): this thread's cp.async groups up
// to it and, in the sm_90 variants, the record's bulk copy (phase i / kStages of its stage's barrier).
template <int kVariant, int kStages>
__device__ __forceinline__ void wait_stage(uint64_t (&stage_full)[kStages], int64_t i) {
  sm80::cp_async_wait<kStages - 1>();
#ifdef FLASHKDA_BULK_COPY
  if constexpr (kVariant != kCpAsyncMma) sm90::mbarrier_wait(&stage_full[i % kStages], uint32_t(i / kStages) & 1);
#else
  (void)stage_full, (void)i;
#endif
}

// Sᵀ ⊙ decay: key column d of the m16n8 accumulators (columns 8 nt + 2 t4 (+ 1)) times decay[d].
template <int kKeyTiles>
__device__ __forceinline__ void scale_key_columns(float (&s)[kKeyTiles][4], const float* decay, int t4) {
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt) {
    const float2 dec = *reinterpret_cast<const float2*>(&decay[8 * nt + 2 * t4]);
    s[nt][0] *= dec.x, s[nt][1] *= dec.y, s[nt][2] *= dec.x, s[nt][3] *= dec.y;
  }
}

// acc (16 value rows x kChunk tokens, m16n8 accumulators) += A · Lᵀ on mma.sync, with A the 16 x kChunk
// operand in A fragments (16 tokens per k-step) and L a triangular TriTile at l_s (T or mqk), tokens
// in record order: output tiles np <= kc only.
template <typename Elem>
__device__ __forceinline__ void times_triangular_transposed(float (&acc)[kChunk / 8][4], const uint32_t (&a)[kChunk / 16][4],
                                                            uint32_t l_s, int lane) {
#pragma unroll
  for (int kc = 0; kc < kChunk / 16; ++kc)
#pragma unroll
    for (int np = 0; np <= kc; ++np) {
      uint32_t bf[4];
      sm80::ldmatrix_x4(bf, l_s + TriTile::chunk_offset(16 * np + (lane & 7) + (lane >> 4) * 8, 2 * kc + ((lane >> 3) & 1)));
      sm80::mma_16816<Elem>(acc[2 * np], a[kc], bf[0], bf[1]);
      sm80::mma_16816<Elem>(acc[2 * np + 1], a[kc], bf[2], bf[3]);
    }
}

#ifdef FLASHKDA_WGMMA
// The same on warpgroup MMAs (64 value rows): slice kc of L is the B operand of one wgmma of
// N = 16 (kc + 1), into the leading accumulator tiles.
template <typename Elem, int... kKc>
__device__ __forceinline__ void times_triangular_transposed_wgmma(float (&acc)[kChunk / 8][4],
                                                                  const uint32_t (&a)[kChunk / 16][4], uint32_t l_s,
                                                                  std::integer_sequence<int, kKc...>) {
  (sm90::wgmma_m64nNk16_rs<Elem, 1>(sm90::leading_tiles<2 * (kKc + 1)>(acc), a[kKc],
                                    sm90::smem_desc(l_s + TriTile::slice_offset(kKc), 16, TriTile::kGroupBytes,
                                                    sm90::kSwizzle32B),
                                    true),
   ...);
}
#endif

// kVariant (RecurrenceVariant): the sm_90 variant's sm_80 image is empty and never launched
// (launch_recurrence checks the image's architecture).
template <typename Elem, int kBlockV, int kVariant>
__global__ void __launch_bounds__(RecurrenceShape<kBlockV>::kThreads, 1)
    chunk_recurrence_kernel(const ChunkParams p) {
#ifndef FLASHKDA_BULK_COPY
  if constexpr (kVariant != kCpAsyncMma) {
    return;
  } else
#endif
  {
    using Shape = RecurrenceShape<kBlockV>;
    using Stage = typename Shape::Stage;
#ifdef FLASHKDA_WGMMA
    constexpr bool kWgmma = kVariant == kBulkWgmma;  // sm_90a: the products on warpgroup MMAs
#endif
    constexpr int kKeyTiles = kHeadDim / 8;  // n-tiles of the state per warp
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Stage* stages = reinterpret_cast<Stage*>(smem_raw);
    // Without chunks no chunk_prepare ran: the grid before this one may be any (see below).
    if (p.num_chunk_slots == 0) wait_prior_grid();
    __shared__ uint64_t stage_full[Shape::kStages];  // record bytes landed (bulk copies only)
    init_stage_barriers<kVariant>(stage_full);

    // Grid: (value blocks [x2 for kSegmentLocal: the transition's rows], HV, N [x segments]).
    constexpr int kValueBlocks = kHeadDim / kBlockV;
    const RecurrencePass pass = p.recurrence_pass;
    const bool segmented = pass != RecurrencePass::kWhole;
    const int hv = blockIdx.y;
    const uint32_t row = blockIdx.z + uint32_t(p.first_grid_row);
    const int z = segmented ? int(row / uint32_t(p.segments_per_seq)) : int(row);
    const int seg = segmented ? int(row % uint32_t(p.segments_per_seq)) : 0;
    const bool transition = pass == RecurrencePass::kSegmentLocal && int(blockIdx.x) >= kValueBlocks;  // v = 0
    const int vblock = int(blockIdx.x) % kValueBlocks;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int v_local = 16 * warp;                      // first value row of this warp within the block
    const int v_glob = vblock * kBlockV + v_local;      // ... within the head
    int n;  // the sequence: the z-th longest with cu_seqlens
    const SeqSpan seq = ordered_sequence_span(p, z, n);
    const int64_t nchunks = recorded_chunks(p, seq);
    // This block's chunks [j0, j1): the sequence, or one segment of it.
    int64_t j0 = 0, j1 = nchunks;
    if (segmented) {
      j0 = int64_t(seg) * p.segment_chunks;
      j1 = j0 + p.segment_chunks < nchunks ? j0 + p.segment_chunks : nchunks;
      if (j0 >= j1) return;  // the whole block: past the sequence's last segment
    }

    // ---- initial state -> registers ---------------------------------------------------------
    // kWhole: state_in (zeros without); kSegmentLocal: zeros, or the identity for the transition;
    // kSegmentOutput: the segment's start state.
    const int64_t state_slot = sequence_state_slot(p, n);  // -1: a skipped sequence (serving mode)
    const int64_t state_base = state_slot * p.state_slot_stride + int64_t(hv) * kHeadDim * kHeadDim;
    const bool from_state_in = !segmented && state_slot >= 0 && reads_initial_state(p, n);
    float s[kKeyTiles][4];
    {
      const float* start = pass == RecurrencePass::kSegmentOutput
                               ? p.seg_states + segment_matrix(p, n, seq, seg, SegmentLayout::kStart, hv)
                               : nullptr;
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = v_glob + g8 + 8 * (e >> 1), d = 8 * nt + 2 * t4 + (e & 1);
          float x = 0.f;
          if (start != nullptr) {
            x = start[v * kHeadDim + d];
          } else if (transition) {
            x = v == d ? 1.f : 0.f;
          } else if (from_state_in) {
            x = state_in_element(p, state_base + state_offset(p.state_v_first, v, d));
          }
          s[nt][e] = x;
        }
    }

    const Elem* vbase = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + hv * p.v_head_stride +
                        vblock * kBlockV;
    Elem* obase = static_cast<Elem*>(p.o) + seq.batch * p.o_batch_stride + hv * p.o_head_stride + vblock * kBlockV;
    auto chunk_len = [&](int64_t j) { return chunk_tokens(seq, j); };
    const bool writes_output = pass != RecurrencePass::kSegmentLocal;
    // States at chunk starts: the local pass of a segment runs from zero (its states are not the
    // sequence's); the output pass starts from the true one.
    const bool stores_states = p.chunk_states != nullptr && pass != RecurrencePass::kSegmentLocal;
    const bool loads_slots = stores_states && p.chunk_state_slots != nullptr;

    constexpr int kStages = Shape::kStages;
    auto issue = [&](int64_t i) {  // loads of the range's chunk i into its stage (one cp.async group, maybe empty)
      const int64_t j = j0 + i;
      if (j < j1)  // the transition runs with v = 0: a zero-filled v tile
        load_stage<Elem, Shape, kVariant>(p, stages[i % kStages], &stage_full[i % kStages], chunk_record(p, seq, j, hv),
                                          vbase + (seq.bos + j * kChunk) * p.v_token_stride,
                                          transition ? 0 : chunk_len(j));
      sm80::cp_async_commit();
    };
    // Where the state at a chunk start goes: entry (dense) or slot (pool) of chunk_states, or nullptr.
    auto state_dst = [&](int64_t entry) { return chunk_state_at(p, entry, hv); };
    // chunk_prepare's records. The initial state and the varlen order above are read before it,
    // while chunk_prepare drains: chunk_prepare allows this grid only after its own wait, so what
    // they come from has completed (kernel_launch.cuh). The segment output pass is not overlapped.
    wait_prior_grid();
    if (state_slot < 0) {  // serving mode, a padding slot: zero output, and zero states in a dense h
      if (writes_output) {
        constexpr int kRowChunks = kBlockV / 8;  // 16-byte pieces of a token's columns
        const int64_t t0 = j0 * kChunk, rows = std::min<int64_t>(j1 * kChunk, seq.len) - t0;
        for (int64_t e = tid; e < rows * kRowChunks; e += Shape::kThreads)
          *reinterpret_cast<uint4*>(obase + (seq.bos + t0 + e / kRowChunks) * p.o_token_stride + e % kRowChunks * 8) =
              make_uint4(0, 0, 0, 0);
      }
      if (stores_states && p.chunk_state_slots == nullptr) {
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
        for (int64_t j = j0; j < j1; ++j)
          if (void* dst = state_dst(seq.first_slot + j))
            store_state(dst, p.chunk_states_dtype, p.state_v_first, s, v_glob, g8, t4);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i);
    // Pool slots (chunk_state_slots) of 32 chunks at a time, one per lane, loaded 32 steps before
    // they are used; a step then tests one bit of a register. (A slot loaded a step ahead still
    // stalled every step, ptxas moving the warp-uniform value into a uniform register at once, and
    // one copied into shared memory with the stage cost 0.19 µs per step: H200, 8k tokens, H = 96.)
    SlotBlock slots;
    if (loads_slots) slots.load(p, n, j0, j1, lane);
    for (int64_t i = 0; i < j1 - j0; ++i) {
      const int64_t j = j0 + i;
      Stage& st = stages[i % kStages];
      // The next grid may launch once every block is in its last chunk (after this grid's wait: a
      // later launch of the same pass, for more than kMaxGridRows rows, reads only what came before
      // this one ahead of its own wait): the next call's first kernel is then resident on the SMs
      // that the last wave leaves free, and starts as soon as this grid ends.
      if (i + 1 == j1 - j0) allow_next_grid();
      __syncthreads();  // every warp is done with the stage that the next load overwrites
      issue(i + kStages - 1);
      wait_stage<kVariant>(stage_full, i);
      __syncthreads();
      // The state before chunk j.
      if (loads_slots) {
        if (i % SlotBlock::kChunks == 0) slots.next(p, n, j, j1, lane);
        if (slots.has(i))  // has(): the slot lies in the pool (SlotBlock::next), so state_dst is not null
          store_state(state_dst(slots.slot(p, i)), p.chunk_states_dtype, p.state_v_first, s, v_glob, g8, t4);
      } else if (stores_states) {
        if (void* dst = state_dst(seq.first_slot + j))
          store_state(dst, p.chunk_states_dtype, p.state_v_first, s, v_glob, g8, t4);
      }

      const uint32_t w_s = sm80::smem_u32(st.w), qd_s = sm80::smem_u32(st.qd), kd_s = sm80::smem_u32(st.kd);
      const uint32_t mqk_s = sm80::smem_u32(st.mqk), tinv_s = sm80::smem_u32(st.tinv), v_s = sm80::smem_u32(st.v);

      float u[kChunk / 8][4], o[kChunk / 8][4];
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) u[nt][e] = o[nt][e] = 0.f;
      // The A fragments of vᵀ (this warp's 16 value rows, 16 tokens per k-step).
      uint32_t va[kChunk / 16][4];
#pragma unroll
      for (int kc = 0; kc < kChunk / 16; ++kc)
        sm80::ldmatrix_x4_trans(va[kc], v_s + Shape::VTile::chunk_offset(16 * kc + (lane & 7) + (lane >> 4) * 8,
                                                                         v_local / 8 + ((lane >> 3) & 1)));
      uint32_t ua[kChunk / 16][4];  // Uᵀ as the A operand of the last two products
#ifdef FLASHKDA_WGMMA
      if constexpr (kWgmma) {
        // One warpgroup (four warps, 64 value rows) per instruction; B operands are the stage's
        // 128-byte swizzled tiles, K-major (16 contraction columns = 32 bytes of a panel row).
        // Uᵀ = vᵀ Tᵀ − Sᵀ wᵀ and Oᵀ = Sᵀ qdᵀ in one batch (−Sᵀ by an A scale of −1).
        uint32_t a[kHeadDim / 16][4];
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) sm80::accumulators_to_a<Elem>(s[2 * kd], s[2 * kd + 1], a[kd]);
        sm90::fence_operands(u);
        sm90::fence_operands(o);
        sm90::wgmma_fence();
        times_triangular_transposed_wgmma<Elem>(u, va, tinv_s, std::make_integer_sequence<int, kChunk / 16>{});
#pragma unroll
        for (int kd = 0; kd < kHeadDim / 16; ++kd) {
          const uint32_t koff = (kd / 4) * MatTile::kPanelBytes + (kd % 4) * 32;
          sm90::wgmma_m64nNk16_rs<Elem, -1>(u, a[kd], sm90::smem_desc(w_s + koff, 16, 1024), true);
          sm90::wgmma_m64nNk16_rs<Elem, 1>(o, a[kd], sm90::smem_desc(qd_s + koff, 16, 1024), true);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_operands(u);
        sm90::fence_operands(o);
#pragma unroll
        for (int kc = 0; kc < kChunk / 16; ++kc) sm80::accumulators_to_a<Elem>(u[2 * kc], u[2 * kc + 1], ua[kc]);
        // Then, in two groups: Oᵀ += Uᵀ mqkᵀ, and Sᵀ ← Sᵀ ⊙ decay + Uᵀ kd (B = kd rows, 128 key
        // columns in two 64-column panels, N-major). The output goes out while the state update runs.
        scale_key_columns(s, st.decay, t4);
        sm90::fence_operands(s);
        sm90::wgmma_fence();
        times_triangular_transposed_wgmma<Elem>(o, ua, mqk_s, std::make_integer_sequence<int, kChunk / 16>{});
        sm90::wgmma_commit();
#pragma unroll
        for (int kc = 0; kc < kChunk / 16; ++kc)
          sm90::wgmma_m64n128k16_rs_mn<Elem>(s, ua[kc],
                                             sm90::smem_desc(kd_s + kc * 16 * 128, MatTile::kPanelBytes, 1024));
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();
        sm90::fence_operands(o);  // the state update is still running
      } else
#endif
      {
        times_triangular_transposed<Elem>(u, va, tinv_s, lane);  // Uᵀ = vᵀ Tᵀ
        // Uᵀ −= Sᵀ wᵀ,  Oᵀ = Sᵀ qdᵀ
#pragma unroll
        for (int kd = 0; kd < kKeyTiles / 2; ++kd) {
          uint32_t a[4];
          sm80::accumulators_to_a<Elem>(s[2 * kd], s[2 * kd + 1], a);
          const uint32_t na[4] = {sm80::neg2(a[0]), sm80::neg2(a[1]), sm80::neg2(a[2]), sm80::neg2(a[3])};
#pragma unroll
          for (int np = 0; np < kChunk / 16; ++np) {
            const uint32_t off = MatTile::chunk_offset(16 * np + (lane & 7) + (lane >> 4) * 8, 2 * kd + ((lane >> 3) & 1));
            uint32_t bw[4], bq[4];
            sm80::ldmatrix_x4(bw, w_s + off);
            sm80::ldmatrix_x4(bq, qd_s + off);
            sm80::mma_16816<Elem>(u[2 * np], na, bw[0], bw[1]);
            sm80::mma_16816<Elem>(u[2 * np + 1], na, bw[2], bw[3]);
            sm80::mma_16816<Elem>(o[2 * np], a, bq[0], bq[1]);
            sm80::mma_16816<Elem>(o[2 * np + 1], a, bq[2], bq[3]);
          }
        }
#pragma unroll
        for (int kc = 0; kc < kChunk / 16; ++kc) sm80::accumulators_to_a<Elem>(u[2 * kc], u[2 * kc + 1], ua[kc]);
        times_triangular_transposed<Elem>(o, ua, mqk_s, lane);  // Oᵀ += Uᵀ mqkᵀ
      }
      // Output: through this warp's own columns of the v tile, then 16-byte stores.
      if (writes_output) {
        __syncwarp();  // every lane's ldmatrix reads of these columns are done
#ifdef FLASHKDA_WGMMA
        if constexpr (kWgmma) {
          // Transposed by stmatrix: per instruction, token n-tiles 2 k and 2 k + 1 of the warp's two
          // 8-row halves; lane l gives the row (token 8 (2 k + l / 16) + l % 8) of matrix l / 8,
          // value chunk v_local / 8 + (l / 8) % 2.
#pragma unroll
          for (int k = 0; k < kChunk / 16; ++k) {
            const uint32_t r[4] = {sm80::pack2<Elem>(o[2 * k][0], o[2 * k][1]), sm80::pack2<Elem>(o[2 * k][2], o[2 * k][3]),
                                   sm80::pack2<Elem>(o[2 * k + 1][0], o[2 * k + 1][1]),
                                   sm80::pack2<Elem>(o[2 * k + 1][2], o[2 * k + 1][3])};
            sm90::stmatrix_x4_trans(
                v_s + Shape::VTile::chunk_offset(16 * k + 8 * (lane >> 4) + (lane & 7), v_local / 8 + ((lane >> 3) & 1)), r);
          }
        } else
#endif
        {
#pragma unroll
          for (int nt = 0; nt < kChunk / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = 8 * nt + 2 * t4 + (e & 1), v = v_local + g8 + 8 * (e >> 1);
              *reinterpret_cast<Elem*>(st.v + Shape::VTile::offset(c, v)) = from_float<Elem>(o[nt][e]);
            }
          }
        }
        __syncwarp();
        const int len = chunk_len(j);
        Elem* orow0 = obase + (seq.bos + j * kChunk) * p.o_token_stride + v_local;
#pragma unroll
        for (int it = 0; it < kChunk / 16; ++it) {
          const int c = 16 * it + (lane >> 1), half = lane & 1, t = record_row(c);
          if (t < len)
            *reinterpret_cast<uint4*>(orow0 + int64_t(t) * p.o_token_stride + 8 * half) =
                *reinterpret_cast<const uint4*>(st.v + Shape::VTile::chunk_offset(c, v_local / 8 + half));
        }
      }
#ifdef FLASHKDA_WGMMA
      if constexpr (kWgmma) {
        sm90::wgmma_wait<0>();
        sm90::fence_operands(s);
      } else
#endif
      {
        // Sᵀ ← Sᵀ ⊙ decay + Uᵀ kd
        scale_key_columns(s, st.decay, t4);
#pragma unroll
        for (int kc = 0; kc < kChunk / 16; ++kc)
#pragma unroll
          for (int dp = 0; dp < kKeyTiles / 2; ++dp) {
            uint32_t bf[4];
            sm80::ldmatrix_x4_trans(bf, kd_s + MatTile::chunk_offset(16 * kc + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                     2 * dp + (lane >> 4)));
            sm80::mma_16816<Elem>(s[2 * dp], ua[kc], bf[0], bf[1]);
            sm80::mma_16816<Elem>(s[2 * dp + 1], ua[kc], bf[2], bf[3]);
          }
      }
    }

    // ---- final state ------------------------------------------------------------------------
    if (pass == RecurrencePass::kSegmentLocal) {  // Q or P of the segment, fp32 [v][d]
      float* dst = p.seg_states +
                   segment_matrix(p, n, seq, seg, transition ? SegmentLayout::kTransition : SegmentLayout::kLocal, hv);
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int v = v_glob + g8 + 8 * (e >> 1), d = 8 * nt + 2 * t4;
          *reinterpret_cast<float2*>(dst + v * kHeadDim + d) = make_float2(s[nt][e], s[nt][e + 1]);
        }
    } else if (pass == RecurrencePass::kWhole && p.state_out != nullptr) {
      store_state(static_cast<char*>(p.state_out) + state_base * dtype_bytes(p.state_out_dtype), p.state_out_dtype,
                  p.state_v_first, s, v_glob, g8, t4);
    }
  }
}

template <typename Elem, int kBlockV, int kVariant>
cudaError_t launch_recurrence_variant(const ChunkParams& p, cudaStream_t stream) {
  using Shape = RecurrenceShape<kBlockV>;
  auto kernel = chunk_recurrence_kernel<Elem, kBlockV, kVariant>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (err != cudaSuccess) return err;
  // kSegmentLocal runs the transition's rows as a second set of value blocks.
  const int blocks_v = (kHeadDim / kBlockV) * (p.recurrence_pass == RecurrencePass::kSegmentLocal ? 2 : 1);
  const int64_t blocks_n = int64_t(p.N) * (p.recurrence_pass == RecurrencePass::kWhole ? 1 : p.segments_per_seq);
  // The passes that follow chunk_prepare are set up while it finishes (see wait_prior_grid); the
  // output pass follows chunk_segment_scan, which does not let the next grid start early, and is
  // launched plainly.
  static const bool sm90 = has_sm90_image(kernel);
  const bool overlapped = sm90 && p.recurrence_pass != RecurrencePass::kSegmentOutput;
  // Grid z holds at most kMaxGridRows rows: more sequences take several launches (each waits for
  // the previous one before it loads a record).
  ChunkParams rows = p;
  for (int64_t first = 0; first < blocks_n; first += kMaxGridRows) {
    rows.first_grid_row = int32_t(first);
    const int64_t count = std::min<int64_t>(blocks_n - first, kMaxGridRows);
    err = launch_overlapped(overlapped, kernel, dim3(blocks_v, p.HV, uint32_t(count)), dim3(Shape::kThreads),
                            Shape::kSmemBytes, stream, rows);
    if (err != cudaSuccess) return err;
  }
  return cudaGetLastError();
}

template <typename Elem, int kBlockV>
cudaError_t launch_recurrence(const ChunkParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  // The image checks cost a driver call: once per process and instantiation (one device kind).
  static const bool sm90_image = has_sm90_image(chunk_recurrence_kernel<Elem, kBlockV, kBulkWgmma>);
  if (p.kernel_family != KernelFamily::kSm80 && sm90_image)
    return launch_recurrence_variant<Elem, kBlockV, kBulkWgmma>(p, stream);
  return launch_recurrence_variant<Elem, kBlockV, kCpAsyncMma>(p, stream);
}

}  // namespace chunk

template <typename Elem, int kBlockV>
cudaError_t run_chunk_recurrence(const ChunkParams& params, cudaStream_t stream) {
  return chunk::launch_recurrence<Elem, kBlockV>(params, stream);
}

}  // namespace flashkda
