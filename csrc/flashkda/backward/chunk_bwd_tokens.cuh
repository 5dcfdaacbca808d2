// chunk_bwd_tokens: the chunked backward's per-token work around the per-chunk passes
// (chunk_bwd_params.h, ChunkBwdTokenParams):
//   inputs   the preprocessed fp32 tensors the passes read: q̂ = scale · l2norm(q), k̂ = l2norm(k)
//            (each repeated over the value heads of its group), the log decay ĝ of every key channel
//            (a scalar gate's: one per token and head) and β̂, computed as the forward kernels
//            compute them (token_math.cuh), and with the l2 norm each row's 1 / norm (the
//            gradients pass takes q and k's gradients back through it where it writes them);
//   grads    the passes' gradients back through that preprocessing (docs/SPEC.md, "Gradients"):
//            dq, dk (summed over each group, through the l2 norm), dg through the gate function,
//            dβ through the sigmoid, written in the raw inputs' dtypes, and the gate parameters'
//            sums per tile of rows (summed by the caller: a fixed order, so the result does not vary
//            from run to run).
// A warp per (kTokensPerWarp tokens, head), four key channels a lane (a scalar gate's ĝ, β̂ and
// their gradients: a thread per token and head): memory-bound, one read of each input and one
// write of each output. Each kernel issues all of its tokens' loads before its
// first store: the compiler, which cannot tell the outputs from the inputs, keeps a load written
// after a store behind it, one memory latency after another.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/constants.h"
#include "flashkda/common/token_math.cuh"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {

namespace chunk_bwd_tokens {

using chunk::kHeadDim;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPerLane = kHeadDim / 32;
constexpr int kRowsPerWarp = kBwdTokenTileRows / kWarps;
// Tokens of a warp in the inputs and q / k gradient kernels: their loads are in flight together
// (sm_90: 48 and 68 registers a thread, five and three blocks an SM, 80 and 48 tokens in flight,
// against 48 and 40 with a token a warp).
constexpr int kTokensPerWarp = 2;
static_assert(kPerLane == 4 && kBwdTokenTileRows % kWarps == 0, "a lane: four channels; a tile: whole warps");

// Element offset of (token row, head) in a [B, T, heads, ...] tensor with these strides.
__device__ __forceinline__ int64_t token_offset(int64_t row, int T, int64_t batch_stride, int64_t token_stride,
                                                int64_t head_stride, int head) {
  const int64_t b = row / T;
  return b * batch_stride + (row - b * T) * token_stride + head * head_stride;
}

// The lane's four channels of q or k at (row, head h), as floats.
__device__ __forceinline__ void load_qk(const ChunkBwdTokenParams& p, bool is_k, int64_t row, int h, int c0,
                                        float (&x)[4]) {
  const RecurrentParams& t = p.tok;
  const int64_t off = is_k ? token_offset(row, t.T, t.k_batch_stride, t.k_token_stride, t.k_head_stride, h)
                           : token_offset(row, t.T, t.q_batch_stride, t.q_token_stride, t.q_head_stride, h);
  load_any_vec<4>(element_at(is_k ? t.k : t.q, p.qk_dtype, off + c0), p.qk_dtype, x);
}

// The raw gate of (row, hv): the lane's four channels, or (scalar gate) the head's value in all four.
__device__ __forceinline__ void load_gate(const ChunkBwdTokenParams& p, int64_t row, int hv, int c0, float (&x)[4]) {
  const RecurrentParams& t = p.tok;
  const int64_t off = token_offset(row, t.T, t.g_batch_stride, t.g_token_stride, t.g_head_stride, hv);
  if (t.scalar_gate) {
    x[0] = x[1] = x[2] = x[3] = load_any(t.g, t.g_dtype, off);
  } else {
    load_any_vec<4>(element_at(t.g, t.g_dtype, off + c0), t.g_dtype, x);
  }
}

// dt_bias of the lane's channels of head hv (a scalar gate: the head's), zero without one.
__device__ __forceinline__ void load_bias(const RecurrentParams& t, int hv, int c0, float (&b)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t i = t.scalar_gate ? hv : int64_t(hv) * kHeadDim + c0 + e;
    b[e] = t.dt_bias == nullptr ? 0.f : load_any(t.dt_bias, t.dt_bias_dtype, i);
  }
}

