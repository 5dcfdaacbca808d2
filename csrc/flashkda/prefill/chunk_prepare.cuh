// chunk_prepare: everything about one chunk that does not depend on the recurrent state, for all
// chunks and value heads in parallel (one block of eight warps per (chunk, value head)). It writes
// the workspace record described in chunk_params.h; chunk_recurrence then only multiplies.
//
// Decay without overflow (docs/SPEC.md, "The chunked form"). Inside a chunk the pairwise factor e^{Γi−Γj}
// (j ≤ i, ≤ 1) is never formed from e^{−Γj} alone. Tokens are grouped in sub-chunks of 16; γ is
// the log decay from the start of a token's sub-chunk (γ ∈ [τ_a, 0]) and τ_a the total of
// sub-chunk a, per channel. Each sub-chunk gets a per-channel pivot h_a = τ_a / 2 and the A / M
// operands are  row_i = x̂_i e^{γi − h_a},  col_j = k̂_j e^{h_b − γj}: within a sub-chunk their
// product is exactly e^{γi−γj} with both factors in [e^{τ/2}, e^{−τ/2}]; for j in an earlier
// sub-chunk b the row takes the per-channel factor e^{h_a + τ_{b+1}+…+τ_{a−1} + τ_b − h_b} ≤ 1,
// so the off-diagonal blocks are exact for any gate. The pivot keeps every factor within e^{±40}
// while the sub-chunk's decay |τ| ≤ kMaxSubchunkLogSpan (always for the lower-bound gate,
// 16 · 5 = 80). A channel that decays more (softplus or precomputed gates with strong decay,
// −1e4 masks) uses h_a = 0 on the row side and h_a = τ_a on the column side, which keeps the
// off-diagonal blocks exact, and its sub-chunk's diagonal block takes an exact path that builds
// e^{Γi−Γj} as a product of per-token decays (which can only underflow).
//
// The A and M products always use bf16 operands (fp32 range; fp16 would overflow at e^{11}).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/bulk_sm90.cuh"
#include "flashkda/common/constants.h"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/common/token_math.cuh"
#include "flashkda/prefill/chunk_common.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {
namespace chunk {

constexpr int kPrepareThreads = 256;
// Largest total log decay |τ| of a sub-chunk for which its diagonal block comes from the MMA. The
// operands stay within e^{±40} and every entry of the block's product, including the masked
// upper triangle (up to e^{|τ|}), stays finite in fp32 (e^{88.7}). 80.5 covers the lower-bound
// gate (at most 16 · 5 = 80).
constexpr float kMaxSubchunkLogSpan = 80.5f;
static_assert(-kLowerBoundMin * kSubChunk < kMaxSubchunkLogSpan, "no sub-chunk of the lower-bound gate is wide");
// Operand type of the A / M products (see above).
using OpElem = __nv_bfloat16;
// Three blocks of 8 warps per SM on sm_90 (at most 80 registers and 75 KB of shared memory each):
// the kernel is bound by latency, and measured on the H200 (T = 8192, H = 96) one block per SM took
// 1.130 ms, two 0.785 and three 0.750 (bench/harness/prepare_harness.cu; BENCHMARK_H200.md). An
// A100 SM holds two, so the sm_80 image takes the registers of two (no spills).
constexpr int kPrepareBlocksPerSm = 3;
constexpr int kPrepareBlocksPerSmSm80 = 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FLASHKDA_PREPARE_MIN_BLOCKS kPrepareBlocksPerSmSm80
#else
#define FLASHKDA_PREPARE_MIN_BLOCKS kPrepareBlocksPerSm
#endif

// The gate parameters as this kernel reads them: chunk_fwd hands it fp32 copies of 16-bit ones.
// Reading 16-bit parameters here took the generic kernel from 8 to 36 bytes of spills (sm_90a,
// ptxas), for a copy of HV·K values that costs a microsecond per prefill.
__device__ __forceinline__ const float* fp32_a_log(const ChunkParams& p) { return static_cast<const float*>(p.A_log); }
__device__ __forceinline__ const float* fp32_dt_bias(const ChunkParams& p) {
  return static_cast<const float*>(p.dt_bias);
}

constexpr int kPairs = kSubChunks * (kSubChunks - 1) / 2;
__host__ __device__ constexpr int pair_index(int a, int b) { return a * (a - 1) / 2 + b; }  // b < a

struct PrepareSmem {
  // Phase 0 loads the raw chunk: q in kj, k in kt (MatTile layout, element type of the inputs), a
  // 16-bit KDA gate in qi (row-major; an fp32 gate goes straight to registers). Phase 1 overwrites
  // each element in place.
  alignas(16) uint8_t qi[kChunk * kHeadDim * 2];  // q̂ e^{γ−h}, OpElem, MatTile
  alignas(16) uint8_t ki[kChunk * kHeadDim * 2];  // k̂ e^{γ−h}, OpElem, MatTile
  alignas(16) uint8_t kj[kChunk * kHeadDim * 2];  // k̂ e^{h−γ} (column side), OpElem, MatTile
  alignas(16) uint8_t kt[kChunk * kHeadDim * 2];  // k̂ e^{Γ}, Elem, MatTile
  float fac[kPairs][kHeadDim];                    // row factors of the off-diagonal blocks (a, b)
  // Per sub-chunk and channel (SubTable; rows by channel_slot): row pivot h (τ/2, or 0 when wide),
  // e^{before + h}, e^{after + h} (before / after: log decay of the sub-chunks before / after it).
  float sub_table[3][kSubChunks][kHeadDim];
  alignas(16) float qscale[kChunk];  // l2 norm scale of q (times the attention scale), 0 past the end
  alignas(16) float kscale[kChunk];  // l2 norm scale of k, 0 past the end
  alignas(16) float beta[kChunk];
  int wide_mask;  // bit a: sub-chunk a has a wide channel (its diagonal block takes the exact path)
};
static_assert(kPrepareBlocksPerSm * (sizeof(PrepareSmem) + kSmemReservedPerBlock) <= kSm90SmemPerSm,
              "three blocks per SM");
static_assert(kPrepareBlocksPerSmSm80 * (sizeof(PrepareSmem) + kSmemReservedPerBlock) <= kSm80SmemPerSm,
              "two blocks per A100 SM");
static_assert(kSubChunks == 4, "the phase-2 job list and the inverse assume four sub-chunks");
// Aliases after the A / M products (see phase 2): amat in ki, linv in qi, then tinv_s in ki, the
// inverse's scratch in the sub-chunk tables, w_s in kj.
enum SubTable : int { kRowPivot = 0, kToStart = 1, kToEnd = 2 };
static_assert(kChunk * kChunk * 4 <= int(sizeof(PrepareSmem::ki)), "an fp32 [kChunk][kChunk] matrix fits in a row tile");

// fp32 [kChunk][kChunk] matrices in shared memory (A, then L = (I + A)⁻¹): element (i, j) at
// i kChunk + (j ^ 4 (i & 7)), so that fragment accesses of 8 rows spread over the banks without
// padding. SqF32 views the 16 x 16 block at (r0, c0). The diagonal inverse (phase 3) folds this
// formula into constant offsets for its blocks.
__device__ __forceinline__ int sq_f32_index(int i, int j) { return i * kChunk + (j ^ ((i & 7) << 2)); }
struct SqF32 {
  float* m;
  int r0, c0;
  __device__ __forceinline__ float& at(int r, int c) const { return m[sq_f32_index(r0 + r, c0 + c)]; }
};

// The sub-chunk tables, which the element loop reads eight channels per thread (thread cg: channels
// 8 cg .. 8 cg + 7), hold in each row every thread's first four channels, contiguous over the 16
// threads of a token, then its last four: a half-warp's 16-byte loads then cover 256 contiguous
// bytes (two wavefronts, no bank conflict) instead of 512 bytes at a 32-byte stride.
// channel_slot(d): channel d's position in such a row.
__device__ __forceinline__ int channel_slot(int d) {
  return ((d >> 2) & 1) * (kHeadDim / 2) + (d >> 3) * 4 + (d & 3);
}
// Channels 8 cg .. 8 cg + 7 of such a row, as two 16-byte accesses.
__device__ __forceinline__ void load_channel_group(const float* row, int cg, float (&x)[8]) {
  const float4 lo = *reinterpret_cast<const float4*>(row + 4 * cg);
  const float4 hi = *reinterpret_cast<const float4*>(row + kHeadDim / 2 + 4 * cg);
  x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
}

// The grid (HV, chunk slots in rows of kMaxGridRows): this block's slot, the last slots first.
__device__ __forceinline__ int block_slot(const ChunkParams& p) {
  return p.num_chunk_slots - 1 - int(blockIdx.y + blockIdx.z * uint32_t(kMaxGridRows));
}
// This block's workspace record, formed again from the grid where the copy engine takes it at the
// end of the kernel: holding the pointer from the start instead made ptxas spill over 100 bytes in
// the element loop (28 this way).
__device__ __forceinline__ uint8_t* block_record(const ChunkParams& p) {
  return static_cast<uint8_t*>(p.workspace) + (int64_t(block_slot(p)) * p.HV + blockIdx.x) * WorkspaceLayout::kRecordBytes;
}

template <typename Elem>
__device__ __forceinline__ void store_elem(uint8_t* base, uint32_t off, float x) {
  *reinterpret_cast<Elem*>(base + off) = from_float<Elem>(x);
}

// Where M's blocks go: on sm_90 into the sub-chunk tables (dead after the element loop; the
// off-diagonal inverse's scratch once M has been read out), then to the record in one bulk copy;
// else straight to the record. A warp's 4-byte fragment stores span eight rows: eight sectors of
// global memory, one wavefront of shared memory.
__device__ __forceinline__ uint8_t* m_tile(const ChunkParams& p, PrepareSmem& s) {
#ifdef FLASHKDA_BULK_COPY
  (void)p;
  return reinterpret_cast<uint8_t*>(s.sub_table);
#else
  return block_record(p) + WorkspaceLayout::kMqk;
#endif
}
static_assert(int(sizeof(PrepareSmem::sub_table)) >= TriTile::kBytes, "M's blocks fit in the sub-chunk tables");

// This thread's index, read again for phases 2-5: indices derived from the first read (at the
// kernel's start) were held across the element loop, where ptxas spilled (68 bytes; 8 with this
// and the wide-mask read after the loop).
__device__ __forceinline__ int thread_index_again() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Two floats from shared memory, loaded where used: the element loop reads the sub-chunk tables
// once per token, and the compiler, free to merge those loads, held them across the loop (ptxas
// spilled there).
__device__ __forceinline__ float2 load_float2_per_use(const float* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(sm80::smem_u32(p)));
  return v;
}

