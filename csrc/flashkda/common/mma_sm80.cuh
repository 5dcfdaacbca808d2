// Warp-level tensor-core and copy primitives of sm_80 (mma.sync m16n8k16 and m16n8k8 tf32, ldmatrix,
// cp.async), which every later architecture also runs: CuTe's MMA and copy atoms, called with the
// fragments and shared-memory addresses the kernels compute. The fragment layouts the kernels index
// (Frag16816, Frag1688Tf32, FragAcc) are checked against the atoms' CuTe layouts at compile time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cute/layout.hpp>
#include <cute/swizzle.hpp>
#include <cute/swizzle_layout.hpp>

namespace flashkda {
namespace sm80 {

template <typename Elem>
struct Mma16816;  // CuTe's m16n8k16 atom for the operand type
template <>
struct Mma16816<__nv_bfloat16> {
  using Atom = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct Mma16816<__half> {
  using Atom = cute::SM80_16x8x16_F32F16F16F32_TN;
};

// d += A B on one m16n8 tile, in place (the atom's C and D are the same registers).
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Mma16816<Elem>::Atom::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2], d[3]);
}

// tf32 operands (fp32 bit patterns with 10 mantissa bits), fp32 accumulation.
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1],
                                            d[2], d[3]);
}

// Fragment layouts of the warp MMAs as the kernels index them (g = lane / 4, t = lane % 4, lane >= 0): the
// operand element that register r of a lane holds; 16-bit operands hold two, h = 0 in the low half.
// m16n8k16, A 16x16 (m, k): a0 (g, 2t + h), a1 (g + 8, 2t + h), a2 (g, 2t + 8 + h), a3 (g + 8, 2t + 8 + h);
//           B 16x8 (k, n):  b0 (2t + h, g), b1 (2t + 8 + h, g).
struct Frag16816 {
  __host__ __device__ static constexpr int a_m(int lane, int r) { return (lane >> 2) + 8 * (r & 1); }
  __host__ __device__ static constexpr int a_k(int lane, int r, int h) { return 2 * (lane & 3) + h + 8 * (r >> 1); }
  __host__ __device__ static constexpr int b_k(int lane, int r, int h) { return 2 * (lane & 3) + h + 8 * r; }
  __host__ __device__ static constexpr int b_n(int lane) { return lane >> 2; }
};
// m16n8k8 tf32, A 16x8 (m, k): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4);
//                B 8x8 (k, n):  b0 (t, g), b1 (t + 4, g).
struct Frag1688Tf32 {
  __host__ __device__ static constexpr int a_m(int lane, int r) { return (lane >> 2) + 8 * (r & 1); }
  __host__ __device__ static constexpr int a_k(int lane, int r) { return (lane & 3) + 4 * (r >> 1); }
  __host__ __device__ static constexpr int b_k(int lane, int r) { return (lane & 3) + 4 * r; }
  __host__ __device__ static constexpr int b_n(int lane) { return lane >> 2; }
};
// The fp32 m16n8 accumulator of both, C/D 16x8 (m, n): c0 c1 (g, 2t + i), c2 c3 (g + 8, 2t + i - 2).
struct FragAcc {
  __host__ __device__ static constexpr int m(int lane, int i) { return (lane >> 2) + 8 * (i >> 1); }
  __host__ __device__ static constexpr int n(int lane, int i) { return 2 * (lane & 3) + (i & 1); }
};

// CuTe's layouts map (lane, value) to the column-major index of the element in the atom's
// M x K (A), N x K (B) and M x N (C) tile; a 16-bit register holds values 2r and 2r + 1.
template <class Atom, class Frag, int kPerReg>
__host__ __device__ constexpr bool matches_mma_layouts() {
  using Traits = cute::MMA_Traits<Atom>;
  constexpr int M = cute::size<0>(typename Traits::Shape_MNK{}), N = cute::size<1>(typename Traits::Shape_MNK{});
  const auto A = typename Traits::ALayout{};
  const auto B = typename Traits::BLayout{};
  const auto C = typename Traits::CLayout{};
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < kPerReg; ++h) {
        int a_k = 0, b_k = 0;
        if constexpr (kPerReg == 2) {
          a_k = Frag::a_k(lane, r, h);
          b_k = r < 2 ? Frag::b_k(lane, r, h) : 0;
        } else {
          a_k = Frag::a_k(lane, r);
          b_k = r < 2 ? Frag::b_k(lane, r) : 0;
        }
        if (int(A(lane, kPerReg * r + h)) != Frag::a_m(lane, r) + M * a_k) return false;
        if (r < 2 && int(B(lane, kPerReg * r + h)) != Frag::b_n(lane) + N * b_k) return false;
      }
    for (int i = 0; i < 4; ++i)
      if (int(C(lane, i)) != FragAcc::m(lane, i) + M * FragAcc::n(lane, i)) return false;
  }
  return true;
}
static_assert(matches_mma_layouts<cute::SM80_16x8x16_F32BF16BF16F32_TN, Frag16816, 2>(), "m16n8k16 bf16");
static_assert(matches_mma_layouts<cute::SM80_16x8x16_F32F16F16F32_TN, Frag16816, 2>(), "m16n8k16 fp16");
static_assert(matches_mma_layouts<cute::SM80_16x8x8_F32TF32TF32F32_TN, Frag1688Tf32, 1>(), "m16n8k8 tf32");

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// x rounded to tf32 as cvt.rna does (to nearest, ties away from zero) for finite x, in one integer
// add: half of tf32's last place goes into the low 13 bits, which the tf32 MMAs ignore.
__device__ __forceinline__ uint32_t to_tf32_fast(float x) { return __float_as_uint(x) + 0x1000u; }

