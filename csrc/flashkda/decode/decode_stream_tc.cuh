// Decode step for bf16 V-first states, one token per sequence: persistent warps stream their state
// items through shared memory, with each token's sums over K on the tensor cores (mma.sync
// m16n8k16, any sm_80+ device). run_decode_stream_tc decides; decode_bulk.cuh (sm_90) and
// decode_step_vfirst serve the rest.
//
// Why: with a bf16 state a 4 KB item holds twice the elements of an fp32 one, and decode_stream's
// per-element arithmetic (unpack, two FMAs for the sums, the update, pack) and shuffle reductions
// then take longer than the memory: measured 0.217 ms at N = 256, H = 32, against decode_bulk.cuh's
// 0.186. Here the sums S (d ⊙ k) and S (d ⊙ q) of an item's 16 rows are 8 MMAs, and only the update
// S ⊙ d + u kᵀ stays elementwise.
//
// Work item: (sequence, value head, 16 value rows), 4 KB of bf16 state. Each item travels in line
// order between global memory and a per-warp shared-memory tile (lane l moves 16-byte chunks 32 i +
// l: every instruction covers 512 contiguous bytes, whole 128-byte lines), and between the tile and
// registers as the MMA's A operand by ldmatrix / stmatrix: k-step s takes keys 16 s .. 16 s + 15 in
// their natural order, so lane (g = lane / 4, t = lane % 4) holds rows g and g + 8 at keys
// 16 s + 2 t, + 1 and 16 s + 8 + 2 t, + 1. The B operand (16 x 8) lists the keys in the same order.
// B's columns: 0 d ⊙ k and 1 d ⊙ q rounded to bf16, 2 and 3 what that rounding left (x − bf16(x)),
// so the products carry about 16 bits of each fp32 factor against the exact bf16 state, with fp32
// accumulation (output and state within 1.5e-5 of decode_bulk.cuh). The update S ⊙ d + u kᵀ runs
// on the A words in place. The state is rounded to bf16 after each token, so this kernel takes one
// token per sequence only (decode_bulk.cuh keeps fp32 between the tokens of a speculative
// verification).
//
// Each warp has two tiles: the next item's state goes out as cp.async copies into the other tile
// when the current item's computation starts, so its 4 KB are in flight during that computation
// without holding registers. A warp walks units of kItemsPerUnit consecutive items of one head,
// which share the token's preparation: its factors go to the warp's shared-memory scratch (read back
// by the update) and into the B operand (registers); the next unit's token rows are loaded as soon
// as the current unit's are prepared.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/common/recurrent_params.h"
#include "flashkda/decode/decode_stream.cuh"
#include "flashkda/decode/recurrent_common.cuh"

