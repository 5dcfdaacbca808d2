// chunk_local_grad: the per-chunk work of the chunked backward, one block of sixteen warps per
// (chunk, value head), every chunk in parallel (the passes and their math: chunk_bwd_params.h).
//
// Each block recomputes the chunk's local forward from the preprocessed inputs: the cumulative log
// decay Γ, the decayed Gram matrices M and A, the unit lower triangular solve L = (I + diag(β) A)⁻¹
// (by 16 x 16 blocks, as chunk_prepare solves it), T = L diag(β), w and u. Products run on the tensor
// cores (mma.sync m16n8k16, bf16 operands in shared memory, fp32 accumulators; on sm_90a the products
// by a state S or dS' on warpgroup MMAs, PanelStateTile); the block's 218 KB of shared memory needs
// an sm_90 GPU, and with one block per SM its sixteen warps are what hides the latencies. The token
// rows a phase reads reach shared memory by cp.async ahead of their use: with 128 registers a
// thread, loads into registers are issued one at a time next to their uses.
//
// Decay without overflow, as the forward (chunk_prepare.cuh): tokens in sub-chunks of 16, γ the
// log decay from a token's sub-chunk start, h_a half of sub-chunk a's total. The Gram operands are
// x e^{γ−h} (rows) and y e^{h−γ} (columns); a block below the diagonal (rows in a, columns in b)
// takes the per-channel factor f_ab = e^{h_a − h_b + Γ_a − Γ_b} ≤ 1 (Γ_a: the decay before a), so
// every product is exactly e^{Γi−Γj} and every factor stays within e^{±kBwdMaxSubchunkSpan / 2}.
// The gradients of the Gram matrices follow the same blocks: for Z = x yᵀ ⊙ e^{Γi−Γj},
// dx = e^{γ−h_a} Σ_b f_ab (dZ_ab Y_b), dy = e^{h_b−γ} Σ_a f_ab (dZ_abᵀ X_a), and the decay's share
// dΓ = x dx − y dy, taken from the products' own operands (see the gradients pass); the log
// decays' gradient is the suffix sum of dΓ over the chunk.
//
// The block's gradients of q̂, k̂ and Γ stay in registers, in the accumulator layout of a 64 x 128
// product (every such product of the block gives each thread the same elements).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flashkda/backward/chunk_bwd_params.h"
#include "flashkda/common/bulk_sm90.cuh"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/common/token_math.cuh"
#include "flashkda/common/wgmma_sm90.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {
namespace chunk_bwd {

using chunk::kChunk;
using chunk::kHeadDim;
using chunk::kSubChunk;
using chunk::kSubChunks;
using Bf16 = __nv_bfloat16;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRowWarps = 4, kColWarps = kWarps / kRowWarps;  // the warp grid of a block product
constexpr int kPairs = kSubChunks * (kSubChunks - 1) / 2;  // sub-chunk blocks below the diagonal
__host__ __device__ constexpr int pair_index(int a, int b) { return a * (a - 1) / 2 + b; }  // b < a

// A bf16 matrix in shared memory, row-major, each row padded by 16 bytes: the eight row addresses
// of an ldmatrix (eight consecutive rows, one 16-byte column) then fall in eight bank groups.
template <int kRows, int kCols>
struct Tile {
  static constexpr int kStride = kCols + 8;
  static constexpr int kBytes = kRows * kStride * 2;
  Bf16* p;
  __device__ __forceinline__ Bf16* at(int r, int c) const { return p + r * kStride + c; }
  __device__ __forceinline__ uint32_t addr(int r, int c) const { return sm80::smem_u32(at(r, c)); }
  __device__ __forceinline__ void store2(int r, int c, float x, float y) const {
    *reinterpret_cast<__nv_bfloat162*>(at(r, c)) = __floats2bfloat162_rn(x, y);
  }
  __device__ __forceinline__ float get(int r, int c) const { return __bfloat162float(*at(r, c)); }
  __device__ __forceinline__ float2 get2(int r, int c) const {  // c even
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(at(r, c)));
  }
};
using ChunkTile = Tile<kChunk, kHeadDim>;   // [token][channel]
using StateTile = Tile<kHeadDim, kHeadDim>;  // [key][value]
using SquareTile = Tile<kChunk, kChunk>;     // [token][token]

// A [kHeadDim][kHeadDim] state ([key][value]) in 128-byte swizzled panels of 64 columns
// (sm80::PanelTile) at a 1024-byte aligned base: the layout a warpgroup MMA reads through a matrix
// descriptor as its B operand, K-major (rows of N) or MN-major (rows of K). The sm_90a gradients
// pass keeps S and dS' so and multiplies them on warpgroup MMAs (state_mma); its other tiles keep
// the padded rows above, which ldmatrix and the accumulator stores address with no XOR.
struct PanelStateTile {
  using Layout = sm80::PanelTile<kHeadDim, kHeadDim / 8>;
  static constexpr int kBytes = 2 * Layout::kPanelBytes;
  Bf16* p;
  // Element (r, c); elements c .. c + 7 - c % 8 of row r are contiguous (one 16-byte piece).
  __device__ __forceinline__ Bf16* at(int r, int c) const {
    return reinterpret_cast<Bf16*>(reinterpret_cast<uint8_t*>(p) + Layout::offset(r, c));
  }
};

// c[mi][ni] += op(A)[m0 + 16 mi + ·][k] · op(B)[k][n0 + 8 ni + ·] for k in [k0, k1) (multiples of 16).
// op(A) is A as stored ([m][k]) or, with kTransA, the transpose of the stored [k][m]; op(B) is the
// transpose of the stored [n][k] or, with kTransB, B as stored ([k][n]). `negate` flips op(A)'s
// sign; `a_scale` (nullptr: none) multiplies column k of op(A) by a_scale[k].
template <bool kTransA, bool kTransB, int MI, int NI, class TA, class TB>
__device__ __forceinline__ void warp_mma(float (&c)[MI][NI][4], const TA& A, const TB& B, int m0, int n0, int k0,
                                         int k1, bool negate = false, const float* a_scale = nullptr) {
  static_assert(NI % 2 == 0, "B fragments load two n8 tiles at once");
  const int lane = threadIdx.x & 31;
  const int mat = lane >> 3, r = lane & 7;
  for (int k = k0; k < k1; k += 16) {
    uint32_t a[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      const int m = m0 + 16 * mi;
      if constexpr (!kTransA)
        sm80::ldmatrix_x4(a[mi], A.addr(m + (lane & 15), k + (lane >> 4) * 8));
      else
        sm80::ldmatrix_x4_trans(a[mi], A.addr(k + r + (mat >> 1) * 8, m + (mat & 1) * 8));
      if (a_scale != nullptr) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int kk = k + 2 * (lane & 3) + 8 * (j >> 1);
          float lo, hi;
          sm80::unpack2_bf16(a[mi][j], lo, hi);
          a[mi][j] = sm80::pack2<Bf16>(lo * a_scale[kk], hi * a_scale[kk + 1]);
        }
      }
      if (negate) {
#pragma unroll
        for (int j = 0; j < 4; ++j) a[mi][j] = sm80::neg2(a[mi][j]);
      }
    }
