// Prototype: decode_stream.cuh's persistent register streaming for bf16 state pools, with each
// token's sums over K (S_d k and S_d q of every row) on the tensor cores. A warp's work item is 16
// value rows (4 KB of bf16 state) held packed in registers exactly as the mma.sync m16n8k16 A
// operand wants them: lane (g = lane / 4, t = lane % 4) loads rows g and g + 8, keys
// 32c + 8t ... 32c + 8t + 7 for c = 0..3 (16-byte loads, 64 contiguous bytes per row and
// instruction). The sums over K do not care in which order the keys come, so k-step s = 2c + h of
// the product takes keys 32c + 8t + 4h + {0, 1} at k positions 2t, 2t + 1 and + {2, 3} at 2t + 8,
// 2t + 9; the B operand (16 x 8) uses the same key order: column 0 holds d ⊙ k, column 1 d ⊙ q
// (both the bf16 high part), columns 2 and 3 their bf16 low parts (x − hi), so that the products
// keep about 16 mantissa bits of the fp32 factors while the state is exact bf16 (fp32
// accumulation). 8 MMAs replace 16 rows × 8 FMAs and the 80-shuffle reductions; the state update
// S ⊙ d + u kᵀ stays elementwise in fp32 (d and k read from the warp's shared-memory scratch).
// M consecutive items of one head share the token's preparation (M = 1, 2, 4, 8).
//
// Same case as decode_harness.cu (bf16 q / k / v / g / beta, bf16 V-first pool of N + 8 slots with
// shuffled int32 slots, lower-bound gate with A_log / dt_bias, l2norm, beta sigmoid, T tokens per
// sequence); compared with decode_bulk.cuh for results and time.
//   nvcc -std=c++17 -O3 -Icsrc -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Xptxas -v bench/harness/decode_tc_probe.cu -o dtc && ./dtc 256 [T]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "flashkda/decode_bulk.cuh"
#include "flashkda/decode_stream.cuh"
#include "flashkda/mma_sm80.cuh"
#include "decode_case.cuh"

namespace probe {
using namespace flashkda;
using bf16 = __nv_bfloat16;
constexpr int D = 128, R = 16, KB = D / R, kWarps = 8;

struct Item {
  int bos, batch, len, read_slot, write_slot, hv, v0;
  bool skip;
};

__device__ __forceinline__ Item resolve(const RecurrentParams& p, uint32_t item) {
  const int vblock = int(item % KB);
  const uint32_t rest = item / KB;
  const int n = int(rest / uint32_t(p.HV));
  const recurrent::Sequence seq = recurrent::resolve_sequence(p, n);
  int64_t write_slot = recurrent::final_slot(p, n, seq);
  if (seq.len == 0 && p.state_in == p.state_out && seq.read_slot == write_slot) write_slot = -1;
  const bool needs_state = !seq.skip && (seq.len > 0 || write_slot >= 0);
  return Item{int(seq.bos), int(seq.batch), int(seq.len), needs_state ? int(seq.read_slot) : -1, int(write_slot),
              int(rest % uint32_t(p.HV)), vblock * R, seq.skip};
}

// The token's per-channel factors for all D channels (each lane writes its 4), per warp.
struct Scratch {
  float d[D], k[D], dk[D], dq[D];
};

struct TokenBits {  // a lane's raw loads of one token: 4 channels of q, k, g, dt_bias; beta, A_log
  uint2 q, k, g;
  float4 bias;
  uint32_t beta;
  float a_log;
};

__device__ __forceinline__ TokenBits load_token(const RecurrentParams& p, const Item& it, int64_t t, int lane) {
  const int hk = it.hv / (p.HV / p.H), c0 = 4 * lane;
  const recurrent::TokenSrc<bf16> src = recurrent::global_token<bf16, D>(p, it.batch, t, hk, it.hv);
  TokenBits r;
  r.q = *reinterpret_cast<const uint2*>(src.q + c0);
  r.k = *reinterpret_cast<const uint2*>(src.k + c0);
  r.g = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(src.g) + c0);  // bf16 gate (the probe's case)
  r.bias = src.bias != nullptr ? *reinterpret_cast<const float4*>(src.bias + c0) : make_float4(0.f, 0.f, 0.f, 0.f);
  r.beta = decode_stream::load_bits(p.beta, p.beta_dtype, it.batch * p.beta_batch_stride + t * p.beta_token_stride + it.hv);
  r.a_log = p.A_log != nullptr ? p.A_log[it.hv] : 0.f;
  return r;
}

