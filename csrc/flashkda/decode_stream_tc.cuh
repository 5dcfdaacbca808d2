// Decode step for bf16 V-first states, one token per sequence: decode_stream.cuh's persistent
// register streaming, with each token's sums over K on the tensor cores (mma.sync m16n8k16, any
// sm_80+ device). run_decode_stream_tc decides; decode_bulk.cuh (sm_90) and decode_step_vfirst serve
// the rest.
//
// Why: with a bf16 state a 4 KB item holds twice the elements of an fp32 one, and decode_stream's
// per-element arithmetic (unpack, two FMAs for the sums, the update, pack) and shuffle reductions
// then take longer than the memory: measured 0.217 ms at N = 256, H = 32, against decode_bulk.cuh's
// 0.186. Here the sums S (d ⊙ k) and S (d ⊙ q) of an item's 16 rows are 8 MMAs, and only the update
// S ⊙ d + u kᵀ stays elementwise: 0.168 ms in its prototype (BENCHMARK_H200.md).
//
// Work item: (sequence, value head, 16 value rows), 4 KB of bf16 state, held packed in registers as
// the MMA's A operand. Lane (g = lane / 4, t = lane % 4) holds rows g and g + 8, keys 32c + 8t ..
// 32c + 8t + 7 for c = 0..3. It stores them as they are (16-byte stores; an instruction covers 64
// bytes of each of 8 rows), but loads go in line order (an instruction covers 512 contiguous
// bytes) and reach the fragment layout through a per-warp shared-memory tile: the half-line loads
// cost the memory system about 5% (bench/harness/rmw_fragment_probe.cu) and the kernel 3-4%.
// A sum over K does not depend on the order of the keys, so k-step s = 2c + h of the product takes
// keys 32c + 8t + 4h + {0, 1} at k positions 2t, 2t + 1 and keys 32c + 8t + 4h + {2, 3} at 2t + 8,
// 2t + 9, which is where that lane's registers already hold them; the B operand (16 x 8) lists the
// keys in the same order. B's columns: 0 d ⊙ k and 1 d ⊙ q rounded to bf16, 2 and 3 what that
// rounding left (x − bf16(x)), so the products carry about 16 bits of each fp32 factor against the
// exact bf16 state, with fp32 accumulation (output and state within 1.2e-5 of decode_bulk.cuh).
// The state is rounded to bf16 after each token, so this kernel takes one token per sequence only
// (decode_bulk.cuh keeps fp32 between the tokens of a speculative verification).
//
// A warp walks units of kItemsPerUnit consecutive items of one head, which share the token's
// preparation: its factors go to the warp's shared-memory scratch (read back by the update) and
// into the B operand (registers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "api.h"
#include "decode_stream.cuh"
#include "mma_sm80.cuh"
#include "recurrent_common.cuh"
#include "recurrent_params.h"

