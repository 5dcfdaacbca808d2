// The chunked-prefill case of the standalone timing programs (prepare_harness.cu,
// partition_probe.cu): B = 1 fixed-length sequence of T tokens, H heads (HV = H), K = V = kHeadDim,
// bf16 token tensors [T, H, D] with one shared layout, the benchmark's lower-bound gate (−5) with
// A_log / dt_bias, l2norm and beta sigmoid in the kernel, no states. v aliases q unless given.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flashkda/chunk_params.h"

inline flashkda::ChunkParams chunk_case_params(int T, int H, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                               const __nv_bfloat16* g, const __nv_bfloat16* beta, const float* A_log,
                                               const float* dt_bias, __nv_bfloat16* o = nullptr) {
  const int D = flashkda::chunk::kHeadDim;
  flashkda::ChunkParams p{};
  p.q = q; p.k = k; p.v = q; p.g = g; p.beta = beta; p.o = o;
  p.q_batch_stride = p.k_batch_stride = p.g_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(T) * H * D;
  p.q_token_stride = p.k_token_stride = p.g_token_stride = p.v_token_stride = p.o_token_stride = int64_t(H) * D;
  p.q_head_stride = p.k_head_stride = p.g_head_stride = p.v_head_stride = p.o_head_stride = D;
  p.beta_batch_stride = int64_t(T) * H; p.beta_token_stride = H;
  p.A_log = A_log; p.dt_bias = dt_bias;
  p.B = 1; p.T = T; p.N = 1; p.H = H; p.HV = H; p.D = D;
  p.scale = 1.f / sqrtf(float(D)); p.lower_bound = -5.f; p.beta_scale = 1.f;
  p.gate_mode = flashkda::GateMode::kLowerBound; p.l2norm = true; p.beta_sigmoid = true; p.state_v_first = true;
  p.g_dtype = p.beta_dtype = flashkda::DType::kBFloat16;
  p.chunks_per_seq = (T + flashkda::chunk::kChunk - 1) / flashkda::chunk::kChunk;
  p.num_chunk_slots = p.chunks_per_seq;
  p.value_split = 1;
  p.recurrence_pass = flashkda::chunk::RecurrencePass::kWhole;
  return p;
}