__device__ __forceinline__ float bf(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Prepares a token into the warp's scratch and the B operand; returns beta and k·q.
__device__ __forceinline__ void prepare(const RecurrentParams& p, const TokenBits& r, Scratch& sc, uint32_t (&B)[8][2],
                                        float& beta, float& kq, int lane) {
  float q[4] = {bf(r.q.x & 0xffffu), bf(r.q.x >> 16), bf(r.q.y & 0xffffu), bf(r.q.y >> 16)};
  float k[4] = {bf(r.k.x & 0xffffu), bf(r.k.x >> 16), bf(r.k.y & 0xffffu), bf(r.k.y >> 16)};
  const float g[4] = {bf(r.g.x & 0xffffu), bf(r.g.x >> 16), bf(r.g.y & 0xffffu), bf(r.g.y >> 16)};
  const float bias[4] = {r.bias.x, r.bias.y, r.bias.z, r.bias.w};
  const float a = p.A_log != nullptr ? __expf(r.a_log) : 1.f;
  float d[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) d[e] = __expf(log_decay(p, g[e], bias[e], a));
  float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) qq += q[e] * q[e], kk += k[e] * k[e], qk += q[e] * k[e];
  float q_scale = p.scale, k_scale = 1.f;
  if (p.l2norm) {
    q_scale *= rsqrtf(recurrent::group_sum<32>(qq) + kL2NormEps);
    k_scale = rsqrtf(recurrent::group_sum<32>(kk) + kL2NormEps);
  }
  kq = recurrent::group_sum<32>(qk) * q_scale * k_scale;
  beta = beta_value(p, decode_stream::bits_to_float(r.beta, p.beta_dtype));
  float dk[4], dq[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) k[e] *= k_scale, dk[e] = d[e] * k[e], dq[e] = d[e] * (q[e] * q_scale);
  __syncwarp();  // every lane has read the previous token's scratch
  reinterpret_cast<float4*>(sc.d)[lane] = make_float4(d[0], d[1], d[2], d[3]);
  reinterpret_cast<float4*>(sc.k)[lane] = make_float4(k[0], k[1], k[2], k[3]);
  reinterpret_cast<float4*>(sc.dk)[lane] = make_float4(dk[0], dk[1], dk[2], dk[3]);
  reinterpret_cast<float4*>(sc.dq)[lane] = make_float4(dq[0], dq[1], dq[2], dq[3]);
  __syncwarp();
  // B column g: 0 dk (high part), 1 dq (high), 2 dk (low), 3 dq (low), 4..7 zero.
  const int g4 = lane / 4, t4 = lane % 4;
  const float* src = (g4 & 1) ? sc.dq : sc.dk;
  const bool low = g4 >= 2, zero = g4 >= 4;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float4 x0 = *reinterpret_cast<const float4*>(src + 32 * c + 8 * t4);
    const float4 x1 = *reinterpret_cast<const float4*>(src + 32 * c + 8 * t4 + 4);
    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    float part[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float hi = __bfloat162float(__float2bfloat16(x[e]));
      part[e] = zero ? 0.f : (low ? x[e] - hi : hi);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      B[2 * c + h][0] = sm80::pack2<bf16>(part[4 * h], part[4 * h + 1]);
      B[2 * c + h][1] = sm80::pack2<bf16>(part[4 * h + 2], part[4 * h + 3]);
    }
  }
}

// Unpacks 8 bf16 (a uint4) to fp32 and back.
__device__ __forceinline__ void unpack8(const uint4& w, float (&x)[8]) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) x[2 * i] = __uint_as_float(u[i] << 16), x[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
}
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(sm80::pack2<bf16>(x[0], x[1]), sm80::pack2<bf16>(x[2], x[3]), sm80::pack2<bf16>(x[4], x[5]),
                    sm80::pack2<bf16>(x[6], x[7]));
}

