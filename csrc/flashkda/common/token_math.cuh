// Element access and per-token preprocessing shared by the recurrent and chunked kernels
// (docs/SPEC.md, "Per-token preprocessing"). Device-only, framework-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/common/constants.h"
#include "flashkda/common/recurrent_params.h"

namespace flashkda {

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

// A 16-bit value of dtype dt (bfloat16 or float16) from its bits, or an fp32 one from its bits.
__device__ __forceinline__ float bits_to_float(uint32_t b, DType dt) {
  switch (dt) {
    case DType::kBFloat16: return __uint_as_float(b << 16);
    case DType::kFloat16: return __half2float(__ushort_as_half(uint16_t(b)));
    default: return __uint_as_float(b);
  }
}

// N consecutive values of run-time dtype dt as floats, in accesses of up to 16 bytes: `src` is
// aligned to min(16, N * dtype_bytes) bytes.
template <int N>
__device__ __forceinline__ void load_any_vec(const void* src, DType dt, float (&x)[N]) {
  static_assert(N == 4 || N == 8, "one or two 16-byte accesses");
  if (dt == DType::kFloat32) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = reinterpret_cast<const float4*>(src)[i / 4];
      x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
    }
    return;
  }
  uint32_t w[N / 2];
  if constexpr (N == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  }
  if (dt == DType::kBFloat16) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) x[2 * i] = __uint_as_float(w[i] << 16), x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      x[2 * i] = f.x, x[2 * i + 1] = f.y;
    }
  }
}

__host__ __device__ constexpr int dtype_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

// x as an element of run-time dtype dt at index i (rounded to nearest).
__device__ __forceinline__ void store_any(void* p, DType dt, int64_t i, float x) {
  switch (dt) {
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

// Two values as one 32-bit word of a 16-bit dtype dt (bfloat16 or float16, rounded to nearest).
__device__ __forceinline__ uint32_t pack_16bit_pair(DType dt, float a, float b) {
  if (dt == DType::kBFloat16) {
    const __nv_bfloat162 x = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&x);
  }
  const __half2 x = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&x);
}

// Four consecutive values of run-time dtype dt, one access: `dst` aligned to 4 elements (the
// counterpart of load_any_vec<4>).
__device__ __forceinline__ void store_any_vec4(void* dst, DType dt, const float (&x)[4]) {
  if (dt == DType::kFloat32)
    *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
  else
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_16bit_pair(dt, x[0], x[1]), pack_16bit_pair(dt, x[2], x[3]));
}

// The address of element i of a tensor of run-time dtype dt.
__device__ __forceinline__ const void* element_at(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + i * dtype_bytes(dt);
}
__device__ __forceinline__ void* element_at(void* base, DType dt, int64_t i) {
  return static_cast<char*>(base) + i * dtype_bytes(dt);
}

// N consecutive floats (16-byte aligned, N a multiple of 4), 16 bytes per access.
template <int N>
__device__ __forceinline__ void load_floats(const float* src, float (&x)[N]) {
  static_assert(N % 4 == 0, "16-byte accesses");
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + i);
    x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
  }
}

