// chunk_local_grad, value-split form: the gradients pass of chunk_local_grad.cuh in a block of 153 KB
// of shared memory, for GPUs whose blocks cannot have the whole pass's 218 KB (sm_80: 163 KB).
//
// Every gradient the pass writes but dv is a sum over the value columns of terms that each read one
// value column's v, dO, S and dS' (dq̂ through dO Sᵀ and dM = dO Uᵀ, dk̂ through U dS'ᵀ and dw = −dU Sᵀ,
// dΓ, dβ and the chunk-end terms through the same products). So two blocks per (chunk, value head)
// each take one half of the value columns (blockIdx.z): each recomputes the chunk's local forward
// (Γ, the Gram matrices, the solve, w, all independent of the values), keeps only its half of v, dO,
// U, dU, S and dS', writes its half of dv, and adds its share of dq̂, dk̂, dĝ and dβ̂ into outputs
// the caller zero-filled. Two shares added to zero give the same sum in either order, so the result
// does not depend on which block adds first.
//
// The shared memory is one pool whose regions change owner from phase to phase (SplitLayout: each
// region's bytes, offset and the phases it lives in, checked at compile time for overlaps). Against
// the whole pass, the pool holds no A for the whole block (the solve's fp32 A is recomputed, from
// the same operands by the same products, where dβ needs it), and stages q̂ and k̂ one at a time
// at the end.
#pragma once

#include "flashkda/backward/chunk_local_grad.cuh"

namespace flashkda {
namespace chunk_bwd {

constexpr int kValueParts = 2;                     // blocks per (chunk, value head), one value half each
constexpr int kPartV = kHeadDim / kValueParts;      // value columns of a block
using PartTile = Tile<kChunk, kPartV>;              // [token][value column of the half]
using StatePartTile = Tile<kHeadDim, kPartV>;       // [key][value column of the half]
using PartAcc = Acc<kChunk, kPartV>;
static_assert(PartAcc::NI % 2 == 0, "warp_mma takes n8 tiles in pairs");

// The phases of the split pass, in order (the kernel's comments name them).
enum SplitPhase : int {
  kPhaseGamma,         // Γ, pivots, factors; q̂ and k̂ (fp32) staged
  kPhaseKSide,         // Gram operands k̂ e^{γ−h}, k̂ e^{h−γ} and k̂ e^Γ from the staged k̂
  kPhaseQSide,         // Gram operand q̂ e^{γ−h}; M's tile zeroed
  kPhaseGram,          // M and A
  kPhaseSolve,         // L (fp32), v staged
  kPhaseLT,            // L and T as bf16 tiles
  kPhaseUW,            // u = T v, w = T (k̂ e^Γ); S and dO staged
  kPhaseU,             // U = u − w S, dO Sᵀ
  kPhaseDU,            // dS', kd; dU, U dS'ᵀ, dO Uᵀ
  kPhaseDW,            // S again; dw, dv
  kPhaseDT,            // dT, Tᵀ dw
  kPhaseY1,            // Lᵀ (dT diag(β))
  kPhaseStageK,        // k̂ staged again
  kPhaseKSide2,        // the k-side Gram operands again
  kPhaseGd,            // dA (with A recomputed for dβ)
  kPhaseStageQ,        // q̂ staged again
  kPhaseQSide2,        // the q-side Gram operand again
  kPhaseGramGrad,      // the Gram matrices' gradients
  kPhaseDg,            // dĝ's suffix sums
};

// A region of shared memory that lives from phase `first` to phase `last`.
struct SmemRegion {
  int offset, bytes, first, last;
};
constexpr int kb(int x) { return x * 1024; }

struct SplitLayout {
  // Regions for the whole block.
  static constexpr int kGamma = 0;                                     // fp32 [kChunk][kHeadDim] Γ
  static constexpr int kPivot = kGamma + kChunk * kHeadDim * 4;        // fp32 [kSubChunks][kHeadDim] h_a
  static constexpr int kFactor = kPivot + kSubChunks * kHeadDim * 4;   // fp32 [kPairs][kHeadDim] f_ab
  static constexpr int kBeta = kFactor + kPairs * kHeadDim * 4;        // fp32 [kChunk]
  static constexpr int kDbeta = kBeta + kChunk * 4;                    // fp32 [kChunk]
  static constexpr int kEnd = kDbeta + kChunk * 4;                     // fp32 [kHeadDim]
  static constexpr int kPool = kEnd + kHeadDim * 4;
  static constexpr int kStagedBytes = kChunk * kHeadDim * 4;           // q̂ or k̂, fp32
  static constexpr int kF32SquareBytes = kChunk * kF32Stride * 4;      // A or L, fp32
  static constexpr int kScratchBytes = (kSubChunks - 1) * kSubChunk * kScratchStride * 4;