namespace flashkda {
namespace decode_stream_tc {

constexpr int D = kDecodeBulkHeadDim;
constexpr int kRows = 16;  // value rows per item: the MMA's M
constexpr int kBlocksV = D / kRows;
// Warps per block and blocks per SM: 16 warps per SM at the 128-register cap, whose two 4 KB tiles
// and scratch fit the static shared-memory limit of a 4-warp block. Measured on the H200
// (bench/harness/decode_harness.cu, N = 64 / 256 / 1024, ms): 4 warps x 4 blocks 0.0415 / 0.1486 /
// 0.5836; 2 x 8 0.0414 / 0.1477 / 0.5791; three tiles per warp (2 x 8) 0.0435 / 0.1507 / 0.5807;
// 20 warps per SM (96 registers, spills) 0.0497 / 0.1667 / 0.6321.
constexpr int kWarps = 4;
constexpr int kBlocksPerSm = 4;
constexpr int kStages = 2;  // tiles per warp
// Items per unit (one token preparation, a template parameter of the kernel): large units while the
// grid takes few rounds of them, small ones from kSmallUnitRounds rounds of large units on (many
// sequences). Measured on the H200 (bench/test_decode.py, N = 64 / 256 / 1024, two runs, ms): 4
// items 0.0414-0.0416 / 0.1502 / 0.5719-0.5722, 2 items 0.0425-0.0429 / 0.1486-0.1488 /
// 0.5683-0.5688. Earlier, with a costlier token preparation (decode_harness.cu): 2 0.0430 / 0.1497 /
// 0.5840, 4 0.0415 / 0.1486 / 0.5836, 8 0.0400 / 0.1535 / 0.5841.
// (The crossing lies between 1.9 and 7.8 rounds of large units, where it was not measured.)
constexpr int kLargeUnit = 4, kSmallUnit = 2;
constexpr uint32_t kSmallUnitRounds = 4;
static_assert(D == 128 && kBlocksV % kLargeUnit == 0 && kLargeUnit % kSmallUnit == 0 && kSmallUnit % 2 == 0,
              "16-row items, units within one head, an even number of items per unit");
// Rounds of the grid (of large units) from which on the blocks sort the slots (slot_order.cuh). The
// sort is not hidden as well as in decode_stream.cuh, and the first round (index order) is a larger
// part of the work: measured on the H200 (bench/test_decode.py), slot order took the bf16 pool from
// 0.5786 to 0.5716-0.5731 ms at N = 1024 (31 rounds) but from 0.1511 to 0.1520 at N = 256 (7.8) and
// from 0.0420 to 0.0426-0.0430 at N = 64 (1.9).
constexpr uint32_t kMinOrderedRounds = 16;

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

__device__ __forceinline__ Item resolve(const RecurrentParams& p, uint32_t item, const uint16_t* order = nullptr,
                                       int first = recurrent::kUnordered) {
  const decode_stream::Item it = decode_stream::resolve_item<kRows>(p, item, order, first);
  return Item{it.batch, it.read_slot, it.write_slot, it.hv, it.v0, it.skip};
}

// decode_stream's token loads take its item type; a one-token item's is bos 0, len 1.
__device__ __forceinline__ decode_stream::Item as_stream_item(const Item& it) {
  decode_stream::Item s;
  s.bos = 0, s.batch = it.batch, s.len = 1, s.read_slot = it.read_slot, s.write_slot = it.write_slot;
  s.hv = it.hv, s.v0 = it.v0, s.skip = it.skip;
  return s;
}

// The current token's factors for all D channels, per warp, at positions key_position(key).
struct Scratch {
  float d[D], k[D], dk[D], dq[D];
};

// Scratch position of key 16 s + 8 q + 2 t + e (s = k-step, t = lane % 4): 16 s + 4 t + 2 q + e, so
// that a lane's four keys of a k-step (those of its A words) are one float4.
__device__ __forceinline__ int key_position(int key) {
  const int s = key >> 4, o = key & 15, q = o >> 3, t = (o & 7) >> 1, e = o & 1;
  return 16 * s + 4 * t + 2 * q + e;
}

// An item's state, per warp: row r's 16-byte chunk j at r * 16 + (j ^ (r & 7)), so that line-order
// accesses and ldmatrix / stmatrix (8 rows of one chunk) are both free of bank conflicts.
struct Tile {
  static constexpr int kChunksPerRow = D * int(sizeof(bf16)) / 16;
  uint4 chunk[kRows * kChunksPerRow];
  __device__ __forceinline__ uint4& at(int r, int j) { return chunk[r * kChunksPerRow + (j ^ (r & 7))]; }
};

// Prepares a token: the scratch, the MMA's B operand for k-steps 0..7, beta and k·q.
template <typename Elem>
__device__ __forceinline__ decode_stream::Prepared prepare(const RecurrentParams& p, const decode_stream::TokenRaw<Elem>& r,
                                                           Scratch& sc, uint32_t (&B)[8][2], int lane) {
  const decode_stream::Prepared t = decode_stream::prepare_token<Elem>(p, r);
  __syncwarp();  // every lane has read the previous token's scratch
  // Lane L holds keys 4L .. 4L + 3: positions p0, p0 + 1 and p0 + 4, p0 + 5.
  const int p0 = key_position(4 * lane);
  *reinterpret_cast<float2*>(sc.d + p0) = make_float2(t.d[0], t.d[1]);
  *reinterpret_cast<float2*>(sc.d + p0 + 4) = make_float2(t.d[2], t.d[3]);
  *reinterpret_cast<float2*>(sc.k + p0) = make_float2(t.k[0], t.k[1]);
  *reinterpret_cast<float2*>(sc.k + p0 + 4) = make_float2(t.k[2], t.k[3]);
  *reinterpret_cast<float2*>(sc.dk + p0) = make_float2(t.dk[0], t.dk[1]);
  *reinterpret_cast<float2*>(sc.dk + p0 + 4) = make_float2(t.dk[2], t.dk[3]);
  *reinterpret_cast<float2*>(sc.dq + p0) = make_float2(t.dq[0], t.dq[1]);
  *reinterpret_cast<float2*>(sc.dq + p0 + 4) = make_float2(t.dq[2], t.dq[3]);
  __syncwarp();
  // Lane (g, t) holds column g of B at its keys: 0 d ⊙ k, 1 d ⊙ q (bf16 parts), 2, 3 their
  // remainders, 4..7 zero.
  const int g = lane / 4, t4 = lane % 4;
  const float* src = (g & 1) ? sc.dq : sc.dk;
  const bool remainder = g >= 2, zero = g >= 4;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const float4 x4 = *reinterpret_cast<const float4*>(src + 16 * s + 4 * t4);
    const float x[4] = {x4.x, x4.y, x4.z, x4.w};
    float part[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float hi = __bfloat162float(__float2bfloat16(x[e]));
      part[e] = zero ? 0.f : (remainder ? x[e] - hi : hi);
    }
    B[s][0] = sm80::pack2<bf16>(part[0], part[1]);  // keys 16 s + 2 t, + 1
    B[s][1] = sm80::pack2<bf16>(part[2], part[3]);  // keys 16 s + 8 + 2 t, + 1
  }
  return t;
}

// stmatrix (sm_90 only: the kernel stores by 32-bit words below it). Here rather than beside
// sm90::stmatrix_x4_trans because wgmma_sm90.cuh compiles only for sm_90a, and this kernel runs on
// any sm_90+ device; same "memory" clobber rule as that one.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#else
  __trap();
#endif
}

