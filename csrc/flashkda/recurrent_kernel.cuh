// Token-by-token KDA / GDN recurrence (KDA_SPEC "Recurrence"), one pass over the state per call.
//
// Decode reads and writes the whole state once per call and does a few FLOPs per state element, so
// it is bound by memory: the state stays in fp32 registers for all tokens of a sequence, each
// element is loaded and stored exactly once with 16-byte (fp32) or 8-byte (bf16) accesses, and a
// block owns a slice of value rows/columns so that nothing crosses blocks.
//
// Both state layouts use the identity  o_t = S_dᵀ q_t + u_t (k_t · q_t),  with S_d the decayed state
// and u_t = beta_t (v_t − S_dᵀ k_t), so S_dᵀ k and S_dᵀ q come from one sweep over the registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "constants.h"
#include "recurrent_params.h"
#include "static_switch.h"

namespace flashkda {
namespace recurrent {

// ---------------------------------------------------------------------------------------------
// Element access
// ---------------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// A tensor whose dtype is only known at run time (g, beta); the branch is uniform per launch.
__device__ __forceinline__ float load_any(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, IndexType t, int64_t i) {
  return t == IndexType::kInt64 ? static_cast<const int64_t*>(p)[i]
                                : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Four consecutive elements as floats (8- or 16-byte load when aligned).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&out)[4]) {
  if constexpr (sizeof(T) == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = to_float(h[e]);
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&in)[4]) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  } else {
    uint2 raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) h[e] = from_float<T>(in[e]);
    *reinterpret_cast<uint2*>(p) = raw;
  }
}

__device__ __forceinline__ void load4_state(const void* base, DType dt, int64_t i, float (&out)[4]) {
  if (dt == DType::kBFloat16) {
    load4(static_cast<const __nv_bfloat16*>(base) + i, out);
  } else {
    load4(static_cast<const float*>(base) + i, out);
  }
}

