// Prototype: a decode step in which every warp streams its state rows through registers (no shared
// memory, no bulk copies), persistent, one work item of R value rows in flight per warp: the next
// item's state and token loads are issued as soon as the current item is stored, and the slot
// index two items ahead. Same case as decode_harness.cu (lower-bound gate with A_log / dt_bias,
// l2norm, beta sigmoid, T = 1, shuffled int32 slots); compared with decode_bulk.cuh for results and
// time. Build with -DSTATE=float|__nv_bfloat16 -DROWS=R -DWARPS=W -DMINB=B
// (blocks per SM for the register cap).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "flashkda/decode_bulk.cuh"
#include "decode_case.cuh"

#ifndef STATE
#define STATE float
#endif
#ifndef ROWS
#define ROWS 16
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef MINB
#define MINB 2
#endif
// Ablations: 1 = no token loads (the state arithmetic with constant tokens), 2 = no arithmetic
// either (the state is scaled and stored: the access pattern alone).
#ifndef ITEMS_PER_TOKEN
#define ITEMS_PER_TOKEN 1
#endif
#ifndef L2HINT
#define L2HINT 0
#endif
#ifndef STRIDED
#define STRIDED 0
#endif
#ifndef NOMATH
#define NOMATH 0
#endif
using StateT = STATE;
using bf16 = __nv_bfloat16;

struct WarpParams {
  const bf16 *q, *k, *v, *g, *beta;  // [N, H, D] (beta [N, H])
  const float *A_log, *dt_bias;      // [H], [H, D]
  const int32_t* idx;                // [N]
  StateT* pool;                      // [slots, H, D, D] V-first
  bf16* o;                           // [N, H, D]
  int N, H, num_slots;
  float scale, lower_bound;
};

constexpr int D = 128;

__device__ __forceinline__ void ld4(const float* p, float (&x)[4]) {
#if L2HINT  // ask L2 to fetch 256-byte blocks from DRAM
  float4 v;
  asm volatile("ld.global.cs.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
#else
  const float4 v = __ldcs(reinterpret_cast<const float4*>(p));
#endif
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void ld4(const bf16* p, float (&x)[8]) {
  const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    x[2 * e] = f.x, x[2 * e + 1] = f.y;
  }
}
__device__ __forceinline__ void st4(float* p, const float (&x)[4]) {
  __stcs(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
}
__device__ __forceinline__ void st4(bf16* p, const float (&x)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(x[2 * e], x[2 * e + 1]);
  __stcs(reinterpret_cast<uint4*>(p), v);
}

// Lane layout: a lane holds kVec consecutive keys of a row (16 bytes of state), kLanesPerRow lanes
// span a row, a warp access covers kRowsPerAccess rows.
constexpr int kVec = 16 / int(sizeof(StateT));
constexpr int kLanesPerRow = D / kVec;
constexpr int kRowsPerAccess = 32 / kLanesPerRow;

template <int N>
struct Bf16x {  // N bf16 values, 8 or 16 bytes
  using T = typename std::conditional<N == 4, uint2, uint4>::type;
  T raw;
  __device__ __forceinline__ void load(const bf16* p) { raw = *reinterpret_cast<const T*>(p); }
  __device__ __forceinline__ void unpack(float (&x)[N]) const {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < N / 2; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      x[2 * e] = f.x, x[2 * e + 1] = f.y;
    }
  }
};

template <int J>
struct RawToken {  // a lane's kVec keys, the v values of its J rows
  Bf16x<kVec> q, k, g;
  float4 bias[kVec / 4];
  float beta, a;
  bf16 v[J];
};

template <int R>
__device__ __forceinline__ void coords(const WarpParams& p, uint32_t it, int& n, int& hv, int& vb) {
  constexpr int KB = D / R;
  vb = int(it % KB);
  const uint32_t r = it / KB;
  hv = int(r % uint32_t(p.H));
  n = int(r / uint32_t(p.H));
}

template <int W>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = W / 2; m >= 1; m >>= 1) x += __shfl_xor_sync(~0u, x, m);
  return x;
}