#pragma unroll
    for (int np = 0; np < NI / 2; ++np) {
      uint32_t b[4];
      const int n = n0 + 16 * np;
      if constexpr (!kTransB)
        sm80::ldmatrix_x4(b, B.addr(n + r + (mat >> 1) * 8, k + (mat & 1) * 8));
      else
        sm80::ldmatrix_x4_trans(b, B.addr(k + r + (mat & 1) * 8, n + (mat >> 1) * 8));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        sm80::mma_16816<Bf16>(c[mi][2 * np], a[mi], b[0], b[1]);
        sm80::mma_16816<Bf16>(c[mi][2 * np + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

#ifdef FLASHKDA_WGMMA
// warp_mma's c[0][·] += ±A[m0 + ·][k] · op(S)[k][n0 + 8 ni + ·] over the state's kHeadDim for a
// 64-row product on warpgroup MMAs: the four warps of a warpgroup (m0 = 16 · (warp % 4)) share one
// n0 and take 8 NI columns from it; A (a padded chunk tile, [m][k]) by ldmatrix into registers,
// every k-step's fragment before one fence (a fence and a wait every 2 or 4 k-steps measured slower);
// S in place through a descriptor: op(S) = Sᵀ (S stored [n][k], K-major) or, with kTransB, S as
// stored ([k][n], MN-major). S's writes must have been published to the async proxy (publish_tiles)
// before the barrier ahead of this product.
template <bool kTransB, int kScaleA, int NI, class TA>
__device__ __forceinline__ void warpgroup_state_mma(float (&c)[NI][4], const TA& A, const PanelStateTile& S, int m0,
                                                    int n0) {
  constexpr uint32_t kPanel = PanelStateTile::Layout::kPanelBytes;
  constexpr int kSteps = kHeadDim / 16;
  const int lane = threadIdx.x & 31;
  const uint32_t s_base = sm80::smem_u32(S.p);
  uint32_t a[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) sm80::ldmatrix_x4(a[s], A.addr(m0 + (lane & 15), 16 * s + (lane >> 4) * 8));
  sm90::fence_operands(c);
  sm90::wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int k = 16 * s;
    if constexpr (kTransB) {  // rows of K, 16 of them from row k; columns n0 .. within one panel
      const uint32_t start = s_base + (n0 / 64) * kPanel + k * 128 + (n0 % 64) * 2;
      sm90::wgmma_m64nNk16_rs<Bf16, kScaleA, NI, sm90::gmma::Major::MN>(c, a[s], sm90::smem_desc(start, kPanel, 1024),
                                                                        true);
    } else {  // rows of N from n0, the 16 columns from k (within one panel)
      const uint32_t start = s_base + (k / 64) * kPanel + n0 * 128 + (k % 64) * 2;
      sm90::wgmma_m64nNk16_rs<Bf16, kScaleA, NI>(c, a[s], sm90::smem_desc(start, 16, 1024), true);
    }
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_operands(c);
}
#endif

// Makes the block's shared-memory writes before the next barrier (stores, cp.async copies: the
// generic proxy) visible to the warpgroup MMAs after it (the async proxy), where the build has them.
__device__ __forceinline__ void publish_tiles() {
#ifdef FLASHKDA_WGMMA
  sm90::fence_proxy_async();
#endif
}

// An M x N fp32 product of the block: warps kRowWarps (rows) x kColWarps (columns), each an
// (M / kRowWarps) x (N / kColWarps) tile.
template <int M, int N>
struct Acc {
  static constexpr int kWarpRows = M / kRowWarps, kWarpCols = N / kColWarps;
  static constexpr int MI = kWarpRows / 16, NI = kWarpCols / 8;
  float c[MI][NI][4];
  __device__ __forceinline__ static int m0() { return ((threadIdx.x >> 5) % kRowWarps) * kWarpRows; }
  __device__ __forceinline__ static int n0() { return ((threadIdx.x >> 5) / kRowWarps) * kWarpCols; }
  __device__ __forceinline__ void zero() {
    for_each([&](int mi, int ni, int e, int, int) { c[mi][ni][e] = 0.f; });
  }
  template <bool kTransA, bool kTransB, class TA, class TB>
  __device__ __forceinline__ void mma(const TA& A, const TB& B, int k0, int k1, bool negate = false) {
    warp_mma<kTransA, kTransB>(c, A, B, m0(), n0(), k0, k1, negate);
  }
  // c += ±A · op(S) over all kHeadDim of the state S (op(S) = Sᵀ, or S with kTransB): on warpgroup
  // MMAs for a PanelStateTile (sm_90a, M = 64), else as mma.
  template <bool kTransB, class TA, class TS>
  __device__ __forceinline__ void state_mma(const TA& A, const TS& S, bool negate = false) {
#ifdef FLASHKDA_WGMMA
    if constexpr (std::is_same_v<TS, PanelStateTile>) {
      static_assert(M == 64 && MI == 1, "a warpgroup's 64 rows");
      if (negate)
        warpgroup_state_mma<kTransB, -1>(c[0], A, S, m0(), n0());
      else
        warpgroup_state_mma<kTransB, 1>(c[0], A, S, m0(), n0());
    } else
#endif
    {
      warp_mma<false, kTransB>(c, A, S, m0(), n0(), 0, kHeadDim, negate);
    }
  }
  // f(mi, ni, e, row, col) for each element this thread holds.
  template <class F>
  __device__ __forceinline__ static void for_each(F&& f) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(mi, ni, e, m0() + 16 * mi + sm80::FragAcc::m(lane, e), n0() + 8 * ni + sm80::FragAcc::n(lane, e));
  }
  // f(mi, ni, h, row, col) for each pair of row neighbours this thread holds: elements 2h, 2h + 1
  // at (row, col) and (row, col + 1).
  template <class F>
  __device__ __forceinline__ static void for_each_pair(F&& f) {
    for_each([&](int mi, int ni, int e, int row, int col) {
      if (e % 2 == 0) f(mi, ni, e / 2, row, col);
    });
  }
  // The product into a bf16 tile, each element through f(row, col, value) (elements e, e + 1 of a
  // tile are neighbours in a row).
  template <class T, class F>
  __device__ __forceinline__ void store(const T& tile, F&& f) const {
    for_each([&](int mi, int ni, int e, int row, int col) {
      if (e % 2 == 0) tile.store2(row, col, f(row, col, c[mi][ni][e]), f(row, col + 1, c[mi][ni][e + 1]));
    });
  }
};
using ChunkAcc = Acc<kChunk, kHeadDim>;
using SquareAcc = Acc<kChunk, kChunk>;
using StateAcc = Acc<kHeadDim, kHeadDim>;

// fp32 [kChunk][kChunk] matrices (A, L) have rows of kF32Stride floats: the tf32 fragment loads of
// the solve (eight rows, four columns) then fall in 32 banks.
constexpr int kF32Stride = kChunk + 4;
// Row stride (floats) of a warp's 16 x 16 scratch block in the solve: its B-fragment reads (rows t,
// t + 4; columns g) fall in 32 banks.
constexpr int kScratchStride = 24;

// Shared memory (bytes). The eight chunk tiles are reused from phase to phase (see the kernel).
struct SmemLayout {
  static constexpr int kGamma = 0;                                     // fp32 [kChunk][kHeadDim] Γ
  static constexpr int kPivot = kGamma + kChunk * kHeadDim * 4;        // fp32 [kSubChunks][kHeadDim] h_a
  static constexpr int kFactor = kPivot + kSubChunks * kHeadDim * 4;   // fp32 [kPairs][kHeadDim] f_ab
  static constexpr int kBeta = kFactor + kPairs * kHeadDim * 4;        // fp32 [kChunk]
  static constexpr int kDbeta = kBeta + kChunk * 4;                    // fp32 [kChunk]
  static constexpr int kEnd = kDbeta + kChunk * 4;                     // fp32 [kHeadDim]: dΓ at the chunk's end
  static constexpr int kA = kEnd + kHeadDim * 4;                       // fp32 [kChunk][kF32Stride] A
  static constexpr int kM = kA + kChunk * kF32Stride * 4;              // SquareTile M, later dM
  static constexpr int kT = kM + SquareTile::kBytes;                   // SquareTile T
  static constexpr int kL = kT + SquareTile::kBytes;                   // SquareTile L
  // kNumSlots chunk tiles of 17 KB each from a 1024-byte boundary (asserted below), so that every
  // slot starts on one (a PanelStateTile's alignment).
  static constexpr int kSlots = kL + SquareTile::kBytes;
  static constexpr int kNumSlots = 8;
  static constexpr int kBytes = kSlots + kNumSlots * ChunkTile::kBytes;
  __host__ __device__ static constexpr int slot(int i) { return kSlots + i * ChunkTile::kBytes; }
  // A scalar decay's pass (BlockT's kScalarDecay) keeps Γ as [kChunk] fp32 and has no pivots or
  // factors: its bf16 q̂ and k̂ tiles (the Gram operands, and q̂, k̂ for every later use) live over
  // the rest of that space for the whole pass, staged once.
  static constexpr int kScalarQ = kGamma + kChunk * 4;
  static constexpr int kScalarK = kScalarQ + ChunkTile::kBytes;
  // With the raw q and k (ChunkBwdParams::raw_q): fp32 [2][kChunk] each, q's rows then k's, the
  // factor f that takes a raw row to q̂ or k̂ and the 1 / norm r.
  static constexpr int kScalarFactor = kScalarK + ChunkTile::kBytes;
  static constexpr int kScalarRnorm = kScalarFactor + 2 * kChunk * 4;
};
static_assert(SmemLayout::kScalarRnorm + 2 * kChunk * 4 <= SmemLayout::kBeta,
              "a scalar decay's q̂, k̂ tiles and raw rows' factors fit over Γ");
static_assert(StateTile::kBytes <= 2 * ChunkTile::kBytes && PanelStateTile::kBytes <= 2 * ChunkTile::kBytes,
              "a state tile takes two slots");
static_assert(SmemLayout::kSlots % 1024 == 0 && ChunkTile::kBytes % 1024 == 0, "slots on 1024-byte boundaries");
static_assert(kChunk * kF32Stride * 4 <= ChunkTile::kBytes, "the fp32 L takes one slot");
static_assert((kSubChunks - 1) * kSubChunk * kScratchStride * 4 <= ChunkTile::kBytes, "the solve's scratch takes one slot");
static_assert(kSubChunks * kHeadDim * 4 <= kChunk * kF32Stride * 4, "the sub-chunk sums fit over A");
static_assert(kSubChunks * kHeadDim == kThreads, "a thread per (sub-chunk, channel)");
static_assert(kChunk * kHeadDim * 4 <= 2 * ChunkTile::kBytes, "the fp32 dΓ takes two slots");
// More than an A100 block may have (163 KB): the kernel runs on sm_90 (227 KB), others take the
// PyTorch backward (flashkda/autograd.py asks chunk_local_grad_smem_bytes()).
static_assert(SmemLayout::kBytes <= 227 * 1024, "fits an sm_90 block");

// The block's view of its chunk, head and shared memory; Layout gives the offsets of Γ, the pivots,
// the factors, β, dβ, the chunk-end terms and A. kScalarDecay: Γ is one log decay per token (a scalar
// gate, the whole pass's gradients: gamma_phase_scalar), [kChunk] fp32 at Γ's offset, which the
// accessors below return for every channel; no pivots or factors.
template <class Layout, bool kScalarDecay = false>
struct BlockT {
  static constexpr bool kScalar = kScalarDecay;
  const ChunkBwdParams& p;
  uint8_t* smem;
  int64_t chunk, bos;
  int len, hv;
  int64_t head0;    // element offset of (token 0, channel 0) of this chunk and head in the token tensors
  int token_pitch;  // elements from one token to the next (HV · kHeadDim)

  __device__ __forceinline__ float* gamma() const { return reinterpret_cast<float*>(smem + Layout::kGamma); }
  __device__ __forceinline__ float* pivot() const { return reinterpret_cast<float*>(smem + Layout::kPivot); }
  __device__ __forceinline__ float* factor(int a, int b) const {
    return reinterpret_cast<float*>(smem + Layout::kFactor) + pair_index(a, b) * kHeadDim;
  }
  __device__ __forceinline__ float* beta() const { return reinterpret_cast<float*>(smem + Layout::kBeta); }
  __device__ __forceinline__ float* dbeta() const { return reinterpret_cast<float*>(smem + Layout::kDbeta); }
  __device__ __forceinline__ float* end() const { return reinterpret_cast<float*>(smem + Layout::kEnd); }
  __device__ __forceinline__ float* A() const { return reinterpret_cast<float*>(smem + Layout::kA); }
  __device__ __forceinline__ float& A(int i, int j) const { return A()[i * kF32Stride + j]; }
  template <class T = ChunkTile>
  __device__ __forceinline__ T tile(int offset) const {
    return T{reinterpret_cast<Bf16*>(smem + offset)};
  }
  __device__ __forceinline__ ChunkTile slot(int i) const { return tile(Layout::slot(i)); }

  // Element offset of (token t, channel c) in the token tensors of this head.
  __device__ __forceinline__ int64_t at(int t, int c) const { return head0 + (t * token_pitch + c); }
  // Element offset of this (chunk, head)'s [kHeadDim][kHeadDim] matrix in a chunk-state tensor.
  __device__ __forceinline__ int64_t state_at() const { return (chunk * p.HV + hv) * int64_t(kHeadDim * kHeadDim); }
  __device__ __forceinline__ float load(const float* x, int t, int c) const { return t < len ? __ldg(x + at(t, c)) : 0.f; }
  // Element offset of token t of this head in a [rows, HV] tensor (β, and a scalar gate's g and dg).
  __device__ __forceinline__ int64_t head_at(int t) const { return (bos + t) * p.HV + hv; }
  // The log decay of token t, key channel c (a scalar gate: the token's one value).
  template <bool kScalarGate>
  __device__ __forceinline__ float load_gate(int t, int c) const {
    if (t >= len) return 0.f;
    return kScalarGate ? __ldg(p.g + head_at(t)) : __ldg(p.g + at(t, c));
  }
  // Channels c, c + 1 (c even) of token t.
  __device__ __forceinline__ float2 load2(const float* x, int t, int c) const {
    return t < len ? __ldg(reinterpret_cast<const float2*>(x + at(t, c))) : make_float2(0.f, 0.f);
  }
  // Channels c, c + 1 (c even) of token t into a token tensor of dtype `type` (fp32, or rounded to
  // bf16 / fp16); nothing for tokens past the chunk's end.
  __device__ __forceinline__ void store2(void* x, DType type, int t, int c, float a, float b) const {
    if (t >= len) return;
    const int64_t i = at(t, c);
    if (type == DType::kFloat32)
      *reinterpret_cast<float2*>(static_cast<float*>(x) + i) = make_float2(a, b);
    else
      *reinterpret_cast<uint32_t*>(static_cast<Bf16*>(x) + i) = pack_16bit_pair(type, a, b);
  }
  // The 16-bit way out (type bf16 / fp16) of a product's gradient in the accumulator layout: each
  // store2 above puts 4 bytes into each of eight rows, eight 128-byte lines per warp store. Instead
  // stage2 writes the pairs into a free chunk tile (that dtype's bits) and, after a barrier,
  // write_rows stores the chunk's rows from it 16 bytes a thread, two whole rows per warp store.
  __device__ __forceinline__ static void stage2(const ChunkTile& tile, DType type, int t, int c, float a, float b) {
    *reinterpret_cast<uint32_t*>(tile.at(t, c)) = pack_16bit_pair(type, a, b);
  }
  __device__ __forceinline__ void write_rows(void* x, const ChunkTile& tile) const {
    constexpr int kPieces = kHeadDim * 2 / 16;  // per row
#pragma unroll
    for (int i = threadIdx.x; i < kChunk * kPieces; i += kThreads) {
      const int t = i / kPieces, c = (i % kPieces) * 8;
      if (t < len)
        *reinterpret_cast<uint4*>(static_cast<Bf16*>(x) + at(t, c)) =
            *reinterpret_cast<const uint4*>(tile.at(t, c));
    }
  }
  __device__ __forceinline__ float2 G2(int t, int c) const {
    if constexpr (kScalar) return make_float2(gamma()[t], gamma()[t]);
    else return *reinterpret_cast<const float2*>(gamma() + t * kHeadDim + c);
  }
  __device__ __forceinline__ float G(int t, int c) const { return kScalar ? gamma()[t] : gamma()[t * kHeadDim + c]; }
  __device__ __forceinline__ float G_end(int c) const { return G(kChunk - 1, c); }
  // γ − h of token t, channels c, c + 1 (c even): the log of its row-side pivot factor.
  __device__ __forceinline__ float2 pivot_log2(int t, int c) const {
    const int a = t / kSubChunk;
    const float2 g = G2(t, c), h = *reinterpret_cast<const float2*>(pivot() + a * kHeadDim + c);
    const float2 before = a > 0 ? G2(a * kSubChunk - 1, c) : make_float2(0.f, 0.f);
    return make_float2(g.x - before.x - h.x, g.y - before.y - h.y);
  }
  // e^{Γi−Γj} (j <= i) of a scalar decay, 1 for a block of per-channel decays (the factors carry them).
  __device__ __forceinline__ float scalar_decay(int i, int j) const {
    if constexpr (kScalar) return __expf(gamma()[i] - gamma()[j]);
    else return 1.f;
  }
  // f_ab of channels c, c + 1 (c even); 1 on the diagonal.
  __device__ __forceinline__ float2 pair_factor2(int a, int b, int c) const {
    return a == b ? make_float2(1.f, 1.f) : *reinterpret_cast<const float2*>(factor(a, b) + c);
  }

  // Four bf16 (one 8-byte word) as fp32.
  __device__ __forceinline__ static float4 unpack4(const uint2& u) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
  // Four consecutive elements of a token tensor (fp32, or bf16 as fp32).
  __device__ __forceinline__ static float4 load4(const float* x) { return __ldg(reinterpret_cast<const float4*>(x)); }
  __device__ __forceinline__ static float4 load4(const Bf16* x) {
    return unpack4(__ldg(reinterpret_cast<const uint2*>(x)));
  }
  // tile[t][c] = f(t, c, x[t][c]) over the chunk, from a token tensor (fp32 or bf16), through
  // registers: loads before stores in two parts, though under the gradients pass's register limit
  // ptxas may still issue them one by one (its rows that need no transform come by copy_rows_async).
  template <class Src, class F>
  __device__ __forceinline__ void fill(const ChunkTile& tile, const Src* x, F&& f) const {
    constexpr int kPerRow = kHeadDim / 4, kParts = 2, kIters = kChunk * kPerRow / kThreads / kParts;
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      float4 v[kIters];
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int i = threadIdx.x + (part * kIters + it) * kThreads, t = i / kPerRow, c = (i % kPerRow) * 4;
        v[it] = t < len ? load4(x + at(t, c)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int i = threadIdx.x + (part * kIters + it) * kThreads, t = i / kPerRow, c = (i % kPerRow) * 4;
        tile.store2(t, c, f(t, c, v[it].x), f(t, c + 1, v[it].y));
        tile.store2(t, c + 2, f(t, c + 2, v[it].z), f(t, c + 3, v[it].w));
      }
    }
  }
  // Asynchronous 16-byte copies (cp.async) of this chunk's token rows of x into shared memory:
  // token t's kCols elements from x + at(t, 0) to dst + t · dst_pitch bytes, zeros for tokens past
  // the chunk's end. The copies hold no registers, so every one is in flight at once;
  // cute::cp_async_wait and a barrier complete them.
  template <int kCols = kHeadDim, class Elem>
  __device__ __forceinline__ void copy_rows_async(uint8_t* dst, int dst_pitch, const Elem* x) const {
    constexpr int kPieces = kCols * int(sizeof(Elem)) / 16, kPer = 16 / int(sizeof(Elem));  // per row
#pragma unroll
    for (int i = threadIdx.x; i < kChunk * kPieces; i += kThreads) {
      const int t = i / kPieces, piece = i % kPieces;
      const Elem* from = x + at(t < len ? t : 0, piece * kPer);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<const cute::uint128_t*>(from), *reinterpret_cast<cute::uint128_t*>(dst + t * dst_pitch + piece * 16),
          t < len);
    }
    cute::cp_async_fence();
  }
  __device__ __forceinline__ void copy_rows_async(const ChunkTile& tile, const Bf16* x) const {
    copy_rows_async(reinterpret_cast<uint8_t*>(tile.p), ChunkTile::kStride * 2, x);
  }
  // The same for the [kHeadDim][kHeadDim] bf16 matrix of this (chunk, head) in x, into a state tile
  // (StateTile or PanelStateTile).
  template <class T>
  __device__ __forceinline__ void copy_state_async(const T& tile, const Bf16* x) const {
    constexpr int kPieces = kHeadDim * 2 / 16;
    const Bf16* base = x + state_at();
#pragma unroll
    for (int i = threadIdx.x; i < kHeadDim * kPieces; i += kThreads) {
      const int r = i / kPieces, piece = i % kPieces;
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<const cute::uint128_t*>(base + r * kHeadDim + piece * 8),
          *reinterpret_cast<cute::uint128_t*>(tile.at(r, piece * 8)), true);
    }
    cute::cp_async_fence();
  }
  // The [kHeadDim][kHeadDim] bf16 matrix of this (chunk, head) in x, into a bf16 state tile; with
  // y, f(row, col, x4, y4) also sees each four values of x with those of y, in fp32 (loads first,
  // as fill, in kParts parts: the registers of the gradients pass allow no more in flight). The 32
  // lanes of a warp hold one row per step.
  template <class T, class F>
  __device__ __forceinline__ void fill_state(const T& tile, const Bf16* x, const Bf16* y, F&& f) const {
    constexpr int kPerRow = kHeadDim / 4, kParts = 4, kIters = kHeadDim * kPerRow / kThreads / kParts;
    const int64_t base = state_at() / 4;
    const uint2* xs = reinterpret_cast<const uint2*>(x) + base;  // four bf16 each
    const uint2* ys = reinterpret_cast<const uint2*>(y) + base;
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      uint2 v[kIters], w[kIters];
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int i = threadIdx.x + (part * kIters + it) * kThreads;
        v[it] = __ldg(xs + i);
        if (y != nullptr) w[it] = __ldg(ys + i);
      }
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int i = threadIdx.x + (part * kIters + it) * kThreads, r = i / kPerRow, c = (i % kPerRow) * 4;
        *reinterpret_cast<uint2*>(tile.at(r, c)) = v[it];  // already bf16
        if (y != nullptr) f(r, c, unpack4(v[it]), unpack4(w[it]));
      }
    }
  }
};
using Block = BlockT<SmemLayout>;