__device__ __forceinline__ float raw_beta(const RecurrentParams& t, int64_t row, int hv) {
  return load_any(t.beta, t.beta_dtype, token_offset(row, t.T, t.beta_batch_stride, t.beta_token_stride, 1, hv));
}

// First token row of this warp's kTokensPerWarp.
__device__ __forceinline__ int64_t warp_first_row() {
  return (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kTokensPerWarp;
}

// A warp per (kTokensPerWarp tokens, value head): q̂ and k̂ of the head's key head (kQK), ĝ and β̂.
template <bool kQK>
__global__ void __launch_bounds__(kThreads) chunk_bwd_inputs_kernel(const ChunkBwdTokenParams p) {
  const RecurrentParams& t = p.tok;
  const int lane = threadIdx.x & 31, c0 = lane * kPerLane, hv = blockIdx.y;
  const int64_t row0 = warp_first_row();
  const int h = key_head(t, hv);
  // q, k, the raw gate, β and dt_bias of every token: every load before the stores (a row past the
  // end loads and stores nothing; the loops stay unrolled, their arrays in registers)
  float x[kTokensPerWarp][2][4], raw[kTokensPerWarp][4], beta_raw[kTokensPerWarp], bias[4];
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t row = row0 + i;
    if (row >= p.rows) continue;
    if constexpr (kQK) {
#pragma unroll
      for (int is_k = 0; is_k < 2; ++is_k) load_qk(p, is_k, row, h, c0, x[i][is_k]);
    }
    load_gate(p, row, hv, c0, raw[i]);
    beta_raw[i] = lane == 0 ? raw_beta(t, row, hv) : 0.f;
  }
  load_bias(t, hv, c0, bias);
  const float a = gate_scale(t, hv);
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t row = row0 + i;
    if (row >= p.rows) continue;
    const int64_t out = (row * t.HV + hv) * kHeadDim + c0;
    if constexpr (kQK) {
#pragma unroll
      for (int is_k = 0; is_k < 2; ++is_k) {
        float (&y)[4] = x[i][is_k];
        float f = is_k ? 1.f : t.scale;
        if (t.l2norm) {
          const float r = l2norm_rnorm(group_sum<32>(sum_sq4(y)));
          f *= r;
          if (lane == 0) p.qk_rnorm[(row * t.HV + hv) * 2 + is_k] = r;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] *= f;
        store_floats<4>((is_k ? p.k_hat : p.q_hat) + out, y);
      }
    }
    float decay[4];
    log_decays(t, raw[i], bias, a, decay);
    if (!t.scalar_gate)
      store_floats<4>(p.g_hat + out, decay);
    else if (lane == 0)
      p.g_hat[row * t.HV + hv] = decay[0];
    if (lane == 0) p.beta_hat[row * t.HV + hv] = beta_value(t, beta_raw[i]);
  }
}

// A warp per (kTokensPerWarp tokens, key head): dq and dk, the group's value heads summed, back
// through the scale and the l2 norm (r dy − r y (dy · y), y the normalised row, r its 1 / norm).
__global__ void __launch_bounds__(kThreads) chunk_bwd_qk_grads_kernel(const ChunkBwdTokenParams p) {
  const RecurrentParams& t = p.tok;
  const int lane = threadIdx.x & 31, c0 = lane * kPerLane, h = blockIdx.y;
  const int64_t row0 = warp_first_row();
  const int group = t.HV / t.H;
  // Every load first: the gradients of the group's value heads (summed) and the raw q and k.
  float dys[kTokensPerWarp][2][4] = {}, xs[kTokensPerWarp][2][4];
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t row = row0 + i;
    if (row >= p.rows) continue;
#pragma unroll
    for (int is_k = 0; is_k < 2; ++is_k) {
      const float* src = is_k ? p.dk_hat : p.dq_hat;
      for (int j = 0; j < group; ++j) {
        float d[4];
        load_floats<4>(src + (row * t.HV + h * group + j) * kHeadDim + c0, d);
#pragma unroll
        for (int e = 0; e < 4; ++e) dys[i][is_k][e] += d[e];
      }
      if (t.l2norm) load_qk(p, is_k, row, h, c0, xs[i][is_k]);
    }
  }
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t row = row0 + i;
    if (row >= p.rows) continue;