// Eight floats as eight b16 elements (one 16-byte store).
template <typename Elem>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(sm80::pack2<Elem>(x[0], x[1]), sm80::pack2<Elem>(x[2], x[3]), sm80::pack2<Elem>(x[4], x[5]),
                    sm80::pack2<Elem>(x[6], x[7]));
}

// Exact diagonal block of sub-chunk a (one warp): A entries (into amat, shared memory) and the
// whole 16x16 diagonal block of M (into m_tile) from products of per-token decays. Lane owns
// channels 4·lane .. 4·lane+3. The chunk, the heads and the record are formed again from the grid:
// held from the start of the kernel for this rare path, they made ptxas spill in the element loop.
template <typename Elem>
__device__ void exact_diagonal_block(const ChunkParams& p, int a, PrepareSmem& s, float* amat) {
  const int lane = threadIdx.x & 31;
  const int hv = blockIdx.x, h = key_head(p, hv);
  ChunkSpan c;
  locate_chunk(p, block_slot(p), c);  // true: the kernel returned otherwise
  uint8_t* const mqk = m_tile(p, s);
  const Elem* qb = static_cast<const Elem*>(p.q) + c.batch * p.q_batch_stride + h * p.q_head_stride;
  const Elem* kb = static_cast<const Elem*>(p.k) + c.batch * p.k_batch_stride + h * p.k_head_stride;
  const char* gb = static_cast<const char*>(p.g);
  const float A = p.A_log != nullptr ? __expf(fp32_a_log(p)[hv]) : 1.f;
  float kh[kSubChunk][4], eg[kSubChunk][4];
  for (int i = 0; i < kSubChunk; ++i) {
    const int t = a * kSubChunk + i;
    const bool valid = t < c.len;
    const int64_t tok = c.bos + t;
    for (int e = 0; e < 4; ++e) {
      const int d = 4 * lane + e;
      kh[i][e] = valid ? to_float(kb[tok * p.k_token_stride + d]) * s.kscale[t] : 0.f;
      float gl = 0.f;
      if (valid) {
        const int64_t gi = c.batch * p.g_batch_stride + tok * p.g_token_stride + hv * p.g_head_stride +
                           (p.scalar_gate ? 0 : d);
        const float bias = p.dt_bias == nullptr ? 0.f : fp32_dt_bias(p)[p.scalar_gate ? hv : hv * kHeadDim + d];
        gl = log_decay(p, load_any(gb, p.g_dtype, gi), bias, A);
      }
      eg[i][e] = __expf(gl);
    }
  }
  for (int i = 0; i < kSubChunk; ++i) {
    const int t = a * kSubChunk + i;
    const bool valid = t < c.len;
    const int64_t tok = c.bos + t;
    float qh[4];
    for (int e = 0; e < 4; ++e)
      qh[e] = valid ? to_float(qb[tok * p.q_token_stride + 4 * lane + e]) * s.qscale[t] : 0.f;
    float decay[4] = {1.f, 1.f, 1.f, 1.f};  // e^{Γi−Γj}, built from j = i downwards
    for (int j = i; j >= 0; --j) {
      if (j < i)
        for (int e = 0; e < 4; ++e) decay[e] *= eg[j + 1][e];
      float sa = 0.f, sm = 0.f;
      for (int e = 0; e < 4; ++e) {
        const float kd = kh[j][e] * decay[e];
        sa += kh[i][e] * kd;
        sm += qh[e] * kd;
      }
      for (int off = 16; off > 0; off >>= 1) {
        sa += __shfl_xor_sync(0xffffffffu, sa, off);
        sm += __shfl_xor_sync(0xffffffffu, sm, off);
      }
      if (lane == 0) {
        const int row = a * kSubChunk + i, col = a * kSubChunk + j;
        amat[sq_f32_index(row, col)] = j < i ? sa * s.beta[t] : 0.f;
        store_elem<Elem>(mqk, TriTile::token_offset(row, col), sm);
      }
    }
  }
  for (int e = lane; e < kSubChunk * kSubChunk; e += 32) {  // the block's upper triangle of M is zero
    const int i = e / kSubChunk, j = e % kSubChunk;
    if (j > i) store_elem<Elem>(mqk, TriTile::token_offset(a * kSubChunk + i, a * kSubChunk + j), 0.f);
  }
}

