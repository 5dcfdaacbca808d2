// chunk_prepare: everything about one chunk that does not depend on the recurrent state, for all
// chunks and value heads in parallel (one block of four warps per (chunk, value head)). It writes
// the workspace record described in chunk_params.h; chunk_recurrence then only multiplies.
//
// Decay without overflow (KDA_SPEC "Reading"). Inside a chunk the pairwise factor e^{Γi−Γj}
// (j ≤ i, ≤ 1) is never formed from e^{−Γj} alone. Tokens are grouped in sub-chunks of 16; γ is
// the log decay from the start of a token's sub-chunk (γ ∈ [τ_a, 0]) and τ_a the total of
// sub-chunk a, per channel. Each sub-chunk gets a per-channel pivot h_a = τ_a / 2 and the A / M
// operands are  row_i = x̂_i e^{γi − h_a},  col_j = k̂_j e^{h_b − γj}: within a sub-chunk their
// product is exactly e^{γi−γj} with both factors in [e^{τ/2}, e^{−τ/2}]; for j in an earlier
// sub-chunk b the row takes the per-channel factor e^{h_a + τ_{b+1}+…+τ_{a−1} + τ_b − h_b} ≤ 1,
// so the off-diagonal blocks are exact for any gate. The pivot keeps every factor within e^{±64}
// while the sub-chunk's decay |τ| ≤ kMaxSubchunkLogSpan = 128 (always for the lower-bound gate,
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

#include <cstdint>

#include "chunk_common.cuh"
#include "chunk_params.h"
#include "mma_sm80.cuh"
#include "token_math.cuh"