#pragma unroll
    for (int is_k = 0; is_k < 2; ++is_k) {
      float (&dy)[4] = dys[i][is_k];
      if (!is_k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dy[e] *= t.scale;
      }
      if (t.l2norm) {
        const float (&x)[4] = xs[i][is_k];
        const float r = l2norm_rnorm(group_sum<32>(sum_sq4(x)));
        float y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] = x[e] * r;
        const float dot = group_sum<32>(dy[0] * y[0] + dy[1] * y[1] + dy[2] * y[2] + dy[3] * y[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) dy[e] = r * (dy[e] - y[e] * dot);
      }
      store_any_vec4(element_at(is_k ? p.dk : p.dq, p.qk_dtype, (row * t.H + h) * kHeadDim + c0), p.qk_dtype, dy);
    }
  }
}

// d(log decay)/d(raw gate) and d(log decay)/d(A_log) of one channel, x = g + dt_bias, a = e^{A_log}.
template <GateMode kMode>
__device__ __forceinline__ void gate_grad_as(const RecurrentParams& t, float dy, float x, float a, float& dx,
                                             float& da) {
  if constexpr (kMode == GateMode::kLowerBound) {  // lower_bound · sigmoid(a x)
    const float s = sigmoidf_(a * x), dz = dy * t.lower_bound * s * (1.f - s);
    dx = dz * a, da = dz * a * x;
  } else if constexpr (kMode == GateMode::kSoftplus) {  // −a · softplus(x)
    const bool linear = x > kSoftplusThreshold;
    dx = -a * dy * (linear ? 1.f : sigmoidf_(x));
    da = -a * dy * softplusf_(x);
  } else {
    dx = dy, da = 0.f;
  }
}

template <GateMode kMode>
__device__ __forceinline__ void gate_grads(const RecurrentParams& t, const float (&dy)[4], const float (&x)[4], float a,
                                           float (&dx)[4], float& da) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float d;
    gate_grad_as<kMode>(t, dy[e], x[e], a, dx[e], d);
    da += d;
  }
}

// A per-channel gate's gradients: one block per (tile of kBwdTokenTileRows tokens, value head), a
// warp per token at a time: dg and dβ of every token, and the tile's sums of d(dt_bias) and d(A_log).
__global__ void __launch_bounds__(kThreads) chunk_bwd_gate_grads_kernel(const ChunkBwdTokenParams p) {
  __shared__ float part_dt[kWarps][kHeadDim];
  __shared__ float part_a[kWarps];
  const RecurrentParams& t = p.tok;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c0 = lane * kPerLane, hv = blockIdx.y;
  const int64_t tile = blockIdx.x;
  const float a = gate_scale(t, hv);
  float bias[4];
  load_bias(t, hv, c0, bias);
  float sum_dx[4] = {0.f, 0.f, 0.f, 0.f}, sum_da = 0.f;
  // The warp's rows kRowsInFlight at a time, every load of them before the first store.
  constexpr int kRowsInFlight = 2;
  static_assert(kRowsPerWarp % kRowsInFlight == 0, "whole groups of rows");
  for (int i0 = 0; i0 < kRowsPerWarp; i0 += kRowsInFlight) {
    float dys[kRowsInFlight][4], raws[kRowsInFlight][4], dbeta_hat[kRowsInFlight], beta_raw[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = tile * kBwdTokenTileRows + (i0 + r) * kWarps + warp;
      if (row >= p.rows) continue;  // (not break: the loop stays unrolled, its arrays in registers)
      load_floats<4>(p.dg_hat + (row * t.HV + hv) * kHeadDim + c0, dys[r]);
      load_gate(p, row, hv, c0, raws[r]);
      if (lane == 0) {
        dbeta_hat[r] = p.dbeta_hat[row * t.HV + hv];
        beta_raw[r] = t.beta_sigmoid ? raw_beta(t, row, hv) : 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = tile * kBwdTokenTileRows + (i0 + r) * kWarps + warp;
      if (row >= p.rows) continue;
      const float (&dy)[4] = dys[r];
      const float (&raw)[4] = raws[r];
      float x[4], dx[4], da = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = raw[e] + bias[e];
      switch (t.gate_mode) {
        case GateMode::kLowerBound: gate_grads<GateMode::kLowerBound>(t, dy, x, a, dx, da); break;
        case GateMode::kSoftplus: gate_grads<GateMode::kSoftplus>(t, dy, x, a, dx, da); break;
        default: gate_grads<GateMode::kPrecomputed>(t, dy, x, a, dx, da);
      }
      store_any_vec4(element_at(p.dg, t.g_dtype, (row * t.HV + hv) * kHeadDim + c0), t.g_dtype, dx);
#pragma unroll
      for (int e = 0; e < 4; ++e) sum_dx[e] += dx[e];
      sum_da += da;
      if (lane == 0) {
        float db = dbeta_hat[r];
        if (t.beta_sigmoid) {
          const float s = sigmoidf_(beta_raw[r]);
          db *= t.beta_scale * s * (1.f - s);
        }
        store_any(p.dbeta, t.beta_dtype, row * t.HV + hv, db);
      }
    }
  }
  if (p.ddt_bias_part == nullptr && p.dA_log_part == nullptr) return;
#pragma unroll
  for (int e = 0; e < 4; ++e) part_dt[warp][c0 + e] = sum_dx[e];
  sum_da = group_sum<32>(sum_da);
  if (lane == 0) part_a[warp] = sum_da;
  __syncthreads();
  const int c = threadIdx.x;
  if (c < kHeadDim && p.ddt_bias_part != nullptr) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += part_dt[w][c];
    p.ddt_bias_part[(tile * t.HV + hv) * kHeadDim + c] = s;
  }
  if (c == 0 && p.dA_log_part != nullptr) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += part_a[w];
    p.dA_log_part[tile * t.HV + hv] = s;
  }
}

// A scalar gate (one log decay per token and value head) would leave a warp per token all but idle,
// its blocks one memory latency after another: its ĝ, β̂ and gradients take a thread per (token,
// value head) instead, the heads of a token in neighbouring lanes (one coalesced access per warp).
constexpr int kScalarHeads = 32;                           // value heads of a block's lanes
constexpr int kScalarRowGroups = kThreads / kScalarHeads;  // rows of a tile taken side by side
constexpr int kScalarRows = kBwdTokenTileRows / kScalarRowGroups;  // a thread's rows (loads in flight)
static_assert(kBwdTokenTileRows % kScalarRowGroups == 0, "a tile: whole row groups");

// The inputs pass of a scalar gate without q̂ and k̂: ĝ and β̂, a thread per (token, value head).
__global__ void __launch_bounds__(kThreads) chunk_bwd_inputs_scalar_gate_kernel(const ChunkBwdTokenParams p) {
  const RecurrentParams& t = p.tok;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // row · HV + hv
  if (i >= p.rows * t.HV) return;
  const int64_t row = i / t.HV;
  const int hv = int(i - row * t.HV);
  const float raw = load_any(t.g, t.g_dtype, token_offset(row, t.T, t.g_batch_stride, t.g_token_stride, t.g_head_stride, hv));
  const float beta_raw = raw_beta(t, row, hv);
  const float bias = t.dt_bias == nullptr ? 0.f : load_any(t.dt_bias, t.dt_bias_dtype, hv);
  p.g_hat[i] = log_decay(t, raw, bias, gate_scale(t, hv));
  p.beta_hat[i] = beta_value(t, beta_raw);
}

// A scalar gate's dg and dβ of the thread's kScalarRows rows of one value head (rows with a stride
// of kScalarRowGroups from row0), adding its gate parameters' gradients to sum_dx and sum_da.
template <GateMode kMode>
__device__ __forceinline__ void scalar_gate_rows(const ChunkBwdTokenParams& p, int64_t row0, int hv, float& sum_dx,
                                                 float& sum_da) {
  const RecurrentParams& t = p.tok;
  const float a = gate_scale(t, hv), bias = t.dt_bias == nullptr ? 0.f : load_any(t.dt_bias, t.dt_bias_dtype, hv);
  float dy[kScalarRows], raw[kScalarRows], dbeta[kScalarRows], beta_raw[kScalarRows];
#pragma unroll
  for (int r = 0; r < kScalarRows; ++r) {  // every load before the first store
    const int64_t row = row0 + r * kScalarRowGroups;
    if (row >= p.rows) continue;
    dy[r] = p.dg_hat[row * t.HV + hv];
    raw[r] = load_any(t.g, t.g_dtype, token_offset(row, t.T, t.g_batch_stride, t.g_token_stride, t.g_head_stride, hv));
    dbeta[r] = p.dbeta_hat[row * t.HV + hv];
    beta_raw[r] = t.beta_sigmoid ? raw_beta(t, row, hv) : 0.f;
  }
#pragma unroll
  for (int r = 0; r < kScalarRows; ++r) {
    const int64_t row = row0 + r * kScalarRowGroups;
    if (row >= p.rows) continue;
    float dx, da;
    gate_grad_as<kMode>(t, dy[r], raw[r] + bias, a, dx, da);
    store_any(p.dg, t.g_dtype, row * t.HV + hv, dx);
    sum_dx += dx;
    sum_da += da;
    float db = dbeta[r];
    if (t.beta_sigmoid) {
      const float s = sigmoidf_(beta_raw[r]);
      db *= t.beta_scale * s * (1.f - s);
    }
    store_any(p.dbeta, t.beta_dtype, row * t.HV + hv, db);
  }
}

// A scalar gate's gradients pass: a block per (tile of kBwdTokenTileRows tokens, kScalarHeads value
// heads), a thread per (value head, row group); the tile's sums of d(dt_bias) and d(A_log) per head
// over the row groups in order.
__global__ void __launch_bounds__(kThreads) chunk_bwd_gate_grads_scalar_kernel(const ChunkBwdTokenParams p) {
  __shared__ float part[2][kScalarRowGroups][kScalarHeads];  // d(dt_bias), d(A_log)
  const RecurrentParams& t = p.tok;
  const int lane = threadIdx.x % kScalarHeads, group = threadIdx.x / kScalarHeads;
  const int hv = blockIdx.y * kScalarHeads + lane;
  const int64_t tile = blockIdx.x, row0 = tile * kBwdTokenTileRows + group;
  float sum_dx = 0.f, sum_da = 0.f;
  if (hv < t.HV) {
    switch (t.gate_mode) {
      case GateMode::kLowerBound: scalar_gate_rows<GateMode::kLowerBound>(p, row0, hv, sum_dx, sum_da); break;
      case GateMode::kSoftplus: scalar_gate_rows<GateMode::kSoftplus>(p, row0, hv, sum_dx, sum_da); break;
      default: scalar_gate_rows<GateMode::kPrecomputed>(p, row0, hv, sum_dx, sum_da);
    }
  }
  part[0][group][lane] = sum_dx;
  part[1][group][lane] = sum_da;
  __syncthreads();
  float* out = group == 0 ? p.ddt_bias_part : p.dA_log_part;
  if (group < 2 && hv < t.HV && out != nullptr) {
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < kScalarRowGroups; ++g) s += part[group][g][lane];
    out[tile * t.HV + hv] = s;
  }
}

}  // namespace chunk_bwd_tokens

cudaError_t run_chunk_bwd_tokens(const ChunkBwdTokenParams& p, ChunkBwdTokenPass pass, cudaStream_t stream) {
  using namespace chunk_bwd_tokens;
  if (p.rows == 0) return cudaSuccess;
  constexpr int kRowsPerBlock = kWarps * kTokensPerWarp;
  const unsigned row_blocks = unsigned((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const bool scalar = p.tok.scalar_gate;
  if (pass == ChunkBwdTokenPass::kInputs) {
    if (p.q_hat != nullptr)
      chunk_bwd_inputs_kernel<true><<<dim3(row_blocks, unsigned(p.tok.HV)), kThreads, 0, stream>>>(p);
    else if (scalar)
      chunk_bwd_inputs_scalar_gate_kernel<<<unsigned((p.rows * p.tok.HV + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
    else
      chunk_bwd_inputs_kernel<false><<<dim3(row_blocks, unsigned(p.tok.HV)), kThreads, 0, stream>>>(p);
  } else {
    if (p.dq_hat != nullptr)  // (else the gradients pass wrote dq and dk)
      chunk_bwd_qk_grads_kernel<<<dim3(row_blocks, unsigned(p.tok.H)), kThreads, 0, stream>>>(p);
    const unsigned tiles = unsigned((p.rows + kBwdTokenTileRows - 1) / kBwdTokenTileRows);
    if (scalar)
      chunk_bwd_gate_grads_scalar_kernel<<<dim3(tiles, unsigned((p.tok.HV + kScalarHeads - 1) / kScalarHeads)), kThreads, 0,
                                           stream>>>(p);
    else
      chunk_bwd_gate_grads_kernel<<<dim3(tiles, unsigned(p.tok.HV)), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace flashkda