__device__ __forceinline__ void store4_state(void* base, DType dt, int64_t i, const float (&in)[4]) {
  if (dt == DType::kBFloat16) {
    store4(static_cast<__nv_bfloat16*>(base) + i, in);
  } else {
    store4(static_cast<float*>(base) + i, in);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-token preprocessing (KDA_SPEC steps 3 and 4)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float softplusf_(float x) {
  return x > kSoftplusThreshold ? x : log1pf(expf(x));
}

// Natural-log decay of one channel; `a` is exp(A_log[hv]) (1 without A_log).
__device__ __forceinline__ float log_decay(const RecurrentParams& p, float raw, float bias, float a) {
  switch (p.gate_mode) {
    case GateMode::kLowerBound: return p.lower_bound * sigmoidf_(a * (raw + bias));
    case GateMode::kSoftplus: return -a * softplusf_(raw + bias);
    default: return raw;
  }
}

__device__ __forceinline__ float beta_value(const RecurrentParams& p, float raw) {
  return p.beta_sigmoid ? p.beta_scale * sigmoidf_(raw) : raw;
}

// ---------------------------------------------------------------------------------------------
// Which tokens and which slots a sequence uses
// ---------------------------------------------------------------------------------------------

struct Sequence {
  int64_t batch;      // batch row of the token tensors
  int64_t bos;        // first token within that row
  int64_t len;        // number of tokens
  int64_t read_slot;  // state slot to start from; -1: zeros
  bool skip;          // padding sequence: zero output, no state traffic
};

__device__ __forceinline__ bool slot_ok(const RecurrentParams& p, int64_t s) {
  return s >= 0 && s < p.num_slots;
}

__device__ __forceinline__ Sequence resolve_sequence(const RecurrentParams& p, int n) {
  Sequence s;
  if (p.cu_seqlens != nullptr) {
    s.batch = 0;
    s.bos = load_index(p.cu_seqlens, p.cu_type, n);
    s.len = load_index(p.cu_seqlens, p.cu_type, n + 1) - s.bos;
    if (s.len < 0) s.len = 0;  // out-of-order offsets never index memory
  } else {
    s.batch = n;
    s.bos = 0;
    s.len = p.T;
  }
  s.skip = false;
  s.read_slot = p.state_in != nullptr ? n : -1;
  if (p.slot_indices != nullptr) {
    int64_t col = 0;
    if (p.idx_cols > 0 && p.num_accepted != nullptr) {
      col = load_index(p.num_accepted, p.accepted_type, n) - 1;
    }
    const bool col_ok = p.idx_cols == 0 ? true : (col >= 0 && col < p.idx_cols);
    const int64_t slot = col_ok ? load_index(p.slot_indices, p.idx_type, n * p.idx_row_stride + col) : -1;
    s.skip = !slot_ok(p, slot);
    s.read_slot = s.skip ? -1 : slot;
  }
  return s;
}

// Slot written after token i (per-token mode), -1 for a padding token.
__device__ __forceinline__ int64_t token_slot(const RecurrentParams& p, int n, int64_t i) {
  if (i >= p.idx_cols) return -1;
  const int64_t slot = load_index(p.slot_indices, p.idx_type, n * p.idx_row_stride + i);
  return slot_ok(p, slot) ? slot : -1;
}

// Slot written after the last token (per-sequence modes), -1 for none.
__device__ __forceinline__ int64_t final_slot(const RecurrentParams& p, int n, const Sequence& s) {
  if (p.state_out == nullptr || s.skip) return -1;
  if (p.slot_indices != nullptr) return s.len > 0 ? s.read_slot : -1;  // zero-length: untouched
  return n;
}

// ---------------------------------------------------------------------------------------------
// V-first state ([HV, V, K]): a row of K contiguous keys per value index. TK lanes span a row
// (16-byte chunks, stride 4*TK), so every reduction over K stays inside a group of TK lanes and
// the block needs no shared memory and no barrier.
// ---------------------------------------------------------------------------------------------

template <int D, int BV>
struct VFirstShape {
  static constexpr int kThreads = 128;
  static constexpr int kLanesK = 8;                        // lanes along K
  static constexpr int kChunks = D / (4 * kLanesK);        // 16-byte chunks per lane and row
  static constexpr int kRowsPerPass = kThreads / kLanesK;  // rows covered by the block at once
  static constexpr int kRowsPerThread = BV / kRowsPerPass;
  static_assert(D % (4 * kLanesK) == 0, "head dim must be a multiple of 32");
  static_assert(BV % kRowsPerPass == 0 && D % BV == 0, "bad value block");
};

template <int W>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = 1; m < W; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

template <typename Elem, int D, int BV>
__global__ void __launch_bounds__(VFirstShape<D, BV>::kThreads)
    decode_step_vfirst(const RecurrentParams p) {
  using Shape = VFirstShape<D, BV>;
  constexpr int TK = Shape::kLanesK, CH = Shape::kChunks, RPT = Shape::kRowsPerThread;
  constexpr int kBlocksV = D / BV;
  const int n = blockIdx.x / kBlocksV;
  const int v0 = (blockIdx.x % kBlocksV) * BV;
  const int hv = blockIdx.y;
  const int h = hv / (p.HV / p.H);
  const int lane_k = threadIdx.x % TK;
  const int row0 = v0 + threadIdx.x / TK;  // rows row0 + j * kRowsPerPass

  const Sequence seq = resolve_sequence(p, n);
  Elem* o_base = static_cast<Elem*>(p.o) + seq.batch * p.o_batch_stride + hv * p.o_head_stride;
  if (seq.skip) {
    if (lane_k == 0) {
      for (int64_t i = 0; i < seq.len; ++i)
#pragma unroll
        for (int j = 0; j < RPT; ++j)
          o_base[(seq.bos + i) * p.o_token_stride + row0 + j * Shape::kRowsPerPass] = from_float<Elem>(0.f);
    }
    return;
  }

  const int64_t slot_elems = int64_t(p.HV) * D * D;
  auto state_offset = [&](int64_t slot, int j, int c) {
    return slot * slot_elems + int64_t(hv) * D * D + int64_t(row0 + j * Shape::kRowsPerPass) * D +
           c * 4 * TK + lane_k * 4;
  };

  float S[RPT][CH][4];
  if (seq.read_slot >= 0) {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
#pragma unroll
      for (int c = 0; c < CH; ++c) load4_state(p.state_in, p.state_in_dtype, state_offset(seq.read_slot, j, c), S[j][c]);
  } else {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[j][c][e] = 0.f;
  }

  const float a = p.A_log != nullptr ? expf(p.A_log[hv]) : 1.f;
  const bool per_token_slots = p.slot_indices != nullptr && p.idx_cols > 0;

  for (int64_t i = 0; i < seq.len; ++i) {
    const int64_t t = seq.bos + i;
    int64_t write_slot = -1;
    if (per_token_slots) {
      write_slot = token_slot(p, n, i);
      if (write_slot < 0) {  // padding token: skipped
        if (lane_k == 0)
#pragma unroll
          for (int j = 0; j < RPT; ++j)
            o_base[t * p.o_token_stride + row0 + j * Shape::kRowsPerPass] = from_float<Elem>(0.f);
        continue;
      }
    }
    const Elem* q_ptr = static_cast<const Elem*>(p.q) + seq.batch * p.q_batch_stride + t * p.q_token_stride + h * p.q_head_stride;
    const Elem* k_ptr = static_cast<const Elem*>(p.k) + seq.batch * p.k_batch_stride + t * p.k_token_stride + h * p.k_head_stride;
    const int64_t g_off = seq.batch * p.g_batch_stride + t * p.g_token_stride + hv * p.g_head_stride;
    float qv[CH][4], kv[CH][4], decay[CH][4];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      load4(q_ptr + c * 4 * TK + lane_k * 4, qv[c]);
      load4(k_ptr + c * 4 * TK + lane_k * 4, kv[c]);
    }
    const float beta = beta_value(p, load_any(p.beta, p.beta_dtype, seq.batch * p.beta_batch_stride + t * p.beta_token_stride + hv));
    if (p.scalar_gate) {
      const float ld = log_decay(p, load_any(p.g, p.g_dtype, g_off), p.dt_bias != nullptr ? p.dt_bias[hv] : 0.f, a);
      const float d = expf(ld);
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) decay[c][e] = d;
    } else {
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kk = c * 4 * TK + lane_k * 4 + e;
          const float bias = p.dt_bias != nullptr ? p.dt_bias[int64_t(hv) * D + kk] : 0.f;
          decay[c][e] = expf(log_decay(p, load_any(p.g, p.g_dtype, g_off + kk), bias, a));
        }
    }

    float q_scale = p.scale, k_scale = 1.f;
    if (p.l2norm) {
      float qq = 0.f, kk2 = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          qq += qv[c][e] * qv[c][e];
          kk2 += kv[c][e] * kv[c][e];
        }
      q_scale *= rsqrtf(group_sum<TK>(qq) + kL2NormEps);
      k_scale = rsqrtf(group_sum<TK>(kk2) + kL2NormEps);
    }
    float kq = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qv[c][e] *= q_scale;
        kv[c][e] *= k_scale;
        kq += kv[c][e] * qv[c][e];
      }
    kq = group_sum<TK>(kq);

    float sk[RPT], sq[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      sk[j] = 0.f;
      sq[j] = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          S[j][c][e] *= decay[c][e];
          sk[j] += S[j][c][e] * kv[c][e];
          sq[j] += S[j][c][e] * qv[c][e];
        }
    }
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      sk[j] = group_sum<TK>(sk[j]);
      sq[j] = group_sum<TK>(sq[j]);
    }
    const Elem* v_ptr = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + t * p.v_token_stride + hv * p.v_head_stride;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int row = row0 + j * Shape::kRowsPerPass;
      const float u = beta * (to_float(v_ptr[row]) - sk[j]);
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[j][c][e] += kv[c][e] * u;
      if (lane_k == 0) o_base[t * p.o_token_stride + row] = from_float<Elem>(sq[j] + u * kq);
    }
    if (write_slot >= 0) {
#pragma unroll
      for (int j = 0; j < RPT; ++j)
#pragma unroll
        for (int c = 0; c < CH; ++c) store4_state(p.state_out, p.state_out_dtype, state_offset(write_slot, j, c), S[j][c]);
    }
  }

  if (!per_token_slots) {
    const int64_t slot = final_slot(p, n, seq);
    if (slot >= 0) {
#pragma unroll
      for (int j = 0; j < RPT; ++j)
#pragma unroll
        for (int c = 0; c < CH; ++c) store4_state(p.state_out, p.state_out_dtype, state_offset(slot, j, c), S[j][c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// K-first state ([HV, K, V]): a row of V contiguous values per key index. A block owns 32 value
// columns; each lane owns one column and half of the K rows (the other half sits 16 lanes away),
// so a reduction over K is a register sweep plus one shuffle. The per-token q, k and decay
// vectors, needed by every lane, go through shared memory.
// ---------------------------------------------------------------------------------------------

template <int D>
struct KFirstShape {
  static constexpr int kThreads = 64;
  static constexpr int kCols = 32;      // value columns per block
  static constexpr int kRows = D / 2;   // key rows per thread
  static_assert(D % kThreads == 0, "head dim must be a multiple of 64");
};

template <typename Elem, int D>
__global__ void __launch_bounds__(KFirstShape<D>::kThreads)
    decode_step_kfirst(const RecurrentParams p) {
  using Shape = KFirstShape<D>;
  constexpr int R = Shape::kRows;
  constexpr int kBlocksV = D / Shape::kCols;
  constexpr int kPerThread = D / Shape::kThreads;  // q/k/g elements each thread preprocesses
  __shared__ float q_s[D], k_s[D], decay_s[D];
  __shared__ float red_s[2][3];

  const int n = blockIdx.x / kBlocksV;
  const int hv = blockIdx.y;
  const int h = hv / (p.HV / p.H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = (blockIdx.x % kBlocksV) * Shape::kCols + warp * 16 + lane % 16;
  const int r0 = (lane / 16) * R;  // this lane's key rows: r0 .. r0 + R - 1

  const Sequence seq = resolve_sequence(p, n);
  Elem* o_base = static_cast<Elem*>(p.o) + seq.batch * p.o_batch_stride + hv * p.o_head_stride;
  if (seq.skip) {
    if (lane < 16)
      for (int64_t i = 0; i < seq.len; ++i) o_base[(seq.bos + i) * p.o_token_stride + col] = from_float<Elem>(0.f);
    return;
  }

  const int64_t slot_elems = int64_t(p.HV) * D * D;
  auto state_offset = [&](int64_t slot, int r) {
    return slot * slot_elems + int64_t(hv) * D * D + int64_t(r0 + r) * D + col;
  };
  auto load_state = [&](int64_t off) {
    return p.state_in_dtype == DType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.state_in)[off])
                                             : static_cast<const float*>(p.state_in)[off];
  };
  auto store_state = [&](int64_t slot, const float (&S)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t off = state_offset(slot, r);
      if (p.state_out_dtype == DType::kBFloat16) {
        static_cast<__nv_bfloat16*>(p.state_out)[off] = __float2bfloat16(S[r]);
      } else {
        static_cast<float*>(p.state_out)[off] = S[r];
      }
    }
  };

  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = seq.read_slot >= 0 ? load_state(state_offset(seq.read_slot, r)) : 0.f;

  const float a = p.A_log != nullptr ? expf(p.A_log[hv]) : 1.f;
  const bool per_token_slots = p.slot_indices != nullptr && p.idx_cols > 0;

  for (int64_t i = 0; i < seq.len; ++i) {
    const int64_t t = seq.bos + i;
    int64_t write_slot = -1;
    if (per_token_slots) {
      write_slot = token_slot(p, n, i);
      if (write_slot < 0) {
        if (lane < 16) o_base[t * p.o_token_stride + col] = from_float<Elem>(0.f);
        continue;
      }
    }
    // Stage q, k and the decay of this token in shared memory, with the l2 norms.
    const Elem* q_ptr = static_cast<const Elem*>(p.q) + seq.batch * p.q_batch_stride + t * p.q_token_stride + h * p.q_head_stride;
    const Elem* k_ptr = static_cast<const Elem*>(p.k) + seq.batch * p.k_batch_stride + t * p.k_token_stride + h * p.k_head_stride;
    const int64_t g_off = seq.batch * p.g_batch_stride + t * p.g_token_stride + hv * p.g_head_stride;
    float qr[kPerThread], kr[kPerThread];
    float part[3] = {0.f, 0.f, 0.f};  // sum q², sum k², sum q k
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int kk = threadIdx.x + e * Shape::kThreads;
      qr[e] = to_float(q_ptr[kk]);
      kr[e] = to_float(k_ptr[kk]);
      part[0] += qr[e] * qr[e];
      part[1] += kr[e] * kr[e];
      part[2] += qr[e] * kr[e];
      const float raw = load_any(p.g, p.g_dtype, g_off + (p.scalar_gate ? 0 : kk));
      const float bias = p.dt_bias == nullptr ? 0.f : p.dt_bias[p.scalar_gate ? int64_t(hv) : int64_t(hv) * D + kk];
      decay_s[kk] = expf(log_decay(p, raw, bias, a));
    }
#pragma unroll
    for (int m = 0; m < 3; ++m) part[m] = group_sum<32>(part[m]);
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < 3; ++m) red_s[warp][m] = part[m];
    }
    __syncthreads();
    float q_scale = p.scale, k_scale = 1.f;
    if (p.l2norm) {
      q_scale *= rsqrtf(red_s[0][0] + red_s[1][0] + kL2NormEps);
      k_scale = rsqrtf(red_s[0][1] + red_s[1][1] + kL2NormEps);
    }
    const float kq = (red_s[0][2] + red_s[1][2]) * q_scale * k_scale;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int kk = threadIdx.x + e * Shape::kThreads;
      q_s[kk] = qr[e] * q_scale;
      k_s[kk] = kr[e] * k_scale;
    }
    __syncthreads();

    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      S[r] *= decay_s[r0 + r];
      sk += S[r] * k_s[r0 + r];
      sq += S[r] * q_s[r0 + r];
    }
    sk += __shfl_xor_sync(0xffffffffu, sk, 16);
    sq += __shfl_xor_sync(0xffffffffu, sq, 16);
    const float beta = beta_value(p, load_any(p.beta, p.beta_dtype, seq.batch * p.beta_batch_stride + t * p.beta_token_stride + hv));
    const Elem* v_ptr = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + t * p.v_token_stride + hv * p.v_head_stride;
    const float u = beta * (to_float(v_ptr[col]) - sk);
#pragma unroll
    for (int r = 0; r < R; ++r) S[r] += k_s[r0 + r] * u;
    if (lane < 16) o_base[t * p.o_token_stride + col] = from_float<Elem>(sq + u * kq);
    if (write_slot >= 0) store_state(write_slot, S);
    __syncthreads();  // shared vectors are rewritten by the next token
  }

  if (!per_token_slots) {
    const int64_t slot = final_slot(p, n, seq);
    if (slot >= 0) store_state(slot, S);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

template <typename Elem, int D>
cudaError_t launch(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  if (p.state_v_first) {
    // Smaller value blocks put more blocks in flight when there are few (sequence, head) pairs.
    const bool small = int64_t(p.N) * p.HV * (D / 32) < 4 * int64_t(p.num_sms);
    return FLASHKDA_BOOL_SWITCH(small, kSmall, [&] {
      constexpr int BV = kSmall ? 16 : 32;
      const dim3 grid(unsigned(p.N) * (D / BV), unsigned(p.HV));
      decode_step_vfirst<Elem, D, BV><<<grid, VFirstShape<D, BV>::kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  }
  const dim3 grid(unsigned(p.N) * (D / KFirstShape<D>::kCols), unsigned(p.HV));
  decode_step_kfirst<Elem, D><<<grid, KFirstShape<D>::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace recurrent

template <typename Elem, int D>
cudaError_t run_recurrent(const RecurrentParams& params, cudaStream_t stream) {
  return recurrent::launch<Elem, D>(params, stream);
}

}  // namespace flashkda
