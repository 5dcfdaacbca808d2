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

// Shared-memory matrix descriptor of a tile in 128-byte swizzled panels (sm80::PanelTile, 1024-byte
// aligned). Byte offsets: lbo between 64-element panels along MN (MN-major B) or unused (K-major,
// 16); sbo between 8-row groups (1024 for 128-byte rows).
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  constexpr uint64_t kSwizzle128B = 1;
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (kSwizzle128B << 62);
}

// Orders earlier register writes (accumulators, A fragments) before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// d[8][4] (64 x 64 fp32) = (scale_d ? d : 0) + kScaleA · A (64 x 16, registers) · B (16 x 64, K-major).
template <typename Elem, int kScaleA>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                   bool scale_d) {
  static_assert(kScaleA == 1 || kScaleA == -1, "A scale is +1 or -1");
#define FLASHKDA_WGMMA_N64(TYPE)                                                                                   \
  asm volatile(                                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                                               \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                             \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"    \
      "%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, %38, 1, 0;\n}\n"                                              \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),    \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),    \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),    \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),    \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])                                                  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(scale_d)), "n"(kScaleA))
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    FLASHKDA_WGMMA_N64("bf16");
  } else {
    FLASHKDA_WGMMA_N64("f16");
  }
#undef FLASHKDA_WGMMA_N64
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
