// Parameters and workspace layout of the chunked forward (prefill): chunk_prepare (parallel over
// chunks) writes a per-(chunk, value head) record; chunk_recurrence walks each sequence's chunks in
// order, carrying the fp32 state. Framework-free; filled in csrc/binding/ and tests/cpp/.
#pragma once

#include <cstdint>

#include "flashkda/common/recurrent_params.h"

namespace flashkda {
namespace chunk {

// Tokens per chunk of the state pass. Fixed by the register/shared-memory tiling of both kernels.
constexpr int kChunk = 64;
// Tokens per sub-chunk of the intra-chunk solve: one warp, one m16 MMA row block.
constexpr int kSubChunk = 16;
constexpr int kSubChunks = kChunk / kSubChunk;
// Head dim of the chunked kernels (K == V); other sizes use the recurrent kernel or the reference.
constexpr int kHeadDim = 128;
// CUDA's limit on gridDim.y and gridDim.z: the chunked kernels lay longer ranges over several grid
// rows or launches.
constexpr int kMaxGridRows = 65535;

// One workspace record per (chunk, value head), written by chunk_prepare, read by chunk_recurrence.
// Matrices are row-major over the chunk's tokens c, in the record's token order (record_row,
// chunk_common.cuh: the four sub-chunks reversed; padded tokens are zero rows and columns): the
// [kChunk][kHeadDim] ones in 128-byte swizzled panels (MatTile), the two lower triangular
// [kChunk][kChunk] ones as their sub-chunk blocks on and below the diagonal only (TriTile: the zero
// blocks are neither stored nor loaded). The record is the image of chunk_recurrence's
// shared-memory stage, so one linear bulk copy loads it and wgmma descriptors address it in place.
//   w     [kChunk][kHeadDim] elem   T · (k ⊙ e^{Γ})          (Γ: log decay from the chunk start)
//   qd    [kChunk][kHeadDim] elem   scale · q ⊙ e^{Γ}
//   kd    [kChunk][kHeadDim] elem   k ⊙ e^{Γ_last − Γ}
//   mqk   [kChunk][kChunk]   elem   tril((q ⊙ e^{Γ}) (k ⊙ e^{−Γ})ᵀ), formed pairwise
//   tinv  [kChunk][kChunk]   elem   T = (I + A)⁻¹ diag(β),  A = strict_tril(diag(β) (k e^{Γ})(k e^{−Γ})ᵀ)
//   decay [kHeadDim]         fp32   e^{Γ_last}
// The chunk's output and state update are then  U = T v − w S,  O = qd S + mqk U,
// S ← decay ⊙ S + kdᵀ U  (docs/SPEC.md, "The chunked form").
struct WorkspaceLayout {
  static constexpr int64_t kMatBytes = int64_t(kChunk) * kHeadDim * 2;
  // The kSubChunks (kSubChunks + 1) / 2 blocks of kSubChunk x kSubChunk b16 elements on and below
  // the diagonal.
  static constexpr int64_t kTriBytes = int64_t(kSubChunks) * (kSubChunks + 1) / 2 * kSubChunk * kSubChunk * 2;
  static constexpr int64_t kW = 0;
  static constexpr int64_t kQd = kW + kMatBytes;
  static constexpr int64_t kKd = kQd + kMatBytes;
  static constexpr int64_t kMqk = kKd + kMatBytes;
  static constexpr int64_t kTinv = kMqk + kTriBytes;
  static constexpr int64_t kDecay = kTinv + kTriBytes;
  static constexpr int64_t kRecordBytes = kDecay + kHeadDim * 4;
};

// Which part of the recurrence a chunk_recurrence launch runs. With segments (few long (sequence,
// head) chains), a sequence's chunks are cut into segments of ChunkParams::segment_chunks chunks
// that run in parallel; per chunk the state map is affine, S ← S P + Q (Sᵀ rows: value rows × key
// columns), so a segment's map comes from two runs of the same recurrence, and a scan joins them.
enum class RecurrencePass : int32_t {
  kWhole = 0,          // every chunk of a sequence: state_in -> state_out, and o
  kSegmentLocal = 1,   // per segment: from S = 0 (its local final state Q) and, in the grid's second
                       // half of value blocks, from S = I with v = 0 (its transition P); no o
  kSegmentOutput = 2,  // per segment: from its start state (chunk_segment_scan), writing o only
};

// The segments' states in the workspace: per (sequence n, segment, kind, value head) one fp32
// [kHeadDim][kHeadDim] matrix, rows = value rows (or rows of P), columns = key columns.
struct SegmentLayout {
  enum Kind : int { kLocal = 0, kTransition = 1, kStart = 2, kKinds = 3 };
  static constexpr int64_t kMatrixFloats = int64_t(kHeadDim) * kHeadDim;
};

}  // namespace chunk

struct ChunkParams : RecurrentParams {
  // Workspace: records of WorkspaceLayout::kRecordBytes, record (chunk slot, hv) at
  // (slot * HV + hv). Chunk slots of sequence n are chunk_offsets[n] ... chunk_offsets[n+1]-1.
  void* workspace;            // [num_chunk_slots, HV, kRecordBytes] bytes
  int32_t* chunk_offsets;     // [N + 1] device, varlen only (filled by the chunk_index kernel)
  int64_t* slot_chunks;       // [num_chunk_slots] device, varlen only (chunk_index): each slot's
                              // chunk as pack_slot_chunk(bos, len), 0 past the last chunk
  int32_t* ordered_spans;     // [N][4] device, varlen only (chunk_index): the sequences longest
                              // first, each as {n, first chunk slot, bos, len} (chunk_recurrence's
                              // grid takes them in this order)
  int32_t num_chunk_slots;    // upper bound on the total chunk count: grid size of chunk_prepare
  int32_t chunks_per_seq;     // ceil(T / kChunk) without cu_seqlens
  int32_t value_split;        // blocks per (sequence, head) in chunk_recurrence: kHeadDim / block V
  // Segments (see RecurrencePass); segment_chunks == 0: none, every launch is kWhole.
  int32_t segment_chunks;     // chunks per segment
  int32_t segments_per_seq;   // segments of the longest possible sequence (grid z = N * this)
  chunk::RecurrencePass recurrence_pass;
  int32_t first_grid_row;     // chunk_recurrence: grid z row of this launch's first z (grid z holds
                              // at most chunk::kMaxGridRows; more rows take several launches)
  float* seg_states;          // [segment_count(), SegmentLayout::kKinds, HV, kHeadDim, kHeadDim]
                              // (segment_matrix in chunk_common.cuh)