  // Pool regions: offset from kPool, bytes, first and last phase. Offsets in KB: a packing of the
  // regions by their phases (checked below), whose peak is the 115 KB that phases kPhaseKSide
  // (k̂ and q̂ staged, three Gram operand tiles) and kPhaseDU (nine tiles) hold at once.
  static constexpr SmemRegion kKStaged{kb(49), kStagedBytes, kPhaseGamma, kPhaseKSide};
  static constexpr SmemRegion kQStaged{kb(17), kStagedBytes, kPhaseGamma, kPhaseQSide};
  static constexpr SmemRegion kTotals{0, kSubChunks * kHeadDim * 4, kPhaseGamma, kPhaseGamma};
  static constexpr SmemRegion kXk{kb(81), ChunkTile::kBytes, kPhaseKSide, kPhaseGram};
  static constexpr SmemRegion kYk{0, ChunkTile::kBytes, kPhaseKSide, kPhaseGram};
  static constexpr SmemRegion kKg{kb(98), ChunkTile::kBytes, kPhaseKSide, kPhaseDT};
  static constexpr SmemRegion kXq{kb(49), ChunkTile::kBytes, kPhaseQSide, kPhaseGram};
  static constexpr SmemRegion kM{kb(71), SquareTile::kBytes, kPhaseQSide, kPhaseGramGrad};  // M, later dM
  static constexpr SmemRegion kAf{kb(17), kF32SquareBytes, kPhaseGram, kPhaseSolve};
  static constexpr SmemRegion kV{kb(44), PartTile::kBytes, kPhaseSolve, kPhaseDT};
  static constexpr SmemRegion kLf{0, kF32SquareBytes, kPhaseSolve, kPhaseLT};
  static constexpr SmemRegion kScratch{kb(34), kScratchBytes, kPhaseSolve, kPhaseSolve};
  static constexpr SmemRegion kL{kb(62), SquareTile::kBytes, kPhaseLT, kPhaseGd};
  static constexpr SmemRegion kT{kb(53), SquareTile::kBytes, kPhaseLT, kPhaseDT};
  static constexpr SmemRegion kW{0, ChunkTile::kBytes, kPhaseUW, kPhaseU};
  static constexpr SmemRegion kS{kb(80), StatePartTile::kBytes, kPhaseUW, kPhaseDW};  // S, dS', S
  static constexpr SmemRegion kDO{kb(35), PartTile::kBytes, kPhaseUW, kPhaseDU};
  static constexpr SmemRegion kU{kb(17), PartTile::kBytes, kPhaseU, kPhaseDU};
  static constexpr SmemRegion kKd{0, ChunkTile::kBytes, kPhaseDU, kPhaseDU};
  static constexpr SmemRegion kDU{kb(26), PartTile::kBytes, kPhaseDU, kPhaseDT};
  static constexpr SmemRegion kDW{kb(9), ChunkTile::kBytes, kPhaseDW, kPhaseDT};
  static constexpr SmemRegion kX1{0, SquareTile::kBytes, kPhaseDT, kPhaseY1};
  static constexpr SmemRegion kY1{kb(17), SquareTile::kBytes, kPhaseY1, kPhaseGd};
  static constexpr SmemRegion kKStaged2{kb(26), kStagedBytes, kPhaseStageK, kPhaseKSide2};
  static constexpr SmemRegion kXk2{0, ChunkTile::kBytes, kPhaseKSide2, kPhaseGramGrad};
  static constexpr SmemRegion kYk2{kb(80), ChunkTile::kBytes, kPhaseKSide2, kPhaseGramGrad};
  static constexpr SmemRegion kDZA{kb(26), SquareTile::kBytes, kPhaseGd, kPhaseGramGrad};
  static constexpr SmemRegion kQStaged2{kb(35), kStagedBytes, kPhaseStageQ, kPhaseQSide2};
  static constexpr SmemRegion kXq2{kb(97), ChunkTile::kBytes, kPhaseQSide2, kPhaseGramGrad};
  static constexpr SmemRegion kDGamma{0, kStagedBytes, kPhaseDg, kPhaseDg};                // fp32 dΓ
  static constexpr SmemRegion kPart{kb(32), kChunk * 4 * 4, kPhaseDg, kPhaseDg};          // scalar gate's sums
  static constexpr SmemRegion kTotals2{kb(33), kSubChunks * kHeadDim * 4, kPhaseDg, kPhaseDg};
  static constexpr SmemRegion kRegions[] = {kKStaged, kQStaged, kTotals, kXk, kYk, kKg, kXq, kM, kAf, kV, kLf,
                                        kScratch, kL, kT, kW, kS, kDO, kU, kKd, kDU, kDW, kX1, kY1,
                                        kKStaged2, kXk2, kYk2, kDZA, kQStaged2, kXq2, kDGamma, kPart, kTotals2};
  static constexpr int kA = kPool + kAf.offset;  // BlockT's A
  __host__ __device__ static constexpr int at(SmemRegion r) { return kPool + r.offset; }
};
constexpr int split_pool_bytes() {
  int top = 0;
  for (const SmemRegion& r : SplitLayout::kRegions) top = r.offset + r.bytes > top ? r.offset + r.bytes : top;
  return top;
}
// No two regions that live in a common phase share a byte; every region 16-byte aligned.
constexpr bool split_regions_disjoint() {
  for (const SmemRegion& a : SplitLayout::kRegions) {
    if (a.offset % 16 != 0) return false;
    for (const SmemRegion& b : SplitLayout::kRegions) {
      if (&a == &b) continue;
      const bool same_time = !(a.last < b.first || b.last < a.first);
      const bool same_bytes = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
      if (same_time && same_bytes) return false;
    }
  }
  return true;
}
constexpr int kSplitSmemBytes = SplitLayout::kPool + split_pool_bytes();
static_assert(split_regions_disjoint(), "regions that live at once must not overlap");
static_assert(SplitLayout::kPool % 16 == 0, "the pool is 16-byte aligned");
static_assert(kSplitSmemBytes <= 163 * 1024, "fits an sm_80 block");
static_assert(kSubChunks * kHeadDim * 4 <= SplitLayout::kF32SquareBytes, "");

using SplitBlock = BlockT<SplitLayout>;

// The half of the [kHeadDim][kHeadDim] bf16 matrix of this (chunk, head) in x whose value columns
// start at v0, into a state part tile (cp.async, as copy_state_async).
__device__ __forceinline__ void copy_state_part_async(const SplitBlock& blk, const StatePartTile& tile, const Bf16* x,
                                                      int v0) {
  constexpr int kPieces = kPartV * 2 / 16;
  const Bf16* base = x + blk.state_at() + v0;
#pragma unroll
  for (int i = threadIdx.x; i < kHeadDim * kPieces; i += kThreads) {
    const int r = i / kPieces, piece = i % kPieces;
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
        *reinterpret_cast<const cute::uint128_t*>(base + r * kHeadDim + piece * 8),
        *reinterpret_cast<cute::uint128_t*>(tile.p + r * StatePartTile::kStride + piece * 8), true);
  }
  cute::cp_async_fence();
}

// The decayed Gram block (a, b) (b <= a) of X Yᵀ: with the factor f_ab below the diagonal.
template <class Blk>
__device__ __forceinline__ void gram_block(const Blk& blk, float (&acc)[1][2][4], const ChunkTile& X, const ChunkTile& Y,
                                           int a, int b) {
  warp_mma<false, false>(acc, X, Y, kSubChunk * a, kSubChunk * b, 0, kHeadDim, false,
                         a == b ? nullptr : blk.factor(a, b));
}

template <bool kScalarGate>
__global__ void __launch_bounds__(kThreads, 1) chunk_local_grad_split_kernel(const ChunkBwdParams p) {
  using L = SplitLayout;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x;
  SplitBlock blk{p, smem, int64_t(blockIdx.x), 0, 0, int(blockIdx.y), 0, p.HV * kHeadDim};
  blk.bos = p.chunk_bos[blk.chunk];
  blk.len = p.chunk_len[blk.chunk];
  blk.head0 = (blk.bos * p.HV + blk.hv) * kHeadDim;
  if (blk.len <= 0) return;  // an empty chunk has no gradients
  const int len = blk.len;
  const int v0 = int(blockIdx.z) * kPartV;  // this block's value columns: v0 .. v0 + kPartV - 1
  auto region = [&](SmemRegion r) { return smem + L::at(r); };
  auto chunk_tile = [&](SmemRegion r) { return ChunkTile{reinterpret_cast<Bf16*>(region(r))}; };
  auto square_tile = [&](SmemRegion r) { return SquareTile{reinterpret_cast<Bf16*>(region(r))}; };
  auto part_tile = [&](SmemRegion r) { return PartTile{reinterpret_cast<Bf16*>(region(r))}; };
  const SquareTile Mt = square_tile(L::kM), Tt = square_tile(L::kT), Lt = square_tile(L::kL);
  const ChunkTile kg = chunk_tile(L::kKg);
  const PartTile vt = part_tile(L::kV);
  const StatePartTile St{reinterpret_cast<Bf16*>(region(L::kS))};

  // kPhaseGamma: Γ, the pivots and the factors as the whole pass; k̂ then q̂ (fp32) staged meanwhile.
  gamma_phase<kScalarGate>(blk, reinterpret_cast<float*>(region(L::kTotals)), [&] {
    blk.copy_rows_async(region(L::kKStaged), kHeadDim * 4, p.k);
    blk.copy_rows_async(region(L::kQStaged), kHeadDim * 4, p.q);
  }, [] {});
  cute::cp_async_wait<1>();  // k̂ (q̂ may still be in flight)
  __syncthreads();

  // The Gram operands from staged fp32 rows, four channels a thread per step: the k-side ones
  // (x e^{γ−h}, x e^{h−γ}; with kg also x e^Γ) or the q-side one (x e^{γ−h}).
  auto build_k_side = [&](const float* staged, const ChunkTile& X, const ChunkTile& Y, const ChunkTile* g_tile) {
    constexpr int kPerRow = kHeadDim / 4;
#pragma unroll 2
    for (int i = tid; i < kChunk * kPerRow; i += kThreads) {
      const int t = i / kPerRow, c = (i % kPerRow) * 4;
      const float4 k4 = *reinterpret_cast<const float4*>(staged + t * kHeadDim + c);
      const float2 pl01 = blk.pivot_log2(t, c), pl23 = blk.pivot_log2(t, c + 2);
      const float pl[4] = {pl01.x, pl01.y, pl23.x, pl23.y}, kx[4] = {k4.x, k4.y, k4.z, k4.w};
      float up[4], down[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) up[j] = __expf(pl[j]), down[j] = __expf(-pl[j]);
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        X.store2(t, c + j, kx[j] * up[j], kx[j + 1] * up[j + 1]);
        Y.store2(t, c + j, kx[j] * down[j], kx[j + 1] * down[j + 1]);
      }
      if (g_tile != nullptr) {
        const float2 g01 = blk.G2(t, c), g23 = blk.G2(t, c + 2);
        g_tile->store2(t, c, kx[0] * __expf(g01.x), kx[1] * __expf(g01.y));
        g_tile->store2(t, c + 2, kx[2] * __expf(g23.x), kx[3] * __expf(g23.y));
      }
    }
  };
  auto build_q_side = [&](const float* staged, const ChunkTile& X) {
    constexpr int kPerRow = kHeadDim / 4;
#pragma unroll 2
    for (int i = tid; i < kChunk * kPerRow; i += kThreads) {
      const int t = i / kPerRow, c = (i % kPerRow) * 4;
      const float4 q4 = *reinterpret_cast<const float4*>(staged + t * kHeadDim + c);
      const float2 pl01 = blk.pivot_log2(t, c), pl23 = blk.pivot_log2(t, c + 2);
      X.store2(t, c, q4.x * __expf(pl01.x), q4.y * __expf(pl01.y));
      X.store2(t, c + 2, q4.z * __expf(pl23.x), q4.w * __expf(pl23.y));
    }
  };

