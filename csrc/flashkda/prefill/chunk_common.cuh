// Where a chunk's tokens live, shared by chunk_index, chunk_prepare and chunk_recurrence.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/common/kernel_launch.cuh"
#include "flashkda/common/mma_sm80.cuh"
#include "flashkda/common/token_math.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {
namespace chunk {

// Shared-memory (and workspace record) layout of the [kChunk][kHeadDim] chunk matrices (w, q e^Γ,
// k e^{Γ_C−Γ}, and chunk_prepare's operand tiles): 128-byte swizzled panels that ldmatrix and
// wgmma descriptors read alike.
using MatTile = sm80::PanelTile<kChunk, kHeadDim / 8>;
static_assert(sm80::matches_swizzle<MatTile>(kChunk, kHeadDim / 8, sm80::panel_tile_layout<kChunk, kHeadDim / 8>()),
              "MatTile is CuTe's 128-byte swizzle in panels");

// Token order of the record and of chunk_recurrence's stages: sub-chunk blocks reversed (token t
// at row record_row(t); rows within a block keep their order). The lower triangular matrices (M,
// T) then have their nonzero blocks first in every 16-column slice (see TriTile), so the wgmmas
// that skip their zero blocks accumulate into leading accumulator tiles: a block of tiles further
// in made ptxas serialize the wgmma pipeline. Every token-indexed tile of the record (w, qd, kd,
// both dimensions of M and T) and of the stage (v, o) uses this order; decay has no token index.
__host__ __device__ __forceinline__ constexpr int record_row(int t) { return t ^ ((kSubChunks - 1) * kSubChunk); }

// The triangular [kChunk][kChunk] matrices (M, T) in record order, where they are block upper
// triangular: only the sub-chunk blocks (r, c), r <= c, are stored, by 16-column slices c. Slice c
// holds rows 0 .. 16 c + 15, 32 bytes each, in the 32-byte swizzle of wgmma (the two 16-byte halves
// of a row swap in rows with bit 2 set), and the slices follow each other. A slice is then the
// K-major B operand of a wgmma of N = 16 (c + 1) rows (SBO 256 bytes), ldmatrix reads of 8 rows
// hit 32 different banks, and the record carries no zero block (10 of 16 blocks: 5 KB, not 8).
struct TriTile {
  static constexpr int kRowBytes = kSubChunk * 2;
  static constexpr int kBlockBytes = kSubChunk * kRowBytes;
  static constexpr int kBytes = int(WorkspaceLayout::kTriBytes);
  static constexpr int kGroupBytes = 8 * kRowBytes;  // 8-row groups: the wgmma descriptor's SBO
  // Byte offset of slice c: the blocks of the slices before it.
  __host__ __device__ __forceinline__ static constexpr int slice_offset(int c) { return c * (c + 1) / 2 * kBlockBytes; }
  // 16-byte chunk `chunk` (columns 8 chunk .. 8 chunk + 7) of row `row`, record order; row / 16 <= chunk / 2.
  __host__ __device__ __forceinline__ static constexpr uint32_t chunk_offset(int row, int chunk) {
    return uint32_t(slice_offset(chunk >> 1) + row * kRowBytes + (((chunk & 1) ^ ((row >> 2) & 1)) << 4));
  }
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return chunk_offset(row, col >> 3) + uint32_t((col & 7) * 2);
  }
  // Element (i, j) and 16-byte chunk (i, columns 8 chunk .. 8 chunk + 7) by tokens, j <= i (block-wise).
  __device__ __forceinline__ static uint32_t token_offset(int i, int j) { return offset(record_row(i), record_row(j)); }
  __device__ __forceinline__ static uint32_t token_chunk_offset(int i, int chunk) {
    return chunk_offset(record_row(i), record_row(8 * chunk) >> 3);
  }
};
static_assert(TriTile::slice_offset(kSubChunks) == TriTile::kBytes, "the slices fill the tile");
static_assert(TriTile::kBlockBytes % 256 == 0, "every slice starts on a 256-byte swizzle atom");
// Each slice is CuTe's 32-byte swizzle (Swizzle<1, 4, 3>) of a tile of 32-byte rows; checked here
// against that layout (the offsets are written out by hand for the reason in mma_sm80.cuh).
__host__ __device__ constexpr bool tri_tile_matches_swizzle() {
  using namespace cute;
  for (int c = 0; c < kSubChunks; ++c) {
    const int rows = kSubChunk * (c + 1);
    const auto slice = composition(Swizzle<1, 4, 3>{}, make_layout(make_shape(rows, Int<2>{}),
                                                                    make_stride(Int<TriTile::kRowBytes>{}, Int<16>{})));
    for (int row = 0; row < rows; ++row)
      for (int half = 0; half < 2; ++half)
        if (TriTile::chunk_offset(row, 2 * c + half) != uint32_t(TriTile::slice_offset(c) + slice(row, half)))
          return false;
  }
  return true;
}
static_assert(tri_tile_matches_swizzle(), "TriTile's slices are CuTe's 32-byte swizzle");

// Overlapped launches (kernel_launch.cuh): chunk_index, chunk_prepare and the first chunk_recurrence
// pass are launched with programmatic stream serialization on sm_90 images and wait for the prior
// grid before touching global memory (chunk_recurrence reads its initial state and the varlen order
// before: see there); each lets the next grid start once its own wait has returned.

struct SeqSpan {
  int64_t batch;  // batch row of the token tensors
  int64_t bos;    // first token of the sequence within that row
  int64_t len;    // tokens (clamped into [0, T - bos]: bad offsets never index memory)
  int64_t first_slot;  // workspace chunk slot of its first chunk
};