// For Z = x yᵀ ⊙ e^{Γi−Γj} (j <= i, blocks as above) and its gradient dZ, this warp's part of the
// chunk in the ChunkAcc layout (the rows of sub-chunk warp % kRowWarps, channels from n0): adds to
// `out` the x-side Σ_b f_ab (dZ_ab Y_b) (kSideX) or the y-side Σ_a f_ab (dZ_abᵀ X_a) of the
// sub-chunk's rows, X = x e^{γ−h} and Y = y e^{h−γ} the operand tiles; the caller scales by
// e^{γ−h} (x-side) or e^{h−γ} (y-side).
template <bool kSideX, class Blk>
__device__ __forceinline__ void gram_grad(const Blk& blk, float (&out)[1][ChunkAcc::NI][4], const SquareTile& dZ,
                                          const ChunkTile& X, const ChunkTile& Y) {
  static_assert(kRowWarps == kSubChunks, "a ChunkAcc warp row is a sub-chunk");
  const int sub = (threadIdx.x >> 5) % kRowWarps, n0 = ChunkAcc::n0();
  const int lane = threadIdx.x & 31;
#pragma unroll 1
  for (int o = 0; o < kSubChunks; ++o) {
    if (kSideX ? o > sub : o < sub) continue;
    float part[1][ChunkAcc::NI][4] = {};
    if constexpr (kSideX)  // dZ[sub][o] (16 x 16) · Y[o] (16 x 64)
      warp_mma<false, true>(part, dZ, Y, kSubChunk * sub, n0, kSubChunk * o, kSubChunk * (o + 1));
    else  // dZ[o][sub]ᵀ · X[o]
      warp_mma<true, true>(part, dZ, X, kSubChunk * sub, n0, kSubChunk * o, kSubChunk * (o + 1));
#pragma unroll
    for (int ni = 0; ni < ChunkAcc::NI; ++ni) {
      const int col = n0 + 8 * ni + sm80::FragAcc::n(lane, 0);  // elements e: columns col + e % 2
      const float2 f = Blk::kScalar ? make_float2(1.f, 1.f)  // the decays are in dZ (add_gram_grads)
                                    : (kSideX ? blk.pair_factor2(sub, o, col) : blk.pair_factor2(o, sub, col));
#pragma unroll
      for (int e = 0; e < 4; ++e) out[0][ni][e] += part[0][ni][e] * (e % 2 ? f.y : f.x);
    }
  }
}