  // States at chunk starts (prefix caching): the state before chunk j of sequence n (after its
  // first kChunk·j tokens; j = 0: the initial state), written by chunk_recurrence as it passes, in
  // the layout of the final state. nullptr: none.
  // * Dense (chunk_state_slots == nullptr): entry first_slot(n) + j of [entries, HV, K, V], where
  //   first_slot(n) = Σ_{m<n} ceil(len_m / kChunk) (FLA's h of return_intermediate_states).
  // * Pool: slot chunk_state_slots[n, j] (j < chunk_slot_cols; a slot outside [0, entries) skips)
  //   of the pool [entries, HV, K, V].
  void* chunk_states;
  DType chunk_states_dtype;           // float32, bfloat16 or float16
  int64_t chunk_state_entries;        // dense entries or pool slots
  int64_t chunk_state_stride;         // elements between entries / slots; 0: dense (plan_chunk sets it)
  const void* chunk_state_slots;      // [N, chunk_slot_cols], row stride chunk_slot_row_stride
  IndexType chunk_slot_type;
  int64_t chunk_slot_row_stride;
  int32_t chunk_slot_cols;

  // Serving mode (RecurrentParams::slot_indices [N], a pool in state_in == state_out): sequence n
  // starts from slot idx[n] and leaves its final state there; has_initial_state[n] == false starts
  // it from zeros instead (nullptr: every sequence reads its slot). A slot outside [0, num_slots)
  // skips the sequence: zero output, nothing written.
  const bool* has_initial_state;  // [N] or nullptr
};

// Segment matrices of all sequences together (see segment_matrix): at most
// num_chunk_slots / segment_chunks + N, whatever the split of the slots into sequences.
inline int64_t segment_count(const ChunkParams& p) {
  return p.segment_chunks == 0 ? 0 : int64_t(p.num_chunk_slots) / p.segment_chunks + p.N + 1;
}


}  // namespace flashkda
