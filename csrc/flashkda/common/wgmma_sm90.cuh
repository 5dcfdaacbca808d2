// sm_90a warpgroup MMA (wgmma) for chunk_recurrence's state products: the A operand (the state or
// U, bf16 / fp16) from registers, B from shared memory through a matrix descriptor. A warpgroup is
// four consecutive warps; warp w of the group holds rows 16w..16w+15 of the 64-row A and of the
// accumulators, in the same per-thread layout as the m16n8 fragments of mma_sm80.cuh, so
// accumulators move between the two kinds of instruction without shuffles. Defined only when
// compiling for sm_90a (FLASHKDA_WGMMA).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>  // the N = 48 atoms

#include "flashkda/common/mma_sm80.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHKDA_WGMMA 1

namespace flashkda {
namespace sm90 {

// Four 8x8 b16 matrices from m16n8 fragments (one packed pair per register, matrix i in r[i]) to
// shared memory transposed: lanes 8 i .. 8 i + 7 give the row addresses of matrix i, and row j of
// the stored matrix i is column j of the fragment's (8 consecutive elements, 16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Shared-memory matrix descriptor. kSwizzle128B: a tile in 128-byte swizzled panels (sm80::PanelTile,
// 1024-byte aligned); lbo between 64-element panels along MN (MN-major B) or unused (K-major, 16);
// sbo between 8-row groups (1024 for 128-byte rows). kSwizzle32B: K-major rows of 32 bytes
// (chunk::TriTile, 256-byte aligned), sbo 256.
enum DescLayout : uint8_t {
  kSwizzle128B = uint8_t(cute::SM90::GMMA::LayoutType::B128),
  kSwizzle32B = uint8_t(cute::SM90::GMMA::LayoutType::B32)
};
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo,
                                              DescLayout layout = kSwizzle128B) {
  cute::GmmaDescriptor desc;  // CuTe's bit fields: addresses and offsets in 16-byte units
  desc.bitfield.start_address_ = uint16_t((smem_addr & 0x3FFFF) >> 4);
  desc.bitfield.leading_byte_offset_ = uint16_t(lbo >> 4);
  desc.bitfield.stride_byte_offset_ = uint16_t(sbo >> 4);
  desc.bitfield.layout_type_ = layout;
  return desc.desc_;
}

// Orders earlier register writes (accumulators, A fragments) before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { cute::warpgroup_arrive(); }
__device__ __forceinline__ void wgmma_commit() { cute::warpgroup_commit_batch(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  cute::warpgroup_wait<N>();
}

// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(d[i][e]);
}

namespace gmma = cute::SM90::GMMA;

// CuTe's warpgroup MMA atom with A (64 x 16, K-major) from registers and fp32 accumulators, for
// N = 16, 32, 48, 64 or 128 columns of B, B of major kMajorB, A scaled by kScaleA.
template <typename Elem, int N, gmma::Major kMajorB, gmma::ScaleIn kScaleA>
struct RsMma;
#define FLASHKDA_RS_MMA(N)                                                                    \
  template <gmma::Major kMajorB, gmma::ScaleIn kScaleA>                                       \
  struct RsMma<__nv_bfloat16, N, kMajorB, kScaleA> {                                          \
    using type = gmma::MMA_64x##N##x16_F32BF16BF16_RS<gmma::Major::K, kMajorB, kScaleA>;      \
  };                                                                                          \
  template <gmma::Major kMajorB, gmma::ScaleIn kScaleA>                                       \
  struct RsMma<__half, N, kMajorB, kScaleA> {                                                 \
    using type = gmma::MMA_64x##N##x16_F32F16F16_RS<gmma::Major::K, kMajorB, kScaleA>;        \
  };
FLASHKDA_RS_MMA(16)
FLASHKDA_RS_MMA(32)
FLASHKDA_RS_MMA(48)
FLASHKDA_RS_MMA(64)
FLASHKDA_RS_MMA(128)
#undef FLASHKDA_RS_MMA

// One atom on the accumulator tiles d[NT][4] (m16n8 layout: tile i holds columns 8 i .. 8 i + 7),
// which the atom takes as its 4 NT accumulator registers in order.
template <typename Mma, int NT, std::size_t... kI>
__device__ __forceinline__ void rs_fma(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc_b,
                                       gmma::ScaleOut scale_d, std::index_sequence<kI...>) {
  Mma::fma(a[0], a[1], a[2], a[3], desc_b, d[kI / 4][kI % 4]..., scale_d);
}

// d[NT][4] (64 x 8 NT fp32) = (scale_d ? d : 0) + kScaleA · A (64 x 16, registers) · B (16 x 8 NT,
// K-major, or MN-major with kMajorB), NT = 2, 4, 6 or 8 (N = 16 .. 64). A slice of a triangular B
// (chunk::TriTile) takes only the accumulators of its rows, the leading ones (leading_tiles).
template <typename Elem, int kScaleA, int NT, gmma::Major kMajorB = gmma::Major::K>
__device__ __forceinline__ void wgmma_m64nNk16_rs(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                  bool scale_d) {
  static_assert(kScaleA == 1 || kScaleA == -1, "A scale is +1 or -1");
  static_assert(NT == 2 || NT == 4 || NT == 6 || NT == 8, "N = 16, 32, 48 or 64");
  using Mma = typename RsMma<Elem, 8 * NT, kMajorB, kScaleA == 1 ? gmma::ScaleIn::One : gmma::ScaleIn::Neg>::type;
  rs_fma<Mma>(d, a, desc_b, scale_d ? gmma::ScaleOut::One : gmma::ScaleOut::Zero, std::make_index_sequence<4 * NT>{});
}

// The first kCount accumulator n-tiles of d, as an array of their own (for wgmma_m64nNk16_rs).
// Only leading tiles: with a block of tiles further in, ptxas serialized every wgmma of the kernel
// (C7511, "insufficient register resources for the wgmma pipeline").
template <int kCount, int NT>
__device__ __forceinline__ float (&leading_tiles(float (&d)[NT][4]))[kCount][4] {
  static_assert(kCount >= 1 && kCount <= NT, "tiles of d");
  return *reinterpret_cast<float(*)[kCount][4]>(&d[0]);
}

// d[16][4] (64 x 128 fp32) += A (64 x 16, registers) · B (16 x 128, MN-major: rows of B contiguous).
template <typename Elem>
__device__ __forceinline__ void wgmma_m64n128k16_rs_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  using Mma = typename RsMma<Elem, 128, gmma::Major::MN, gmma::ScaleIn::One>::type;
  rs_fma<Mma>(d, a, desc_b, gmma::ScaleOut::One, std::make_index_sequence<64>{});
}

}  // namespace sm90
}  // namespace flashkda
#endif