// The phases both forms of the gradients pass share (the whole pass below, the value halves in
// chunk_local_grad_split.cuh), on a block view Blk of either layout.

// β of the chunk's tokens, zeros for dβ and the chunk-end terms (gamma_phase, gamma_phase_scalar).
template <class Blk>
__device__ __forceinline__ void init_beta_and_sums(const Blk& blk) {
  const int tid = threadIdx.x;
  if (tid < kChunk) {
    blk.beta()[tid] = tid < blk.len ? __ldg(blk.p.beta + blk.head_at(tid)) : 0.f;
    blk.dbeta()[tid] = 0.f;
  }
  if (tid < kHeadDim) blk.end()[tid] = 0.f;
}

// Γ, the pivots h_a and the factors f_ab, one thread per (sub-chunk a, channel c): the sub-chunk's
// running sums in registers, its total through `total` ([kSubChunks][kHeadDim] fp32 scratch) to the
// later sub-chunks. Also β and zeros for dβ and the chunk-end terms. `after_loads()` runs once the
// gate's loads are issued (copies to overlap with the sums), `before_barrier()` before the barrier
// that publishes the totals.
template <bool kScalarGate, class Blk, class AfterLoads, class BeforeBarrier>
__device__ __forceinline__ void gamma_phase(const Blk& blk, float* total, AfterLoads&& after_loads,
                                            BeforeBarrier&& before_barrier) {
  const int tid = threadIdx.x, own_c = tid % kHeadDim, own_a = tid / kHeadDim;
  float run[kSubChunk];
#pragma unroll
  for (int t = 0; t < kSubChunk; ++t) run[t] = blk.template load_gate<kScalarGate>(own_a * kSubChunk + t, own_c);
  after_loads();  // after the loads that the sums wait for
#pragma unroll
  for (int t = 1; t < kSubChunk; ++t) run[t] += run[t - 1];
  total[own_a * kHeadDim + own_c] = run[kSubChunk - 1];
  init_beta_and_sums(blk);
  before_barrier();
  __syncthreads();
  float before[kSubChunks], h[kSubChunks];  // Γ before each sub-chunk, half its total
  before[0] = 0.f;
#pragma unroll
  for (int a = 0; a < kSubChunks; ++a) {
    const float x = total[a * kHeadDim + own_c];
    h[a] = 0.5f * x;
    if (a + 1 < kSubChunks) before[a + 1] = before[a] + x;
  }
#pragma unroll
  for (int a = 0; a < kSubChunks; ++a) {
    if (a != own_a) continue;
#pragma unroll
    for (int t = 0; t < kSubChunk; ++t) blk.gamma()[(a * kSubChunk + t) * kHeadDim + own_c] = before[a] + run[t];
    blk.pivot()[a * kHeadDim + own_c] = h[a];
#pragma unroll
    for (int b = 0; b < a; ++b) blk.factor(a, b)[own_c] = __expf(before[a] - before[b] + h[a] - h[b]);
  }
}

// gamma_phase for a block of scalar decay (Blk::kScalar): Γ of the chunk's kChunk tokens, one per
// thread of the first two warps, by a scan over each warp's lanes and the first warp's total through
// `total`; β and the zeros as gamma_phase.
template <class Blk, class AfterLoads, class BeforeBarrier>
__device__ __forceinline__ void gamma_phase_scalar(const Blk& blk, float* total, AfterLoads&& after_loads,
                                                   BeforeBarrier&& before_barrier) {
  static_assert(Blk::kScalar && kChunk == 64, "two warps of tokens");
  const int tid = threadIdx.x, lane = tid & 31;
  float x = tid < kChunk ? blk.template load_gate<true>(tid, 0) : 0.f;
  after_loads();
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (tid == 31) total[0] = x;
  init_beta_and_sums(blk);
  before_barrier();
  __syncthreads();
  if (tid < kChunk) blk.gamma()[tid] = tid < 32 ? x : x + total[0];
}

// A scalar decay's pass on the raw q and k (ChunkBwdParams::raw_q): the chunk's rows, staged in
// raw_q / raw_k (qk_dtype in a ChunkTile's layout, zeros past the chunk's end), to q̂ = scale ·
// l2norm(q) and k̂ = l2norm(k) as chunk_bwd_inputs computes them (four channels a lane, a row's
// sum over the warp in group_sum's order, l2norm_rnorm: the same values), as bf16 into the Gram
// tiles Xq and Xk; each row's factor (x̂ = f x) and 1 / norm into `factor` and `rnorm`
// ([2][kChunk] fp32, q's rows then k's).
template <class Blk>
__device__ __forceinline__ void normalise_raw_qk(const Blk& blk, const ChunkTile& raw_q, const ChunkTile& raw_k,
                                                 const ChunkTile& Xq, const ChunkTile& Xk, float* factor,
                                                 float* rnorm) {
  const ChunkBwdParams& p = blk.p;
  const int lane = threadIdx.x & 31, c = lane * 4, warp = threadIdx.x >> 5;
  static_assert(kHeadDim == 4 * 32, "four channels a lane");
  constexpr int kRows = 2 * kChunk / kWarps;  // a warp's rows: warp + kWarps j, q's then k's
  static_assert(kChunk % kWarps == 0, "whole rows of q, then of k, per warp");
  // Every row's loads, then the sums side by side (each row's shuffles in group_sum's order).
  float x[kRows][4], ss[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int row = warp + kWarps * j;
    load_any_vec<4>((row >= kChunk ? raw_k : raw_q).p + (row % kChunk) * ChunkTile::kStride + c, p.qk_dtype, x[j]);
    ss[j] = sum_sq4(x[j]);
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1)
#pragma unroll
    for (int j = 0; j < kRows; ++j) ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], m);
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int row = warp + kWarps * j, is_k = row >= kChunk, t = row % kChunk;
    float f = is_k ? 1.f : p.scale, r = 1.f;
    if (p.l2norm) {
      r = l2norm_rnorm(ss[j]);
      f *= r;
    }
    const ChunkTile& X = is_k ? Xk : Xq;
    X.store2(t, c, x[j][0] * f, x[j][1] * f);
    X.store2(t, c + 2, x[j][2] * f, x[j][3] * f);
    if (lane == 0) factor[row] = f, rnorm[row] = r;
  }
}

// Channels c, c + 1 (c even) of token t of a staged raw row tile (qk_dtype), times f.
__device__ __forceinline__ float2 raw_pair(const ChunkTile& raw, DType type, int t, int c, float f) {
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(raw.at(t, c));
  return make_float2(bits_to_float(bits & 0xffffu, type) * f, bits_to_float(bits >> 16, type) * f);
}

// M (j <= i, bf16 into Mt, whose blocks above the diagonal the caller zeroed) and A (j < i, fp32
// into blk.A()), 16 x 16 blocks on and below the diagonal: 2 x 10 warp tasks. A scalar decay
// (Blk::kScalar): the operands are undecayed and each element takes e^{Γi−Γj} itself.
template <class Blk>
__device__ __forceinline__ void gram_products(const Blk& blk, const SquareTile& Mt, const ChunkTile& Xq,
                                              const ChunkTile& Xk, const ChunkTile& Yk) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int kBlocks = kSubChunks * (kSubChunks + 1) / 2;
  for (int task = warp; task < 2 * kBlocks; task += kWarps) {
    const bool is_A = task >= kBlocks;
    int rest = task % kBlocks, a = 0;
    while (rest > a) rest -= ++a;
    const int b = rest;
    float acc[1][2][4] = {};
    warp_mma<false, false>(acc, is_A ? Xk : Xq, Yk, kSubChunk * a, kSubChunk * b, 0, kHeadDim, false,
                           Blk::kScalar || a == b ? nullptr : blk.factor(a, b));
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = kSubChunk * a + sm80::FragAcc::m(lane, e), j = kSubChunk * b + 8 * ni + sm80::FragAcc::n(lane, e);
        const bool keep = is_A ? j < i : j <= i;
        float x = keep ? acc[0][ni][e] : 0.f;
        if constexpr (Blk::kScalar) x = keep ? x * blk.scalar_decay(i, j) : 0.f;
        if (is_A)
          blk.A(i, j) = x;
        else
          Mt.p[i * SquareTile::kStride + j] = __float2bfloat16(x);
      }
  }
}