namespace flashkda {
namespace decode_stream_tc {

constexpr int D = kDecodeBulkHeadDim;
constexpr int kRows = 16;  // value rows per item: the MMA's M
constexpr int kBlocksV = D / kRows;
constexpr int kWarps = 8;
constexpr int kBlocksPerSm = 2;  // 128 registers; 3 blocks at 80 registers spill and are slower
// Items per unit (one token preparation). Measured on the H200 (N = 64 / 256 / 1024, ms): 1 0.0555 /
// 0.1788 / 0.7126, 2 0.0499 / 0.1697 / 0.6596, 4 0.0527 / 0.1683 / 0.6476, 8 0.0492 / 0.1704 / 0.6656.
constexpr int kItemsPerUnit = 4;
static_assert(D == 128 && kBlocksV % kItemsPerUnit == 0, "16-row items, units within one head");

using bf16 = __nv_bfloat16;

// A resolved item of a uniform one-token batch (covers()): decode_stream::Item without the token
// range (first token 0, one token), so that two of them cost fewer registers.
struct Item {
  int batch;       // sequence = batch row
  int read_slot;   // -1: the state starts at zero
  int write_slot;  // -1: the final state is not stored
  int hv, v0;      // value head, first value row
  bool skip;       // padding sequence: zero output, no state traffic
};

__device__ __forceinline__ Item resolve(const RecurrentParams& p, uint32_t item) {
  const decode_stream::Item it = decode_stream::resolve_item<kRows>(p, item);
  return Item{it.batch, it.read_slot, it.write_slot, it.hv, it.v0, it.skip};
}

// decode_stream's token loads take its item type; a one-token item's is bos 0, len 1.
__device__ __forceinline__ decode_stream::Item as_stream_item(const Item& it) {
  decode_stream::Item s;
  s.bos = 0, s.batch = it.batch, s.len = 1, s.read_slot = it.read_slot, s.write_slot = it.write_slot;
  s.hv = it.hv, s.v0 = it.v0, s.skip = it.skip;
  return s;
}

// The current token's factors for all D channels (each lane writes its own four), per warp.
struct Scratch {
  float d[D], k[D], dk[D], dq[D];
};

// Prepares a token: the scratch, the MMA's B operand for k-steps 0..7, beta and k·q.
template <typename Elem>
__device__ __forceinline__ decode_stream::Prepared prepare(const RecurrentParams& p, const decode_stream::TokenRaw<Elem>& r,
                                                           Scratch& sc, uint32_t (&B)[8][2], int lane) {
  const decode_stream::Prepared t = decode_stream::prepare_token<Elem>(p, r);
  __syncwarp();  // every lane has read the previous token's scratch
  reinterpret_cast<float4*>(sc.d)[lane] = make_float4(t.d[0], t.d[1], t.d[2], t.d[3]);
  reinterpret_cast<float4*>(sc.k)[lane] = make_float4(t.k[0], t.k[1], t.k[2], t.k[3]);
  reinterpret_cast<float4*>(sc.dk)[lane] = make_float4(t.dk[0], t.dk[1], t.dk[2], t.dk[3]);
  reinterpret_cast<float4*>(sc.dq)[lane] = make_float4(t.dq[0], t.dq[1], t.dq[2], t.dq[3]);
  __syncwarp();
  // Lane (g, t) holds column g of B at its keys: 0 d ⊙ k, 1 d ⊙ q (bf16 parts), 2, 3 their
  // remainders, 4..7 zero.
  const int g = lane / 4, t4 = lane % 4;
  const float* src = (g & 1) ? sc.dq : sc.dk;
  const bool remainder = g >= 2, zero = g >= 4;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float4 x0 = *reinterpret_cast<const float4*>(src + 32 * c + 8 * t4);
    const float4 x1 = *reinterpret_cast<const float4*>(src + 32 * c + 8 * t4 + 4);
    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    float part[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float hi = __bfloat162float(__float2bfloat16(x[e]));
      part[e] = zero ? 0.f : (remainder ? x[e] - hi : hi);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      B[2 * c + h][0] = sm80::pack2<bf16>(part[4 * h], part[4 * h + 1]);
      B[2 * c + h][1] = sm80::pack2<bf16>(part[4 * h + 2], part[4 * h + 3]);
    }
  }
  return t;
}

__device__ __forceinline__ void unpack8(const uint4& w, float (&x)[8]) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) x[2 * i] = __uint_as_float(u[i] << 16), x[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
}

__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(sm80::pack2<bf16>(x[0], x[1]), sm80::pack2<bf16>(x[2], x[3]), sm80::pack2<bf16>(x[4], x[5]),
                    sm80::pack2<bf16>(x[6], x[7]));
}

// An item's state as loaded, per warp: row r's 16-byte chunk j at r * 16 + (j ^ 4 (r & 1)), so that
// the line-order writes and the fragment-order reads are both free of bank conflicts.
struct Tile {
  static constexpr int kChunksPerRow = D * int(sizeof(bf16)) / 16;
  uint4 chunk[kRows * kChunksPerRow];
  __device__ __forceinline__ uint4& at(int r, int j) { return chunk[r * kChunksPerRow + (j ^ ((r & 1) << 2))]; }
};

// kPrefetch: while an item is computed, state rows ahead are prefetched into L2, one 128-byte line per
// lane and instruction: 1, the next item's; 3, the same with the evict-last priority, so that the line
// is still there when its load comes; 2, at the start of a unit, the whole next unit's. Measured on
// the H200 (bench/harness/decode_harness.cu, N = 64 / 256 / 1024, ms, one run): none 0.0503 / 0.1661
// / 0.6410, 1: 0.0449 / 0.1636 / 0.6047, 3: 0.0455 / 0.1611 / 0.5983, 2: 0.0456 / 0.2006 / 0.7952.
// The library runs 3. Also measured in that run and not kept: units of 8 items (1: 0.0428 / 0.1622 /
// 0.6058) and stores as one 4 KB bulk copy of the tile per item (whole-line writes; 1: 0.0470 /
// 0.1649 / 0.6075).
template <typename Elem, int kPrefetch = 0>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
    decode_step_stream_tc(const RecurrentParams p, const uint32_t num_units) {
  __shared__ Scratch scratch[kWarps];
  __shared__ Tile tiles[kWarps];  // with the scratch, 48 KB: the static limit
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t4 = lane % 4;
  Scratch& sc = scratch[warp];
  Tile& tile = tiles[warp];
  const uint32_t stride = gridDim.x * kWarps;
  const int64_t slot_elems = int64_t(p.HV) * D * D;
  const bf16* state_in = static_cast<const bf16*>(p.state_in);
  bf16* state_out = static_cast<bf16*>(p.state_out);

  uint32_t unit = blockIdx.x * kWarps + warp;
  if (unit >= num_units) return;
  Item cur = resolve(p, unit * kItemsPerUnit), next{};
  if (unit + stride < num_units) next = resolve(p, (unit + stride) * kItemsPerUnit);
  int m = 0;  // item within the unit

  // Row g (h = 0) or g + 8 (h = 1) of an item in a slot, at key 8 t4; chunk c is 32 c further.
  auto row = [&](const Item& it, int slot, int h) {
    return int64_t(slot) * slot_elems + int64_t(it.hv) * D * D + int64_t(it.v0 + g + 8 * h) * D + 8 * t4;
  };
  static_assert(kRows * D * sizeof(bf16) == 32 * 128, "an item is one 128-byte line per lane");
  // An item's first state element in its read slot (read_slot >= 0), and line `lane` of the item.
  auto item_state = [&](const Item& it) {
    return state_in + int64_t(it.read_slot) * slot_elems + int64_t(it.hv) * D * D + int64_t(it.v0) * D;
  };
  auto item_line = [&](const Item& it) { return item_state(it) + 64 * lane; };
  // A: rows g, g + 8, chunks c once in fragment order (to_fragments); loaded in line order,
  // A[i / 4][i % 4] holding the item's 16-byte chunk 32 i + lane (row line_row(i), chunk lane % 16).
  uint4 A[2][4];
  auto line_row = [&](int i) { return 2 * i + lane / 16; };
  decode_stream::TokenRaw<Elem> tok;
  Elem v[2];  // the token's v at rows g, g + 8
  auto load_item = [&](const Item& it, bool token) {
    const uint4* src = reinterpret_cast<const uint4*>(item_state(it));
#pragma unroll
    for (int i = 0; i < 8; ++i)
      A[i / 4][i % 4] = it.read_slot >= 0 ? __ldcs(src + 32 * i + lane) : make_uint4(0u, 0u, 0u, 0u);
    if (!it.skip) {
      const decode_stream::Item si = as_stream_item(it);
      if (token) tok = decode_stream::load_token<Elem>(p, si, 0, lane);
      v[0] = decode_stream::load_v<Elem>(p, si, 0, g), v[1] = decode_stream::load_v<Elem>(p, si, 0, g + 8);
    }
  };
  load_item(cur, true);
  auto to_fragments = [&] {
    __syncwarp();  // every lane has read the previous item's fragments
#pragma unroll
    for (int i = 0; i < 8; ++i) tile.at(line_row(i), lane % 16) = A[i / 4][i % 4];
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 4; ++c) A[h][c] = tile.at(g + 8 * h, 4 * c + t4);
  };

  uint32_t B[8][2];
  decode_stream::Prepared t{};
  while (true) {
    if constexpr (kPrefetch == 1 || kPrefetch == 3) {  // 3: with the evict-last priority
      const bool same_unit = m + 1 < kItemsPerUnit;
      if (same_unit || unit + stride < num_units) {
        Item after = same_unit ? cur : next;
        if (same_unit) after.v0 += kRows;
        if (after.read_slot >= 0) {
          if constexpr (kPrefetch == 3) decode_stream::prefetch_l2_evict_last(item_line(after));
          else decode_stream::prefetch_l2(item_line(after));
        }
      }
    } else if constexpr (kPrefetch == 2) {
      if (m == 0 && unit + stride < num_units && next.read_slot >= 0)
#pragma unroll
        for (int i = 0; i < kItemsPerUnit; ++i) decode_stream::prefetch_l2(item_line(next) + i * kRows * D);
    }
    Elem* o = static_cast<Elem*>(p.o) + cur.batch * p.o_batch_stride + int64_t(cur.hv) * p.o_head_stride + cur.v0 + g;
    to_fragments();
    if (cur.skip) {
      if (t4 == 0) o[0] = o[8] = from_float<Elem>(0.f);
    } else {
      if (m == 0) t = prepare<Elem>(p, tok, sc, B, lane);
      // Column n of the product at rows g, g + 8 lands in lanes with t4 = n / 2: t4 0 holds the
      // bf16 parts of sk, sq, t4 1 the remainders.
      float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int c = s / 2, w = 2 * (s % 2);
        const uint32_t* r0 = reinterpret_cast<const uint32_t*>(&A[0][c]);
        const uint32_t* r1 = reinterpret_cast<const uint32_t*>(&A[1][c]);
        const uint32_t a[4] = {r0[w], r1[w], r0[w + 1], r1[w + 1]};
        sm80::mma_16816<bf16>(s % 2 ? acc1 : acc0, a, B[s][0], B[s][1]);  // two chains of four
      }
      float sums[4];  // sk(g), sq(g), sk(g + 8), sq(g + 8) in lanes with t4 < 2
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        sums[j] = acc0[j] + acc1[j];
        sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], 1);
      }
      float u0 = t.beta * (to_float(v[0]) - sums[0]), u1 = t.beta * (to_float(v[1]) - sums[2]);
      if (t4 == 0) o[0] = from_float<Elem>(sums[1] + u0 * t.kq), o[8] = from_float<Elem>(sums[3] + u1 * t.kq);
      u0 = __shfl_sync(0xffffffffu, u0, lane & ~3);
      u1 = __shfl_sync(0xffffffffu, u1, lane & ~3);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float4 d0 = *reinterpret_cast<const float4*>(sc.d + 32 * c + 8 * t4);
        const float4 d1 = *reinterpret_cast<const float4*>(sc.d + 32 * c + 8 * t4 + 4);
        const float4 k0 = *reinterpret_cast<const float4*>(sc.k + 32 * c + 8 * t4);
        const float4 k1 = *reinterpret_cast<const float4*>(sc.k + 32 * c + 8 * t4 + 4);
        const float d[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
        const float k[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x[8];
          unpack8(A[h][c], x);
          const float u = h ? u1 : u0;
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = x[e] * d[e] + k[e] * u;
          A[h][c] = pack8(x);
        }
      }
    }
    if (!cur.skip && cur.write_slot >= 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 4; ++c) __stcs(reinterpret_cast<uint4*>(state_out + row(cur, cur.write_slot, h)) + 4 * c, A[h][c]);
    }
    if (++m < kItemsPerUnit) {
      cur.v0 += kRows;  // the next rows of the same head: same slots, same token
      load_item(cur, false);
      continue;
    }
    m = 0;
    unit += stride;
    if (unit >= num_units) break;
    cur = next;
    if (unit + stride < num_units) next = resolve(p, (unit + stride) * kItemsPerUnit);
    load_item(cur, true);
  }
}

// The cases this kernel serves: recurrent::persistent_decode_covers with bf16 states, exactly one
// token per sequence (a uniform batch with T = 1), slots that fit Item's 32 bits, 16-byte aligned
// token rows.
template <typename Elem>
bool covers(const RecurrentParams& p) {
  return recurrent::persistent_decode_covers(p, kBlocksV, DType::kBFloat16) && p.cu_seqlens == nullptr && p.T == 1 &&
         p.num_slots < (int64_t(1) << 31) && recurrent::token_rows_aligned16<Elem>(p);
}

template <typename Elem, int kPrefetch = 0>
cudaError_t run(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  launched = false;
  if (!covers<Elem>(p)) return cudaSuccess;
  const uint32_t num_units = uint32_t(int64_t(p.N) * p.HV * (kBlocksV / kItemsPerUnit));
  return recurrent::launch_persistent<decode_step_stream_tc<Elem, kPrefetch>>(p, kWarps, num_units, stream, launched);
}

}  // namespace decode_stream_tc

template <typename Elem>
cudaError_t run_decode_stream_tc(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  return decode_stream_tc::run<Elem, 3>(p, stream, launched);
}

}  // namespace flashkda