  // kPhaseKSide
  const ChunkTile Xk = chunk_tile(L::kXk), Yk = chunk_tile(L::kYk);
  build_k_side(reinterpret_cast<const float*>(region(L::kKStaged)), Xk, Yk, &kg);
  cute::cp_async_wait<0>();  // q̂
  __syncthreads();
  // kPhaseQSide (over the staged k̂), and zeros for M (its blocks above the diagonal are read)
  const ChunkTile Xq = chunk_tile(L::kXq);
  build_q_side(reinterpret_cast<const float*>(region(L::kQStaged)), Xq);
  for (int i = tid; i < SquareTile::kBytes / 16; i += kThreads) reinterpret_cast<uint4*>(Mt.p)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // kPhaseGram
  gram_products(blk, Mt, Xq, Xk, Yk);
  __syncthreads();

  // kPhaseSolve: L = (I + diag(β) A)⁻¹ by 16 x 16 blocks, as the whole pass; this half of v staged.
  blk.copy_rows_async<kPartV>(region(L::kV), PartTile::kStride * 2, p.v + v0);
  solve(blk, reinterpret_cast<float*>(region(L::kLf)), reinterpret_cast<float*>(region(L::kScratch)), Lt, Tt);
  cute::cp_async_wait<0>();  // v
  __syncthreads();