// A lane's share of one token: q and k normalised (q scaled), the decays of its channels, beta
// and k·q (lower-bound gate with A_log and dt_bias, l2norm, beta sigmoid).
template <int J>
__device__ __forceinline__ void prepare_token(const WarpParams& p, const RawToken<J>& raw, float (&q)[kVec],
                                              float (&k)[kVec], float (&d)[kVec], float& beta, float& kq) {
  constexpr int L = kLanesPerRow;
  float g[kVec];
  raw.q.unpack(q);
  raw.k.unpack(k);
  raw.g.unpack(g);
  const float a = __expf(raw.a);
  const float* b = reinterpret_cast<const float*>(raw.bias);
  float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    qq += q[e] * q[e], kk += k[e] * k[e], qk += q[e] * k[e];
    d[e] = __expf(p.lower_bound * flashkda::sigmoidf_(a * (g[e] + b[e])));
  }
  qq = group_sum<L>(qq), kk = group_sum<L>(kk), qk = group_sum<L>(qk);
  const float qs = p.scale * rsqrtf(qq + 1e-6f), ks = rsqrtf(kk + 1e-6f);
  kq = qk * qs * ks;
#pragma unroll
  for (int e = 0; e < kVec; ++e) q[e] *= qs, k[e] *= ks;
  beta = flashkda::sigmoidf_(raw.beta);
}

// S ⊙ decay in place, then S_d k and S_d q of every row, summed over the lanes of a row.
template <int J>
__device__ __forceinline__ void decayed_row_sums(float (&S)[J][kVec], const float (&d)[kVec], const float (&k)[kVec],
                                                 const float (&q)[kVec], float (&sk)[J], float (&sq)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    sk[j] = sq[j] = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      S[j][e] *= d[e];
      sk[j] += S[j][e] * k[e];
      sq[j] += S[j][e] * q[e];
    }
  }
#pragma unroll
  for (int mm = kLanesPerRow / 2; mm >= 1; mm >>= 1)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      sk[j] += __shfl_xor_sync(~0u, sk[j], mm);
      sq[j] += __shfl_xor_sync(~0u, sq[j], mm);
    }
}

template <int R>
__global__ void __launch_bounds__(WARPS * 32, MINB) decode_warp(const WarpParams p) {
  constexpr int KB = D / R, J = R / kRowsPerAccess, L = kLanesPerRow, M = ITEMS_PER_TOKEN;
  static_assert(J * kRowsPerAccess == R && J <= L && KB % M == 0, "rows");
  const int lane = threadIdx.x & 31, lk = lane % L, lr = lane / L;
  // An item's rows: contiguous (STRIDED 0) or every KB-th group of kRowsPerAccess rows of the head.
  constexpr int kRowStep = STRIDED ? KB * kRowsPerAccess : kRowsPerAccess;
  auto first_row = [&](int b) { return (STRIDED ? b * kRowsPerAccess : b * R) + lr; };
  // A warp takes units of M consecutive items of one head (one token preprocessing per unit).
  const uint32_t stride = gridDim.x * WARPS;
  const uint32_t units = uint32_t(p.N) * p.H * (KB / M);
  uint32_t unit = blockIdx.x * WARPS + threadIdx.x / 32;
  if (unit >= units) return;
  int m = 0;
  int n, hv, vb;
  coords<R>(p, unit * M, n, hv, vb);
  int slot = p.idx[n];
  uint32_t next = unit + stride;
  int slot_next = -1;
  if (next < units) {
    int n2, h2, v2;
    coords<R>(p, next * M, n2, h2, v2);
    slot_next = p.idx[n2];
  }
  float S[J][kVec];
  RawToken<J> raw;
  // The next item's state (and, at a new unit, token) loads go out as soon as the current item is
  // stored.
  auto issue = [&]() {
    const int64_t base = (int64_t(slot) * p.H + hv) * D * D + int64_t(first_row(vb)) * D + lk * kVec;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (slot >= 0) ld4(p.pool + base + j * kRowStep * D, S[j]);
      else
#pragma unroll
        for (int e = 0; e < kVec; ++e) S[j][e] = NOMATH ? 1.f : 0.f;
    }
#if NOMATH
    raw = RawToken<J>{};
#else
    const int64_t row = (int64_t(n) * p.H + hv) * D;
    if (m == 0) {
      raw.q.load(p.q + row + lk * kVec);
      raw.k.load(p.k + row + lk * kVec);
      raw.g.load(p.g + row + lk * kVec);
#pragma unroll
      for (int i = 0; i < kVec / 4; ++i) raw.bias[i] = reinterpret_cast<const float4*>(p.dt_bias + hv * D + lk * kVec)[i];
      raw.beta = __bfloat162float(p.beta[int64_t(n) * p.H + hv]);
      raw.a = p.A_log[hv];
    }
#pragma unroll
    for (int j = 0; j < J; ++j) raw.v[j] = p.v[row + first_row(vb) + j * kRowStep];
#endif
  };
  issue();
  float q[kVec], k[kVec], d[kVec], beta = 0.f, kq = 0.f;
  while (true) {
    if (m == 0) {
      prepare_token<J>(p, raw, q, k, d, beta, kq);
    }
    const int64_t base = (int64_t(slot) * p.H + hv) * D * D + int64_t(first_row(vb)) * D + lk * kVec;
#if NOMATH == 2
    if (slot >= 0) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) S[j][e] = S[j][e] * 0.999f + 1e-3f;
        st4(p.pool + base + j * kRowStep * D, S[j]);
      }
    }