template <int M, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) decode_tc(const RecurrentParams p, const uint32_t num_units) {
  static_assert(KB % M == 0, "units of M items of one head");
  __shared__ Scratch scratch[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g4 = lane / 4, t4 = lane % 4;
  Scratch& sc = scratch[warp];
  const uint32_t stride = gridDim.x * kWarps;
  const int64_t slot_elems = int64_t(p.HV) * D * D;
  const bf16* state_in = static_cast<const bf16*>(p.state_in);
  bf16* state_out = static_cast<bf16*>(p.state_out);

  uint32_t unit = blockIdx.x * kWarps + warp;
  if (unit >= num_units) return;
  Item cur = resolve(p, unit * M), next{};
  if (unit + stride < num_units) next = resolve(p, (unit + stride) * M);
  int m = 0;

  // Rows g (h = 0) and g + 8 (h = 1), chunk c: keys 32c + 8 t4 .. + 7.
  auto row_ptr = [&](const Item& it, int slot, int h) {
    return int64_t(slot) * slot_elems + int64_t(it.hv) * D * D + int64_t(it.v0 + g4 + 8 * h) * D + 8 * t4;
  };
  uint4 A[2][4];
  TokenBits tok;
  uint32_t v_bits[2];  // v of rows g and g + 8
  auto load_item = [&](const Item& it, bool first_of_unit) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        A[h][c] = it.read_slot >= 0 ? __ldcs(reinterpret_cast<const uint4*>(state_in + row_ptr(it, it.read_slot, h) + 32 * c))
                                    : make_uint4(0u, 0u, 0u, 0u);
    if (!it.skip && it.len > 0) {
      if (first_of_unit || it.len > 1) tok = load_token(p, it, it.bos, lane);
      const uint16_t* v = static_cast<const uint16_t*>(p.v) + it.batch * p.v_batch_stride + int64_t(it.bos) * p.v_token_stride +
                          int64_t(it.hv) * p.v_head_stride + it.v0 + g4;
      v_bits[0] = v[0], v_bits[1] = v[8];
    }
  };
  load_item(cur, true);

  uint32_t B[8][2];
  float beta = 0.f, kq = 0.f;
  while (true) {
    bf16* o = static_cast<bf16*>(p.o) + cur.batch * p.o_batch_stride + int64_t(cur.hv) * p.o_head_stride + cur.v0 + g4;
    if (cur.skip) {
      if (t4 == 0)
        for (int i = 0; i < cur.len; ++i) o[int64_t(cur.bos + i) * p.o_token_stride] = o[int64_t(cur.bos + i) * p.o_token_stride + 8] = __float2bfloat16(0.f);
    } else {
      for (int i = 0; i < cur.len; ++i) {
        if (i > 0) {
          tok = load_token(p, cur, cur.bos + i, lane);
          const uint16_t* v = static_cast<const uint16_t*>(p.v) + cur.batch * p.v_batch_stride +
                              int64_t(cur.bos + i) * p.v_token_stride + int64_t(cur.hv) * p.v_head_stride + cur.v0 + g4;
          v_bits[0] = v[0], v_bits[1] = v[8];
        }
        if (m == 0 || cur.len > 1) prepare(p, tok, sc, B, beta, kq, lane);
        float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const int c = s / 2, w = 2 * (s % 2);
          const uint32_t* lo = reinterpret_cast<const uint32_t*>(&A[0][c]);
          const uint32_t* hi = reinterpret_cast<const uint32_t*>(&A[1][c]);
          const uint32_t a[4] = {lo[w], hi[w], lo[w + 1], hi[w + 1]};
          sm80::mma_16816<bf16>(s % 2 ? acc1 : acc0, a, B[s][0], B[s][1]);
        }
        float sums[4];  // t4 0 (and 1): sk(g), sq(g), sk(g+8), sq(g+8)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          sums[j] = acc0[j] + acc1[j];
          sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], 1);
        }
        float u0 = beta * (bf(v_bits[0]) - sums[0]), u1 = beta * (bf(v_bits[1]) - sums[2]);
        if (t4 == 0) {
          o[int64_t(cur.bos + i) * p.o_token_stride] = __float2bfloat16(sums[1] + u0 * kq);
          o[int64_t(cur.bos + i) * p.o_token_stride + 8] = __float2bfloat16(sums[3] + u1 * kq);
        }
        u0 = __shfl_sync(0xffffffffu, u0, lane & ~3);
        u1 = __shfl_sync(0xffffffffu, u1, lane & ~3);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float4 d0 = *reinterpret_cast<const float4*>(sc.d + 32 * c + 8 * t4);
          const float4 d1 = *reinterpret_cast<const float4*>(sc.d + 32 * c + 8 * t4 + 4);
          const float4 k0 = *reinterpret_cast<const float4*>(sc.k + 32 * c + 8 * t4);
          const float4 k1 = *reinterpret_cast<const float4*>(sc.k + 32 * c + 8 * t4 + 4);
          const float d[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
          const float k[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float x[8];
            unpack8(A[h][c], x);
            const float u = h ? u1 : u0;
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = x[e] * d[e] + k[e] * u;
            A[h][c] = pack8(x);
          }
        }
      }
      if (cur.write_slot >= 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int c = 0; c < 4; ++c) __stcs(reinterpret_cast<uint4*>(state_out + row_ptr(cur, cur.write_slot, h) + 32 * c), A[h][c]);
      }
    }
    if (++m < M) {
      cur.v0 += R;  // the next rows of the same head: same slot, same token
      load_item(cur, false);
      continue;
    }
    m = 0;
    unit += stride;
    if (unit >= num_units) break;
    cur = next;
    if (unit + stride < num_units) next = resolve(p, (unit + stride) * M);
    load_item(cur, true);
  }
}