// x = hi + lo (to about 2^-22 relative) with both parts tf32: the three products hi·hi, hi·lo and
// lo·hi of two split operands give an fp32-accurate product on the tf32 tensor cores ("3xTF32").
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}

// The shared-window address of a pointer into shared memory (what PTX shared-memory operands take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return cute::cast_smem_ptr_to_uint(p); }

// The 16 bytes at shared-window address addr, as the reference CuTe's shared-memory copy atoms take
// (they convert it back to the same address).
__device__ __forceinline__ const cute::uint128_t& shared_ref(uint32_t addr) {
  return *static_cast<const cute::uint128_t*>(__cvta_shared_to_generic(addr));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  cute::SM75_U32x4_LDSM_N::copy(shared_ref(addr), r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  cute::SM75_U16x8_LDSM_T::copy(shared_ref(addr), r[0], r[1], r[2], r[3]);
}

// 16-byte global -> shared copy; with valid == false the destination is zero-filled (CuTe's atom
// adds an L2::128B prefetch hint).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid = true) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
      *static_cast<const cute::uint128_t*>(src), *static_cast<cute::uint128_t*>(__cvta_shared_to_generic(dst)), valid);
}

__device__ __forceinline__ void cp_async_commit() { cute::cp_async_fence(); }

// Waits until at most N committed groups of this thread are in flight (CuTe spells N = 0 as
// cp.async.wait_all, which commits an empty group first).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<N>();
}

// Transposes an 8 x 8 matrix of 16-bit elements held in the m8n8 fragment layout (lane l: row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1, one 32-bit word).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  cute::SM75_U32x1_MOVM_T::copy(x, r);
  return r;
}

template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The two bf16 of a packed pair (low half first) as floats: exact, two integer instructions.
__device__ __forceinline__ void unpack2_bf16(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// The A fragment of a 16 x 16 operand (m16n8k16 and wgmma k16 register layout) from the two m16n8
// accumulator tiles that hold its columns 0-7 and 8-15: accumulators feed the next product as is.
template <typename Elem>
__device__ __forceinline__ void accumulators_to_a(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = pack2<Elem>(lo[0], lo[1]);
  a[1] = pack2<Elem>(lo[2], lo[3]);
  a[2] = pack2<Elem>(hi[0], hi[1]);
  a[3] = pack2<Elem>(hi[2], hi[3]);
}

// Negates both halves of a packed pair (sign bits; exact for bf16 and fp16).
__device__ __forceinline__ uint32_t neg2(uint32_t x) { return x ^ 0x80008000u; }

// The tiles below are CuTe's swizzled layouts of bytes (cute::Swizzle<B, 4, S> composed with a
// row-major byte layout: bits S+4 .. S+4+B-1 of the byte offset, the row's low bits, flip the
// 16-byte chunk bits 4 .. 4+B-1). Their offsets are written out by hand, each a small XOR of the
// chunk index with the row: applying the Swizzle functor to the whole byte offset computes the same
// values but takes 3-6% more SASS instructions in chunk_prepare and chunk_recurrence (where the
// chunk index is a constant of an unrolled loop and the row a lane's), and ran 4-6% slower. matches_swizzle() checks
// each tile's offsets against CuTe's layout at compile time.
template <class Tile, class Layout>
__host__ __device__ constexpr bool matches_swizzle(int rows, int chunks, Layout layout) {
  for (int row = 0; row < rows; ++row)
    for (int chunk = 0; chunk < chunks; ++chunk)
      if (Tile::chunk_offset(row, chunk) != uint32_t(layout(row, chunk))) return false;
  return true;
}

// Shared-memory tiles of b16 elements with rows of kRowChunks 16-byte chunks. The chunk index is
// XOR-swizzled with the row so that the eight row addresses of one ldmatrix (same column, eight
// consecutive rows) fall in eight different bank groups.
template <int kRowChunks>
struct SwizzledTile {
  static_assert(kRowChunks == 4 || kRowChunks == 8 || kRowChunks == 16, "rows of 64, 128 or 256 bytes");
  static constexpr int kRowBytes = kRowChunks * 16;
  // The layout: 64-byte rows swizzle with bits 1-2 of the row, 128- and 256-byte rows with bits 0-2.
  using Swizzle = cute::Swizzle<kRowChunks == 4 ? 2 : 3, 4, kRowChunks == 16 ? 4 : 3>;
  __host__ __device__ __forceinline__ static constexpr uint32_t chunk_offset(int row, int chunk) {
    const int sw = kRowChunks == 4 ? ((row >> 1) & 3) : (row & 7);
    return uint32_t(row * kRowBytes + ((chunk ^ sw) * 16));
  }
  // Byte offset of element (row, col), col in b16 elements.
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return chunk_offset(row, col >> 3) + uint32_t((col & 7) * 2);
  }
};