__device__ __forceinline__ int64_t num_chunks(int64_t len) { return (len + kChunk - 1) / kChunk; }

// Offset (floats) of one segment matrix in ChunkParams::seg_states (SegmentLayout). Sequence n's
// segments start at segment first_slot / segment_chunks + n: it has ceil(chunks / segment_chunks)
// <= chunks / segment_chunks + 1 of them, so the ranges of consecutive sequences never overlap and
// all fit in segment_count() (sized by the chunk slots, not by N times the longest sequence).
__device__ __forceinline__ int64_t segment_matrix(const ChunkParams& p, int n, const SeqSpan& seq, int seg, int kind,
                                                  int hv) {
  const int64_t index = seq.first_slot / p.segment_chunks + n + seg;
  return ((index * SegmentLayout::kKinds + kind) * p.HV + hv) * SegmentLayout::kMatrixFloats;
}

// The state slot of sequence n (of state_in / state_out): n, or in serving mode its pool slot, -1
// when the slot is outside the pool (the sequence is skipped).
__device__ __forceinline__ int64_t sequence_state_slot(const ChunkParams& p, int n) {
  if (p.slot_indices == nullptr) return n;
  const int64_t slot = load_index(p.slot_indices, p.idx_type, n);
  return slot_ok(p, slot) ? slot : -1;
}

// Whether sequence n starts from its stored state (else from zeros).
__device__ __forceinline__ bool reads_initial_state(const ChunkParams& p, int n) {
  return p.state_in != nullptr && (p.has_initial_state == nullptr || p.has_initial_state[n]);
}

// Element (v, d) of Sᵀ (value row v, key column d) in a [kHeadDim][kHeadDim] state of either layout.
__device__ __forceinline__ int64_t state_offset(bool v_first, int v, int d) {
  return v_first ? int64_t(v) * kHeadDim + d : int64_t(d) * kHeadDim + v;
}

// Chunks of a sequence that have workspace records (bad cu_seqlens on the device could name more
// chunks than the workspace has: stop there).
__device__ __forceinline__ int64_t recorded_chunks(const ChunkParams& p, const SeqSpan& s) {
  const int64_t chunks = num_chunks(s.len), last = p.num_chunk_slots - s.first_slot;
  return chunks < last ? chunks : (last > 0 ? last : 0);
}

// Varlen batches: the clamped span of sequence n (cu_seqlens on the device may be anything).
__device__ __forceinline__ void varlen_bounds(const ChunkParams& p, int n, int64_t& bos, int64_t& len) {
  int64_t b = load_index(p.cu_seqlens, p.cu_type, n), e = load_index(p.cu_seqlens, p.cu_type, n + 1);
  b = b < 0 ? 0 : (b > p.T ? p.T : b);
  e = e < b ? b : (e > p.T ? p.T : e);
  bos = b, len = e - b;
}

__device__ __forceinline__ SeqSpan sequence_span(const ChunkParams& p, int n) {
  SeqSpan s;
  if (p.cu_seqlens != nullptr) {
    s.batch = 0;
    varlen_bounds(p, n, s.bos, s.len);
    s.first_slot = p.chunk_offsets[n];
  } else {
    s.batch = n;
    s.bos = 0;
    s.len = p.T;
    s.first_slot = int64_t(n) * p.chunks_per_seq;
  }
  return s;
}

// The sequence that chunk_recurrence's grid position z takes, and its span: with cu_seqlens the
// z-th longest (ChunkParams::ordered_spans, one 16-byte load), else sequence z.
__device__ __forceinline__ SeqSpan ordered_sequence_span(const ChunkParams& p, int z, int& n) {
  if (p.cu_seqlens == nullptr) {
    n = z;
    return sequence_span(p, z);
  }
  const int4 r = reinterpret_cast<const int4*>(p.ordered_spans)[z];
  n = r.x;
  SeqSpan s;
  s.batch = 0, s.first_slot = r.y, s.bos = r.z, s.len = r.w;
  return s;
}

// Chunk slot -> (sequence, chunk). Returns false for slots past the last chunk.
struct ChunkSpan {
  int64_t batch, bos;  // first token of the chunk
  int len;             // valid tokens, 1..kChunk
};

// A varlen chunk slot's first token and length in one word of ChunkParams::slot_chunks (a length
// of 0: no chunk).
constexpr int kSlotLenBits = 7;
static_assert(kChunk < (1 << kSlotLenBits), "a chunk's length fits in its bits");
__host__ __device__ __forceinline__ int64_t pack_slot_chunk(int64_t bos, int len) {
  return (bos << kSlotLenBits) | len;
}

__device__ __forceinline__ bool locate_chunk(const ChunkParams& p, int slot, ChunkSpan& c) {
  if (p.cu_seqlens != nullptr) {  // one load: chunk_index resolved the slot
    const int64_t word = p.slot_chunks[slot];
    c.batch = 0;
    c.bos = word >> kSlotLenBits;
    c.len = int(word & ((1 << kSlotLenBits) - 1));
    return c.len > 0;
  }
  const int n = slot / p.chunks_per_seq;
  const int64_t j = slot - int64_t(n) * p.chunks_per_seq;
  c.batch = n;
  c.bos = j * kChunk;
  const int64_t rest = p.T - j * kChunk;
  if (rest <= 0) return false;
  c.len = rest < kChunk ? int(rest) : kChunk;
  return true;
}

}  // namespace chunk
}  // namespace flashkda