template <int M, int kMinBlocks>
void launch(const RecurrentParams& p, int sms) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_tc<M, kMinBlocks>, kWarps * 32, 0);
  const uint32_t units = uint32_t(int64_t(p.N) * p.HV * KB / M);
  const unsigned grid = unsigned(std::min<int64_t>(int64_t(sms) * per_sm, (int64_t(units) + kWarps - 1) / kWarps));
  decode_tc<M, kMinBlocks><<<grid, kWarps * 32>>>(p, units);
}

}  // namespace probe

using bf16 = __nv_bfloat16;

template <int M, int kMinBlocks>
int run_variant(DecodeCase<bf16>& c, const bf16* pool0, const bf16* pool_bulk, const bf16* o_bulk, double floor_ms) {
  flashkda::RecurrentParams& p = c.p;
  CHECK(cudaMemcpy(c.pool, pool0, c.state * 2, cudaMemcpyDeviceToDevice));
  probe::launch<M, kMinBlocks>(p, p.num_sms);
  CHECK(cudaDeviceSynchronize());
  const double od = rel_diff(o_bulk, c.o, c.tok), sd = rel_diff(pool_bulk, c.pool, c.state);
  const float ms = median_ms([&] { probe::launch<M, kMinBlocks>(p, p.num_sms); }, 50);
  CHECK(cudaGetLastError());
  cudaFuncAttributes attr;
  CHECK(cudaFuncGetAttributes(&attr, probe::decode_tc<M, kMinBlocks>));
  std::printf("tensor-core sums, M = %d, %d blocks/SM cap (%3d regs, %3zu B local) N=%4d T=%d: %.4f ms (%.0f%% of the floor) | "
              "vs bulk: rel diff o %.1e, state %.1e\n",
              M, kMinBlocks, attr.numRegs, attr.localSizeBytes, c.N, c.T, ms, 100.0 * floor_ms / ms, od, sd);
  return 0;
}

int main(int argc, char** argv) {
  DecodeCase<bf16> c;
  if (!c.init(argc > 1 ? std::atoi(argv[1]) : 256, true, argc > 2 ? std::atoi(argv[2]) : 1)) return 1;
  flashkda::RecurrentParams& p = c.p;
  const double floor_ms = c.floor_bytes() / copy_bandwidth() * 1e3;
  bf16 *pool0 = nullptr, *pool_bulk = nullptr, *o_bulk = nullptr;
  CHECK(cudaMalloc(&pool0, c.state * 2));
  CHECK(cudaMalloc(&pool_bulk, c.state * 2));
  CHECK(cudaMalloc(&o_bulk, c.tok * 2));
  CHECK(cudaMemcpy(pool0, c.pool, c.state * 2, cudaMemcpyDeviceToDevice));
  using Tune = flashkda::decode_bulk::DefaultTuning<bf16>;
  bool launched = false;
  CHECK((flashkda::run_decode_bulk_tuned<bf16, bf16, Tune>(p, 0, launched)));
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(pool_bulk, c.pool, c.state * 2, cudaMemcpyDeviceToDevice));
  CHECK(cudaMemcpy(o_bulk, c.o, c.tok * 2, cudaMemcpyDeviceToDevice));
  const float ms_bulk = median_ms([&] { flashkda::run_decode_bulk_tuned<bf16, bf16, Tune>(p, 0, launched); }, 50);
  std::printf("decode_bulk (bf16 pool) N=%4d T=%d: %.4f ms (%.0f%% of the floor %.4f ms)\n", c.N, c.T, ms_bulk,
              100.0 * floor_ms / ms_bulk, floor_ms);
  if (run_variant<1, 2>(c, pool0, pool_bulk, o_bulk, floor_ms) || run_variant<2, 2>(c, pool0, pool_bulk, o_bulk, floor_ms) ||
      run_variant<4, 2>(c, pool0, pool_bulk, o_bulk, floor_ms) || run_variant<8, 2>(c, pool0, pool_bulk, o_bulk, floor_ms) ||
      run_variant<1, 3>(c, pool0, pool_bulk, o_bulk, floor_ms) || run_variant<4, 3>(c, pool0, pool_bulk, o_bulk, floor_ms))
    return 1;
  return 0;
}