#else
    float sk[J], sq[J];
    decayed_row_sums<J>(S, d, k, q, sk, sq);
    float out = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const float u = beta * (__bfloat162float(raw.v[j]) - sk[j]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) S[j][e] += k[e] * u;
      if (slot >= 0) st4(p.pool + base + j * kRowStep * D, S[j]);
      if (lk == j) out = sq[j] + u * kq;
    }
    if (lk < J)
      p.o[(int64_t(n) * p.H + hv) * D + first_row(vb) + lk * kRowStep] = __float2bfloat16(slot >= 0 ? out : 0.f);
#endif

    if (++m < M) {
      ++vb;  // same head, same slot, same token
    } else {
      m = 0;
      unit = next;
      if (unit >= units) break;
      coords<R>(p, unit * M, n, hv, vb);
      slot = slot_next;
      next += stride;
      if (next < units) {
        int n2, h2, v2;
        coords<R>(p, next * M, n2, h2, v2);
        slot_next = p.idx[n2];
      }
    }
    issue();
  }
}

// Double-buffered variant (DBUF=1): a warp holds two items, so the loads of item i+1 are in flight
// while item i is computed (a warp's step costs max(latency, arithmetic) instead of their sum).
struct ItemRef {
  uint32_t item;
  int n, hv, vb, slot;
};

template <int R>
__device__ __forceinline__ void db_issue(const WarpParams& p, const ItemRef& it, float (&S)[R / kRowsPerAccess][kVec],
                                         RawToken<R / kRowsPerAccess>& raw, int lk, int lr) {
  constexpr int J = R / kRowsPerAccess;
  const int64_t base = (int64_t(it.slot) * p.H + it.hv) * D * D + int64_t(it.vb * R + lr) * D + lk * kVec;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if (it.slot >= 0) ld4(p.pool + base + j * kRowsPerAccess * D, S[j]);
    else
#pragma unroll
      for (int e = 0; e < kVec; ++e) S[j][e] = 0.f;
  }
  const int64_t row = (int64_t(it.n) * p.H + it.hv) * D;
  raw.q.load(p.q + row + lk * kVec);
  raw.k.load(p.k + row + lk * kVec);
  raw.g.load(p.g + row + lk * kVec);
#pragma unroll
  for (int i = 0; i < kVec / 4; ++i) raw.bias[i] = reinterpret_cast<const float4*>(p.dt_bias + it.hv * D + lk * kVec)[i];
  raw.beta = __bfloat162float(p.beta[int64_t(it.n) * p.H + it.hv]);
  raw.a = p.A_log[it.hv];
#pragma unroll
  for (int j = 0; j < J; ++j) raw.v[j] = p.v[row + it.vb * R + j * kRowsPerAccess + lr];
}