// The slot order (slot_order.cuh) only on sm_90+: without it an A100's 164 KB per SM hold exactly
// kBlocksPerSm of these blocks.
static_assert(kWarps * (kStages * sizeof(Tile) + sizeof(Scratch)) + sizeof(recurrent::SlotOrder) <= 48 * 1024,
              "static shared memory");

// kWordStores: the updated fragments reach the tile by 32-bit stores, as below sm_90, instead of
// stmatrix (for checking that path on an sm_90 device). kItemsPerUnit: kLargeUnit or kSmallUnit.
template <typename Elem, bool kWordStores = false, int kItemsPerUnit = kLargeUnit>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
    decode_step_stream_tc(const RecurrentParams p, const uint32_t num_units) {
  static_assert(kStages == 2 && kItemsPerUnit % 2 == 0, "one item ahead; a unit's tiles alternate");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kMatrixStores = !kWordStores;
#else
  constexpr bool kMatrixStores = false;
#endif
  __shared__ Scratch scratch[kWarps];
  __shared__ Tile tiles[kWarps][kStages];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t4 = lane % 4;
  Scratch& sc = scratch[warp];
  const uint32_t stride = gridDim.x * kWarps;
  const int64_t slot_elems = state_slot_elems(p);
  const bf16* state_in = static_cast<const bf16*>(p.state_in);
  bf16* state_out = static_cast<bf16*>(p.state_out);

  uint32_t unit = blockIdx.x * kWarps + warp;
  if (unit >= num_units) return;  // never when the block sorts (orders_by_slot)
  // The later rounds take their sequences in slot order (slot_order.cuh; sm_90+, see the shared
  // memory above): the sort's index loads go out with the first unit's, and the sort runs once the
  // first item's copy and token loads are issued.
  const uint16_t* order = nullptr;
  int first = recurrent::kUnordered;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ recurrent::SlotOrder slot_order;
  order = slot_order.seq;
  const bool ordered =
      recurrent::orders_by_slot(p, num_units, stride, kMinOrderedRounds * (kLargeUnit / kItemsPerUnit));
  if (ordered) first = recurrent::first_sorted_position(stride, uint32_t(p.HV) * (kBlocksV / kItemsPerUnit));
  recurrent::SlotsOfThread<kWarps * 32> slots;
  if (ordered) slots = recurrent::begin_slot_order<kWarps * 32>(p, first, slot_order);
#endif
  Item cur = resolve(p, unit * kItemsPerUnit), next{};  // the first round keeps index order
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  recurrent::SettledSlots<kWarps * 32> settled;
  if (ordered) settled = recurrent::settle_slot_order<kWarps * 32>(p, first, slots, slot_order);
#endif
  bool has_next = unit + stride < num_units;
  int m = 0, b = 0;  // item within the unit, tile of the current item

  auto item_offset = [&](const Item& it, int slot) {
    return int64_t(slot) * slot_elems + int64_t(it.hv) * D * D + int64_t(it.v0) * D;
  };
  // Chunk 32 i + lane of an item (row 2 i + lane / 16, chunk lane % 16), in and out.
  auto line_row = [&](int i) { return 2 * i + lane / 16; };
  // The item's state into `tile` (zeros without a read slot); one commit group per call.
  auto load_state = [&](const Item& it, Tile& tile) {
    if (!it.skip) {
      if (it.read_slot >= 0) {
        const uint4* src = reinterpret_cast<const uint4*>(state_in + item_offset(it, it.read_slot));
#pragma unroll
        for (int i = 0; i < 8; ++i) sm80::cp_async_16(sm80::smem_u32(&tile.at(line_row(i), lane % 16)), src + 32 * i + lane);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) tile.at(line_row(i), lane % 16) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    sm80::cp_async_commit();
  };
  // ldmatrix / stmatrix address of k-step s: lane supplies row (lane & 7) + 8 ((lane >> 3) & 1) of
  // chunk 2 s + (lane >> 4).
  const int mrow = (lane & 7) + 8 * ((lane >> 3) & 1), mchunk = lane >> 4;
  decode_stream::TokenRaw<Elem> tok;
  Elem v[2];  // the token's v at rows g, g + 8
  auto load_v = [&](const Item& it) {
    if (!it.skip) {
      const decode_stream::Item si = as_stream_item(it);
      v[0] = decode_stream::load_v<Elem>(p, si, 0, g), v[1] = decode_stream::load_v<Elem>(p, si, 0, g + 8);
    }
  };
  auto load_next_token = [&] {
    if (has_next && !next.skip) tok = decode_stream::load_token<Elem>(p, as_stream_item(next), 0, lane);
  };
  load_state(cur, tiles[warp][0]);
  if (!cur.skip) tok = decode_stream::load_token<Elem>(p, as_stream_item(cur), 0, lane);
  load_v(cur);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (ordered && !recurrent::finish_slot_order<kWarps * 32>(p, first, settled, slot_order)) first = recurrent::kUnordered;
#endif
  if (has_next) next = resolve(p, (unit + stride) * kItemsPerUnit, order, first);

  uint32_t B[8][2];
  uint32_t A[8][4];
  decode_stream::Prepared t{};
  while (true) {
    // The item after this one: the next rows of the head, or the next unit's first item.
    const bool same_unit = m + 1 < kItemsPerUnit;
    Item after = same_unit ? cur : next;
    if (same_unit) after.v0 += kRows;
    const bool has_after = same_unit || has_next;
    __syncwarp();  // every lane has read tile b ^ 1 (the previous item's stores)
    if (has_after) load_state(after, tiles[warp][b ^ 1]);
    else sm80::cp_async_commit();
    Tile& tile = tiles[warp][b];
    Elem* o = static_cast<Elem*>(p.o) + cur.batch * p.o_batch_stride + int64_t(cur.hv) * p.o_head_stride + cur.v0 + g;
    if (cur.skip) {
      if (t4 == 0) o[0] = o[8] = from_float<Elem>(0.f);
    } else {
      // The token's preparation does not need the tile: it runs while the copies are in flight.
      if (m == 0) t = prepare<Elem>(p, tok, sc, B, lane), load_next_token();
      sm80::cp_async_wait<kStages - 1>();
      __syncwarp();
#pragma unroll
      for (int s = 0; s < 8; ++s) sm80::ldmatrix_x4(A[s], sm80::smem_u32(&tile.at(mrow, 2 * s + mchunk)));
      // Column n of the product at rows g, g + 8 lands in lanes with t4 = n / 2: t4 0 holds the
      // bf16 parts of sk, sq, t4 1 the remainders.
      float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < 8; ++s) sm80::mma_16816<bf16>(s % 2 ? acc1 : acc0, A[s], B[s][0], B[s][1]);
      float sums[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        sums[j] = acc0[j] + acc1[j];
        sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], 1);
      }
      float u0 = t.beta * (to_float(v[0]) - sums[0]), u1 = t.beta * (to_float(v[1]) - sums[2]);
      if (has_after) load_v(after);
      if (t4 == 0) o[0] = from_float<Elem>(sums[1] + u0 * t.kq), o[8] = from_float<Elem>(sums[3] + u1 * t.kq);
      u0 = __shfl_sync(0xffffffffu, u0, lane & ~3);
      u1 = __shfl_sync(0xffffffffu, u1, lane & ~3);
      const bool writes = cur.write_slot >= 0;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const float4 d = *reinterpret_cast<const float4*>(sc.d + 16 * s + 4 * t4);
        const float4 k = *reinterpret_cast<const float4*>(sc.k + 16 * s + 4 * t4);
        // A[s]: row g keys (2t, 2t+1), row g+8 the same, row g keys (2t+8, 2t+9), row g+8 the same.
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float u = (w & 1) ? u1 : u0;
          const float d0 = (w & 2) ? d.z : d.x, d1 = (w & 2) ? d.w : d.y;
          const float k0 = (w & 2) ? k.z : k.x, k1 = (w & 2) ? k.w : k.y;
          float x0, x1;
          sm80::unpack2_bf16(A[s][w], x0, x1);
          A[s][w] = sm80::pack2<bf16>(x0 * d0 + k0 * u, x1 * d1 + k1 * u);
        }
        // Back into the tile at once (the ldmatrix reads of the whole warp are done: the MMAs used
        // them): the updated words leave the registers where the item's register use peaks.
        if (writes) {
          if constexpr (kMatrixStores) {
            stmatrix_x4(sm80::smem_u32(&tile.at(mrow, 2 * s + mchunk)), A[s]);
          } else {
#pragma unroll
            for (int w = 0; w < 4; ++w)
              reinterpret_cast<uint32_t*>(&tile.at(g + 8 * (w & 1), 2 * s + (w >> 1)))[t4] = A[s][w];
          }
        }
      }
      if (writes) {
        __syncwarp();
        uint4* dst = reinterpret_cast<uint4*>(state_out + item_offset(cur, cur.write_slot));
#pragma unroll
        for (int i = 0; i < 8; ++i) __stcs(dst + 32 * i + lane, tile.at(line_row(i), lane % 16));
      }
    }
    if (cur.skip && has_after) load_v(after);
    b ^= 1;
    if (++m < kItemsPerUnit) {
      cur.v0 += kRows;  // the next rows of the same head: same slots, same token
      continue;
    }
    m = 0;
    unit += stride;
    if (unit >= num_units) break;
    if (cur.skip && !next.skip) tok = decode_stream::load_token<Elem>(p, as_stream_item(next), 0, lane);
    cur = next;
    has_next = unit + stride < num_units;
    if (has_next) next = resolve(p, (unit + stride) * kItemsPerUnit, order, first);
  }
  sm80::cp_async_wait<0>();
}

// The cases this kernel serves: recurrent::persistent_decode_covers with bf16 states, exactly one
// token per sequence (a uniform batch with T = 1), slots that fit Item's 32 bits, 16-byte aligned
// token rows.
template <typename Elem>
bool covers(const RecurrentParams& p) {
  return recurrent::persistent_decode_covers(p, kBlocksV, DType::kBFloat16) && p.cu_seqlens == nullptr && p.T == 1 &&
         p.num_slots < (int64_t(1) << 31) && recurrent::token_rows_aligned16<Elem>(p);
}

// Items per unit for a call: kLargeUnit while the grid would take fewer than kSmallUnitRounds rounds
// of them (every block of the device resident), else kSmallUnit.
inline int items_per_unit(const RecurrentParams& p) {
  const int64_t large_units = int64_t(p.N) * p.HV * (kBlocksV / kLargeUnit);
  const int64_t grid_warps = int64_t(std::max(p.num_sms, 1)) * kBlocksPerSm * kWarps;
  return large_units < int64_t(kSmallUnitRounds) * grid_warps ? kLargeUnit : kSmallUnit;
}

// Whether this device holds resident blocks of the variant that run_decode_stream_tc launches for p.
template <typename Elem>
bool resident(const RecurrentParams& p) {
  return items_per_unit(p) == kLargeUnit
             ? recurrent::resident_blocks<decode_step_stream_tc<Elem, false, kLargeUnit>>(kWarps * 32) > 0
             : recurrent::resident_blocks<decode_step_stream_tc<Elem, false, kSmallUnit>>(kWarps * 32) > 0;
}

template <typename Elem, bool kWordStores = false>
cudaError_t run(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  launched = false;
  if (!covers<Elem>(p)) return cudaSuccess;
  const int64_t items = int64_t(p.N) * p.HV * kBlocksV;
  if (items_per_unit(p) == kLargeUnit)
    return recurrent::launch_persistent<decode_step_stream_tc<Elem, kWordStores, kLargeUnit>>(
        p, kWarps, uint32_t(items / kLargeUnit), stream, launched);
  return recurrent::launch_persistent<decode_step_stream_tc<Elem, kWordStores, kSmallUnit>>(
      p, kWarps, uint32_t(items / kSmallUnit), stream, launched);
}

}  // namespace decode_stream_tc

// State traffic in cp.async tiles against the earlier form that held the next item in registers
// (loaded after the current item's stores; L2 prefetch one item ahead): H200, N = 256, 0.148-0.152
// ms against 0.158-0.161 in the same runs (bench/harness/decode_harness.cu, BENCHMARK_H200.md).
template <typename Elem>
bool decode_stream_tc_serves(const RecurrentParams& p) {
  return decode_stream_tc::covers<Elem>(p) && decode_stream_tc::resident<Elem>(p);
}

template <typename Elem>
cudaError_t run_decode_stream_tc(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  return decode_stream_tc::run<Elem>(p, stream, launched);
}

}  // namespace flashkda