// Tiles of kRows rows of kRowChunks 16-byte chunks, stored as panels of eight chunks (128 bytes):
// panel p holds chunks 8p..8p+7 of every row, rows 128 bytes apart, the chunk index XOR-swizzled
// with row % 8. With a 1024-byte aligned base this is the 128-byte-swizzle layout that wgmma
// descriptors name (8-row x 128-byte atoms, cute::Swizzle<3, 4, 3>), and ldmatrix reads of eight
// consecutive rows of one chunk column still hit eight different bank groups.
template <int kRows, int kRowChunks>
struct PanelTile {
  static_assert(kRows % 8 == 0 && kRowChunks % 8 == 0, "whole 8-row x 128-byte atoms");
  static constexpr int kPanelBytes = kRows * 128;
  __host__ __device__ __forceinline__ static constexpr uint32_t chunk_offset(int row, int chunk) {
    return uint32_t((chunk >> 3) * kPanelBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  }
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return chunk_offset(row, col >> 3) + uint32_t((col & 7) * 2);
  }
};

// The layouts of the tiles as CuTe writes them ((row, chunk) -> byte offset), for the checks.
template <int kRowChunks>
__host__ __device__ constexpr auto swizzled_tile_layout(int rows) {
  using namespace cute;
  return composition(typename SwizzledTile<kRowChunks>::Swizzle{},
                     make_layout(make_shape(rows, Int<kRowChunks>{}), make_stride(Int<kRowChunks * 16>{}, Int<16>{})));
}
template <int kRows, int kRowChunks>
__host__ __device__ constexpr auto panel_tile_layout() {
  using namespace cute;
  // (row, (chunk in panel, panel)): panels kRows x 128 bytes apart, then the 128-byte swizzle.
  return composition(Swizzle<3, 4, 3>{},
                     make_layout(make_shape(Int<kRows>{}, make_shape(Int<8>{}, Int<kRowChunks / 8>{})),
                                 make_stride(Int<128>{}, make_stride(Int<16>{}, Int<kRows * 128>{}))));
}
static_assert(matches_swizzle<SwizzledTile<4>>(16, 4, swizzled_tile_layout<4>(16)), "64-byte rows");
static_assert(matches_swizzle<SwizzledTile<8>>(16, 8, swizzled_tile_layout<8>(16)), "128-byte rows");
static_assert(matches_swizzle<SwizzledTile<16>>(16, 16, swizzled_tile_layout<16>(16)), "256-byte rows");

// A plain row-major fp32 matrix view in shared memory (at(r, c), row stride in floats).
struct PlainF32 {
  float* p;
  int stride;
  __device__ __forceinline__ float& at(int r, int c) const { return p[r * stride + c]; }
};

// acc (two 16x8 C fragments, columns 0-7 and 8-15) += X · Y for 16x16 fp32 blocks in shared
// memory (views with at(r, c)), tf32 operands (kSplit: 3xTF32, fp32 accuracy). The operands are
// gathered in Frag1688Tf32's layout, written out: the same offsets through its functions compile
// to other SASS (chunk_prepare's register allocation is sensitive to the form).
template <bool kSplit, class XView, class YView>
__device__ __forceinline__ void block_product_tf32(float (&acc)[2][4], const XView& X, const YView& Y) {
  const int lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const int k0 = 8 * ks;
    const float xa[4] = {X.at(g8, k0 + t4), X.at(g8 + 8, k0 + t4), X.at(g8, k0 + t4 + 4), X.at(g8 + 8, k0 + t4 + 4)};
    uint32_t ahi[4], alo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if constexpr (kSplit) split_tf32(xa[r], ahi[r], alo[r]);
      else ahi[r] = to_tf32_fast(xa[r]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float y0 = Y.at(k0 + t4, 8 * nt + g8), y1 = Y.at(k0 + t4 + 4, 8 * nt + g8);
      if constexpr (kSplit) {
        uint32_t bhi0, blo0, bhi1, blo1;
        split_tf32(y0, bhi0, blo0);
        split_tf32(y1, bhi1, blo1);
        mma_1688_tf32(acc[nt], alo, bhi0, bhi1);
        mma_1688_tf32(acc[nt], ahi, blo0, blo1);
        mma_1688_tf32(acc[nt], ahi, bhi0, bhi1);
      } else {
        mma_1688_tf32(acc[nt], ahi, to_tf32_fast(y0), to_tf32_fast(y1));
      }
    }
  }
}

// A 16x16 block of C fragments (as block_product_tf32 leaves it), times sign, to shared memory.
template <class View>
__device__ __forceinline__ void store_block(const View& dst, const float (&acc)[2][4], float sign) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst.at(FragAcc::m(lane, e), 8 * nt + FragAcc::n(lane, e)) = sign * acc[nt][e];
}

}  // namespace sm80
}  // namespace flashkda