template <int R>
__device__ __forceinline__ void db_process(const WarpParams& p, const ItemRef& it, float (&S)[R / kRowsPerAccess][kVec],
                                           const RawToken<R / kRowsPerAccess>& raw, int lk, int lr) {
  constexpr int J = R / kRowsPerAccess, L = kLanesPerRow;
  float q[kVec], k[kVec], d[kVec], beta, kq;
  prepare_token<J>(p, raw, q, k, d, beta, kq);
  float sk[J], sq[J];
  decayed_row_sums<J>(S, d, k, q, sk, sq);
  float out = 0.f;
  const int64_t base = (int64_t(it.slot) * p.H + it.hv) * D * D + int64_t(it.vb * R + lr) * D + lk * kVec;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float u = beta * (__bfloat162float(raw.v[j]) - sk[j]);
#pragma unroll
    for (int e = 0; e < kVec; ++e) S[j][e] += k[e] * u;
    if (it.slot >= 0) st4(p.pool + base + j * kRowsPerAccess * D, S[j]);
    if (lk == j) out = sq[j] + u * kq;
  }
  if (lk < J)
    p.o[(int64_t(it.n) * p.H + it.hv) * D + it.vb * R + lk * kRowsPerAccess + lr] = __float2bfloat16(it.slot >= 0 ? out : 0.f);
}

template <int R>
__global__ void __launch_bounds__(WARPS * 32, MINB) decode_warp_db(const WarpParams p) {
  constexpr int J = R / kRowsPerAccess, L = kLanesPerRow;
  const int lane = threadIdx.x & 31, lk = lane % L, lr = lane / L;
  const uint32_t stride = gridDim.x * WARPS;
  const uint32_t items = uint32_t(p.N) * p.H * (D / R);
  auto make = [&](uint32_t item) {
    ItemRef it{item, 0, 0, 0, -1};
    if (item < items) {
      coords<R>(p, item, it.n, it.hv, it.vb);
      it.slot = p.idx[it.n];
    }
    return it;
  };
  ItemRef a = make(blockIdx.x * WARPS + threadIdx.x / 32);
  if (a.item >= items) return;
  ItemRef b = make(a.item + stride);
  float SA[J][kVec], SB[J][kVec];
  RawToken<J> ra, rb;
  db_issue<R>(p, a, SA, ra, lk, lr);
  if (b.item < items) db_issue<R>(p, b, SB, rb, lk, lr);
  ItemRef ahead = make(b.item + stride);  // its slot load is on the way
  while (true) {
    db_process<R>(p, a, SA, ra, lk, lr);
    a = ahead;
    ahead = make(a.item + stride);
    if (a.item < items) db_issue<R>(p, a, SA, ra, lk, lr);
    if (b.item >= items) break;
    db_process<R>(p, b, SB, rb, lk, lr);
    b = ahead;
    ahead = make(b.item + stride);
    if (b.item < items) db_issue<R>(p, b, SB, rb, lk, lr);
    if (a.item >= items) break;
  }
}

#ifndef DBUF
#define DBUF 0
#endif
#if DBUF
#define WARP_KERNEL decode_warp_db<ROWS>
#else
#define WARP_KERNEL decode_warp<ROWS>
#endif

template <typename T>
float to_f(T x) { return float(x); }
float to_f(bf16 x) { return __bfloat162float(x); }