template <int N>
__device__ __forceinline__ void store_floats(float* dst, const float (&x)[N]) {
  static_assert(N % 4 == 0, "16-byte accesses");
#pragma unroll
  for (int i = 0; i < N; i += 4) *reinterpret_cast<float4*>(dst + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
}

__device__ __forceinline__ int64_t load_index(const void* p, IndexType t, int64_t i) {
  return t == IndexType::kInt64 ? static_cast<const int64_t*>(p)[i]
                                : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Whether slot s names a state of the pool; any other slot marks padding (RecurrentParams::num_slots).
__device__ __forceinline__ bool slot_ok(const RecurrentParams& p, int64_t s) {
  return s >= 0 && s < p.num_slots;
}

// Sum over aligned groups of W lanes (W a power of two up to 32; all 32 lanes take part), in every
// lane of the group.
template <int W>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = 1; m < W; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The l2 norm of a row of kHeadDim channels, four a lane (the backward's per-token passes and the
// gradients pass that normalises the raw q and k compute it alike, so their values agree to the
// bit): the lane's share of Σ x², then the row's 1 / norm from the sum over the warp.
__device__ __forceinline__ float sum_sq4(const float (&x)[4]) {
  return x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
}
__device__ __forceinline__ float l2norm_rnorm(float row_sum_sq) { return rsqrtf(row_sum_sq + kL2NormEps); }

// Inclusive prefix sum over the lanes of a warp (all 32 lanes take part).
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// The q / k head that value head hv reads (GVA: HV / H consecutive value heads share one). With
// HV == H, the usual case, it skips the two integer divisions (about 25 instructions each).
template <class Params>
__device__ __forceinline__ int key_head(const Params& p, int hv) {
  return p.HV == p.H ? hv : hv / (p.HV / p.H);
}

// ---------------------------------------------------------------------------------------------
// Per-token preprocessing (docs/SPEC.md, "Per-token preprocessing", steps 3 and 4)
// ---------------------------------------------------------------------------------------------

// 2^x on the special-function unit, results below 2^-126 flushed to zero. __expf(x) is this of
// x·log2(e), plus the rescaling that keeps subnormal results: code that works on base-2 logs skips
// both. Only for factors that no later factor scales back up (a decay that small then contributes
// nothing); a factor that meets a large one later needs exp2f.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f;

// log2(x) on the special-function unit (absolute error about 2^-22 near 1).
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x on the special-function unit (about 1 ulp; 1/inf = 0), without the IEEE division's fixups.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Fast sigmoid: exp and reciprocal on the special-function unit; exp overflow gives 1/inf = 0.
__device__ __forceinline__ float sigmoidf_(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

__device__ __forceinline__ float softplusf_(float x) {
  return x > kSoftplusThreshold ? x : log1pf(__expf(x));
}

// A_log[hv] and its exponential, the gate's scale (1 without A_log).
template <class Params>
__device__ __forceinline__ float a_log_value(const Params& p, int hv) {
  return p.A_log != nullptr ? load_any(p.A_log, p.A_log_dtype, hv) : 0.f;
}
template <class Params>
__device__ __forceinline__ float gate_scale(const Params& p, int hv) {
  return p.A_log != nullptr ? __expf(load_any(p.A_log, p.A_log_dtype, hv)) : 1.f;
}

// Natural-log decay of one channel with the gate mode known at compile time (loops over many
// channels branch once); `a` is exp(A_log[hv]) (1 without A_log).
template <GateMode kMode>
__device__ __forceinline__ float log_decay_as(const RecurrentParams& p, float raw, float bias, float a) {
  if constexpr (kMode == GateMode::kLowerBound) return p.lower_bound * sigmoidf_(a * (raw + bias));
  else if constexpr (kMode == GateMode::kSoftplus) return -a * softplusf_(raw + bias);
  else return raw;
}

// Natural-log decays of N channels with one branch on the gate mode for all of them, so that their
// special-function chains can interleave (a branch per channel serialises them).
template <int N>
__device__ __forceinline__ void log_decays(const RecurrentParams& p, const float (&raw)[N], const float (&bias)[N], float a,
                                           float (&out)[N]) {
  switch (p.gate_mode) {
    case GateMode::kLowerBound:
#pragma unroll
      for (int e = 0; e < N; ++e) out[e] = log_decay_as<GateMode::kLowerBound>(p, raw[e], bias[e], a);
      break;
    case GateMode::kSoftplus:
#pragma unroll
      for (int e = 0; e < N; ++e) out[e] = log_decay_as<GateMode::kSoftplus>(p, raw[e], bias[e], a);
      break;
    default:
#pragma unroll
      for (int e = 0; e < N; ++e) out[e] = log_decay_as<GateMode::kPrecomputed>(p, raw[e], bias[e], a);
  }
}

// One channel (a scalar gate, or channels handled one at a time).
__device__ __forceinline__ float log_decay(const RecurrentParams& p, float raw, float bias, float a) {
  const float raw1[1] = {raw}, bias1[1] = {bias};
  float out[1];
  log_decays(p, raw1, bias1, a, out);
  return out[0];
}

__device__ __forceinline__ float beta_value(const RecurrentParams& p, float raw) {
  return p.beta_sigmoid ? p.beta_scale * sigmoidf_(raw) : raw;
}

}  // namespace flashkda
