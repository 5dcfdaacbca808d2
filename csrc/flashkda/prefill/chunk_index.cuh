// chunk_index: chunk_offsets[n] = Σ_{m<n} ceil(len_m / kChunk) for varlen batches, on the device,
// and then every chunk slot's first token and length (slot_chunks), so that chunk_prepare maps its
// work to sequences with one load and without a host sync; and the sequences longest first
// (ordered_spans) for chunk_recurrence.
#pragma once

#include <cuda_runtime.h>

#include "flashkda/prefill/chunk_common.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {
namespace chunk {

constexpr int kIndexThreads = 1024;
// Batches of up to this many sequences keep the offsets in shared memory as well, where the slot
// search and the ordering read them (global memory only for more: 16 KB).
constexpr int kIndexSmemSeqs = 4096;

// Sort keys of the longest-first order: a chunk count rounded down to its leading bit and the two
// bits below it (0 for an empty sequence), so 4 keys per octave, at most 4 · 30 + 4 < 128.
constexpr int kOrderKeys = 128;
__device__ __forceinline__ int order_key(int chunks) {
  if (chunks <= 0) return 0;
  const int lead = 31 - __clz(chunks);
  const int below = lead >= 2 ? (chunks >> (lead - 2)) & 3 : (chunks << (2 - lead)) & 3;
  return 1 + 4 * lead + below;
}

__global__ void __launch_bounds__(kIndexThreads) chunk_index_kernel(const ChunkParams p) {
  __shared__ int warp_total[kIndexThreads / 32];
  __shared__ int carry;
  __shared__ int key_start[kOrderKeys];
  __shared__ int offsets_s[kIndexSmemSeqs + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool cached = p.N <= kIndexSmemSeqs;
  auto offset = [&](int n) { return cached ? offsets_s[n] : p.chunk_offsets[n]; };
  wait_prior_grid();  // the grid before (launch_overlapped): cu_seqlens, and readers of the last workspace
  allow_next_grid();  // chunk_prepare may launch (after the wait: kernel_launch.cuh); it waits for this grid
  if (tid == 0) {
    carry = 0;
    p.chunk_offsets[0] = 0;
    offsets_s[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < p.N; base += kIndexThreads) {
    const int n = base + tid;
    int x = 0;
    if (n < p.N) {
      int64_t bos, len;
      varlen_bounds(p, n, bos, len);
      x = int(num_chunks(len));
    }
    x = warp_inclusive_sum(x, lane);
    if (lane == 31) warp_total[warp] = x;
    __syncthreads();
    if (warp == 0) {
      warp_total[lane] = warp_inclusive_sum(warp_total[lane], lane);
    }
    __syncthreads();
    const int value = carry + x + (warp > 0 ? warp_total[warp - 1] : 0);
    if (n < p.N) {
      p.chunk_offsets[n + 1] = value;
      if (cached) offsets_s[n + 1] = value;
    }
    __syncthreads();
    if (tid == kIndexThreads - 1) carry = value;
    __syncthreads();
  }
  // Slot -> (sequence, chunk) by a binary search over the offsets just written (visible to the
  // whole block after the barrier above).
  const int total = offset(p.N);
  for (int slot = tid; slot < p.num_chunk_slots; slot += kIndexThreads) {
    int64_t word = 0;
    if (slot < total) {
      int lo = 0, hi = p.N;  // offset(lo) <= slot < offset(hi)
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (offset(mid) <= slot) lo = mid; else hi = mid;
      }
      int64_t bos, len;
      varlen_bounds(p, lo, bos, len);
      const int64_t first = int64_t(slot - offset(lo)) * kChunk;
      const int64_t rest = len - first;
      word = pack_slot_chunk(bos + first, rest < kChunk ? int(rest) : kChunk);
    }
    p.slot_chunks[slot] = word;
  }

  // Longest first: chunk_recurrence's blocks are dispatched in grid order, one (sequence, head)
  // chain per block, so the longest chains start first and the short ones fill in around them
  // instead of a long one starting last (a bucket sort by order_key; the order within a key is
  // whatever the atomics give, which no result depends on).
  for (int b = tid; b < kOrderKeys; b += kIndexThreads) key_start[b] = 0;
  __syncthreads();
  for (int n = tid; n < p.N; n += kIndexThreads) atomicAdd(&key_start[order_key(offset(n + 1) - offset(n))], 1);
  __syncthreads();
  if (warp == 0) {  // key b starts after the sequences of every key above it: a suffix scan, 4 keys per lane
    static_assert(kOrderKeys == 4 * 32, "four keys per lane");
    int count[4], sum = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) sum += count[e] = key_start[4 * lane + e];
    int above = sum;  // inclusive: lanes lane .. 31
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_down_sync(0xffffffffu, above, off);
      if (lane + off < 32) above += y;
    }
    int start = above - sum;
#pragma unroll
    for (int e = 3; e >= 0; --e) {
      key_start[4 * lane + e] = start;
      start += count[e];
    }
  }
  __syncthreads();
  for (int n = tid; n < p.N; n += kIndexThreads) {
    const int first = offset(n);
    const int pos = atomicAdd(&key_start[order_key(offset(n + 1) - first)], 1);
    int64_t bos, len;
    varlen_bounds(p, n, bos, len);
    reinterpret_cast<int4*>(p.ordered_spans)[pos] = make_int4(n, first, int(bos), int(len));
  }
}

}  // namespace chunk

cudaError_t run_chunk_index(const ChunkParams& p, cudaStream_t stream) {
  static const bool sm90 = has_sm90_image(chunk::chunk_index_kernel);
  const cudaError_t err = launch_overlapped(sm90, chunk::chunk_index_kernel, dim3(1), dim3(chunk::kIndexThreads), 0,
                                            stream, p);
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t kernel_image_status() {
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, chunk::chunk_index_kernel);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

}  // namespace flashkda