int main(int argc, char** argv) {
  // argv[2] = 0: slot n for sequence n; argv[3] > 0: at most that many blocks per SM.
  const bool shuffled = !(argc > 2 && std::atoi(argv[2]) == 0);
  DecodeCase<StateT> c;
  if (!c.init(argc > 1 ? std::atoi(argv[1]) : 1024, shuffled)) return 1;
  const int N = c.N, H = c.H, slots = c.slots;
  const size_t tok = c.tok, state = c.state;
  flashkda::RecurrentParams& p = c.p;
  bf16 *o2;
  StateT* pool2;
  CHECK(cudaMalloc(&o2, tok * 2));
  CHECK(cudaMalloc(&pool2, state * sizeof(StateT)));
  CHECK(cudaMemcpy(pool2, c.pool, state * sizeof(StateT), cudaMemcpyDeviceToDevice));
  bf16 *q = c.q, *k = c.k, *v = c.v, *g = c.g, *beta = c.beta, *o = c.o;
  float *A_log = c.A_log, *dt_bias = c.dt_bias;
  int32_t* idx = c.idx;
  StateT* pool = c.pool;

  WarpParams w{q, k, v, g, beta, A_log, dt_bias, idx, pool2, o2, N, H, slots, p.scale, p.lower_bound};
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, WARP_KERNEL, WARPS * 32, 0));
  if (argc > 3 && std::atoi(argv[3]) > 0) per_sm = std::min(per_sm, std::atoi(argv[3]));  // cap blocks per SM
  cudaFuncAttributes attr;
  CHECK(cudaFuncGetAttributes(&attr, WARP_KERNEL));
  const int64_t units = int64_t(N) * H * (D / ROWS / ITEMS_PER_TOKEN);
  unsigned grid = unsigned(std::min<int64_t>(p.num_sms * per_sm, (units + WARPS - 1) / WARPS));
  const bool balanced = argc > 4 && std::atoi(argv[4]) == 1;  // argv[4] = 1: as few warps as give the same rounds
  if (balanced) {
    const int64_t rounds = (units + int64_t(grid) * WARPS - 1) / (int64_t(grid) * WARPS);
    grid = unsigned(((units + rounds - 1) / rounds + WARPS - 1) / WARPS);
  }

  // One step of each from the same pool: outputs and updated states agree?
  using Tune = flashkda::decode_bulk::DefaultTuning<StateT>;
  bool launched = false;
  CHECK((flashkda::run_decode_bulk_tuned<bf16, StateT, Tune>(p, 0, launched)));
  WARP_KERNEL<<<grid, WARPS * 32>>>(w);
  CHECK(cudaDeviceSynchronize());
  double od = 0, on = 0, sd = 0, sn = 0;
  if (N <= 256) {  // the comparison runs on the host
  std::vector<bf16> ho(tok), ho2(tok);
  std::vector<StateT> hs(state), hs2(state);
  CHECK(cudaMemcpy(ho.data(), o, tok * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ho2.data(), o2, tok * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hs.data(), pool, state * sizeof(StateT), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hs2.data(), pool2, state * sizeof(StateT), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < tok; ++i) {
    const double a = to_f(ho[i]), b = to_f(ho2[i]);
    od += (a - b) * (a - b), on += a * a;
  }
  for (size_t i = 0; i < state; ++i) {
    const double a = to_f(hs[i]), b = to_f(hs2[i]);
    sd += (a - b) * (a - b), sn += a * a;
  }
  }

  const double floor_ms = c.floor_bytes() / copy_bandwidth() * 1e3;
  const float ms_bulk = median_ms([&] { flashkda::run_decode_bulk_tuned<bf16, StateT, Tune>(p, 0, launched); }, 50);
  const float ms_warp = median_ms([&] { WARP_KERNEL<<<grid, WARPS * 32>>>(w); }, 50);
  const float ms_bulk2 = median_ms([&] { flashkda::run_decode_bulk_tuned<bf16, StateT, Tune>(p, 0, launched); }, 50);
  const float ms_warp2 = median_ms([&] { WARP_KERNEL<<<grid, WARPS * 32>>>(w); }, 50);
  CHECK(cudaGetLastError());
  std::printf("%s[M=%d] %s%s%s%s%s", DBUF ? "[double-buffered] " : "", ITEMS_PER_TOKEN, L2HINT ? "[L2::256B] " : "", balanced ? "[balanced grid] " : "",
              STRIDED ? "[strided rows] " : "", NOMATH == 1 ? "[no token loads] " : NOMATH == 2 ? "[access pattern only] " : "",
              shuffled ? "" : "[slots in order] ");
  std::printf("state %-4s rows %2d warps %d regs %3d blocks/SM %2d N=%4d: warp %.4f/%.4f ms (%.0f%%) bulk %.4f/%.4f ms "
              "(%.0f%%) floor %.4f | rel diff o %.1e state %.1e\n",
              sizeof(StateT) == 4 ? "fp32" : "bf16", ROWS, WARPS, attr.numRegs, per_sm, N, ms_warp, ms_warp2,
              100.0 * floor_ms / std::min(ms_warp, ms_warp2), ms_bulk, ms_bulk2,
              100.0 * floor_ms / std::min(ms_bulk, ms_bulk2), floor_ms, std::sqrt(od / on), std::sqrt(sd / sn));
  return 0;
}
