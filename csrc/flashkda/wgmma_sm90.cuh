// sm_90a warpgroup MMA (wgmma) for chunk_recurrence's state products: the A operand (the state or
// U, bf16 / fp16) from registers, B from shared memory through a matrix descriptor. A warpgroup is
// four consecutive warps; warp w of the group holds rows 16w..16w+15 of the 64-row A and of the
// accumulators, in the same per-thread layout as the m16n8 fragments of mma_sm80.cuh, so
// accumulators move between the two kinds of instruction without shuffles. Defined only when
// compiling for sm_90a (FLASHKDA_WGMMA).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "mma_sm80.cuh"

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

// d[NT][4] (64 x 8 NT fp32) = (scale_d ? d : 0) + kScaleA · A (64 x 16, registers) · B (16 x 8 NT,
// K-major), NT = 2, 4, 6 or 8 (N = 16 .. 64). A slice of a triangular B (chunk::TriTile) takes
// only the accumulators of its rows, the leading ones (leading_tiles).
#define FLASHKDA_ACC_TILE(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define FLASHKDA_ACC_TILES2 FLASHKDA_ACC_TILE(0), FLASHKDA_ACC_TILE(1)
#define FLASHKDA_ACC_TILES4 FLASHKDA_ACC_TILES2, FLASHKDA_ACC_TILE(2), FLASHKDA_ACC_TILE(3)
#define FLASHKDA_ACC_TILES6 FLASHKDA_ACC_TILES4, FLASHKDA_ACC_TILE(4), FLASHKDA_ACC_TILE(5)
#define FLASHKDA_ACC_TILES8 FLASHKDA_ACC_TILES6, FLASHKDA_ACC_TILE(6), FLASHKDA_ACC_TILE(7)
#define FLASHKDA_REGS8 "%0,%1,%2,%3,%4,%5,%6,%7"
#define FLASHKDA_REGS16 FLASHKDA_REGS8 ",%8,%9,%10,%11,%12,%13,%14,%15"
#define FLASHKDA_REGS24 FLASHKDA_REGS16 ",%16,%17,%18,%19,%20,%21,%22,%23"
#define FLASHKDA_REGS32 FLASHKDA_REGS24 ",%24,%25,%26,%27,%28,%29,%30,%31"
// Operands: the accumulators (4 NT), then A (4), the descriptor, scale_d and kScaleA.
#define FLASHKDA_WGMMA_RS(N, TYPE, ACC, DREGS, A0, A1, A2, A3, DESC, PRED, SCALE)                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " PRED ", 0;\n wgmma.mma_async.sync.aligned.m64n" #N \
               "k16.f32." TYPE "." TYPE " {" DREGS "}, {" A0 "," A1 "," A2 "," A3 "}, " DESC ", p, " SCALE   \
               ", 1, 0;\n}\n"                                                                            \
               : ACC                                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(scale_d)), "n"(kScaleA))
#define FLASHKDA_WGMMA_RS_TYPES                        \
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) { \
    FLASHKDA_WGMMA_RS_N("bf16");                       \
  } else {                                             \
    FLASHKDA_WGMMA_RS_N("f16");                        \
  }
template <typename Elem, int kScaleA, int NT>
__device__ __forceinline__ void wgmma_m64nNk16_rs(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                  bool scale_d) {
  static_assert(kScaleA == 1 || kScaleA == -1, "A scale is +1 or -1");
  static_assert(NT == 2 || NT == 4 || NT == 6 || NT == 8, "N = 16, 32, 48 or 64");
  if constexpr (NT == 2) {
#define FLASHKDA_WGMMA_RS_N(TYPE) \
  FLASHKDA_WGMMA_RS(16, TYPE, FLASHKDA_ACC_TILES2, FLASHKDA_REGS8, "%8", "%9", "%10", "%11", "%12", "%13", "%14")
    FLASHKDA_WGMMA_RS_TYPES
#undef FLASHKDA_WGMMA_RS_N
  } else if constexpr (NT == 4) {
#define FLASHKDA_WGMMA_RS_N(TYPE) \
  FLASHKDA_WGMMA_RS(32, TYPE, FLASHKDA_ACC_TILES4, FLASHKDA_REGS16, "%16", "%17", "%18", "%19", "%20", "%21", "%22")
    FLASHKDA_WGMMA_RS_TYPES
#undef FLASHKDA_WGMMA_RS_N
  } else if constexpr (NT == 6) {
#define FLASHKDA_WGMMA_RS_N(TYPE) \
  FLASHKDA_WGMMA_RS(48, TYPE, FLASHKDA_ACC_TILES6, FLASHKDA_REGS24, "%24", "%25", "%26", "%27", "%28", "%29", "%30")
    FLASHKDA_WGMMA_RS_TYPES
#undef FLASHKDA_WGMMA_RS_N
  } else {
#define FLASHKDA_WGMMA_RS_N(TYPE) \
  FLASHKDA_WGMMA_RS(64, TYPE, FLASHKDA_ACC_TILES8, FLASHKDA_REGS32, "%32", "%33", "%34", "%35", "%36", "%37", "%38")
    FLASHKDA_WGMMA_RS_TYPES
#undef FLASHKDA_WGMMA_RS_N
  }
}
#undef FLASHKDA_WGMMA_RS_TYPES
#undef FLASHKDA_WGMMA_RS
#undef FLASHKDA_REGS32
#undef FLASHKDA_REGS24
#undef FLASHKDA_REGS16
#undef FLASHKDA_REGS8
#undef FLASHKDA_ACC_TILES8
#undef FLASHKDA_ACC_TILES6
#undef FLASHKDA_ACC_TILES4
#undef FLASHKDA_ACC_TILES2
#undef FLASHKDA_ACC_TILE

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
#define FLASHKDA_WGMMA_N128(TYPE)                                                                                  \
  asm volatile(                                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                                               \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                                            \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"    \
      "%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,"   \
      "%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                        \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),    \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),    \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),    \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),    \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),    \
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),  \
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),             \
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),             \
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),             \
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                              \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    FLASHKDA_WGMMA_N128("bf16");
  } else {
    FLASHKDA_WGMMA_N128("f16");
  }
#undef FLASHKDA_WGMMA_N128
}

}  // namespace sm90
}  // namespace flashkda
#endif