// Row stride (floats) of a warp's 16x16 scratch block in the off-diagonal inverse: the B-fragment
// reads (rows t, t+4; columns g) then hit 32 different banks.
constexpr int kScratchStride = 24;
static_assert((kSubChunks - 1) * kSubChunk * kScratchStride * 4 <= int(sizeof(PrepareSmem::sub_table)),
              "the inverse's scratch fits in the sub-chunk tables");

// Operands of the off-diagonal inverse products: tf32 (10-bit mantissa, rounded to nearest). T is
// rounded to the 16-bit input type for the record right after, so a 3xTF32 split (fp32 accuracy,
// three MMAs per product) bought no accuracy: the products sit on the inverse's serial chain.
constexpr bool kInverseSplitTf32 = false;

// Phase 2 work: the ten blocks (a, b), b <= a, of A and of M. A and M share their column operand
// k e^{h−γ} and, off the diagonal, its per-channel factor: one warp runs both products of a block
// position, scaling the column fragments once. Warps 0-5 take the six off-diagonal positions
// (warp = pair_index(a, b)), warps 6 and 7 two diagonal positions each (unscaled).
constexpr int kDiagonalWarpsFirst = kPairs;
static_assert(kPairs + kSubChunks / 2 == kPrepareThreads / 32, "six pair warps and two diagonal warps");
// Block position j (0, or 1 for the diagonal warps) of a warp.
__device__ __forceinline__ void block_position(int warp, int j, int& a, int& b) {
  if (warp < kDiagonalWarpsFirst) {
    a = warp < 1 ? 1 : warp < 3 ? 2 : 3;
    b = warp - pair_index(a, 0);
  } else {
    a = b = 2 * (warp - kDiagonalWarpsFirst) + j;
  }
}

// acc_a += ki[a] · (diag(f) kj[b])ᵀ and acc_m += qi[a] · (diag(f) kj[b])ᵀ (16x16 blocks) over the
// head dim; ki, qi and kj OpElem MatTiles. kScaled false: f is 1 (a narrow diagonal block) and is
// not read.
template <bool kScaled>
__device__ __forceinline__ void pair_block_product(float (&acc_a)[2][4], float (&acc_m)[2][4], uint32_t ki_base,
                                                   uint32_t qi_base, const float* f, uint32_t kj_base, int a, int b) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
#pragma unroll
  for (int kd = 0; kd < kHeadDim / 16; ++kd) {
    // Column fragments: tokens g (n-tile 0) and g + 8 (n-tile 1) at keys 16 kd + 2 t, + 1 (regs 0, 2)
    // and 16 kd + 8 + 2 t, + 1 (regs 1, 3).
    uint32_t bf[4];
    sm80::ldmatrix_x4(bf, kj_base + MatTile::chunk_offset(b * kSubChunk + (lane & 7) + (lane >> 4) * 8,
                                                          2 * kd + ((lane >> 3) & 1)));
    if constexpr (kScaled) {
      const int dd = 16 * kd + 2 * t4;
      const float2 f01 = *reinterpret_cast<const float2*>(&f[dd]);
      const float2 f23 = *reinterpret_cast<const float2*>(&f[dd + 8]);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 fw = (w & 1) ? f23 : f01;
        float lo, hi;
        sm80::unpack2_bf16(bf[w], lo, hi);
        bf[w] = sm80::pack2<OpElem>(lo * fw.x, hi * fw.y);
      }
    }
    const uint32_t row = MatTile::chunk_offset(a * kSubChunk + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * kd + (lane >> 4));
    uint32_t ak[4], aq[4];  // rows g, g + 8 at keys 16 kd + 2 t, + 1, then at 16 kd + 8 + 2 t, + 1
    sm80::ldmatrix_x4(ak, ki_base + row);
    sm80::ldmatrix_x4(aq, qi_base + row);
    sm80::mma_16816<OpElem>(acc_a[0], ak, bf[0], bf[1]);
    sm80::mma_16816<OpElem>(acc_a[1], ak, bf[2], bf[3]);
    sm80::mma_16816<OpElem>(acc_m[0], aq, bf[0], bf[1]);
    sm80::mma_16816<OpElem>(acc_m[1], aq, bf[2], bf[3]);
  }
}

// Gate forms compiled apart (run_chunk_prepare picks one per call). kGeneric reads the gate's mode,
// dtype and form (per channel or scalar) at run time; kLowerBound16 is the lower-bound gate on a
// 16-bit per-channel g with a bound in the contract's [kLowerBoundMin, 0), which keeps every
// sub-chunk narrow (|τ| <= 16 |lower_bound| <= 80 < kMaxSubchunkLogSpan; the API rejects other
// bounds), the common serving form: those branches and the exact diagonal path
// fold away, and fewer values stay live at the element loop's register edge (H200 harness,
// T = 8192, H = 96: 0.522 → 0.508 ms, records bitwise the same).
enum class PrepareGate : int { kGeneric = 0, kLowerBound16 = 1 };

inline PrepareGate prepare_gate(const ChunkParams& p) {
  const bool bits16 = p.g_dtype == DType::kBFloat16 || p.g_dtype == DType::kFloat16;
  return p.gate_mode == GateMode::kLowerBound && p.lower_bound >= kLowerBoundMin && !p.scalar_gate && bits16
             ? PrepareGate::kLowerBound16
             : PrepareGate::kGeneric;
}

// The gate's form as kGate fixes it, else from the params.
template <PrepareGate kGate>
__device__ __forceinline__ bool scalar_gate(const ChunkParams& p) {
  return kGate == PrepareGate::kLowerBound16 ? false : p.scalar_gate;
}
template <PrepareGate kGate>
__device__ __forceinline__ GateMode gate_mode(const ChunkParams& p) {
  return kGate == PrepareGate::kLowerBound16 ? GateMode::kLowerBound : p.gate_mode;
}

