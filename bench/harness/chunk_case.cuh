// The chunked-prefill case of the standalone timing program prepare_harness.cu: one fixed-length
// sequence of T tokens (token_case.cuh), no states, v = q.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/prefill/chunk_params.h"
#include "token_case.cuh"

inline flashkda::ChunkParams chunk_case_params(int T, int H, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                               const __nv_bfloat16* g, const __nv_bfloat16* beta, const float* A_log,
                                               const float* dt_bias, __nv_bfloat16* o = nullptr) {
  flashkda::ChunkParams p{};
  set_benchmark_tokens(p, 1, T, H, q, k, q, g, beta, o, A_log, dt_bias);
  p.chunks_per_seq = (T + flashkda::chunk::kChunk - 1) / flashkda::chunk::kChunk;
  p.num_chunk_slots = p.chunks_per_seq;
  p.value_split = 1;
  p.recurrence_pass = flashkda::chunk::RecurrencePass::kWhole;
  return p;
}
