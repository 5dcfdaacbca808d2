// Planning and running a chunked forward (prefill) without a framework, in three steps:
//   1. plan_chunk(p, value_split, segment_chunks): from the shapes in `p` (B, T, N, HV, whether
//      cu_seqlens is given) and p.num_sms, choose the grid, the value split and the segments, and
//      size the workspace (ChunkWorkspace);
//   2. the caller allocates ChunkWorkspace::total() bytes of device memory, any way it likes (the
//      torch binding: PyTorch's caching allocator, so a CUDA graph keeps it in its pool), and
//      carve_chunk_workspace() points the params at its parts;
//   3. run_chunk_forward<Elem>(p, stream) launches chunk_index (varlen), chunk_prepare and the
//      recurrence (whole chains, or the segment passes and the scan) on one stream.
// No host synchronisation anywhere: the varlen grid is sized from an upper bound on the chunk count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "flashkda/api.h"

namespace flashkda {

// Bytes of each part of a chunked forward's workspace, in the order they are laid out: the
// records (one per chunk slot and value head), the segment matrices, then the varlen index
// (ordered_spans as int4, slot_chunks as int64, chunk_offsets as int32), each part 16-byte aligned.
struct ChunkWorkspace {
  int64_t record_bytes = 0, segment_bytes = 0, order_bytes = 0, slot_bytes = 0, offset_bytes = 0;
  // Bytes to allocate: every part, or every part but the records when the caller keeps them in
  // memory of its own (carve_chunk_workspace's `records`, e.g. for a backward that reads them).
  int64_t total(bool records_elsewhere = false) const {
    return (records_elsewhere ? 0 : record_bytes) + segment_bytes + order_bytes + slot_bytes + offset_bytes;
  }
};

// Chunks per segment for few long chains, or 0 for whole chains. chunk_recurrence holds one block
// per SM and spends about the same time per chunk whatever the grid (H200: 1.66 µs at T = 32768,
// H = 8, and 1.68 µs at T = 8192, H = 16), so a launch costs (chunks per block) × (waves of blocks).
// Segments of c chunks cost c × (waves of the local pass, which runs twice the blocks, plus waves
// of the output pass) plus one scan step per segment (about 2 µs, counted as one chunk);
// they are taken when that saves at least a sixth. `chunks` is per sequence (the mean with
// cu_seqlens: lengths live on the device), `chains` the blocks of one whole-chain launch.
inline int64_t auto_segment_chunks(int64_t chunks, int64_t chains, int64_t sms) {
  auto waves = [sms](int64_t blocks) { return (blocks + sms - 1) / sms; };
  int64_t best = 0, best_cost = chunks * waves(chains) * 5 / 6;
  for (int64_t c = 16; c < chunks; c *= 2) {
    const int64_t segments = (chunks + c - 1) / c;
    const int64_t cost = c * (waves(2 * chains * segments) + waves(chains * segments)) + segments;
    if (cost < best_cost) best = c, best_cost = cost;
  }
  return best;
}

// Fills num_chunk_slots, chunks_per_seq, value_split, segment_chunks, segments_per_seq and
// recurrence_pass of `p` (whose token, state and varlen fields and num_sms are set) and `ws`.
// value_split: blocks per (sequence, head) in chunk_recurrence, 1 or 2; 0 splits only while all
// blocks fit in one wave. segment_chunks: 0 runs each sequence's recurrence as one chain; n > 0
// cuts it into segments of n chunks joined by a scan; -1 picks by auto_segment_chunks. Returns ""
// or why the call cannot run.
inline std::string plan_chunk(ChunkParams& p, int64_t value_split, int64_t segment_chunks, ChunkWorkspace& ws) {
  // Slot strides of 0 mean dense: the chunked kernels read the strides as set here (a select in
  // chunk_recurrence cost it 4 registers and 16 bytes of spills).
  if (p.state_slot_stride == 0) p.state_slot_stride = int64_t(p.HV) * p.D * p.D;
  if (p.chunk_state_stride == 0) p.chunk_state_stride = int64_t(p.HV) * p.D * p.D;
  const int64_t chunk = chunk::kChunk;
  const bool varlen = p.cu_seqlens != nullptr;
  int64_t slots = 0;
  if (varlen) {
    slots = (int64_t(p.T) + (chunk - 1) * p.N) / chunk;  // >= Σ ceil(len_n / kChunk) for any split of T
  } else {
    p.chunks_per_seq = int32_t((p.T + chunk - 1) / chunk);
    slots = int64_t(p.B) * p.chunks_per_seq;
  }
  if (slots >= (int64_t(1) << 31)) return "too many chunks";
  p.num_chunk_slots = int32_t(slots);
  // chunk_recurrence runs one block per SM (its shared memory): split a chain's value columns over
  // two blocks only while all blocks still fit in one wave (measured on the H200: H = 64 split 0.29
  // ms vs 0.49 unsplit; H = 96 split 0.57 ms, two waves, vs 0.50 unsplit).
  if (value_split == 0) value_split = 2 * int64_t(p.N) * p.HV <= p.num_sms ? 2 : 1;
  if (value_split != 1 && value_split != 2) return "value_split must be 0, 1 or 2";
  p.value_split = int32_t(value_split);
  if (segment_chunks < -1)
    return "segment_chunks must be -1 (auto), 0 or more, got " + std::to_string(segment_chunks);
  // With cu_seqlens one sequence may hold every token: size the grid for that.
  const int64_t max_chunks = varlen ? (int64_t(p.T) + chunk - 1) / chunk : p.chunks_per_seq;
  const bool auto_segments = segment_chunks == -1;
  if (auto_segments) {
    const int64_t mean_chunks = varlen ? max_chunks / std::max(p.N, 1) : p.chunks_per_seq;
    segment_chunks = auto_segment_chunks(mean_chunks, int64_t(p.N) * p.HV * value_split, p.num_sms);
  }
  // The segment passes keep N × segments per sequence in one grid (grid z: chunk::kMaxGridRows).
  const int64_t segments =
      segment_chunks > 0 ? std::max<int64_t>(1, (max_chunks + segment_chunks - 1) / segment_chunks) : 0;
  if (auto_segments && segments * p.N > chunk::kMaxGridRows) segment_chunks = 0;
  p.recurrence_pass = chunk::RecurrencePass::kWhole;
  p.segment_chunks = 0;
  p.segments_per_seq = 0;
  if (segment_chunks > 0) {
    if (segments * p.N > chunk::kMaxGridRows)
      return "too many segments (" + std::to_string(segments) + " per sequence, " + std::to_string(p.N) +
             " sequences): choose more chunks per segment";
    p.segment_chunks = int32_t(segment_chunks);
    p.segments_per_seq = int32_t(segments);
  }
  ws = ChunkWorkspace{};
  ws.record_bytes = slots * p.HV * chunk::WorkspaceLayout::kRecordBytes;
  ws.segment_bytes =
      segment_count(p) * chunk::SegmentLayout::kKinds * p.HV * chunk::SegmentLayout::kMatrixFloats * 4;
  if (varlen) {
    ws.order_bytes = int64_t(p.N) * 16;
    ws.slot_bytes = slots * 8;
    ws.offset_bytes = (int64_t(p.N) + 1) * 4;
  }
  return "";
}

// Points the workspace fields of `p` at the parts of `base` (device memory of ws.total() bytes,
// 16-byte aligned), or, with `records` (ws.record_bytes bytes, 16-byte aligned), the records there
// and the other parts at `base` (ws.total(true) bytes).
inline void carve_chunk_workspace(ChunkParams& p, const ChunkWorkspace& ws, void* base, void* records = nullptr) {
  uint8_t* const bytes = static_cast<uint8_t*>(base);
  const int64_t rest = records != nullptr ? 0 : ws.record_bytes;  // where the parts after the records start
  p.workspace = records != nullptr ? records : bytes;
  p.seg_states = ws.segment_bytes > 0 ? reinterpret_cast<float*>(bytes + rest) : nullptr;
  if (p.cu_seqlens != nullptr) {
    uint8_t* const index = bytes + rest + ws.segment_bytes;
    p.ordered_spans = reinterpret_cast<int32_t*>(index);
    p.slot_chunks = reinterpret_cast<int64_t*>(index + ws.order_bytes);
    p.chunk_offsets = reinterpret_cast<int32_t*>(index + ws.order_bytes + ws.slot_bytes);
  }
}

// Launches the planned forward on `stream`: chunk_index (varlen), chunk_prepare, then the
// recurrence, whole or as the segments' local pass, the scan and the output pass. Elem:
// __nv_bfloat16 or __half (q, k, v, o).
template <typename Elem>
cudaError_t run_chunk_forward(ChunkParams& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (p.cu_seqlens != nullptr) err = run_chunk_index(p, stream);
  if (err == cudaSuccess) err = run_chunk_prepare<Elem>(p, stream);
  auto recurrence = [&](chunk::RecurrencePass pass) {
    p.recurrence_pass = pass;
    if (err == cudaSuccess)
      err = p.value_split == 1 ? run_chunk_recurrence<Elem, chunk::kHeadDim>(p, stream)
                               : run_chunk_recurrence<Elem, chunk::kHeadDim / 2>(p, stream);
  };
  if (p.segment_chunks == 0) {
    recurrence(chunk::RecurrencePass::kWhole);
  } else {
    recurrence(chunk::RecurrencePass::kSegmentLocal);
    if (err == cudaSuccess) err = run_chunk_segment_scan(p, stream);
    recurrence(chunk::RecurrencePass::kSegmentOutput);
  }
  return err;
}

}  // namespace flashkda