// The thread's indices as phases 2-5 use them (read again after phase 1: thread_index_again).
struct ThreadIndex {
  int tid, warp, lane, g8, t4;
};
// Phase 2: A = diag(β) (k e^{Γ})(k e^{−Γ})ᵀ and M = (q e^{Γ})(k e^{−Γ})ᵀ, blockwise, from the
// operand tiles of phase 1: M to the record, A to amat (in ki).
template <typename Elem, PrepareGate kGate>
__device__ __forceinline__ void gram_blocks(const ChunkParams& p, PrepareSmem& s, const ThreadIndex& x, int wide_mask) {
  const int tid = x.tid, warp = x.warp, g8 = x.g8, t4 = x.t4;
  // Stage 1: every warp runs its block positions (block_position), M's blocks go to m_tile and
  // A's stay in registers; stage 2 stores A (after the barrier, over the dead row tiles). Shared
  // memory from here on:
  //   ki (A rows): amat (sq_f32_index), then tinv_s (TriTile) after the off-diagonal inverse
  //   qi (M rows): linv (sq_f32_index)
  //   sub_table (dead): M's blocks on sm_90 (m_tile), then the off-diagonal inverse's scratch
  //   kj (column operand): w_s (MatTile)
  float* amat = reinterpret_cast<float*>(s.ki);
  uint8_t* const mqk_out = m_tile(p, s);
  const uint32_t kj_base = sm80::smem_u32(s.kj), qi_base = sm80::smem_u32(s.qi), ki_base = sm80::smem_u32(s.ki);
  const bool pair_warp = warp < kDiagonalWarpsFirst;
  const int positions = pair_warp ? 1 : 2;
  float acc[2][2][4];  // A's block of each position
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][n][e] = 0.f;
    if (j >= positions) continue;
    int a, b;
    block_position(warp, j, a, b);
    if (b == a && (wide_mask >> a & 1)) continue;  // exact_diagonal_block writes both blocks
    float acc_m[2][4] = {};
    if (b == a) pair_block_product<false>(acc[j], acc_m, ki_base, qi_base, nullptr, kj_base, a, b);
    else pair_block_product<true>(acc[j], acc_m, ki_base, qi_base, s.fac[pair_index(a, b)], kj_base, a, b);
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = a * kSubChunk + g8 + 8 * hh, jc = b * kSubChunk + 8 * n + 2 * t4;
        *reinterpret_cast<uint32_t*>(mqk_out + TriTile::token_offset(i, jc)) =
            sm80::pack2<Elem>(jc <= i ? acc_m[n][2 * hh] : 0.f, jc + 1 <= i ? acc_m[n][2 * hh + 1] : 0.f);
      }
  }
  __syncthreads();  // the row tiles are dead
  // Stage 2: A's blocks to amat (in ki), strictly lower triangle, times β of the row.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (j >= positions) continue;
    int a, b;
    block_position(warp, j, a, b);
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = a * kSubChunk + g8 + 8 * hh, jc = b * kSubChunk + 8 * n + 2 * t4;
        const float bi = s.beta[i];
        *reinterpret_cast<float2*>(&amat[sq_f32_index(i, jc)]) =
            make_float2(jc < i ? acc[j][n][2 * hh] * bi : 0.f, jc + 1 < i ? acc[j][n][2 * hh + 1] * bi : 0.f);
      }
  }
#ifdef FLASHKDA_BULK_COPY
  sm90::fence_proxy_async();  // M's blocks in shared memory, for the copy engine
#endif
  __syncthreads();
  if (kGate != PrepareGate::kLowerBound16 && wide_mask != 0) {  // rare (block-uniform): exact diagonal blocks
    if (warp < kSubChunks && (wide_mask >> warp & 1)) exact_diagonal_block<Elem>(p, warp, s, amat);
#ifdef FLASHKDA_BULK_COPY
    sm90::fence_proxy_async();
#endif
    __syncthreads();
  }
#ifdef FLASHKDA_BULK_COPY
  if (tid == 0) sm90::bulk_copy_to_global(block_record(p) + WorkspaceLayout::kMqk, mqk_out, uint32_t(TriTile::kBytes));
#endif
}

// Phase 3: T = (I + A)⁻¹ diag(β), by blocks of 16, into tinv_s (in ki) and the record.
template <typename Elem>
__device__ __forceinline__ void inverse_blocks(const ChunkParams& p, PrepareSmem& s, const ThreadIndex& x, uint8_t* rec) {
  const int tid = x.tid, warp = x.warp, lane = x.lane;
  float* amat = reinterpret_cast<float*>(s.ki);
  float* linv = reinterpret_cast<float*>(s.qi);
  uint8_t* tinv_s = s.ki;
  float* scratch = &s.sub_table[0][0][0];
  if (warp < kSubChunks) {
    if (lane < kSubChunk) {  // diagonal blocks: column `lane` of (I + A_aa)⁻¹
      // sq_f32_index(16 a + i, 16 a + l) = (16 a + i) 64 + 16 (a ^ (m >> 4)) + (l ^ (m & 15)) with
      // m = 4 (i & 7): from one of two bases per block, at offsets that are constants once i and l
      // are unrolled.
      static_assert(kSubChunk == 16 && kChunk == 64, "the folded sq_f32_index below");
      const int a = warp, j = lane;
      const int at[2] = {a * kSubChunk * kChunk + kSubChunk * a, a * kSubChunk * kChunk + kSubChunk * (a ^ 1)};
      float x[kSubChunk];
#pragma unroll
      for (int i = 0; i < kSubChunk; ++i) {
        const int m = (i & 7) << 2;
        float accv = i == j ? 1.f : 0.f;
#pragma unroll
        for (int l = 0; l < i; ++l) accv -= amat[at[m >> 4] + i * kChunk + (l ^ (m & 15))] * x[l];
        x[i] = accv;
        linv[at[m >> 4] + i * kChunk + (j ^ (m & 15))] = accv;
      }
    }
  }
#ifdef FLASHKDA_BULK_COPY
  if (tid == 0) {  // the scratch below overwrites M's blocks: the engine must have read them
    sm90::bulk_commit();
    sm90::bulk_wait_read<0>();
  }
#endif
  __syncthreads();
  // Off-diagonal blocks, one warp per block column b (columns are independent):
  //   L[a, b] = −L[a, a] · Σ_{c=b}^{a−1} A[a, c] L[c, b],   a = b+1 .. 3, in order,
  // as 16x16x16 products on the tf32 tensor cores.
  if (warp < kSubChunks - 1) {
    const int b = warp;
    const sm80::PlainF32 scr{scratch + warp * kSubChunk * kScratchStride, kScratchStride};
    for (int a = b + 1; a < kSubChunks; ++a) {
      float acc2[2][4] = {};
      for (int cc = b; cc < a; ++cc)
        sm80::block_product_tf32<kInverseSplitTf32>(acc2, SqF32{amat, a * kSubChunk, cc * kSubChunk}, SqF32{linv, cc * kSubChunk, b * kSubChunk});
      sm80::store_block(scr, acc2, 1.f);
      __syncwarp();
      float acc3[2][4] = {};
      sm80::block_product_tf32<kInverseSplitTf32>(acc3, SqF32{linv, a * kSubChunk, a * kSubChunk}, scr);
      sm80::store_block(SqF32{linv, a * kSubChunk, b * kSubChunk}, acc3, -1.f);
      __syncwarp();  // L[a, b] is read by the next step; scr is rewritten
    }
  }
  __syncthreads();
  // T = L diag(β), its blocks on and below the diagonal (TriTile), 16 bytes per store into shared
  // memory (phase 4) and the record (sm_80; on sm_90 the copy engine copies the tile).
  // Under sq_f32_index's XOR (bits 2-4 of the column) a row's columns 8 ch .. 8 ch + 7 stay one
  // 32-byte group: bits 3-4 move the group, bit 2 swaps its halves. Two 16-byte loads of L per row
  // piece; β's two once per thread.
  static_assert(kPrepareThreads % (kChunk / 8) == 0, "a thread keeps its column piece (and β) in every iteration");
  const int ch = tid % (kChunk / 8);
  const float4 b0 = *reinterpret_cast<const float4*>(&s.beta[8 * ch]);
  const float4 b1 = *reinterpret_cast<const float4*>(&s.beta[8 * ch + 4]);
  for (int e = tid; e < kChunk * (kChunk / 8); e += kPrepareThreads) {
    const int i = e / (kChunk / 8);
    if (8 * ch / kSubChunk > i / kSubChunk) continue;  // a zero block: not in the TriTile
    const int flip = (i & 7) << 2;
    const float* group = linv + i * kChunk + 8 * (ch ^ (flip >> 3));
    const float4 lo = *reinterpret_cast<const float4*>(group + (flip & 4));
    const float4 hi = *reinterpret_cast<const float4*>(group + (4 - (flip & 4)));
    const float l[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    float x[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) x[m] = 8 * ch + m <= i ? l[m] * b[m] : 0.f;
    const uint4 packed = pack8<Elem>(x);
    *reinterpret_cast<uint4*>(tinv_s + TriTile::token_chunk_offset(i, ch)) = packed;
#ifndef FLASHKDA_BULK_COPY
    *reinterpret_cast<uint4*>(rec + WorkspaceLayout::kTinv + TriTile::token_chunk_offset(i, ch)) = packed;
#endif
  }
#ifdef FLASHKDA_BULK_COPY
  // sm_90: the copy engine moves T (tinv_s is the record's image) and later w to the record. Both
  // tiles stay untouched to the end, where the issuing thread waits for the engine's reads; the
  // load / store path stays free for the other warps' shared-memory traffic.
  sm90::fence_proxy_async();
  __syncthreads();
  if (tid == 0) sm90::bulk_copy_to_global(block_record(p) + WorkspaceLayout::kTinv, tinv_s, uint32_t(TriTile::kBytes));
#else
  __syncthreads();
#endif
}

// Phase 4: w = T (k e^{Γ}) into w_s (in kj).
template <typename Elem>
__device__ __forceinline__ void w_product(PrepareSmem& s, const ThreadIndex& x) {
  const int warp = x.warp, lane = x.lane, g8 = x.g8, t4 = x.t4;
  uint8_t* tinv_s = s.ki;
  uint8_t* w_s = s.kj;
  // Warp w: key columns 32 (w % 4) .. +31 of row blocks {3, 0} (w < 4) or {2, 1}: row block a
  // takes a + 1 products (T is lower triangular), so every warp runs five.
  {
    const int quarter = warp % 4, pairing = warp / 4;
    const uint32_t t_base = sm80::smem_u32(tinv_s), kt_base = sm80::smem_u32(s.kt);
    static_assert(kSubChunks == 4 && kPrepareThreads == 256, "phase 4 splits four row blocks over eight warps");
    // MatTile::offset(record_row(16 a) + g8 + 8 hh, 32 quarter + 8 n + 2 t4) (w in the record's
    // token order), taken apart: the panel and the lane's row and column once, the swizzled chunk
    // (4 (quarter & 1) + n) ^ g8 per n, and the row block and hh as constants.
    static_assert(MatTile::kPanelBytes == kChunk * 128 && kHeadDim == 128, "the w store offsets below");
    const int w_lane = (quarter >> 1) * MatTile::kPanelBytes + g8 * 128 + 4 * t4;
    const int w_swz = (4 * (quarter & 1)) ^ g8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int a = r == 0 ? kSubChunks - 1 - pairing : pairing;
      float accw[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) accw[n][e] = 0.f;
#pragma unroll
      for (int kc = 0; kc < kSubChunks; ++kc) {  // kc <= a (unrolled: the tile offsets fold into constants)
        if (kc > a) break;
        uint32_t af[4];
        sm80::ldmatrix_x4(af, t_base + TriTile::token_chunk_offset(a * kSubChunk + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                            2 * kc + (lane >> 4)));
#pragma unroll
        for (int dp = 0; dp < 2; ++dp) {
          uint32_t bf[4];
          sm80::ldmatrix_x4_trans(bf, kt_base + MatTile::chunk_offset(kc * kSubChunk + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                      4 * quarter + 2 * dp + (lane >> 4)));
          sm80::mma_16816<Elem>(accw[2 * dp], af, bf[0], bf[1]);
          sm80::mma_16816<Elem>(accw[2 * dp + 1], af, bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          *reinterpret_cast<uint32_t*>(w_s + w_lane + (record_row(a * kSubChunk) + 8 * hh) * 128 + ((w_swz ^ n) << 4)) =
              sm80::pack2<Elem>(accw[n][2 * hh], accw[n][2 * hh + 1]);
        }
    }
  }
#ifdef FLASHKDA_BULK_COPY
  sm90::fence_proxy_async();
#endif
  __syncthreads();
}

// Phase 5: w to the record (same swizzled layout).
__device__ __forceinline__ void w_to_record(const ChunkParams& p, PrepareSmem& s, int tid, uint8_t* rec) {
  uint8_t* w_s = s.kj;
#ifdef FLASHKDA_BULK_COPY
  if (tid == 0) {
    sm90::bulk_copy_to_global(block_record(p) + WorkspaceLayout::kW, w_s, uint32_t(WorkspaceLayout::kMatBytes));
    sm90::bulk_commit();
    sm90::bulk_wait_read<0>();  // the block's shared memory outlives the engine's reads of T and w
  }
#else
  for (int e = tid; e < kChunk * kHeadDim * 2 / 16; e += kPrepareThreads)
    reinterpret_cast<uint4*>(rec + WorkspaceLayout::kW)[e] = reinterpret_cast<const uint4*>(w_s)[e];
#endif
}

template <typename Elem, PrepareGate kGate>
__global__ void __launch_bounds__(kPrepareThreads, FLASHKDA_PREPARE_MIN_BLOCKS) chunk_prepare_kernel(const ChunkParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  PrepareSmem& s = *reinterpret_cast<PrepareSmem*>(smem_raw);
  wait_prior_grid();  // the previous kernel's writes: chunk_index's slot table, the inputs (launch_overlapped)
  allow_next_grid();  // chunk_recurrence may launch (after the wait: kernel_launch.cuh); it waits for the records
  // Grid (HV, slots in rows of kMaxGridRows): heads fastest and the last chunk slots first, so
  // that the records written last, still in L2, are the first that chunk_recurrence reads (its
  // first blocks take every head of the first sequence, slot 0 on, in a batch of equal lengths).
  const int hv = blockIdx.x;
  const int slot = block_slot(p);
  if (slot < 0) return;  // the last grid row's tail
  ChunkSpan c;
  if (!locate_chunk(p, slot, c)) return;
  const int h = key_head(p, hv);
  int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;  // read again after phase 1 (thread_index_again)
  int g8 = lane >> 2, t4 = lane & 3;
  uint8_t* rec = static_cast<uint8_t*>(p.workspace) + (int64_t(slot) * p.HV + hv) * WorkspaceLayout::kRecordBytes;

  const Elem* qb = static_cast<const Elem*>(p.q) + c.batch * p.q_batch_stride + h * p.q_head_stride;
  const Elem* kb = static_cast<const Elem*>(p.k) + c.batch * p.k_batch_stride + h * p.k_head_stride;
  const char* gbytes = static_cast<const char*>(p.g);
  const int g_size = kGate == PrepareGate::kLowerBound16 ? 2 : dtype_bytes(p.g_dtype);

  // Thread (cg, ts) owns channels 8cg .. 8cg+7 of tokens 4ts .. 4ts+3 (sub-chunk ts / 4) through
  // phase 1, so that every shared and global access moves 16 bytes. Warp w holds slices 2w and
  // 2w + 1 (lanes l and l + 16 share their channels): half of sub-chunk w / 2.
  constexpr int kSliceTokens = 4, kGroups = kHeadDim / 8;
  const int cg = tid % kGroups, ts = tid / kGroups, d0 = 8 * cg, sub = ts / (kSubChunk / kSliceTokens);
  static_assert(kPrepareThreads == kGroups * kChunk / kSliceTokens && kGroups == 16, "two slices per warp");

  // The gate's per-head and per-channel constants, loaded first: their latency then passes under
  // the copies below instead of after them.
  const float a_log = p.A_log != nullptr ? fp32_a_log(p)[hv] : 0.f;
  float bias[8];
  {
    const float* bp = p.dt_bias == nullptr ? nullptr : fp32_dt_bias(p) + (scalar_gate<kGate>(p) ? hv : hv * kHeadDim + d0);
    if (bp != nullptr && !scalar_gate<kGate>(p) && (reinterpret_cast<uintptr_t>(bp) & 15) == 0) {
      load_floats(bp, bias);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) bias[e] = bp == nullptr ? 0.f : bp[scalar_gate<kGate>(p) ? 0 : e];
    }
  }

  // ---- Phase 0: this thread's part of the raw chunk into shared memory ------------------------
  // Each thread copies exactly the elements it reads in phase 1 (q in kj, k in kt, MatTile layout;
  // the KDA gate in qi, row-major in its own dtype) and waits for its own copies: no barrier.
  {
#pragma unroll
    for (int i = 0; i < kSliceTokens; ++i) {
      const int t = kSliceTokens * ts + i;
      const bool valid = t < c.len;
      const int64_t tok = c.bos + (valid ? t : 0);
      const uint32_t off = MatTile::chunk_offset(t, cg);
      sm80::cp_async_16(sm80::smem_u32(s.kj) + off, qb + tok * p.q_token_stride + d0, valid);
      sm80::cp_async_16(sm80::smem_u32(s.kt) + off, kb + tok * p.k_token_stride + d0, valid);
      if (!scalar_gate<kGate>(p) && g_size == 2) {
        const char* src =
            gbytes + (c.batch * p.g_batch_stride + tok * p.g_token_stride + hv * p.g_head_stride + d0) * g_size;
        sm80::cp_async_16(sm80::smem_u32(s.qi) + (t * kHeadDim + d0) * 2, src, valid);
      }
    }
    sm80::cp_async_commit();
    if (tid < kChunk) {  // read after the barriers below
      const int64_t tok = c.bos + tid;
      s.beta[tid] = tid < c.len ? beta_value(p, load_any(p.beta, p.beta_dtype,
                                                         c.batch * p.beta_batch_stride + tok * p.beta_token_stride + hv))
                                : 0.f;
    }
    if (tid == 0) s.wide_mask = 0;
  }
  // The gate's scalars for this thread's channels (and tokens, with a scalar gate).
  const float A = p.A_log != nullptr ? __expf(a_log) : 1.f;
  float gate_scalar[kSliceTokens];
#pragma unroll
  for (int i = 0; i < kSliceTokens; ++i) {
    const int t = kSliceTokens * ts + i;
    gate_scalar[i] = scalar_gate<kGate>(p) && t < c.len
                         ? load_any(p.g, p.g_dtype,
                                    c.batch * p.g_batch_stride + (c.bos + t) * p.g_token_stride + hv * p.g_head_stride)
                         : 0.f;
  }
  sm80::cp_async_wait<0>();
  __syncwarp();  // the warp's eight tokens (both slices) are in kj / kt

  // l2 norms and scales of the warp's eight tokens on the tensor cores: the 16 x 16 Gram matrix of
  // their q rows (0-7) and k rows (8-15) has the squared norms on its diagonal (16-bit products are
  // exact in the fp32 accumulators). Read after the barriers below (the element loop, the exact
  // diagonal blocks).
  {
    const int t8 = kSliceTokens * 2 * warp;  // the warp's first token
    float acc[2][4] = {};
    if (p.l2norm) {
      const uint32_t kj_rows = sm80::smem_u32(s.kj), kt_rows = sm80::smem_u32(s.kt);
      const uint32_t a_rows = ((lane >> 3) & 1) ? kt_rows : kj_rows, b_rows = (lane >> 4) ? kt_rows : kj_rows;
#pragma unroll
      for (int kd = 0; kd < kHeadDim / 16; ++kd) {
        uint32_t af[4], bf[4];
        sm80::ldmatrix_x4(af, a_rows + MatTile::chunk_offset(t8 + (lane & 7), 2 * kd + (lane >> 4)));
        sm80::ldmatrix_x4(bf, b_rows + MatTile::chunk_offset(t8 + (lane & 7), 2 * kd + ((lane >> 3) & 1)));
        sm80::mma_16816<Elem>(acc[0], af, bf[0], bf[1]);
        sm80::mma_16816<Elem>(acc[1], af, bf[2], bf[3]);
      }
    }
    if (t4 == (g8 >> 1)) {  // this lane holds the diagonal entries of rows g8 (q) and g8 + 8 (k)
      const int t = t8 + g8;
      // Selected, not indexed by g8: a register array indexed at run time goes to local memory.
      const bool odd = (g8 & 1) != 0;
      const float rq = p.l2norm ? rsqrtf((odd ? acc[0][1] : acc[0][0]) + kL2NormEps) : 1.f;
      const float rk = p.l2norm ? rsqrtf((odd ? acc[1][3] : acc[1][2]) + kL2NormEps) : 1.f;
      s.qscale[t] = t < c.len ? rq * p.scale : 0.f;
      s.kscale[t] = t < c.len ? rk : 0.f;
    }
  }

  // ---- Phase 1: gate, decays and the decayed operands ----------------------------------------
  // Log decays of the slice. Every exponent below is a direct sum of them (prefixes and suffixes),
  // never a difference of long cumulative sums: with −1e4 masks those lose the small terms. The gate
  // dtype and mode are uniform per launch: one branch each, outside the element loops.
  float gl[kSliceTokens][8];
  {
#pragma unroll
    for (int i = 0; i < kSliceTokens; ++i) {
      const int t = kSliceTokens * ts + i;
      if (scalar_gate<kGate>(p)) {
#pragma unroll
        for (int e = 0; e < 8; ++e) gl[i][e] = gate_scalar[i];
      } else if (g_size == 4) {  // fp32: straight from global memory (a row tile holds 16-bit gates only)
        const int64_t tok = c.bos + (t < c.len ? t : 0);
        load_floats(reinterpret_cast<const float*>(gbytes) + c.batch * p.g_batch_stride + tok * p.g_token_stride +
                        hv * p.g_head_stride + d0,
                    gl[i]);
      } else {
        const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(s.qi) + (t * kHeadDim + d0) * 2);
        if (p.g_dtype == DType::kBFloat16) {
          const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
          for (int e = 0; e < 8; ++e) gl[i][e] = __bfloat162float(x[e]);
        } else {
          const __half* x = reinterpret_cast<const __half*>(&v);
#pragma unroll
          for (int e = 0; e < 8; ++e) gl[i][e] = __half2float(x[e]);
        }
      }
    }
    // Base-2 log decays from here on (every exponential below is one exp2_ftz), zero past the end.
    // Lower bound: lb·σ(A (g + b))·log2(e) = lb·log2(e) / (1 + 2^{−A·log2(e)·g − A·log2(e)·b}).
    if (gate_mode<kGate>(p) == GateMode::kLowerBound) {
      const float slope = -A * kLog2e, top = p.lower_bound * kLog2e;
      float shift[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) shift[e] = slope * bias[e];
#pragma unroll
      for (int i = 0; i < kSliceTokens; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float d = top * rcp_approx(1.f + exp2_ftz(fmaf(gl[i][e], slope, shift[e])));
          gl[i][e] = kSliceTokens * ts + i < c.len ? d : 0.f;
        }
    } else if (gate_mode<kGate>(p) == GateMode::kSoftplus) {
      // −A·softplus(x)·log2(e), softplus(x)·log2(e) = max(x', 0) + log2(1 + 2^{−|x'|}), x' = x·log2(e).
#pragma unroll
      for (int i = 0; i < kSliceTokens; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float x = (gl[i][e] + bias[e]) * kLog2e;
          const float d = -A * (fmaxf(x, 0.f) + log2_approx(1.f + exp2_ftz(-fabsf(x))));
          gl[i][e] = kSliceTokens * ts + i < c.len ? d : 0.f;
        }
    } else {
#pragma unroll
      for (int i = 0; i < kSliceTokens; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) gl[i][e] = kSliceTokens * ts + i < c.len ? gl[i][e] * kLog2e : 0.f;
    }
  }
  // Slice totals; the other slice of this warp by a shuffle, the two-slice sums of every warp
  // through shared memory (ki is free until the element loop).
  float tot[8], other[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    tot[e] = gl[0][e] + gl[1][e] + gl[2][e] + gl[3][e];
    other[e] = __shfl_xor_sync(0xffffffffu, tot[e], 16);
  }
  const bool second_slice = (ts & 1) != 0;   // this slice is the later one of its warp
  const bool second_half = (warp & 1) != 0;  // this warp holds the later half of its sub-chunk
  float* pair = reinterpret_cast<float*>(s.ki);  // [kPrepareThreads / 32][kHeadDim]: each warp's two-slice log-decay totals
  if (!second_slice) {
    float both[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) both[e] = tot[e] + other[e];
    store_floats(&pair[warp * kHeadDim + d0], both);
  }
  __syncthreads();
  // This slice's offsets within its sub-chunk: γ before its first token (off) and after its last
  // (later), from the other slice of the warp and the other warp of the sub-chunk.
  {
    float off[8], later[8];
    float v0[8], v1[8];  // the two halves of this sub-chunk
    // The two 16-byte halves in a lane-dependent order: a half-warp's loads then hit 32 banks each.
    // (Laying these rows out by channel_slot too, with the per-channel pass's reads, made ptxas
    // spill 120 bytes.)
    {
      const int h0 = (cg >> 2) & 1;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float* row = &pair[(2 * sub + r) * kHeadDim + d0];
        const float4 x = *reinterpret_cast<const float4*>(row + 4 * h0);
        const float4 y = *reinterpret_cast<const float4*>(row + 4 - 4 * h0);
        float* v = r == 0 ? v0 : v1;
        v[0] = h0 ? y.x : x.x, v[1] = h0 ? y.y : x.y, v[2] = h0 ? y.z : x.z, v[3] = h0 ? y.w : x.w;
        v[4] = h0 ? x.x : y.x, v[5] = h0 ? x.y : y.y, v[6] = h0 ? x.z : y.z, v[7] = h0 ? x.w : y.w;
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      off[e] = (second_slice ? other[e] : 0.f) + (second_half ? v0[e] : 0.f);
      later[e] = (second_slice ? 0.f : other[e]) + (second_half ? 0.f : v1[e]);
    }
    // Kept until the element loop in this thread's own chunks of qi (its raw gate has been read;
    // the element loop overwrites them only after reading these back): fewer live registers
    // across the per-channel pass.
#pragma unroll
    for (int i = 0; i < kSliceTokens; ++i) {
      const float* src = i < 2 ? off : later;
      *reinterpret_cast<float4*>(s.qi + MatTile::chunk_offset(kSliceTokens * ts + i, cg)) =
          make_float4(src[4 * (i & 1)], src[4 * (i & 1) + 1], src[4 * (i & 1) + 2], src[4 * (i & 1) + 3]);
    }
  }
  // Per channel, once (two threads per channel, `part` splitting the exponentials): sub-chunk
  // totals τ, pivots, the row factors of the A / M products, the chunk decay, and per sub-chunk the
  // tables that the element loop reads.
  {
    const int d = tid % kHeadDim, part = tid / kHeadDim, slot_d = channel_slot(d);
    static_assert(kPrepareThreads == 2 * kHeadDim, "two threads per channel");
    float tau[kSubChunks];
    bool small[kSubChunks];
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) {
      tau[a] = pair[(2 * a) * kHeadDim + d] + pair[(2 * a + 1) * kHeadDim + d];
      small[a] = -tau[a] <= kMaxSubchunkLogSpan * kLog2e;
    }
    // Pivots: row side h_row, column side h_col (equal unless the channel's sub-chunk is wide).
    auto h_row = [&](int a) { return small[a] ? 0.5f * tau[a] : 0.f; };
    auto h_col = [&](int a) { return small[a] ? 0.5f * tau[a] : tau[a]; };
    float before = 0.f;  // τ of the sub-chunks before a
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) {
      if ((a >> 1) == part) {  // sub-chunk tables: part 0 for sub-chunks 0, 1; part 1 for 2, 3
        float after = 0.f;
#pragma unroll
        for (int m = a + 1; m < kSubChunks; ++m) after += tau[m];
        s.sub_table[kRowPivot][a][slot_d] = h_row(a);
        s.sub_table[kToStart][a][slot_d] = exp2_ftz(before + h_row(a));  // e^{γ−h} -> e^{Γ}
        s.sub_table[kToEnd][a][slot_d] = exp2_ftz(after + h_row(a));     // e^{h−γ} -> e^{Γ_last − Γ}
      }
      before += tau[a];
    }
    if (part == 1) reinterpret_cast<float*>(rec + WorkspaceLayout::kDecay)[d] = exp2_ftz(before);
#pragma unroll
    for (int a = 1; a < kSubChunks; ++a)
#pragma unroll
      for (int b = 0; b < a; ++b) {
        if ((pair_index(a, b) & 1) != part) continue;
        float between = 0.f;
#pragma unroll
        for (int m = b + 1; m < a; ++m) between += tau[m];
        // Not flushed: the row and column operands (each up to 2^58) can undo a factor below 2^-126.
        s.fac[pair_index(a, b)][d] = exp2f(h_row(a) + between + (tau[b] - h_col(b)));
      }
    int wide = 0;  // bit a: some channel of sub-chunk a is wide
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) wide |= small[a] ? 0 : 1 << a;
    wide = __reduce_or_sync(0xffffffffu, wide);
    if (lane == 0 && wide != 0) atomicOr(&s.wide_mask, wide);
  }
  __syncthreads();  // also: every read of pair and of the raw gate is done
  {
    // This sub-chunk's pivot (τ/2 for a narrow channel, 0 for a wide one) and rescaling factors,
    // read per channel pair and token (few live registers), and the outputs packed per pair.
    float off[8], later[8];
#pragma unroll
    for (int i = 0; i < kSliceTokens; ++i) {
      float* dst = i < 2 ? off : later;
      const float4 x = *reinterpret_cast<const float4*>(s.qi + MatTile::chunk_offset(kSliceTokens * ts + i, cg));
      dst[4 * (i & 1)] = x.x, dst[4 * (i & 1) + 1] = x.y, dst[4 * (i & 1) + 2] = x.z, dst[4 * (i & 1) + 3] = x.w;
    }
    {  // the pivot, taken out of both offsets once: pre − h and suf − h below
      float h[8];
      load_channel_group(s.sub_table[kRowPivot][sub], cg, h);
#pragma unroll
      for (int e = 0; e < 8; ++e) off[e] -= h[e], later[e] -= h[e];
    }
#pragma unroll
    for (int i = 0; i < kSliceTokens; ++i) {
      const int t = kSliceTokens * ts + i;
      const uint32_t moff = MatTile::chunk_offset(t, cg);
      const uint4 rq = *reinterpret_cast<const uint4*>(s.kj + moff);
      const uint4 rk = *reinterpret_cast<const uint4*>(s.kt + moff);
      const Elem* xq = reinterpret_cast<const Elem*>(&rq);
      const Elem* xk = reinterpret_cast<const Elem*>(&rk);
      uint32_t wqi[4], wki[4], wkj[4], wkt[4], wqd[4], wkd[4];
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) {
        const int dd = channel_slot(d0 + 2 * e2);  // channels d0 + 2 e2 and + 1, adjacent in the row
        const float2 up2 = load_float2_per_use(&s.sub_table[kToStart][sub][dd]);
        const float2 to2 = load_float2_per_use(&s.sub_table[kToEnd][sub][dd]);
        float vqi[2], vki[2], vkj[2], vkt[2], vqd[2], vkd[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int e = 2 * e2 + u;
          float pre = off[e], suf = later[e];  // γ − h (inclusive prefix) and τ − γ − h (suffix)
#pragma unroll
          for (int i2 = 0; i2 < kSliceTokens; ++i2) {
            if (i2 <= i) pre += gl[i2][e];
            else suf += gl[i2][e];
          }
          const float qsi = s.qscale[t], ksi = s.kscale[t];  // the token's l2 norm scales (broadcast loads)
          const float qh = to_float(xq[e]) * qsi, kh = to_float(xk[e]) * ksi;
          const float x = exp2_ftz(pre);  // e^{γ − h}
          const float y = exp2_ftz(suf);  // e^{h − γ} = e^{(τ − γ) − (τ − h)}
          vqi[u] = qh * x;
          vki[u] = kh * x;
          vkj[u] = kh * y;
          vkt[u] = vki[u] * (u ? up2.y : up2.x);
          vqd[u] = vqi[u] * (u ? up2.y : up2.x);
          vkd[u] = vkj[u] * (u ? to2.y : to2.x);
        }
        wqi[e2] = sm80::pack2<OpElem>(vqi[0], vqi[1]);
        wki[e2] = sm80::pack2<OpElem>(vki[0], vki[1]);
        wkj[e2] = sm80::pack2<OpElem>(vkj[0], vkj[1]);
        wkt[e2] = sm80::pack2<Elem>(vkt[0], vkt[1]);
        wqd[e2] = sm80::pack2<Elem>(vqd[0], vqd[1]);
        wkd[e2] = sm80::pack2<Elem>(vkd[0], vkd[1]);
      }
      *reinterpret_cast<uint4*>(s.qi + moff) = make_uint4(wqi[0], wqi[1], wqi[2], wqi[3]);
      *reinterpret_cast<uint4*>(s.ki + moff) = make_uint4(wki[0], wki[1], wki[2], wki[3]);
      *reinterpret_cast<uint4*>(s.kj + moff) = make_uint4(wkj[0], wkj[1], wkj[2], wkj[3]);
      *reinterpret_cast<uint4*>(s.kt + moff) = make_uint4(wkt[0], wkt[1], wkt[2], wkt[3]);
      // MatTile::chunk_offset(record_row(t), cg): record_row moves whole 8-row groups, which keep
      // their swizzle, so the record's row is the same offset with the row bits flipped.
      static_assert(record_row(0) % 8 == 0, "record_row keeps the swizzle");
      const uint32_t roff = moff ^ uint32_t(record_row(0) * 128);
      *reinterpret_cast<uint4*>(rec + WorkspaceLayout::kQd + roff) = make_uint4(wqd[0], wqd[1], wqd[2], wqd[3]);
      *reinterpret_cast<uint4*>(rec + WorkspaceLayout::kKd + roff) = make_uint4(wkd[0], wkd[1], wkd[2], wkd[3]);
    }
  }
  __syncthreads();
  // Read here rather than held across the element loop, like the thread indices.
  const int wide_mask = s.wide_mask;
  tid = thread_index_again(), warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;

  const ThreadIndex x{tid, warp, lane, g8, t4};
  gram_blocks<Elem, kGate>(p, s, x, wide_mask);  // phase 2
  inverse_blocks<Elem>(p, s, x, rec);            // phase 3
  w_product<Elem>(s, x);                         // phase 4
  w_to_record(p, s, tid, rec);                   // phase 5
}

template <typename Elem, PrepareGate kGate>
cudaError_t launch_prepare(const ChunkParams& p, cudaStream_t stream) {
  constexpr int kSmem = int(sizeof(PrepareSmem));
  auto kernel = chunk_prepare_kernel<Elem, kGate>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  static const bool sm90 = has_sm90_image(kernel);
  const dim3 grid(p.HV, std::min(p.num_chunk_slots, kMaxGridRows),
                  (p.num_chunk_slots + kMaxGridRows - 1) / kMaxGridRows);
  err = launch_overlapped(sm90, kernel, grid, dim3(kPrepareThreads), kSmem, stream, p);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace chunk

// chunk_prepare_<elem>.cu instantiates this for kGeneric, chunk_prepare_<elem>_lower_bound.cu for
// kLowerBound16 (one kernel per translation unit).
template <typename Elem>
cudaError_t run_chunk_prepare(const ChunkParams& params, cudaStream_t stream) {
  if (params.num_chunk_slots == 0) return cudaSuccess;
  return chunk::prepare_gate(params) == chunk::PrepareGate::kLowerBound16
             ? chunk::launch_prepare<Elem, chunk::PrepareGate::kLowerBound16>(params, stream)
             : chunk::launch_prepare<Elem, chunk::PrepareGate::kGeneric>(params, stream);
}

}  // namespace flashkda