namespace flashkda {
namespace chunk {

constexpr int kPrepareThreads = 32 * kSubChunks;  // warp a owns sub-chunk a
// Largest total log decay |τ| of a sub-chunk for which its diagonal block comes from the MMA: the
// operands then stay within e^{±64}, inside the normal range of fp32 and bf16 (e^{±87}).
constexpr float kMaxSubchunkLogSpan = 128.f;
// Operand type of the A / M products (see above).
using OpElem = __nv_bfloat16;
// fp32 tiles are padded by 4 words per row so that fragment loads spread over the banks.
constexpr int kF32Stride = kHeadDim + 4;
constexpr int kSqStride = kChunk + 1;

using MatTile = sm80::SwizzledTile<kHeadDim * 2 / 16>;  // [kChunk][kHeadDim] b16
using SqTile = sm80::SwizzledTile<kChunk * 2 / 16>;     // [kChunk][kChunk] b16

constexpr int kPairs = kSubChunks * (kSubChunks - 1) / 2;
__host__ __device__ constexpr int pair_index(int a, int b) { return a * (a - 1) / 2 + b; }  // b < a

struct PrepareSmem {
  // Phase 0-1 hold the raw chunk: q in kj, k in kt (MatTile layout, element type of the inputs),
  // the KDA gate in qi (row-major, its own dtype). Phase 2 overwrites each element in place.
  float qi[kChunk * kF32Stride];   // q̂ e^{γ−h}, fp32
  float ki[kChunk * kF32Stride];   // k̂ e^{γ−h}, fp32
  alignas(16) uint8_t kj[kChunk * kHeadDim * 2];  // k̂ e^{h−γ} (column side), OpElem, MatTile
  alignas(16) uint8_t kt[kChunk * kHeadDim * 2];  // k̂ e^{Γ}, Elem, MatTile
  float fac[kSubChunks + kPairs][kHeadDim];       // row factors: diagonal (1, or 0 when wide), pairs
  float qscale[kChunk], kscale[kChunk], beta[kChunk], gate_scalar[kChunk];
  int wide[kSubChunks];
};
static_assert(sizeof(float) * kChunk * kF32Stride >= kChunk * kHeadDim * 4, "raw fp32 gate fits in qi");
// Aliases, valid after the A / M products:
//   qi: amat (f32 [kChunk][kSqStride]) then tinv_s (SqTile)
//   ki: linv (f32 [kChunk][kSqStride]) then mqk_s (SqTile)
//   kj: tmp (f32 [kSubChunk][kChunk]) during the inverse, then w_s (MatTile)
constexpr int kAliasSqF32Bytes = kChunk * kSqStride * 4;
static_assert(kAliasSqF32Bytes + kChunk * kChunk * 2 <= int(sizeof(float)) * kChunk * kF32Stride, "alias fits");
static_assert(kAliasSqF32Bytes % 16 == 0, "b16 tile after the fp32 matrix stays 16-byte aligned");

template <typename Elem>
__device__ __forceinline__ void store_elem(uint8_t* base, uint32_t off, float x) {
  *reinterpret_cast<Elem*>(base + off) = from_float<Elem>(x);
}

// Exact diagonal block of sub-chunk a (one warp): A and M entries from products of per-token
// decays. Lane owns channels 4·lane .. 4·lane+3.
template <typename Elem>
__device__ void exact_diagonal_block(const ChunkParams& p, const ChunkSpan& c, int hv, int h, int a,
                                     PrepareSmem& s, float* amat, uint8_t* mqk_s) {
  const int lane = threadIdx.x & 31;
  const Elem* qb = static_cast<const Elem*>(p.q) + c.batch * p.q_batch_stride + h * p.q_head_stride;
  const Elem* kb = static_cast<const Elem*>(p.k) + c.batch * p.k_batch_stride + h * p.k_head_stride;
  const char* gb = static_cast<const char*>(p.g);
  const float A = p.A_log != nullptr ? __expf(p.A_log[hv]) : 1.f;
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
        const float bias = p.dt_bias == nullptr ? 0.f : p.dt_bias[p.scalar_gate ? hv : hv * kHeadDim + d];
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
        amat[row * kSqStride + col] = j < i ? sa * s.beta[t] : 0.f;
        store_elem<Elem>(mqk_s, SqTile::offset(row, col), sm);
      }
    }
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kPrepareThreads) chunk_prepare_kernel(const ChunkParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  PrepareSmem& s = *reinterpret_cast<PrepareSmem*>(smem_raw);
  const int slot = blockIdx.x, hv = blockIdx.y;
  ChunkSpan c;
  if (!locate_chunk(p, slot, c)) return;
  const int h = hv / (p.HV / p.H);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  uint8_t* rec = static_cast<uint8_t*>(p.workspace) + (int64_t(slot) * p.HV + hv) * WorkspaceLayout::kRecordBytes;

  const Elem* qb = static_cast<const Elem*>(p.q) + c.batch * p.q_batch_stride + h * p.q_head_stride;
  const Elem* kb = static_cast<const Elem*>(p.k) + c.batch * p.k_batch_stride + h * p.k_head_stride;
  const char* gbytes = static_cast<const char*>(p.g);
  const int g_size = p.g_dtype == DType::kFloat32 ? 4 : 2;

  // ---- Phase 0: the raw chunk into shared memory (all loads in flight at once) ---------------
  {
    for (int e = tid; e < kChunk * (kHeadDim / 8); e += kPrepareThreads) {
      const int t = e / (kHeadDim / 8), ch = e % (kHeadDim / 8);
      const bool valid = t < c.len;
      const int64_t tok = c.bos + (valid ? t : 0);
      const uint32_t off = MatTile::chunk_offset(t, ch);
      sm80::cp_async_16(sm80::smem_u32(s.kj) + off, qb + tok * p.q_token_stride + ch * 8, valid);
      sm80::cp_async_16(sm80::smem_u32(s.kt) + off, kb + tok * p.k_token_stride + ch * 8, valid);
    }
    if (!p.scalar_gate) {
      const int row_chunks = kHeadDim * g_size / 16;
      for (int e = tid; e < kChunk * row_chunks; e += kPrepareThreads) {
        const int t = e / row_chunks, ch = e % row_chunks;
        const bool valid = t < c.len;
        const int64_t tok = c.bos + (valid ? t : 0);
        const char* src = gbytes + (c.batch * p.g_batch_stride + tok * p.g_token_stride + hv * p.g_head_stride) * g_size;
        sm80::cp_async_16(sm80::smem_u32(s.qi) + e * 16, src + ch * 16, valid);
      }
    }
    sm80::cp_async_commit();
    if (tid < kChunk) {
      const int t = tid;
      const int64_t tok = c.bos + t;
      float b = 0.f, gs = 0.f;
      if (t < c.len) {
        b = beta_value(p, load_any(p.beta, p.beta_dtype, c.batch * p.beta_batch_stride + tok * p.beta_token_stride + hv));
        if (p.scalar_gate)
          gs = load_any(p.g, p.g_dtype, c.batch * p.g_batch_stride + tok * p.g_token_stride + hv * p.g_head_stride);
      }
      s.beta[t] = b;
      s.gate_scalar[t] = gs;
    }
    sm80::cp_async_wait<0>();
  }
  __syncthreads();

  // ---- Phase 1: per-token l2 norms (warp a: tokens of sub-chunk a) ----------------------------
  for (int i = 0; i < kSubChunk; ++i) {
    const int t = warp * kSubChunk + i;
    float sq = 0.f, sk = 0.f;
    if (p.l2norm) {
      const uint32_t off = MatTile::offset(t, 4 * lane);
      const Elem* xq = reinterpret_cast<const Elem*>(s.kj + off);
      const Elem* xk = reinterpret_cast<const Elem*>(s.kt + off);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = to_float(xq[e]), y = to_float(xk[e]);
        sq += x * x;
        sk += y * y;
      }
#pragma unroll
      for (int off2 = 16; off2 > 0; off2 >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, off2);
        sk += __shfl_xor_sync(0xffffffffu, sk, off2);
      }
    }
    if (lane == 0) {
      const bool valid = t < c.len;
      s.qscale[t] = !valid ? 0.f : (p.l2norm ? rsqrtf(sq + kL2NormEps) * p.scale : p.scale);
      s.kscale[t] = !valid ? 0.f : (p.l2norm ? rsqrtf(sk + kL2NormEps) : 1.f);
    }
  }
  __syncthreads();

  // ---- Phase 2: gate, decays and the decayed operands (thread d owns channel d) ---------------
  {
    const int d = tid;
    const float A = p.A_log != nullptr ? __expf(p.A_log[hv]) : 1.f;
    const float bias = p.dt_bias == nullptr ? 0.f : p.dt_bias[p.scalar_gate ? hv : hv * kHeadDim + d];
    float gl[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      float raw;
      if (p.scalar_gate) raw = s.gate_scalar[t];
      else if (g_size == 4) raw = s.qi[t * kHeadDim + d];
      else raw = load_any(s.qi, p.g_dtype, t * kHeadDim + d);
      gl[t] = t < c.len ? log_decay(p, raw, bias, A) : 0.f;
    }
    __syncthreads();  // the raw gate in qi is dead: qi / ki are written below
    float tau[kSubChunks];
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < kSubChunk; ++i) acc += gl[a * kSubChunk + i];
      tau[a] = acc;
    }
    float total = 0.f;
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) total += tau[a];
    reinterpret_cast<float*>(rec + WorkspaceLayout::kDecay)[d] = __expf(total);
    // Pivots: row side h, column side hc (equal unless the channel's sub-chunk is wide).
    float h_row[kSubChunks], h_col[kSubChunks];
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) {
      const bool small = -tau[a] <= kMaxSubchunkLogSpan;
      h_row[a] = small ? 0.5f * tau[a] : 0.f;
      h_col[a] = small ? 0.5f * tau[a] : tau[a];
      s.fac[a][d] = small ? 1.f : 0.f;
#pragma unroll
      for (int b = 0; b < a; ++b) {
        float between = 0.f;
#pragma unroll
        for (int m = b + 1; m < a; ++m) between += tau[m];
        s.fac[kSubChunks + pair_index(a, b)][d] = __expf(h_row[a] + between + tau[b] - h_col[b]);
      }
    }

    Elem* qd_out = reinterpret_cast<Elem*>(rec + WorkspaceLayout::kQd);
    Elem* kd_out = reinterpret_cast<Elem*>(rec + WorkspaceLayout::kKd);
    float before = 0.f;  // Γ at the start of sub-chunk a
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) {
      const float up_row = __expf(before + h_row[a]);           // e^{γ−h} -> e^{Γ}
      const float to_end = __expf(total - before - h_col[a]);   // e^{h−γ} -> e^{Γ_last − Γ}
      float gam = 0.f;
#pragma unroll
      for (int i = 0; i < kSubChunk; ++i) {
        const int t = a * kSubChunk + i;
        gam += gl[t];
        const uint32_t off = MatTile::offset(t, d);
        const float qh = to_float(*reinterpret_cast<const Elem*>(s.kj + off)) * s.qscale[t];
        const float kh = to_float(*reinterpret_cast<const Elem*>(s.kt + off)) * s.kscale[t];
        const float x = __expf(gam - h_row[a]);   // e^{γ − h}
        const float y = __expf(h_col[a] - gam);   // e^{h − γ}
        s.qi[t * kF32Stride + d] = qh * x;
        s.ki[t * kF32Stride + d] = kh * x;
        store_elem<OpElem>(s.kj, off, kh * y);
        store_elem<Elem>(s.kt, off, kh * x * up_row);
        qd_out[t * kHeadDim + d] = from_float<Elem>(qh * x * up_row);
        kd_out[t * kHeadDim + d] = from_float<Elem>(kh * y * to_end);
      }
      before += tau[a];
    }
#pragma unroll
    for (int a = 0; a < kSubChunks; ++a) {
      const int any_wide = __syncthreads_or(-tau[a] > kMaxSubchunkLogSpan);
      if (tid == 0) s.wide[a] = any_wide;
    }
  }
  __syncthreads();

  // ---- Phase 3: A = diag(β) (k e^{Γ})(k e^{−Γ})ᵀ and M = (q e^{Γ})(k e^{−Γ})ᵀ, blockwise -------
  float acc_a[kSubChunks][2][4], acc_m[kSubChunks][2][4];
#pragma unroll
  for (int b = 0; b < kSubChunks; ++b)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_a[b][n][e] = acc_m[b][n][e] = 0.f;
  {
    const int a = warp;
    const int r0 = a * kSubChunk + g8, r1 = r0 + 8;
    const uint32_t kj_base = sm80::smem_u32(s.kj);
#pragma unroll
    for (int b = 0; b < kSubChunks; ++b) {
      if (b > a || (b == a && s.wide[a])) continue;
      const float* f = s.fac[b == a ? a : kSubChunks + pair_index(a, b)];
#pragma unroll
      for (int kd = 0; kd < kHeadDim / 16; ++kd) {
        const int d0 = 16 * kd + 2 * t4;
        const float f0 = f[d0], f1 = f[d0 + 1], f2 = f[d0 + 8], f3 = f[d0 + 9];
        const float2 k00 = *reinterpret_cast<const float2*>(&s.ki[r0 * kF32Stride + d0]);
        const float2 k10 = *reinterpret_cast<const float2*>(&s.ki[r1 * kF32Stride + d0]);
        const float2 k01 = *reinterpret_cast<const float2*>(&s.ki[r0 * kF32Stride + d0 + 8]);
        const float2 k11 = *reinterpret_cast<const float2*>(&s.ki[r1 * kF32Stride + d0 + 8]);
        const float2 q00 = *reinterpret_cast<const float2*>(&s.qi[r0 * kF32Stride + d0]);
        const float2 q10 = *reinterpret_cast<const float2*>(&s.qi[r1 * kF32Stride + d0]);
        const float2 q01 = *reinterpret_cast<const float2*>(&s.qi[r0 * kF32Stride + d0 + 8]);
        const float2 q11 = *reinterpret_cast<const float2*>(&s.qi[r1 * kF32Stride + d0 + 8]);
        const uint32_t ak[4] = {sm80::pack2<OpElem>(k00.x * f0, k00.y * f1), sm80::pack2<OpElem>(k10.x * f0, k10.y * f1),
                                sm80::pack2<OpElem>(k01.x * f2, k01.y * f3), sm80::pack2<OpElem>(k11.x * f2, k11.y * f3)};
        const uint32_t aq[4] = {sm80::pack2<OpElem>(q00.x * f0, q00.y * f1), sm80::pack2<OpElem>(q10.x * f0, q10.y * f1),
                                sm80::pack2<OpElem>(q01.x * f2, q01.y * f3), sm80::pack2<OpElem>(q11.x * f2, q11.y * f3)};
        uint32_t bf[4];
        sm80::ldmatrix_x4(bf, kj_base + MatTile::chunk_offset(b * kSubChunk + (lane & 7) + (lane >> 4) * 8,
                                                              2 * kd + ((lane >> 3) & 1)));
        sm80::mma_16816<OpElem>(acc_a[b][0], ak, bf[0], bf[1]);
        sm80::mma_16816<OpElem>(acc_a[b][1], ak, bf[2], bf[3]);
        sm80::mma_16816<OpElem>(acc_m[b][0], aq, bf[0], bf[1]);
        sm80::mma_16816<OpElem>(acc_m[b][1], aq, bf[2], bf[3]);
      }
    }
  }
  __syncthreads();  // qi / ki / kj are dead from here on

  float* amat = s.qi;
  uint8_t* tinv_s = reinterpret_cast<uint8_t*>(s.qi) + kAliasSqF32Bytes;
  float* linv = s.ki;
  uint8_t* mqk_s = reinterpret_cast<uint8_t*>(s.ki) + kAliasSqF32Bytes;
  float* tmp = reinterpret_cast<float*>(s.kj);
  uint8_t* w_s = s.kj;
  {
    const int a = warp;
#pragma unroll
    for (int b = 0; b < kSubChunks; ++b)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = a * kSubChunk + g8 + 8 * (e >> 1);
          const int j = b * kSubChunk + 8 * n + 2 * t4 + (e & 1);
          amat[i * kSqStride + j] = (b <= a && j < i) ? acc_a[b][n][e] * s.beta[i] : 0.f;
          store_elem<Elem>(mqk_s, SqTile::offset(i, j), (b <= a && j <= i) ? acc_m[b][n][e] : 0.f);
        }
    if (s.wide[a]) {
      __syncwarp();
      exact_diagonal_block<Elem>(p, c, hv, h, a, s, amat, mqk_s);
    }
  }
  __syncthreads();

  // ---- Phase 4: T = (I + A)⁻¹ diag(β), by blocks of 16 --------------------------------------
  if (lane < kSubChunk) {  // diagonal blocks: column `lane` of (I + A_aa)⁻¹ by forward substitution
    const int a = warp, j = lane, base = a * kSubChunk;
    float x[kSubChunk];
#pragma unroll
    for (int i = 0; i < kSubChunk; ++i) {
      float acc = i == j ? 1.f : 0.f;
#pragma unroll
      for (int l = 0; l < i; ++l) acc -= amat[(base + i) * kSqStride + base + l] * x[l];
      x[i] = acc;
      linv[(base + i) * kSqStride + base + j] = acc;
    }
  }
  __syncthreads();
  for (int a = 1; a < kSubChunks; ++a) {  // off-diagonal blocks of row block a
    const int cols = a * kSubChunk, base = a * kSubChunk;
    for (int e = tid; e < kSubChunk * cols; e += kPrepareThreads) {
      const int i = e / cols, j = e % cols;
      float acc = 0.f;
      for (int l = (j / kSubChunk) * kSubChunk; l < base; ++l)
        acc += amat[(base + i) * kSqStride + l] * linv[l * kSqStride + j];
      tmp[i * kChunk + j] = acc;
    }
    __syncthreads();
    for (int e = tid; e < kSubChunk * cols; e += kPrepareThreads) {
      const int i = e / cols, j = e % cols;
      float acc = 0.f;
      for (int l = 0; l <= i; ++l) acc -= linv[(base + i) * kSqStride + base + l] * tmp[l * kChunk + j];
      linv[(base + i) * kSqStride + j] = acc;
    }
    __syncthreads();
  }
  for (int e = tid; e < kChunk * kChunk; e += kPrepareThreads) {
    const int i = e / kChunk, j = e % kChunk;
    store_elem<Elem>(tinv_s, SqTile::offset(i, j), j <= i ? linv[i * kSqStride + j] * s.beta[j] : 0.f);
  }
  __syncthreads();

  // ---- Phase 5: w = T (k e^{Γ}); warp a computes rows of sub-chunk a ------------------------
  {
    const int a = warp;
    float acc[kHeadDim / 8][4];
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    const uint32_t t_base = sm80::smem_u32(tinv_s), kt_base = sm80::smem_u32(s.kt);
#pragma unroll
    for (int kc = 0; kc < kSubChunks; ++kc) {
      if (kc > a) break;  // T is lower triangular
      uint32_t af[4];
      sm80::ldmatrix_x4(af, t_base + SqTile::chunk_offset(a * kSubChunk + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                          2 * kc + (lane >> 4)));
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t bf[4];
        sm80::ldmatrix_x4_trans(bf, kt_base + MatTile::chunk_offset(kc * kSubChunk + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                    2 * dp + (lane >> 4)));
        sm80::mma_16816<Elem>(acc[2 * dp], af, bf[0], bf[1]);
        sm80::mma_16816<Elem>(acc[2 * dp + 1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = a * kSubChunk + g8 + 8 * hh, col = 8 * n + 2 * t4;
        *reinterpret_cast<uint32_t*>(w_s + MatTile::offset(row, col)) =
            sm80::pack2<Elem>(acc[n][2 * hh], acc[n][2 * hh + 1]);
      }
  }
  __syncthreads();

  // ---- Phase 6: copy w, mqk and T to the record (16-byte stores) -----------------------------
  for (int e = tid; e < kChunk * (kHeadDim / 8); e += kPrepareThreads) {
    const int row = e / (kHeadDim / 8), ch = e % (kHeadDim / 8);
    *reinterpret_cast<uint4*>(rec + WorkspaceLayout::kW + row * kHeadDim * 2 + ch * 16) =
        *reinterpret_cast<const uint4*>(w_s + MatTile::chunk_offset(row, ch));
  }
  for (int e = tid; e < kChunk * (kChunk / 8); e += kPrepareThreads) {
    const int row = e / (kChunk / 8), ch = e % (kChunk / 8);
    *reinterpret_cast<uint4*>(rec + WorkspaceLayout::kMqk + row * kChunk * 2 + ch * 16) =
        *reinterpret_cast<const uint4*>(mqk_s + SqTile::chunk_offset(row, ch));
    *reinterpret_cast<uint4*>(rec + WorkspaceLayout::kTinv + row * kChunk * 2 + ch * 16) =
        *reinterpret_cast<const uint4*>(tinv_s + SqTile::chunk_offset(row, ch));
  }
}

template <typename Elem>
cudaError_t launch_prepare(const ChunkParams& p, cudaStream_t stream) {
  if (p.num_chunk_slots == 0) return cudaSuccess;
  constexpr int kSmem = int(sizeof(PrepareSmem));
  auto kernel = chunk_prepare_kernel<Elem>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(p.num_chunk_slots, p.HV), kPrepareThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace chunk

template <typename Elem>
cudaError_t run_chunk_prepare(const ChunkParams& params, cudaStream_t stream) {
  return chunk::launch_prepare<Elem>(params, stream);
}

}  // namespace flashkda