  // kPhaseUW: S and dO (this half) staged during u = T v and w = T kg.
  const PartTile dOt = part_tile(L::kDO);
  copy_state_part_async(blk, St, p.states, v0);
  blk.copy_rows_async<kPartV>(region(L::kDO), PartTile::kStride * 2, p.dO + v0);
  const ChunkTile wt = chunk_tile(L::kW);
  PartAcc u;  // T v, then U = T v − w S
  u.zero();
  u.mma<false, true>(Tt, vt, 0, kChunk);
  {
    ChunkAcc w;
    w.zero();
    w.mma<false, true>(Tt, kg, 0, kChunk);
    w.store(wt, [](int, int, float x) { return x; });
  }
  ChunkAcc dq, dk, dG;  // this half's shares of the gradients of q̂, k̂ and Γ
  dq.zero();
  dk.zero();
  dG.zero();
  cute::cp_async_wait<0>();  // S and dO
  __syncthreads();

  // kPhaseU
  const PartTile Ut = part_tile(L::kU);
  u.mma<false, true>(wt, St, 0, kHeadDim, true);
  u.store(Ut, [](int, int, float x) { return x; });
  {
    ChunkAcc dqg;  // of q̂ e^Γ: dO Sᵀ (this half's value columns)
    dqg.zero();
    dqg.mma<false, false>(dOt, St, 0, kPartV);
    add_through_decay(blk, dqg, dq, dG, [&](int t, int c) { return blk.load2(p.q, t, c); });
  }
  __syncthreads();