// L = (I + Ab)⁻¹, Ab = diag(β) A strictly lower, by 16 x 16 blocks (fp32, into Lf; `scratch` a
// warp's 16 x 16 block per warp below the last): each diagonal block L_aa = (I + Ab_aa)⁻¹ by forward
// substitution, one column per lane of warp a, in registers; then the blocks below, one warp per
// block column b, for a = b + 1 .. in order (from (I + Ab) L = I): L_ab = −L_aa diag(β_a) Σ_{b<=c<a}
// A_ac L_cb, as 16 x 16 x 16 products on the tf32 tensor cores (L reaches the later products as
// bf16, so tf32 operands cost them nothing). Then L and T = L diag(β) as bf16 tiles (zero above
// the diagonal blocks), with no barrier after them.
template <class Blk>
__device__ __forceinline__ void solve(const Blk& blk, float* Lf_base, float* scratch_base, const SquareTile& Lt,
                                      const SquareTile& Tt) {
  const sm80::PlainF32 L{Lf_base, kF32Stride};
  const sm80::PlainF32 Af{blk.A(), kF32Stride};
  auto block = [](const sm80::PlainF32& m, int a, int b) {
    return sm80::PlainF32{m.p + a * kSubChunk * m.stride + b * kSubChunk, m.stride};
  };
  const float* beta = blk.beta();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (warp < kSubChunks && lane < kSubChunk) {  // column `lane` of L_aa, a = warp
    const int o = warp * kSubChunk, j = lane;
    float x[kSubChunk];  // zero above the diagonal (i < j) by the recurrence itself
#pragma unroll
    for (int i = 0; i < kSubChunk; ++i) {
      float sum = 0.f;
#pragma unroll
      for (int l = 0; l < i; ++l) sum += Af.at(o + i, o + l) * x[l];
      x[i] = (i == j ? 1.f : 0.f) - beta[o + i] * sum;
      L.at(o + i, o + j) = x[i];
    }
  }
  __syncthreads();
  if (warp < kSubChunks - 1) {
    const int b = warp;
    const sm80::PlainF32 scratch{scratch_base + warp * kSubChunk * kScratchStride, kScratchStride};
    for (int a = b + 1; a < kSubChunks; ++a) {
      float acc[2][4] = {};
      for (int c = b; c < a; ++c) sm80::block_product_tf32<false>(acc, block(Af, a, c), block(L, c, b));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] *= beta[a * kSubChunk + sm80::FragAcc::m(lane, e)];
      sm80::store_block(scratch, acc, 1.f);
      __syncwarp();
      float out[2][4] = {};
      sm80::block_product_tf32<false>(out, block(L, a, a), scratch);
      sm80::store_block(block(L, a, b), out, -1.f);
      __syncwarp();  // L_ab is read by the next step; the scratch is rewritten
    }
  }
  __syncthreads();
  for (int i = tid; i < kChunk * kChunk / 2; i += kThreads) {  // zero above the diagonal blocks
    const int r = i / (kChunk / 2), c = (i % (kChunk / 2)) * 2;
    const bool below = c / kSubChunk <= r / kSubChunk;
    const float l0 = below ? L.at(r, c) : 0.f, l1 = below ? L.at(r, c + 1) : 0.f;
    Lt.store2(r, c, l0, l1);
    Tt.store2(r, c, l0 * beta[c], l1 * beta[c + 1]);
  }
}

// From the gradient d of x e^Γ (x = q̂ or k̂): dx += e^Γ d, and dΓ += x e^Γ d; x_of(t, c) gives
// channels c, c + 1 of token t's x.
template <class Blk, class XOf>
__device__ __forceinline__ void add_through_decay(const Blk& blk, const ChunkAcc& d, ChunkAcc& dx, ChunkAcc& dG,
                                                  XOf&& x_of) {
  ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
    const float2 G = blk.G2(t, c), xs = x_of(t, c);
    const float x0 = d.c[mi][ni][2 * h] * __expf(G.x), x1 = d.c[mi][ni][2 * h + 1] * __expf(G.y);
    dx.c[mi][ni][2 * h] += x0;
    dx.c[mi][ni][2 * h + 1] += x1;
    dG.c[mi][ni][2 * h] += xs.x * x0;
    dG.c[mi][ni][2 * h + 1] += xs.y * x1;
  });
}

// From dkd, the gradient of kd = k̂ e^{Γ_C−Γ}: dk̂ += e^{Γ_C−Γ} dkd, dΓ −= kd dkd, and Σ_t kd dkd to
// the chunk's end (shared-memory atomics over the warps); k_of(t, c) as add_through_decay's x_of.
template <class Blk, class KOf>
__device__ __forceinline__ void add_kd_grad(const Blk& blk, const ChunkAcc& dkd, ChunkAcc& dk, ChunkAcc& dG, KOf&& k_of) {
  float end_part[ChunkAcc::NI][2] = {};
  ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
    const float2 G = blk.G2(t, c), ks = k_of(t, c);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float decay = __expf(blk.G_end(c + j) - (j ? G.y : G.x));
      const float kdv = (j ? ks.y : ks.x) * decay, x = dkd.c[mi][ni][2 * h + j];
      dk.c[mi][ni][2 * h + j] += x * decay;
      dG.c[mi][ni][2 * h + j] -= kdv * x;
      end_part[ni][j] += kdv * x;
    }
  });
  const int lane = int(threadIdx.x) & 31;
#pragma unroll
  for (int ni = 0; ni < ChunkAcc::NI; ++ni)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x = end_part[ni][h];  // sum over the warp's rows (lanes with the same lane % 4)
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane < 4) atomicAdd(blk.end() + ChunkAcc::n0() + 8 * ni + sm80::FragAcc::n(lane, h), x);
    }
}

// T = L diag(β): dβ_j += Σ_i dT_ij L_ij (shared-memory atomics over the warps).
template <class Blk>
__device__ __forceinline__ void add_dbeta_of_T(const Blk& blk, const SquareAcc& dT, const SquareTile& Lt) {
  float col_part[SquareAcc::NI][2] = {};
  SquareAcc::for_each([&](int mi, int ni, int e, int i, int j) { col_part[ni][e & 1] += dT.c[mi][ni][e] * Lt.get(i, j); });
  const int lane = int(threadIdx.x) & 31;
#pragma unroll
  for (int ni = 0; ni < SquareAcc::NI; ++ni)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x = col_part[ni][h];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane < 4) atomicAdd(blk.dbeta() + SquareAcc::n0() + 8 * ni + sm80::FragAcc::n(lane, h), x);
    }
}

// G = −strict_tril(Gd) in place, the gradient of diag(β) A: dβ_i += Σ_j G_ij A_ij, A(mi, ni, e, i, j)
// giving A's element (shared-memory atomics over the warps).
template <class Blk, class AOf>
__device__ __forceinline__ void mask_and_add_dbeta_of_A(const Blk& blk, SquareAcc& Gd, AOf&& A_of) {
  float row_part[SquareAcc::MI][2] = {};
  SquareAcc::for_each([&](int mi, int ni, int e, int i, int j) {
    if (j >= i) Gd.c[mi][ni][e] = 0.f;
    if (j < i) row_part[mi][e >> 1] += Gd.c[mi][ni][e] * A_of(mi, ni, e, i, j);
  });
  const int lane = int(threadIdx.x) & 31;
#pragma unroll
  for (int mi = 0; mi < SquareAcc::MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x = row_part[mi][h];  // sum over the lanes of one row (lane / 4 fixed)
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      if ((lane & 3) == 0) atomicAdd(blk.dbeta() + SquareAcc::m0() + 16 * mi + sm80::FragAcc::m(lane, 2 * h), x);
    }
}

// γ − h of token t, channels c, c + 1 (Blk::pivot_log2); zeros for a scalar decay (no pivots).
template <class Blk>
__device__ __forceinline__ float2 pivot_log2(const Blk& blk, int t, int c) {
  if constexpr (Blk::kScalar) return make_float2(0.f, 0.f);
  else return blk.pivot_log2(t, c);
}

// The Gram matrices' gradients: M (x = q̂, y = k̂, dM) and A (x = y = k̂, dZA), each side apart:
// the x-side's dx = e^{γ−h} acc, the y-side's dy = e^{h−γ} acc. The decay's share x dx − y dy
// is taken as X acc − Y acc with the bf16 operands X = x e^{γ−h}, Y = y e^{h−γ} of the products
// themselves: each pair (i, j) then adds and takes off the same product, so the pairs cancel in
// dg's suffix sums as in exact arithmetic (with x dx, the two roundings of a pair differ, and
// the residues of all pairs summed into dg: measured 2.2x FLA's dg error, 8x its ddt_bias).
template <class Blk>
__device__ __forceinline__ void add_gram_grads(const Blk& blk, ChunkAcc& dq, ChunkAcc& dk, ChunkAcc& dG,
                                               const SquareTile& dM, const SquareTile& dZA, const ChunkTile& Xq,
                                               const ChunkTile& Xk, const ChunkTile& Yk) {
  {  // x-sides: dq from M, dk from A (one pivot factor e^{γ−h} per element for both)
    float xM[1][ChunkAcc::NI][4] = {}, xA[1][ChunkAcc::NI][4] = {};
    gram_grad<true>(blk, xM, dM, Xq, Yk);
    gram_grad<true>(blk, xA, dZA, Xk, Yk);
    ChunkAcc::for_each_pair([&](int, int ni, int h, int t, int c) {
      const float2 pl = pivot_log2(blk, t, c), xq = Xq.get2(t, c), xk = Xk.get2(t, c);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int e = 2 * h + j;
        const float up = Blk::kScalar ? 1.f : __expf(j ? pl.y : pl.x);
        dq.c[0][ni][e] += xM[0][ni][e] * up;
        dk.c[0][ni][e] += xA[0][ni][e] * up;
        dG.c[0][ni][e] += (j ? xq.y : xq.x) * xM[0][ni][e] + (j ? xk.y : xk.x) * xA[0][ni][e];
      }
    });
  }
  {  // the y-sides of M and A, both of k̂, summed before their factor e^{h−γ}
    float y[1][ChunkAcc::NI][4] = {};
    gram_grad<false>(blk, y, dM, Xq, Yk);
    gram_grad<false>(blk, y, dZA, Xk, Yk);
    ChunkAcc::for_each_pair([&](int, int ni, int h, int t, int c) {
      const float2 pl = pivot_log2(blk, t, c), yk = Yk.get2(t, c);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int e = 2 * h + j;
        dk.c[0][ni][e] += Blk::kScalar ? y[0][ni][e] : y[0][ni][e] * __expf(-(j ? pl.y : pl.x));
        dG.c[0][ni][e] -= (j ? yk.y : yk.x) * y[0][ni][e];
      }
    });
  }
}

// Writes dg's value v at x, or with kAdd adds it (dg zero-filled, shares of several blocks).
template <bool kAdd>
__device__ __forceinline__ void put_dg(float* x, float v) {
  if constexpr (kAdd)
    atomicAdd(x, v);
  else
    *x = v;
}

// dg of a per-channel gate: the suffix sums of dΓ (`dgamma`, fp32 [kChunk][kHeadDim], written by
// the caller before a barrier) over the chunk, the chunk-end terms at its last token; one thread per
// (sub-chunk, channel), as Γ, the sub-chunk's total to the earlier ones through `total`
// ([kSubChunks][kHeadDim]). Also dβ.
template <bool kAdd, class Blk>
__device__ __forceinline__ void write_dg(const Blk& blk, const float* dgamma, float* total) {
  const int tid = threadIdx.x, own_c = tid % kHeadDim, own_a = tid / kHeadDim, t0 = own_a * kSubChunk;
  float run[kSubChunk], sum = 0.f;
#pragma unroll
  for (int t = kSubChunk - 1; t >= 0; --t) run[t] = sum += dgamma[(t0 + t) * kHeadDim + own_c];
  total[own_a * kHeadDim + own_c] = sum;
  __syncthreads();
  float after = blk.end()[own_c];
#pragma unroll
  for (int a = 1; a < kSubChunks; ++a)
    if (a > own_a) after += total[a * kHeadDim + own_c];
#pragma unroll
  for (int t = 0; t < kSubChunk; ++t)
    if (t0 + t < blk.len) put_dg<kAdd>(blk.p.dg + blk.at(t0 + t, own_c), after + run[t]);
  if (tid < kChunk && tid < blk.len) put_dg<kAdd>(blk.p.dbeta + blk.head_at(tid), blk.dbeta()[tid]);
}

// dg of a scalar gate (one log decay per token and head), from the block's dΓ accumulators:
// dg_t = Σ_c (e_c + Σ_{s≥t} dΓ_sc), e the chunk-end terms, summed over the key channels first (a
// thread's pairs of each of its two rows, the row's four lanes by shuffles, the four column warps
// through `part`, fp32 [kChunk][kColWarps], 16-byte aligned, free), then over the chunk's tokens by
// warp 0 (two tokens a lane, the suffix sums by shuffles). Also dβ.
template <bool kAdd, class Blk>
__device__ __forceinline__ void write_dg_scalar(const Blk& blk, const ChunkAcc& dG, float* part) {
  static_assert(kChunk == 2 * 32 && kHeadDim == 4 * 32 && kColWarps == 4,
                "warp 0: two tokens and four chunk-end terms a lane, a token's four column-warp sums in 16 bytes");
  const int tid = threadIdx.x, lane = tid & 31, col_warp = (tid >> 5) / kRowWarps;
  float row[2] = {};  // rows lane / 4 and lane / 4 + 8 of the warp's sixteen
  ChunkAcc::for_each_pair([&](int mi, int ni, int h, int, int) { row[h] += dG.c[mi][ni][2 * h] + dG.c[mi][ni][2 * h + 1]; });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float x = row[h];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    if ((lane & 3) == 0) part[(ChunkAcc::m0() + sm80::FragAcc::m(lane, 2 * h)) * kColWarps + col_warp] = x;
  }
  __syncthreads();
  if (tid < 32) {
    const float4 a = reinterpret_cast<const float4*>(part)[2 * lane], b = reinterpret_cast<const float4*>(part)[2 * lane + 1];
    const float* e = blk.end();
    const float first = (a.x + a.y) + (a.z + a.w), second = (b.x + b.y) + (b.z + b.w);
    float end = (e[lane] + e[lane + 32]) + (e[lane + 64] + e[lane + 96]), suffix = first + second;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) end += __shfl_xor_sync(0xffffffffu, end, o);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {  // suffix: the sums of lanes lane .. 31
      const float y = __shfl_down_sync(0xffffffffu, suffix, o);
      if (lane + o < 32) suffix += y;
    }
    float after = __shfl_down_sync(0xffffffffu, suffix, 1);  // lanes lane + 1 .. 31
    if (lane == 31) after = 0.f;
    const float dg1 = second + after, dg0 = first + dg1;  // tokens 2 lane + 1, 2 lane
    if (2 * lane < blk.len) put_dg<kAdd>(blk.p.dg + blk.head_at(2 * lane), end + dg0);
    if (2 * lane + 1 < blk.len) put_dg<kAdd>(blk.p.dg + blk.head_at(2 * lane + 1), end + dg1);
  }
  if (tid < kChunk && tid < blk.len) put_dg<kAdd>(blk.p.dbeta + blk.head_at(tid), blk.dbeta()[tid]);
}

// dq and dk of the raw q and k (ChunkBwdParams::dq_raw) from the block's gradients dq̂, dk̂ of q̂ =
// scale · y_q, k̂ = y_k (y the l2-normalised rows, r their 1 / norms): dx = r (dy − y (y · dy)) with
// dy = scale · dq̂ for q (y · dy = q̂ · dq̂), dk̂ for k; without the l2 norm dx = dy. x_of(i, t, c):
// channels c, c + 1 of token t's q̂ (i = 0) or k̂ (i = 1) in fp32 (zeros past the chunk's end);
// rnorm_of(i, t): that row's 1 / norm (t < blk.len, with the l2 norm). `dots` ([2][kChunk][kColWarps]
// fp32 scratch) takes each column warp's share of the row sums. 16-bit dq and dk go through the
// staging tiles `out` (Blk::stage2, free once every thread is past this function's first barrier),
// which are read after its last. Ends with a barrier (dots and what x_of reads free again) and the
// stores from `out`.
template <class Blk, class XOf, class RnormOf>
__device__ __forceinline__ void write_raw_qk_grads(const Blk& blk, const ChunkAcc& dq, const ChunkAcc& dk, XOf&& x_of,
                                                   RnormOf&& rnorm_of, float* dots, const ChunkTile (&out)[2]) {
  const ChunkBwdParams& p = blk.p;
  const int lane = threadIdx.x & 31, col_warp = (threadIdx.x >> 5) / kRowWarps;
  static_assert(ChunkAcc::MI == 1, "a thread's rows: lane / 4 and lane / 4 + 8 of its warp's sixteen");
  const auto row_of = [&](int h) { return ChunkAcc::m0() + sm80::FragAcc::m(lane, 2 * h); };
  // The 1 / norms of the thread's two rows, read first (loads in flight during the row sums).
  float r[2][2];  // [q, k][row lane / 4, lane / 4 + 8]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 2; ++i) r[i][h] = p.l2norm && row_of(h) < blk.len ? rnorm_of(i, row_of(h)) : 1.f;
  if (p.l2norm) {
    float part[2][2] = {};  // [q, k][row lane / 4, lane / 4 + 8]
    ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
      const float2 xq = x_of(0, t, c), xk = x_of(1, t, c);
      part[0][h] += dq.c[mi][ni][2 * h] * xq.x + dq.c[mi][ni][2 * h + 1] * xq.y;
      part[1][h] += dk.c[mi][ni][2 * h] * xk.x + dk.c[mi][ni][2 * h + 1] * xk.y;
    });
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x = part[i][h];  // the row's four lanes
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        if ((lane & 3) == 0) dots[(i * kChunk + row_of(h)) * kColWarps + col_warp] = x;
      }
  }
  __syncthreads();  // dots written; `out` free
  // Per row: the dot of y and dy as the multiple of x = f · y that dx takes off (dot / f).
  const float s = p.scale;
  float take[2][2] = {};
  if (p.l2norm) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int w = 0; w < kColWarps; ++w) dot += dots[(i * kChunk + row_of(h)) * kColWarps + w];
        take[i][h] = i ? dot : dot / s;
      }
  }
  const bool staged = p.qk_dtype != DType::kFloat32;
  ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
    float dx[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // q, k
      const ChunkAcc& d = i ? dk : dq;
      const float f = i ? 1.f : s;
      dx[i][0] = f * d.c[mi][ni][2 * h];
      dx[i][1] = f * d.c[mi][ni][2 * h + 1];
      if (p.l2norm) {
        const float2 x = x_of(i, t, c);  // f · y (zero past the chunk's end)
        dx[i][0] = r[i][h] * (dx[i][0] - x.x * take[i][h]);
        dx[i][1] = r[i][h] * (dx[i][1] - x.y * take[i][h]);
      }
    }
    if (staged) {
      Blk::stage2(out[0], p.qk_dtype, t, c, dx[0][0], dx[0][1]);
      Blk::stage2(out[1], p.qk_dtype, t, c, dx[1][0], dx[1][1]);
    } else {
      blk.store2(p.dq_raw, p.qk_dtype, t, c, dx[0][0], dx[0][1]);
      blk.store2(p.dk_raw, p.qk_dtype, t, c, dx[1][0], dx[1][1]);
    }
  });
  __syncthreads();
  if (staged) {
    blk.write_rows(p.dq_raw, out[0]);
    blk.write_rows(p.dk_raw, out[1]);
  }
}

// kScalarGate: g and dg hold one log decay per (token, head) for every key channel (GDN). The
// gradients pass then keeps Γ per token (BlockT's kScalarDecay): the Gram operands undecayed, and
// e^{Γi−Γj} on each element of M, A and their gradients instead of pivots and factors per channel.
template <Pass kPass, bool kScalarGate>
__global__ void __launch_bounds__(kThreads, 1) chunk_local_grad_kernel(const ChunkBwdParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr bool kScalar = kScalarGate && kPass == Pass::kGradients;
  // S and dS' of the gradients pass: on sm_90a in the panels its warpgroup MMAs read in place.
#ifdef FLASHKDA_WGMMA
  using PassStateTile = std::conditional_t<kPass == Pass::kGradients, PanelStateTile, StateTile>;
#else
  using PassStateTile = StateTile;
#endif
  const int tid = threadIdx.x;
  BlockT<SmemLayout, kScalar> blk{p, smem, int64_t(blockIdx.x), 0, 0, int(blockIdx.y), 0, p.HV * kHeadDim};
  blk.bos = p.chunk_bos[blk.chunk];
  blk.len = p.chunk_len[blk.chunk];
  blk.head0 = (blk.bos * p.HV + blk.hv) * kHeadDim;
  if (kPass == Pass::kGradients && blk.len <= 0) return;  // an empty chunk has no gradients
  float* A = blk.A();
  const SquareTile Mt = blk.template tile<SquareTile>(SmemLayout::kM);
  const SquareTile Tt = blk.template tile<SquareTile>(SmemLayout::kT);
  const SquareTile Lt = blk.template tile<SquareTile>(SmemLayout::kL);
  // q̂ and k̂, fp32, into the free slots 3-6, in flight while Γ is summed; or a scalar decay's raw q
  // and k (ChunkBwdParams::raw_q, 16-bit) into slots 3 and 5.
  const bool raw_in = kScalar && p.raw_q != nullptr;
  const ChunkTile raw_q = blk.slot(3), raw_k = blk.slot(5);
  auto stage_qk = [&] {
    if (raw_in) {
      blk.copy_rows_async(raw_q, static_cast<const Bf16*>(p.raw_q));  // 16-bit rows: the bytes as they are
      blk.copy_rows_async(raw_k, static_cast<const Bf16*>(p.raw_k));
      return;
    }
    blk.copy_rows_async(smem + SmemLayout::slot(3), kHeadDim * 4, p.q);
    blk.copy_rows_async(smem + SmemLayout::slot(5), kHeadDim * 4, p.k);
  };
  static_assert(kChunk * kHeadDim * 4 <= 2 * ChunkTile::kBytes, "a staged fp32 chunk takes two slots");

  // Γ, the pivots and the factors (the sub-chunk totals over A, until the M / A products), with q̂
  // and k̂ staged meanwhile; zeros for M (its blocks above the diagonal are read).
  const auto zero_M = [&] {
    for (int i = tid; i < SquareTile::kBytes / 16; i += kThreads) reinterpret_cast<uint4*>(Mt.p)[i] = make_uint4(0, 0, 0, 0);
  };
  if constexpr (kScalar)
    gamma_phase_scalar(blk, A, stage_qk, zero_M);
  else
    gamma_phase<kScalarGate>(blk, A, stage_qk, zero_M);
  cute::cp_async_wait<0>();  // stage_qk: this barrier completes it too
  __syncthreads();

  // Gram operands: q̂ e^{γ−h}, k̂ e^{γ−h} (rows), k̂ e^{h−γ} (columns), from q̂ and k̂ staged in
  // shared memory (fp32, dense rows: stage_qk); a scalar decay's are q̂ and k̂ (Yk is Xk), in tiles
  // of their own that the pass keeps (SmemLayout::kScalarQ): its later uses of q̂ and k̂ read them
  // there, with no second staging.
  const ChunkTile Xq = kScalar ? blk.tile(SmemLayout::kScalarQ) : blk.slot(0);
  const ChunkTile Xk = kScalar ? blk.tile(SmemLayout::kScalarK) : blk.slot(1);
  const ChunkTile Yk = kScalar ? Xk : blk.slot(2);
  // Channels c, c + 1 of token t's q̂ and k̂ for the gradients' decay terms: the kept tiles, or
  // fp32 from global memory.
  const auto q_of = [&](int t, int c) { return kScalar ? Xq.get2(t, c) : blk.load2(p.q, t, c); };
  const auto k_of = [&](int t, int c) { return kScalar ? Xk.get2(t, c) : blk.load2(p.k, t, c); };
  const float* q_staged = reinterpret_cast<const float*>(smem + SmemLayout::slot(3));  // slots 3-4
  const float* k_staged = reinterpret_cast<const float*>(smem + SmemLayout::slot(5));  // slots 5-6
  float* raw_factor = reinterpret_cast<float*>(smem + SmemLayout::kScalarFactor);  // raw_in only
  float* raw_rnorm = reinterpret_cast<float*>(smem + SmemLayout::kScalarRnorm);
  // fp32 q̂ (i = 0) or k̂ (i = 1), channels c, c + 1 of token t, from what stage_qk staged.
  const auto staged_pair = [&](int i, int t, int c) {
    if (raw_in) return raw_pair(i ? raw_k : raw_q, p.qk_dtype, t, c, raw_factor[i * kChunk + t]);
    return *reinterpret_cast<const float2*>((i ? k_staged : q_staged) + t * kHeadDim + c);
  };
  auto build_gram_operands = [&] {
    if (raw_in) {
      normalise_raw_qk(blk, raw_q, raw_k, Xq, Xk, raw_factor, raw_rnorm);
      return;
    }
    constexpr int kPerRow = kHeadDim / 4;
#pragma unroll 2
    for (int i = tid; i < kChunk * kPerRow; i += kThreads) {
      const int t = i / kPerRow, c = (i % kPerRow) * 4;
      const float4 q4 = *reinterpret_cast<const float4*>(q_staged + t * kHeadDim + c);
      const float4 k4 = *reinterpret_cast<const float4*>(k_staged + t * kHeadDim + c);
      if constexpr (kScalar) {
        Xq.store2(t, c, q4.x, q4.y);
        Xq.store2(t, c + 2, q4.z, q4.w);
        Xk.store2(t, c, k4.x, k4.y);
        Xk.store2(t, c + 2, k4.z, k4.w);
        continue;
      }
      const float2 pl01 = pivot_log2(blk, t, c), pl23 = pivot_log2(blk, t, c + 2);
      const float pl[4] = {pl01.x, pl01.y, pl23.x, pl23.y};
      const float qx[4] = {q4.x, q4.y, q4.z, q4.w}, kx[4] = {k4.x, k4.y, k4.z, k4.w};
      float up[4], down[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) up[j] = __expf(pl[j]), down[j] = __expf(-pl[j]);
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        Xq.store2(t, c + j, qx[j] * up[j], qx[j + 1] * up[j + 1]);
        Xk.store2(t, c + j, kx[j] * up[j], kx[j + 1] * up[j + 1]);
        Yk.store2(t, c + j, kx[j] * down[j], kx[j + 1] * down[j + 1]);
      }
    }
  };
  build_gram_operands();
  __syncthreads();
  gram_products(blk, Mt, Xq, Xk, Yk);
  __syncthreads();
  // L and T (the solve: fp32 L over slot 3, the scratch in slot 4), v in flight over Xk. A scalar
  // decay's pass, whose Gram operands left slots 0-2 free, also brings dS' (the gradient of the
  // state after the chunk) into slots 0-1 now and keeps S from its arrival to its last use, so
  // neither is read by registers or read twice; its later phases form kd and k̂ e^Γ products from
  // the kept k̂ tile with the decays applied to the accumulators (no tiles for them). Slots, in
  // order of use (X1 and Y1 over slots 4 and 5 in both):
  //   KDA     0 kg | 1 v | 2 w, kd | 3 U, dw | 4-5 S, dS', S | 6 dO | 7 dU, dZA
  //   scalar  0-1 dS', then 0 dw | 2 v | 3 w, dU | 4-5 S | 6 dO | 7 kg, U, dZA
  const ChunkTile kg = blk.slot(kScalar ? 7 : 0), vt = blk.slot(kScalar ? 2 : 1), wt = blk.slot(kScalar ? 3 : 2);
  const PassStateTile dSt = blk.template tile<PassStateTile>(SmemLayout::slot(0));  // scalar decay only
  blk.copy_rows_async(vt, p.v);
  if constexpr (kScalar && kPass == Pass::kGradients) blk.copy_state_async(dSt, p.dstates);
  solve(blk, reinterpret_cast<float*>(smem + SmemLayout::slot(3)), reinterpret_cast<float*>(smem + SmemLayout::slot(4)),
        Lt, Tt);
  // k̂ e^Γ from the k̂ still staged (over Xq: the solve above ended with a barrier), and v.
  for (int i = tid; i < kChunk * kHeadDim / 2; i += kThreads) {
    const int t = i / (kHeadDim / 2), c = (i % (kHeadDim / 2)) * 2;
    const float2 k2 = staged_pair(1, t, c), g2 = blk.G2(t, c);
    kg.store2(t, c, k2.x * __expf(g2.x), k2.y * __expf(g2.y));
  }
  cute::cp_async_wait<0>();
  __syncthreads();
  if constexpr (kPass == Pass::kGradients) {  // S and dO (over the staged k̂), in flight during T v and T kg
    blk.copy_state_async(blk.template tile<PassStateTile>(SmemLayout::slot(4)), p.states);
    blk.copy_rows_async(blk.slot(6), p.dO);
  }
  ChunkAcc u;  // T v, then U = T v − w S
  u.zero();
  u.mma<false, true>(Tt, vt, 0, kChunk);
  {
    ChunkAcc w;
    w.zero();
    w.mma<false, true>(Tt, kg, 0, kChunk);
    w.store(wt, [](int, int, float x) { return x; });
  }

  if constexpr (kPass == Pass::kTransitions) {
    const ChunkTile ut = blk.slot(3), Pt = blk.slot(4), dOt = blk.slot(5), kd = blk.slot(6);
    u.store(ut, [](int, int, float x) { return x; });
    blk.fill(kd, p.k, [&](int t, int c, float x) { return x * __expf(blk.G_end(c) - blk.G(t, c)); });
    blk.fill(dOt, p.dO, [](int, int, float x) { return x; });
    __syncthreads();
    {
      ChunkAcc P;  // q̂ e^Γ − M w
      P.zero();
      P.mma<false, true>(Mt, wt, 0, kChunk, true);
      P.store(Pt, [&](int t, int c, float x) { return x + blk.load(p.q, t, c) * __expf(blk.G(t, c)); });
    }
    const int64_t base = blk.state_at();
    auto write = [&](float* out, StateAcc& acc, bool diagonal_decay) {
      StateAcc::for_each([&](int mi, int ni, int e, int r, int c) {
        float x = acc.c[mi][ni][e];
        if (diagonal_decay && r == c) x += __expf(blk.G_end(c));
        out[base + r * kHeadDim + c] = x;
      });
    };
    {
      StateAcc D;  // diag(e^{Γ_C}) − kdᵀ w
      D.zero();
      D.mma<true, true>(kd, wt, 0, kChunk, true);
      write(p.trans_D, D, true);
    }
    {
      StateAcc B;  // kdᵀ u
      B.zero();
      B.mma<true, true>(kd, ut, 0, kChunk);
      write(p.trans_B, B, false);
    }
    __syncthreads();
    {
      StateAcc Y;  // Pᵀ dO
      Y.zero();
      Y.mma<true, true>(Pt, dOt, 0, kChunk);
      write(p.trans_Y, Y, false);
    }
    return;
  } else {
    const PassStateTile St = blk.template tile<PassStateTile>(SmemLayout::slot(4));
    const ChunkTile Ut = blk.slot(kScalar ? 7 : 3), dOt = blk.slot(6), dUt = blk.slot(kScalar ? 3 : 7);
    const ChunkTile kd = blk.slot(2);  // KDA's only
    ChunkAcc dq, dk, dG;  // gradients of q̂, k̂ and Γ, accumulated in this layout
    dq.zero();
    dk.zero();
    dG.zero();
    cute::cp_async_wait<0>();  // S and dO (and a scalar decay's dS')
    publish_tiles();
    __syncthreads();
    u.state_mma<true>(wt, St, true);  // U = T v − w S
    u.store(Ut, [](int, int, float x) { return x; });
    {
      ChunkAcc dqg;  // of q̂ e^Γ: dO Sᵀ
      dqg.zero();
      dqg.state_mma<false>(dOt, St);
      add_through_decay(blk, dqg, dq, dG, q_of);
    }
    // e^{Γ_C} Σ_v S dS' to the chunk's end (per key row r, the warp's lanes over its values): a
    // scalar decay's pass from the tiles it keeps; else dS' comes over S, kd over w.
    const auto add_end_term = [&](int r, const float4& s, const float4& d) {
      float x = s.x * d.x + s.y * d.y + s.z * d.z + s.w * d.w;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);  // the warp's row
      if ((threadIdx.x & 31) == 0) blk.end()[r] += x * __expf(blk.G_end(r));
    };
    if constexpr (kScalar) {
      const int c = (tid & 31) * 4;
      for (int r = tid >> 5; r < kHeadDim; r += kWarps) {
        const auto at = [&](const PassStateTile& x) { return Block::unpack4(*reinterpret_cast<const uint2*>(x.at(r, c))); };
        add_end_term(r, at(St), at(dSt));
      }
    } else {
      __syncthreads();
      blk.fill_state(St, p.dstates, p.states, [&](int r, int, const float4& d, const float4& s) { add_end_term(r, s, d); });
      blk.fill(kd, p.k, [&](int t, int c, float x) { return x * __expf(blk.G_end(c) - blk.G(t, c)); });
      publish_tiles();  // dS' over S
    }
    __syncthreads();
    SquareAcc dM;  // dO Uᵀ, masked when stored
    {
      ChunkAcc dU;  // Mᵀ dO + kd dS'
      dU.zero();
      if constexpr (kScalar) {  // kd dS' = diag(e^{Γ_C−Γ}) (k̂ dS'), then Mᵀ dO
        dU.state_mma<true>(Xk, dSt);
        ChunkAcc::for_each([&](int mi, int ni, int e, int t, int) { dU.c[mi][ni][e] *= __expf(blk.G_end(0) - blk.G(t, 0)); });
        dU.mma<true, true>(Mt, dOt, 0, kChunk);
      } else {
        dU.mma<true, true>(Mt, dOt, 0, kChunk);
        dU.state_mma<true>(kd, St);
      }
      dU.store(dUt, [](int, int, float x) { return x; });
      ChunkAcc dkd;  // of kd: U dS'ᵀ
      dkd.zero();
      dkd.state_mma<false>(Ut, kScalar ? dSt : St);
      add_kd_grad(blk, dkd, dk, dG, k_of);
      dM.zero();
      dM.mma<false, false>(dOt, Ut, 0, kHeadDim);
    }
    __syncthreads();
    if constexpr (!kScalar) blk.copy_state_async(St, p.states);  // S again (a scalar decay's pass kept it)
    // dM over M (a scalar decay: dM ⊙ e^{Γi−Γj}, what the Gram gradients read)
    if constexpr (kScalar)
      dM.store(Mt, [&](int i, int j, float x) { return j <= i ? x * blk.scalar_decay(i, j) : 0.f; });
    else
      dM.store(Mt, [](int i, int j, float x) { return j <= i ? x : 0.f; });
    if constexpr (!kScalar) {
      cute::cp_async_wait<0>();
      publish_tiles();  // S again
      __syncthreads();
    }
    const ChunkTile dwt = blk.slot(kScalar ? 0 : 3);  // over dS' or U
    {
      ChunkAcc dw;  // −dU Sᵀ
      dw.zero();
      dw.state_mma<false>(dUt, St, true);
      dw.store(dwt, [](int, int, float x) { return x; });
      ChunkAcc dv;  // Tᵀ dU
      dv.zero();
      dv.mma<true, true>(Tt, dUt, 0, kChunk);
      // dv as pairs: staged and stored as whole rows as dq and dk are, it took the per-channel gate's
      // raw-q/k pass from 1.42 to 1.61 ms (T = 8192, HV = 32, H100) and left GDN's at 1.06.
      ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
        blk.store2(p.dv, p.dv_dtype, t, c, dv.c[mi][ni][2 * h], dv.c[mi][ni][2 * h + 1]);
      });
    }
    __syncthreads();
    const SquareTile X1 = blk.template tile<SquareTile>(SmemLayout::slot(4));  // over S
    const SquareTile Y1 = blk.template tile<SquareTile>(SmemLayout::slot(5));
    const SquareTile dZA = blk.template tile<SquareTile>(SmemLayout::slot(7));  // over dU or U
    {
      SquareAcc dT;  // dU vᵀ + dw kgᵀ; T = L diag(β): dβ_j += Σ_i dT_ij L_ij, and dL = dT diag(β)
      dT.zero();
      if constexpr (kScalar) {  // dw kgᵀ = (dw k̂ᵀ) diag(e^Γ), then dU vᵀ
        dT.mma<false, false>(dwt, Xk, 0, kHeadDim);
        SquareAcc::for_each([&](int mi, int ni, int e, int, int j) { dT.c[mi][ni][e] *= __expf(blk.G(j, 0)); });
        dT.mma<false, false>(dUt, vt, 0, kHeadDim);
      } else {
        dT.mma<false, false>(dUt, vt, 0, kHeadDim);
        dT.mma<false, false>(dwt, kg, 0, kHeadDim);
      }
      add_dbeta_of_T(blk, dT, Lt);
      dT.store(X1, [&](int, int j, float x) { return x * blk.beta()[j]; });
      ChunkAcc dkg;  // Tᵀ dw
      dkg.zero();
      dkg.mma<true, true>(Tt, dwt, 0, kChunk);
      add_through_decay(blk, dkg, dk, dG, k_of);
    }
    __syncthreads();
    {
      SquareAcc y;  // Lᵀ X1
      y.zero();
      y.mma<true, true>(Lt, X1, 0, kChunk);
      y.store(Y1, [](int, int, float x) { return x; });
    }
    __syncthreads();
    {
      // G = −strict_tril(Y1 Lᵀ), the gradient of diag(β) A: dβ_i += Σ_j G_ij A_ij, dA = diag(β) G.
      SquareAcc Gd;
      Gd.zero();
      Gd.mma<false, false>(Y1, Lt, 0, kChunk, true);
      mask_and_add_dbeta_of_A(blk, Gd, [&](int, int, int, int i, int j) { return blk.A(i, j); });  // A: j < i
      if constexpr (kScalar)  // Gd is zero for j >= i, where e^{Γi−Γj} may overflow
        Gd.store(dZA, [&](int i, int j, float x) { return j < i ? x * blk.beta()[i] * blk.scalar_decay(i, j) : 0.f; });
      else
        Gd.store(dZA, [&](int i, int, float x) { return x * blk.beta()[i]; });
    }
    __syncthreads();
    const bool raw_grads = p.dq_raw != nullptr;
    if constexpr (!kScalar) {  // the operands again (a scalar decay's are kept)
      stage_qk();  // over dw, X1, Y1 and dO
      cute::cp_async_wait<0>();
      __syncthreads();
      build_gram_operands();  // over k̂ e^Γ, v and kd
      __syncthreads();
    } else if (raw_grads) {
      stage_qk();  // q̂ and k̂ (or the raw rows) for the l2 norm's gradient, in flight during the Gram gradients
    }
    add_gram_grads(blk, dq, dk, dG, Mt, dZA, Xq, Xk, Yk);  // dM over M
    if (raw_grads) {  // through the scale and the l2 norm, from the staged q̂ and k̂ (slots 3-6)
      if constexpr (kScalar) {
        cute::cp_async_wait<0>();
        __syncthreads();
      }
      const auto rnorm_of = [&](int i, int t) {
        return raw_in ? raw_rnorm[i * kChunk + t] : __ldg(p.qk_rnorm + blk.head_at(t) * 2 + i);
      };
      // the row sums over A, 16-bit dq and dk staged in slots 0-1 (KDA's Xq and Xk, a scalar decay's
      // dw and dS': read no more)
      write_raw_qk_grads(blk, dq, dk, staged_pair, rnorm_of, A, {blk.slot(0), blk.slot(1)});
    } else {
      ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
        blk.store2(p.dq, DType::kFloat32, t, c, dq.c[mi][ni][2 * h], dq.c[mi][ni][2 * h + 1]);
        blk.store2(p.dk, DType::kFloat32, t, c, dk.c[mi][ni][2 * h], dk.c[mi][ni][2 * h + 1]);
      });
    }
    // dg: suffix sums of dΓ over the chunk, the chunk-end terms (kd, e^{Γ_C}) at its last token.
    if constexpr (kScalarGate) {
      write_dg_scalar<false>(blk, dG, A);  // the sums over the column warps over A (read no more)
    } else {
      float* dgamma = reinterpret_cast<float*>(smem + SmemLayout::slot(3));  // over dw and X1
      ChunkAcc::for_each_pair([&](int mi, int ni, int h, int t, int c) {
        *reinterpret_cast<float2*>(dgamma + t * kHeadDim + c) = make_float2(dG.c[mi][ni][2 * h], dG.c[mi][ni][2 * h + 1]);
      });
      __syncthreads();
      write_dg<false>(blk, dgamma, A);  // totals over A (read no more)
    }
  }
}

}  // namespace chunk_bwd

template <chunk_bwd::Pass kPass, bool kScalarGate>
cudaError_t run_chunk_local_grad(const ChunkBwdParams& p, cudaStream_t stream) {
  using namespace chunk_bwd;
  if (p.chunks == 0 || p.HV == 0) return cudaSuccess;
  const auto kernel = chunk_local_grad_kernel<kPass, kScalarGate>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SmemLayout::kBytes);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(unsigned(p.chunks), unsigned(p.HV)), kThreads, SmemLayout::kBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashkda
