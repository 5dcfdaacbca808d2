// The order in which the persistent decode kernels (decode_stream.cuh, decode_stream_tc.cuh) take
// their sequences: by state slot, when the slots come from an index tensor.
//
// Why: the warps of a grid stride work on neighbouring work items, so at any moment the grid reads
// and writes the states of a few consecutive sequences. With slots in index order those are a few
// neighbouring regions of the pool; with a serving engine's slots (any permutation) they are
// scattered, and HBM serves the same bytes more slowly. Measured on the H200 (one token per
// sequence, H = 32, a pool of N + 8 slots; the same kernel fed shuffled or sorted indices): sorted
// 0.9-1.3% faster with fp32 states and 1.0-2.3% with bf16 states at N = 64-1024. With the sort
// below, bench/test_decode.py (shuffled slots) went from 0.2801-0.2816 to 0.2779-0.2796 ms at
// N = 256 and from 1.103-1.107 to 1.094-1.098 at N = 1024 for an fp32 pool (BENCHMARK_H200.md).
//
// Each block sorts the slots itself, in shared memory, so there is no workspace and no second
// launch: padding sequences first, in index order; then a counting sort of the valid slots into
// kSlotRanges equal ranges of [lowest, highest slot] (one shared-memory atomic per sequence, one
// scan), each range's sequences put in index order afterwards. Every block must arrive at the same
// order (a work unit's position names its sequence in every block), so nothing depends on the
// order of the atomics. A range with more than kMaxPerRange sequences (duplicate slots, or slots
// clustered in a wide span) would make that last step slow: the launch then keeps index order,
// which every block decides alike.
//
// The sort takes 1.2-1.5 us, about the gain at N = 256, when it stands before the first loads
// (measured), so the grid's first round of work units keeps index order and is issued before the
// sort: its index loads go out with the first unit's (begin_slot_order), they are waited for with
// the first unit's slot (settle_slot_order), and the rest runs while that unit's state loads are in
// flight (finish_slot_order).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "flashkda/common/recurrent_params.h"
#include "flashkda/decode/recurrent_common.cuh"

namespace flashkda {
namespace recurrent {

constexpr int kSlotRanges = 1024;      // ranges of the counting sort
constexpr int kMaxOrderedSeqs = 1024;  // more sequences keep index order
constexpr int kMaxPerRange = 8;        // more sequences in one range: index order

// `first` of a launch that keeps index order throughout.
constexpr int kUnordered = INT_MAX;

struct SlotOrder {
  int32_t start[kSlotRanges];     // per range: its sequences, then its first position
  int32_t warp_min[32];           // per warp: lowest and highest valid slot of its sequences
  int32_t warp_max[32];
  int32_t padding[32];            // per (column j, warp): padding sequences (see SlotsOfThread)
  int32_t warp_total[32];         // the scan's per-warp sums
  int32_t crowded;                // some range holds more than kMaxPerRange sequences
  int32_t shared;                 // some range holds more than one sequence
  uint16_t seq[kMaxOrderedSeqs];  // position - first -> sequence, for positions from `first` on
};
static_assert(kMaxOrderedSeqs <= 65536 && kSlotRanges <= 65536, "16-bit positions and ranges");

// Whether a launch takes its sequences in slot order: slots from an index tensor, few enough
// sequences, and more work units than `min_rounds` rounds of the grid (at least one, so that every
// warp has a first unit; block-uniform).
__device__ __forceinline__ bool orders_by_slot(const RecurrentParams& p, uint32_t units, uint32_t grid_warps,
                                               uint32_t min_rounds = 1) {
  return p.slot_indices != nullptr && p.N <= kMaxOrderedSeqs && units > uint64_t(grid_warps) * min_rounds;
}

// Sequence positions below this one keep their index order: those the grid's first round of work
// units (`grid_warps` units, `units_per_seq` per sequence) touches.
__device__ __forceinline__ int first_sorted_position(uint32_t grid_warps, uint32_t units_per_seq) {
  return int((grid_warps + units_per_seq - 1) / units_per_seq);
}

// The sequence at a position: positions from `first` on are looked up in `seq` (SlotOrder::seq).
__device__ __forceinline__ int sequence_at(int position, const uint16_t* seq, int first) {
  return position >= first ? int(seq[position - first]) : position;
}

// The slot indices of a thread's sequences, sequence first + threadIdx.x + j kThreads in column j,
// as loaded: raw bits, so that nothing waits for the loads before settle_slot_order (a sign
// extension right after each load would make them one latency after another).
template <int kThreads>
struct SlotsOfThread {
  static constexpr int kSeqs = (kMaxOrderedSeqs + kThreads - 1) / kThreads;
  static constexpr int kPadding = -1, kNone = -2;  // a padding sequence, past the last sequence
  uint32_t lo[kSeqs], hi[kSeqs];                   // hi: int64 indices only

  // Column j's slot (the kernels' callers keep num_slots below 2^31), kPadding or kNone.
  __device__ __forceinline__ int slot(const RecurrentParams& p, int first, int j) const {
    if (first + int(threadIdx.x) + j * kThreads >= p.N) return kNone;
    const int64_t s = p.idx_type == IndexType::kInt64 ? int64_t(uint64_t(hi[j]) << 32 | lo[j]) : int64_t(int32_t(lo[j]));
    return slot_ok(p, s) ? int(s) : kPadding;
  }
};

// Issues the index loads of the sort and clears its counts.
template <int kThreads>
__device__ __forceinline__ SlotsOfThread<kThreads> begin_slot_order(const RecurrentParams& p, int first, SlotOrder& o) {
  using Slots = SlotsOfThread<kThreads>;
  static_assert(kThreads % 32 == 0 && kSlotRanges % kThreads == 0, "block shape");
  static_assert(Slots::kSeqs * (kThreads / 32) <= 32, "SlotOrder::padding: one entry per (column, warp)");
  constexpr int kRanges = kSlotRanges / kThreads;
  Slots s;
  const bool wide = p.idx_type == IndexType::kInt64;
#pragma unroll
  for (int j = 0; j < Slots::kSeqs; ++j) {
    const int n = first + int(threadIdx.x) + j * kThreads;
    s.lo[j] = s.hi[j] = 0u;
    if (n < p.N) {
      const int64_t i = int64_t(n) * p.idx_row_stride;
      if (wide) {
        const uint2 w = static_cast<const uint2*>(p.slot_indices)[i];
        s.lo[j] = w.x, s.hi[j] = w.y;
      } else {
        s.lo[j] = static_cast<const uint32_t*>(p.slot_indices)[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRanges; ++i) o.start[threadIdx.x * kRanges + i] = 0;
  if (threadIdx.x == 0) o.crowded = 0, o.shared = 0;
  return s;
}

// The slots as numbers, each warp's span of them and its padding sequences per column in shared
// memory; ends with a barrier. Waits for begin_slot_order's loads: called before the kernel's first
// state loads, so that it does not wait for those.
template <int kThreads>
struct SettledSlots {
  int slot[SlotsOfThread<kThreads>::kSeqs];  // as SlotsOfThread::slot()
};

template <int kThreads>
__device__ __forceinline__ SettledSlots<kThreads> settle_slot_order(const RecurrentParams& p, int first,
                                                                    const SlotsOfThread<kThreads>& raw, SlotOrder& o) {
  using Slots = SlotsOfThread<kThreads>;
  constexpr int kSeqs = Slots::kSeqs, kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  SettledSlots<kThreads> s;
#pragma unroll
  for (int j = 0; j < kSeqs; ++j) s.slot[j] = raw.slot(p, first, j);
  int lo = INT_MAX, hi = -1;
#pragma unroll
  for (int j = 0; j < kSeqs; ++j)
    if (s.slot[j] >= 0) lo = min(lo, s.slot[j]), hi = max(hi, s.slot[j]);
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, m));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, m));
  }
  if (lane == 0) o.warp_min[warp] = lo, o.warp_max[warp] = hi;
#pragma unroll
  for (int j = 0; j < kSeqs; ++j) {
    const int pads = __popc(__ballot_sync(0xffffffffu, s.slot[j] == Slots::kPadding));
    if (lane == 0) o.padding[j * kWarps + warp] = pads;
  }
  __syncthreads();  // also: the counts are cleared (begin_slot_order)
  return s;
}

// Fills o.seq[0 .. N - first) with the sequences first .. N - 1 in slot order; false (and no order)
// when a range is crowded. Every thread of the block takes part; ends with a barrier.
template <int kThreads>
__device__ __forceinline__ bool finish_slot_order(const RecurrentParams& p, int first, const SettledSlots<kThreads>& settled,
                                                  SlotOrder& o) {
  using Slots = SlotsOfThread<kThreads>;
  constexpr int kSeqs = Slots::kSeqs, kWarps = kThreads / 32;
  constexpr int kRanges = kSlotRanges / kThreads;  // consecutive ranges per thread in the scan
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int* slot = settled.slot;
  // The span of the valid slots.
  int lo = INT_MAX, hi = -1;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) lo = min(lo, o.warp_min[w]), hi = max(hi, o.warp_max[w]);
  // Padding first, in index order (column-major over the block): position = the padding sequences
  // of earlier columns and warps, then of lower lanes.
  int pad_before[kSeqs], pad_total = 0;
#pragma unroll
  for (int j = 0; j < kSeqs; ++j)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w == warp) pad_before[j] = pad_total;
      pad_total += o.padding[j * kWarps + w];
    }
  const float per_range = float(kSlotRanges) / float(hi - lo + 1);  // hi < lo: no valid slot, unused
  uint32_t where[kSeqs];  // a valid slot's range << 16 | its rank among the range's atomics
#pragma unroll
  for (int j = 0; j < kSeqs; ++j) {
    const int n = first + tid + j * kThreads;
    const uint32_t pads = __ballot_sync(0xffffffffu, slot[j] == Slots::kPadding);
    if (slot[j] == Slots::kPadding) o.seq[pad_before[j] + __popc(pads & lanes_below)] = uint16_t(n);
    if (slot[j] >= 0) {
      const int range = min(int(float(slot[j] - lo) * per_range), kSlotRanges - 1);
      where[j] = uint32_t(range) << 16 | uint32_t(atomicAdd(&o.start[range], 1));
    }
  }
  __syncthreads();
  // Exclusive scan of the counts, after the padding sequences: kRanges ranges per thread, then warps.
  int count[kRanges], sum = 0;
#pragma unroll
  for (int i = 0; i < kRanges; ++i) {
    count[i] = o.start[tid * kRanges + i], sum += count[i];
    if (count[i] > 1) o.shared = 1;
    if (count[i] > kMaxPerRange) o.crowded = 1;
  }
  const int incl = warp_inclusive_sum(sum, lane);
  if (lane == 31) o.warp_total[warp] = incl;
  __syncthreads();
  if (o.crowded) return false;  // the same in every thread: written before the barrier above
  int pos = pad_total + incl - sum;
  for (int w = 0; w < warp; ++w) pos += o.warp_total[w];
  int range_first[kRanges];
#pragma unroll
  for (int i = 0; i < kRanges; ++i) range_first[i] = pos, o.start[tid * kRanges + i] = pos, pos += count[i];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kSeqs; ++j)
    if (slot[j] >= 0) o.seq[o.start[where[j] >> 16] + (where[j] & 0xffffu)] = uint16_t(first + tid + j * kThreads);
  __syncthreads();
  if (!o.shared) return true;  // the same in every thread, as o.crowded
  // Each range's sequences in index order (insertion sort; at most kMaxPerRange).
#pragma unroll
  for (int i = 0; i < kRanges; ++i) {
    uint16_t* seg = o.seq + range_first[i];
    for (int a = 1; a < count[i]; ++a) {
      const uint16_t x = seg[a];
      int b = a - 1;
      for (; b >= 0 && seg[b] > x; --b) seg[b + 1] = seg[b];
      seg[b + 1] = x;
    }
  }
  __syncthreads();
  return true;
}

}  // namespace recurrent
}  // namespace flashkda