  // kPhaseDU: this half of dS' over S, with its share of e^{Γ_C} Σ_v S dS' to the chunk's end; kd
  // over w.
  {
    constexpr int kPerRow = kPartV / 4, kIters = kHeadDim * kPerRow / kThreads;  // 16 lanes a row
    const int64_t base = blk.state_at() + v0;
    uint2 d[kIters], s[kIters];
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = tid + it * kThreads, r = i / kPerRow, c = (i % kPerRow) * 4;
      d[it] = __ldg(reinterpret_cast<const uint2*>(p.dstates + base + r * kHeadDim + c));
      s[it] = __ldg(reinterpret_cast<const uint2*>(p.states + base + r * kHeadDim + c));
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = tid + it * kThreads, r = i / kPerRow, c = (i % kPerRow) * 4;
      *reinterpret_cast<uint2*>(St.at(r, c)) = d[it];
      const float4 d4 = SplitBlock::unpack4(d[it]), s4 = SplitBlock::unpack4(s[it]);
      float x = s4.x * d4.x + s4.y * d4.y + s4.z * d4.z + s4.w * d4.w;
#pragma unroll
      for (int o = 1; o < kPerRow; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);  // the row's lanes
      if ((tid % kPerRow) == 0) blk.end()[r] += x * __expf(blk.G_end(r));
    }
  }
  const ChunkTile kd = chunk_tile(L::kKd);
  blk.fill(kd, p.k, [&](int t, int c, float x) { return x * __expf(blk.G_end(c) - blk.G(t, c)); });
  __syncthreads();
  const PartTile dUt = part_tile(L::kDU);
  SquareAcc dM;  // dO Uᵀ (this half), masked when stored
  {
    PartAcc dU;  // Mᵀ dO + kd dS'
    dU.zero();
    dU.mma<true, true>(Mt, dOt, 0, kChunk);
    dU.mma<false, true>(kd, St, 0, kHeadDim);
    dU.store(dUt, [](int, int, float x) { return x; });
    ChunkAcc dkd;  // of kd: U dS'ᵀ
    dkd.zero();
    dkd.mma<false, false>(Ut, St, 0, kPartV);
    add_kd_grad(blk, dkd, dk, dG, [&](int t, int c) { return blk.load2(p.k, t, c); });
    dM.zero();
    dM.mma<false, false>(dOt, Ut, 0, kPartV);
  }
  __syncthreads();

  // kPhaseDW: S (this half) again over dS'; dM over M.
  copy_state_part_async(blk, St, p.states, v0);
  dM.store(Mt, [](int i, int j, float x) { return j <= i ? x : 0.f; });
  cute::cp_async_wait<0>();
  __syncthreads();
  const ChunkTile dwt = chunk_tile(L::kDW);
  {
    ChunkAcc dw;  // −dU Sᵀ (this half's share)
    dw.zero();
    dw.mma<false, false>(dUt, St, 0, kPartV, true);
    dw.store(dwt, [](int, int, float x) { return x; });
    PartAcc dv;  // Tᵀ dU
    dv.zero();
    dv.mma<true, true>(Tt, dUt, 0, kChunk);
    PartAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
      blk.store2(p.dv, p.dv_dtype, t, v0 + c, dv.c[mi][ni][2 * h], dv.c[mi][ni][2 * h + 1]);
    });
  }
  __syncthreads();

  // kPhaseDT
  const SquareTile X1 = square_tile(L::kX1), Y1 = square_tile(L::kY1);
  {
    SquareAcc dT;  // dU vᵀ + dw kgᵀ; T = L diag(β): dβ_j += Σ_i dT_ij L_ij, and dL = dT diag(β)
    dT.zero();
    dT.mma<false, false>(dUt, vt, 0, kPartV);
    dT.mma<false, false>(dwt, kg, 0, kHeadDim);
    add_dbeta_of_T(blk, dT, Lt);
    dT.store(X1, [&](int, int j, float x) { return x * blk.beta()[j]; });
    ChunkAcc dkg;  // Tᵀ dw
    dkg.zero();
    dkg.mma<true, true>(Tt, dwt, 0, kChunk);
    add_through_decay(blk, dkg, dk, dG, [&](int t, int c) { return blk.load2(p.k, t, c); });
  }
  __syncthreads();

  // kPhaseY1
  {
    SquareAcc y;  // Lᵀ X1
    y.zero();
    y.mma<true, true>(Lt, X1, 0, kChunk);
    y.store(Y1, [](int, int, float x) { return x; });
  }
  __syncthreads();

  // kPhaseStageK, kPhaseKSide2: the k-side Gram operands again (A is rebuilt from them for dβ).
  blk.copy_rows_async(region(L::kKStaged2), kHeadDim * 4, p.k);
  cute::cp_async_wait<0>();
  __syncthreads();
  const ChunkTile Xk2 = chunk_tile(L::kXk2), Yk2 = chunk_tile(L::kYk2);
  build_k_side(reinterpret_cast<const float*>(region(L::kKStaged2)), Xk2, Yk2, nullptr);
  __syncthreads();

  // kPhaseGd: G = −strict_tril(Y1 Lᵀ), the gradient of diag(β) A: dβ_i += Σ_j G_ij A_ij (A's block
  // recomputed by the warp that holds G's: each warp's 16 x 16 tile of a SquareAcc is the sub-chunk
  // block (a, b), a = the warp's row, b = its column), dA = diag(β) G.
  const SquareTile dZA = square_tile(L::kDZA);
  {
    static_assert(SquareAcc::kWarpRows == kSubChunk && SquareAcc::kWarpCols == kSubChunk, "a warp's tile is a block");
    SquareAcc Gd;
    Gd.zero();
    Gd.mma<false, false>(Y1, Lt, 0, kChunk, true);
    const int a = SquareAcc::m0() / kSubChunk, b = SquareAcc::n0() / kSubChunk;
    float Ab[1][2][4] = {};
    if (b <= a) gram_block(blk, Ab, Xk2, Yk2, a, b);
    mask_and_add_dbeta_of_A(blk, Gd, [&](int mi, int ni, int e, int, int) { return Ab[mi][ni][e]; });
    Gd.store(dZA, [&](int i, int, float x) { return x * blk.beta()[i]; });
  }
  __syncthreads();

  // kPhaseStageQ, kPhaseQSide2
  blk.copy_rows_async(region(L::kQStaged2), kHeadDim * 4, p.q);
  cute::cp_async_wait<0>();
  __syncthreads();
  const ChunkTile Xq2 = chunk_tile(L::kXq2);
  build_q_side(reinterpret_cast<const float*>(region(L::kQStaged2)), Xq2);
  __syncthreads();

  // kPhaseGramGrad
  add_gram_grads(blk, dq, dk, dG, Mt, dZA, Xq2, Xk2, Yk2);  // dM over M
  // This half's shares into the zero-filled outputs.
  ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
    if (t >= len) return;
    const int64_t i = blk.at(t, c);
    atomicAdd(p.dq + i, dq.c[mi][ni][2 * h]);
    atomicAdd(p.dq + i + 1, dq.c[mi][ni][2 * h + 1]);
    atomicAdd(p.dk + i, dk.c[mi][ni][2 * h]);
    atomicAdd(p.dk + i + 1, dk.c[mi][ni][2 * h + 1]);
  });
  // kPhaseDg: dĝ's suffix sums over the chunk, as the whole pass (dΓ over the Gram operands).
  __syncthreads();
  if constexpr (kScalarGate) {
    write_dg_scalar<true>(blk, dG, reinterpret_cast<float*>(region(L::kPart)));
  } else {
    float* dgamma = reinterpret_cast<float*>(region(L::kDGamma));
    ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
      *reinterpret_cast<float2*>(dgamma + t * kHeadDim + c) = make_float2(dG.c[mi][ni][2 * h], dG.c[mi][ni][2 * h + 1]);
    });
    __syncthreads();
    write_dg<true>(blk, dgamma, reinterpret_cast<float*>(region(L::kTotals2)));
  }
}

}  // namespace chunk_bwd

// The value-split gradients pass: dq, dk, dg and dbeta must be zero-filled (each half adds its
// share); dv is written (this pass's columns of every token in a chunk).
template <bool kScalarGate>
cudaError_t run_chunk_local_grad_split(const ChunkBwdParams& p, cudaStream_t stream) {
  using namespace chunk_bwd;
  if (p.chunks == 0 || p.HV == 0) return cudaSuccess;
  const auto kernel = chunk_local_grad_split_kernel<kScalarGate>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSplitSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(unsigned(p.chunks), unsigned(p.HV), kValueParts), kThreads, kSplitSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashkda
