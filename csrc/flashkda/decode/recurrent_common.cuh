// Pieces shared by the decode kernels (recurrent_kernel.cuh for every device, decode_bulk.cuh for
// sm_90): which tokens and state slots a sequence uses, and the per-token preprocessing of q, k and
// the gate into a warp's shared-memory scratch; and the host helpers that size and launch the
// persistent decode kernels. Framework-free.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/constants.h"
#include "flashkda/common/recurrent_params.h"
#include "flashkda/common/token_math.cuh"

namespace flashkda {
namespace recurrent {

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
// Token vectors. Every warp stages the preprocessed q, k and decay of the current token in its own
// shared-memory scratch (lane l computes channels l, l+32, ...): loads are coalesced, the l2 norms
// are warp reductions, and no block-wide barrier is needed. Redundant across warps, but tiny next
// to the state traffic.
// ---------------------------------------------------------------------------------------------

template <int D>
struct TokenScratch {
  float q[D];      // scale * q / |q|
  float k[D];      // k / |k|
  float decay[D];  // exp(log decay)
};

// The raw values of one token that a lane preprocesses (channels lane, lane + 32, ...).
template <int D>
struct TokenRegs {
  static constexpr int M = D / 32;  // channels per lane: lane, lane + 32, ...
  float q[M], k[M], g[M], bias[M];  // g[0] / bias[0] only with a scalar gate
};

// Where one token's q, k and gate come from: rows of the token tensors in global memory, or copies
// of them in shared memory (decode_bulk.cuh stages the first token of a work item). Generic
// pointers serve both.
template <typename Elem>
struct TokenSrc {
  const Elem* q;      // [D]
  const Elem* k;      // [D]
  const void* g;      // [D] of g_dtype, or one value with a scalar gate
  DType g_dtype;
  const void* bias;   // [D] of bias_dtype, or one value with a scalar gate; nullptr: zero bias
  DType bias_dtype;
};

// Token t of batch row `batch`, key head h, value head hv, in global memory.
template <typename Elem, int D>
__device__ __forceinline__ TokenSrc<Elem> global_token(const RecurrentParams& p, int64_t batch, int64_t t, int h,
                                                       int hv) {
  TokenSrc<Elem> s;
  s.q = static_cast<const Elem*>(p.q) + batch * p.q_batch_stride + t * p.q_token_stride + h * p.q_head_stride;
  s.k = static_cast<const Elem*>(p.k) + batch * p.k_batch_stride + t * p.k_token_stride + h * p.k_head_stride;
  s.g = static_cast<const char*>(p.g) +
        (batch * p.g_batch_stride + t * p.g_token_stride + hv * p.g_head_stride) * dtype_bytes(p.g_dtype);
  s.g_dtype = p.g_dtype;
  s.bias = p.dt_bias == nullptr ? nullptr
                                 : static_cast<const char*>(p.dt_bias) +
                                       (p.scalar_gate ? int64_t(hv) : int64_t(hv) * D) * dtype_bytes(p.dt_bias_dtype);
  s.bias_dtype = p.dt_bias_dtype;
  return s;
}

template <typename Elem, int D>
__device__ __forceinline__ TokenRegs<D> load_token(const RecurrentParams& p, const TokenSrc<Elem>& s, int lane) {
  constexpr int M = TokenRegs<D>::M;
  TokenRegs<D> r;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int ch = lane + 32 * m;
    r.q[m] = to_float(s.q[ch]);
    r.k[m] = to_float(s.k[ch]);
    if (p.scalar_gate) {
      r.g[m] = m == 0 ? load_any(s.g, s.g_dtype, 0) : 0.f;
      r.bias[m] = m == 0 && s.bias != nullptr ? load_any(s.bias, s.bias_dtype, 0) : 0.f;
    } else {
      r.g[m] = load_any(s.g, s.g_dtype, ch);
      r.bias[m] = s.bias != nullptr ? load_any(s.bias, s.bias_dtype, ch) : 0.f;
    }
  }
  return r;
}

// Preprocesses a loaded token into the warp's scratch (q scaled and normalised, k normalised, the
// decay); returns k·q of the staged vectors. `a` is exp(A_log[hv]) (1 without A_log).
template <int D>
__device__ __forceinline__ float finish_token(const RecurrentParams& p, const TokenRegs<D>& r, float a,
                                              TokenScratch<D>& sc, int lane) {
  constexpr int M = TokenRegs<D>::M;
  float qq = 0.f, kk = 0.f, qk = 0.f, dr[M];
  if (p.scalar_gate) {
    const float decay = __expf(log_decay(p, r.g[0], r.bias[0], a));
#pragma unroll
    for (int m = 0; m < M; ++m) dr[m] = decay;
  } else {
    log_decays(p, r.g, r.bias, a, dr);
#pragma unroll
    for (int m = 0; m < M; ++m) dr[m] = __expf(dr[m]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    qq += r.q[m] * r.q[m];
    kk += r.k[m] * r.k[m];
    qk += r.q[m] * r.k[m];
  }
  float q_scale = p.scale, k_scale = 1.f;
  if (p.l2norm) {
    q_scale *= rsqrtf(group_sum<32>(qq) + kL2NormEps);
    k_scale = rsqrtf(group_sum<32>(kk) + kL2NormEps);
  }
  qk = group_sum<32>(qk);
  __syncwarp();  // the previous token's scratch has been read by every lane of this warp
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int ch = lane + 32 * m;
    sc.q[ch] = r.q[m] * q_scale;
    sc.k[ch] = r.k[m] * k_scale;
    sc.decay[ch] = dr[m];
  }
  __syncwarp();
  return qk * q_scale * k_scale;
}

template <typename Elem, int D>
__device__ __forceinline__ float stage_token(const RecurrentParams& p, const TokenSrc<Elem>& src, float a,
                                             TokenScratch<D>& sc, int lane) {
  return finish_token<D>(p, load_token<Elem, D>(p, src, lane), a, sc, lane);
}

// One token's update of a thread's share of a V-first state, both decode kernels' core. The thread
// holds rows j of the state, key channels c * kVec * kLanesK + lane_k * kVec + e in S[j][c][e]
// (kLanesK lanes span a row); sc holds the token's staged vectors and v its values of those rows.
//   S_d = S ⊙ decay,  sk = S_d k,  sq = S_d q,  u = beta (v − sk),  S = S_d + u kᵀ
// in two sweeps; returns u and sq (the output is sq + u (k·q)).
template <int kLanesK, int kRows, int kChunks, int kVec, int D>
__device__ __forceinline__ void vfirst_token_update(float (&S)[kRows][kChunks][kVec], const TokenScratch<D>& sc,
                                                    int lane_k, float beta, const float (&v)[kRows],
                                                    float (&u)[kRows], float (&sq)[kRows]) {
  float sk[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) sk[j] = sq[j] = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int ch = c * kVec * kLanesK + lane_k * kVec;
    float d[kVec], kv[kVec], qv[kVec];
    load_floats(&sc.decay[ch], d);
    load_floats(&sc.k[ch], kv);
    load_floats(&sc.q[ch], qv);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        S[j][c][e] *= d[e];
        sk[j] += S[j][c][e] * kv[e];
        sq[j] += S[j][c][e] * qv[e];
      }
  }
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    sk[j] = group_sum<kLanesK>(sk[j]);
    sq[j] = group_sum<kLanesK>(sq[j]);
    u[j] = beta * (v[j] - sk[j]);
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    float kv[kVec];
    load_floats(&sc.k[c * kVec * kLanesK + lane_k * kVec], kv);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int e = 0; e < kVec; ++e) S[j][c][e] += kv[e] * u[j];
  }
}

// ---------------------------------------------------------------------------------------------
// Host-side helpers of the persistent decode kernels (decode_stream.cuh, decode_stream_tc.cuh,
// decode_bulk.cuh)
// ---------------------------------------------------------------------------------------------

// A per-device value (a kernel's resident blocks per SM), computed by `query` on the first call on
// each device and kept in `known` (value + 1; 0: not computed yet); 0 when the current device
// cannot be read.
constexpr int kMaxCachedDevices = 64;
template <typename Query>
int cached_per_device(std::atomic<int> (&known)[kMaxCachedDevices], Query&& query) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device < kMaxCachedDevices) {
    const int k = known[device].load(std::memory_order_relaxed);
    if (k > 0) return k - 1;
  }
  const int value = query();
  if (device < kMaxCachedDevices) known[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

// SMs of the current device: p.num_sms when the binding filled it in, else a device query.
inline cudaError_t sm_count(const RecurrentParams& p, int& sms) {
  sms = p.num_sms;
  if (sms > 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return err;
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Resident blocks per SM of kKernel at `threads` threads and no dynamic shared memory on the current
// device (queried once per device), 0 if the query fails.
template <auto kKernel>
int resident_blocks(int threads) {
  static std::atomic<int> known[kMaxCachedDevices];
  return cached_per_device(known, [threads] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      blocks = 0;
    }
    return blocks;
  });
}

// Launches the persistent decode kernel kKernel(p, units): `warps` warps per block, each warp
// taking one of `units` work units at a time with a grid stride, as many blocks as the units need
// and at most as many as the device holds at once. `launched` is false when the occupancy query
// fails (the caller falls back to another kernel).
template <auto kKernel>
cudaError_t launch_persistent(const RecurrentParams& p, int warps, uint32_t units, cudaStream_t stream, bool& launched) {
  const int per_sm = resident_blocks<kKernel>(warps * 32);
  launched = per_sm > 0;
  if (!launched || units == 0) return cudaSuccess;
  int sms = 0;
  if (const cudaError_t err = sm_count(p, sms); err != cudaSuccess) return err;
  const int64_t blocks_needed = (int64_t(units) + warps - 1) / warps;
  const unsigned grid = unsigned(std::min<int64_t>(blocks_needed, int64_t(sms) * per_sm));
  kKernel<<<grid, warps * 32, 0, stream>>>(p, units);
  return cudaGetLastError();
}

// Mean tokens per sequence up to which the persistent decode kernels take a call (decode,
// speculative verification). A long sequence is a chain of token latencies, and decode_step_vfirst
// keeps more such chains per SM in flight.
constexpr int kMaxDecodeMeanTokens = 8;

// The calls both persistent decode kernels can serve: V-first, K = V = kDecodeBulkHeadDim, one slot
// per sequence, decode-sized (kMaxDecodeMeanTokens), fewer than 2^31 work items of `blocks_v`
// value blocks per (sequence, head), and every state tensor given of dtype `state`, 16-byte
// aligned.
inline bool persistent_decode_covers(const RecurrentParams& p, int blocks_v, DType state) {
  if (p.D != kDecodeBulkHeadDim || !p.state_v_first) return false;
  if (p.slot_indices != nullptr && p.idx_cols > 0) return false;  // per-token slots
  if (p.H <= 0 || p.HV % p.H != 0) return false;
  if (int64_t(p.N) * p.HV * blocks_v >= (int64_t(1) << 31)) return false;  // 32-bit item numbers
  const int64_t tokens = p.cu_seqlens != nullptr ? int64_t(p.T) : int64_t(p.B) * p.T;
  if (tokens > int64_t(kMaxDecodeMeanTokens) * p.N) return false;
  if (p.state_in != nullptr && (p.state_in_dtype != state || !aligned16(p.state_in))) return false;
  if (p.state_out != nullptr && (p.state_out_dtype != state || !aligned16(p.state_out))) return false;
  return true;
}

// A stride keeps 16-byte aligned rows aligned, or is never taken (extent 1).
inline bool stride_ok(int64_t stride, int elem_bytes, int64_t extent) {
  return extent <= 1 || (stride * elem_bytes) % 16 == 0;
}

// Every row of q, k, v and (per-channel) g starts 16-byte aligned, and so does dt_bias.
template <typename Elem>
bool token_rows_aligned16(const RecurrentParams& p) {
  constexpr int e = sizeof(Elem);
  auto rows_ok = [&](const void* ptr, int bytes, int64_t sb, int64_t st, int64_t sh, int64_t heads) {
    return aligned16(ptr) && stride_ok(sb, bytes, p.B) && stride_ok(st, bytes, p.T) && stride_ok(sh, bytes, heads);
  };
  bool ok = rows_ok(p.q, e, p.q_batch_stride, p.q_token_stride, p.q_head_stride, p.H) &&
            rows_ok(p.k, e, p.k_batch_stride, p.k_token_stride, p.k_head_stride, p.H) &&
            rows_ok(p.v, e, p.v_batch_stride, p.v_token_stride, p.v_head_stride, p.HV);
  if (!p.scalar_gate) {
    ok = ok && rows_ok(p.g, dtype_bytes(p.g_dtype), p.g_batch_stride, p.g_token_stride, p.g_head_stride, p.HV);
    ok = ok && (p.dt_bias == nullptr || aligned16(p.dt_bias));
  }
  return ok;
}

}  // namespace recurrent
}  // namespace flashkda
