// The token side shared by the harnesses' cases (decode_case.cuh, chunk_case.cuh): B sequences of
// T tokens, H heads (HV = H), K = V = 128, bf16 token tensors [B, T, H, D] with one shared layout,
// the benchmark's lower-bound gate (−5) with A_log / dt_bias, l2norm and beta sigmoid in the kernel.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "flashkda/common/recurrent_params.h"

inline void set_benchmark_tokens(flashkda::RecurrentParams& p, int B, int T, int H, const __nv_bfloat16* q,
                                 const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* g,
                                 const __nv_bfloat16* beta, __nv_bfloat16* o, const float* A_log,
                                 const float* dt_bias) {
  const int D = 128;
  p.q = q; p.k = k; p.v = v; p.g = g; p.beta = beta; p.o = o;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.g_batch_stride = p.o_batch_stride = int64_t(T) * H * D;
  p.q_token_stride = p.k_token_stride = p.v_token_stride = p.g_token_stride = p.o_token_stride = int64_t(H) * D;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.g_head_stride = p.o_head_stride = D;
  p.beta_batch_stride = int64_t(T) * H; p.beta_token_stride = H;
  p.A_log = A_log; p.dt_bias = dt_bias;
  p.B = B; p.T = T; p.N = B; p.H = H; p.HV = H; p.D = D;
  p.scale = 1.f / sqrtf(float(D)); p.lower_bound = -5.f; p.beta_scale = 1.f;
  p.gate_mode = flashkda::GateMode::kLowerBound; p.l2norm = true; p.beta_sigmoid = true; p.state_v_first = true;
  p.g_dtype = p.beta_dtype = flashkda::DType::kBFloat16;
}
