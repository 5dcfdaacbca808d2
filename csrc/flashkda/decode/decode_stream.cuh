// Decode step for fp32 V-first states: persistent warps stream their state rows through registers.
// decode_step_vfirst (recurrent_kernel.cuh) serves every case this kernel does not cover
// (run_decode_stream decides); the two sum in different orders and agree to fp32 rounding.
//
// Why: a decode step reads and writes the whole state once, so it is bound by HBM bandwidth, and
// the question is how many state bytes are in flight. In decode_step_vfirst each block waits a
// memory latency for its slot index before its state loads go out, then exits; in decode_bulk.cuh
// the state takes a detour through shared memory (bulk copies in and out). Here each warp owns one
// work item at a time in registers, and issues the next item's state and token loads as soon as the
// current item is stored, with that item's slot (and sequence bounds) resolved one item earlier, so
// a warp almost always has its next 4 KB on the way. Measured on the H200 (BENCHMARK_H200.md,
// CUDA-graph replays at N = 64-1024): 86-90% of the copy floor where decode_bulk.cuh reaches 80-82%;
// the same loop without token loads or arithmetic (the access pattern alone) is only 1-2% faster.
//
// Work item: (sequence n, value head hv, block of kItemRows value rows), kItemRows * D contiguous
// fp32 state elements. Lane l holds keys 4l .. 4l+3 of every row of its item, so a warp access is
// one 512-byte row, the token vectors a lane needs are its own four channels (vector loads into
// registers, no shared memory), and a sum over K is a sum over the warp. The 2 kItemRows sums of a
// token (S_d k and S_d q of each row) are reduced together by halving exchanges (reduce_scatter:
// 2 kItemRows shuffles instead of 5 per sum) and leave each sum in known lanes, which compute
// that row's correction and output. Items are numbered value block fastest: the warps of a block
// work on neighbouring rows of one head and share its token rows in L1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "flashkda/api.h"
#include "flashkda/common/recurrent_params.h"
#include "flashkda/common/token_math.cuh"
#include "flashkda/decode/recurrent_common.cuh"
#include "flashkda/decode/slot_order.cuh"

namespace flashkda {
namespace decode_stream {

constexpr int D = kDecodeBulkHeadDim;
constexpr int kWarps = 8;        // warps per block
constexpr int kBlocksPerSm = 2;  // with 256 threads: a cap of 128 registers
// 8 rows (4 KB) per item. Measured on the H200 (a prototype of this kernel, N = 256): 8
// rows, 2 blocks/SM 0.281-0.286 ms; 4 rows, 3-4 blocks/SM 0.287-0.301; 16 rows, 2 blocks/SM 0.306.
constexpr int kItemRows = 8;
constexpr int kBlocksV = D / kItemRows;
constexpr int kKeysPerLane = D / 32;
static_assert(kKeysPerLane == 4, "lane layout: 4 keys per lane");

// Where the sums of an item end up (reduce_scatter over the 2 kItemRows values: sk of every row,
// then sq of every row): value i in lanes i * kLanesPerSum ... (i + 1) * kLanesPerSum - 1.
constexpr int kLanesPerSum = 32 / (2 * kItemRows);
static_assert(kLanesPerSum >= 1 && 32 % (2 * kItemRows) == 0, "2 kItemRows sums over 32 lanes");
// The row whose sk (lanes < 16) or sq (the others) a lane holds, and the lanes that hold sk.
__device__ __forceinline__ int sum_row(int lane) { return (lane % 16) / kLanesPerSum; }
__device__ __forceinline__ int sk_lane(int row) { return row * kLanesPerSum; }
// One lane per row writes the output.
__device__ __forceinline__ bool writes_output(int lane) { return lane >= 16 && lane % kLanesPerSum == 0; }

// Sums NV values over the warp: afterwards each lane holds the total of value lane / (32 / NV).
// Each step halves the values a lane carries: it sends one half to the partner lane (lane ^ M) and
// adds the partner's values of the half it keeps; with NV < 32 the last value is then summed over
// the remaining log2(32 / NV) lane bits. NV - 1 + log2(32 / NV) shuffles replace 5 NV. (A template
// recursion, so that every index is a constant and x stays in registers.)
template <int NV, int M = 16>
__device__ __forceinline__ float reduce_scatter(float (&x)[NV], int lane) {
  static_assert(NV >= 1 && (NV == 1 || NV <= 2 * M) && (NV & (NV - 1)) == 0, "a power of two, at most 32");
  if constexpr (NV == 1) {
#pragma unroll
    for (int m = M; m >= 1; m /= 2) x[0] += __shfl_xor_sync(0xffffffffu, x[0], m);
    return x[0];
  } else {
    const bool upper = (lane & M) != 0;
    float half[NV / 2];
#pragma unroll
    for (int i = 0; i < NV / 2; ++i) {
      const float send = upper ? x[i] : x[i + NV / 2];
      const float keep = upper ? x[i + NV / 2] : x[i];
      half[i] = keep + __shfl_xor_sync(0xffffffffu, send, M);
    }
    return reduce_scatter<NV / 2, M / 2>(half, lane);
  }
}

// A resolved work item, compact (it is carried one item ahead in registers): 32-bit fields where
// the values fit (batch rows and lengths: B and T are int32; slots: covers() bounds num_slots).
struct Item {
  int64_t bos;     // first token of the sequence within its batch row
  int batch, len;  // batch row, number of tokens
  int read_slot;   // -1: the state starts at zero (or is not needed)
  int write_slot;  // -1: the final state is not stored
  int hv, v0;      // value head, first value row
  bool skip;       // padding sequence: zero output, no state traffic
};

// Item number -> item, for items of kRows value rows (value block fastest, then value head, then
// sequence position). Positions from `first` on hold the sequences in `order` (slot_order.cuh).
template <int kRows = kItemRows>
__device__ __forceinline__ Item resolve_item(const RecurrentParams& p, uint32_t item, const uint16_t* order = nullptr,
                                             int first = recurrent::kUnordered) {
  constexpr int kBlocks = D / kRows;
  const int vblock = int(item % kBlocks);
  const uint32_t rest = item / kBlocks;
  const int n = recurrent::sequence_at(int(rest / uint32_t(p.HV)), order, first);
  const recurrent::Sequence seq = recurrent::resolve_sequence(p, n);
  int64_t write_slot = recurrent::final_slot(p, n, seq);
  // A zero-length sequence passes its state through: nothing moves when it stays in place.
  if (seq.len == 0 && p.state_in == p.state_out && seq.read_slot == write_slot) write_slot = -1;
  const bool needs_state = !seq.skip && (seq.len > 0 || write_slot >= 0);
  Item it;
  it.bos = seq.bos;
  it.batch = int(seq.batch);
  it.len = int(seq.len);
  it.read_slot = needs_state ? int(seq.read_slot) : -1;
  it.write_slot = int(write_slot);
  it.hv = int(rest % uint32_t(p.HV));
  it.v0 = vblock * kRows;
  it.skip = seq.skip;
  return it;
}

// Raw bits of one token as a lane loads them (its four key channels), turned into numbers only when
// used, so that every load of an item goes out before the first wait.
template <typename Elem>
struct TokenRaw {
  using Four = typename std::conditional<sizeof(Elem) == 2, uint2, uint4>::type;  // 4 Elem
  Four q, k;
  uint4 g;         // 4 gate values of g_dtype (16-bit types: .x, .y); scalar gate: .x
  uint4 bias;      // dt_bias of the 4 channels as g (bits of dt_bias_dtype); zeros without dt_bias
  uint32_t beta;   // beta_dtype bits
  float a_log;     // A_log[hv], 0 without A_log
};

__device__ __forceinline__ uint32_t load_bits(const void* base, DType dt, int64_t i) {
  return dt == DType::kFloat32 ? static_cast<const uint32_t*>(base)[i] : uint32_t(static_cast<const uint16_t*>(base)[i]);
}

// The bits of values i .. i + 3 of dtype dt (16-bit types: .x, .y), one 16- or 8-byte access.
__device__ __forceinline__ uint4 load_bits4(const void* base, DType dt, int64_t i) {
  if (dt == DType::kFloat32) return *reinterpret_cast<const uint4*>(static_cast<const float*>(base) + i);
  const uint2 h = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
  return make_uint4(h.x, h.y, 0u, 0u);
}

template <typename Elem>
__device__ __forceinline__ void unpack4(const typename TokenRaw<Elem>::Four& raw, float (&x)[4]) {
  const Elem* e = reinterpret_cast<const Elem*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = to_float(e[i]);
}

__device__ __forceinline__ void unpack_gate4(const uint4& raw, DType dt, float (&x)[4]) {
  if (dt == DType::kFloat32) {
    x[0] = __uint_as_float(raw.x), x[1] = __uint_as_float(raw.y), x[2] = __uint_as_float(raw.z), x[3] = __uint_as_float(raw.w);
  } else {
    x[0] = bits_to_float(raw.x & 0xffffu, dt), x[1] = bits_to_float(raw.x >> 16, dt);
    x[2] = bits_to_float(raw.y & 0xffffu, dt), x[3] = bits_to_float(raw.y >> 16, dt);
  }
}

template <typename Elem>
__device__ __forceinline__ TokenRaw<Elem> load_token(const RecurrentParams& p, const Item& it, int64_t t, int lane) {
  using Four = typename TokenRaw<Elem>::Four;
  const int hk = key_head(p, it.hv), c0 = kKeysPerLane * lane;
  const recurrent::TokenSrc<Elem> src = recurrent::global_token<Elem, D>(p, it.batch, t, hk, it.hv);
  TokenRaw<Elem> r;
  r.q = *reinterpret_cast<const Four*>(src.q + c0);
  r.k = *reinterpret_cast<const Four*>(src.k + c0);
  if (p.scalar_gate) {
    r.g = make_uint4(load_bits(src.g, p.g_dtype, 0), 0u, 0u, 0u);
    r.bias = make_uint4(src.bias != nullptr ? load_bits(src.bias, src.bias_dtype, 0) : 0u, 0u, 0u, 0u);
  } else {
    r.g = load_bits4(src.g, p.g_dtype, c0);
    r.bias = src.bias != nullptr ? load_bits4(src.bias, src.bias_dtype, c0) : make_uint4(0u, 0u, 0u, 0u);
  }
  r.beta = load_bits(p.beta, p.beta_dtype, it.batch * p.beta_batch_stride + t * p.beta_token_stride + it.hv);
  r.a_log = a_log_value(p, it.hv);
  return r;
}

// v of token t at value row it.v0 + row.
template <typename Elem>
__device__ __forceinline__ Elem load_v(const RecurrentParams& p, const Item& it, int64_t t, int row) {
  return static_cast<const Elem*>(p.v)[it.batch * p.v_batch_stride + t * p.v_token_stride + int64_t(it.hv) * p.v_head_stride +
                                       it.v0 + row];
}

// A token's factors for a lane's four key channels: decay d, normalised k, d ⊙ k and d ⊙ q (q
// normalised and scaled), beta and k·q.
struct Prepared {
  float d[4], k[4], dk[4], dq[4];
  float beta, kq;
};

template <typename Elem>
__device__ __forceinline__ Prepared prepare_token(const RecurrentParams& p, const TokenRaw<Elem>& r) {
  Prepared t;
  float q[4], g[4];
  unpack4<Elem>(r.q, q);
  unpack4<Elem>(r.k, t.k);
  const float a = p.A_log != nullptr ? __expf(r.a_log) : 1.f;
  float bias[4];
  unpack_gate4(r.bias, p.dt_bias_dtype, bias);
  if (p.scalar_gate) {
    const float decay = __expf(log_decay(p, bits_to_float(r.g.x, p.g_dtype), bias[0], a));
#pragma unroll
    for (int e = 0; e < 4; ++e) t.d[e] = decay;
  } else {
    unpack_gate4(r.g, p.g_dtype, g);
    float log_d[4];
    log_decays(p, g, bias, a, log_d);
#pragma unroll
    for (int e = 0; e < 4; ++e) t.d[e] = __expf(log_d[e]);
  }
  float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) qq += q[e] * q[e], kk += t.k[e] * t.k[e], qk += q[e] * t.k[e];
  float q_scale = p.scale, k_scale = 1.f;
  if (p.l2norm) {
    // The three sums in one reduce_scatter (6 shuffles instead of 15): lanes 0-7 get q·q, 8-15
    // k·k, 16-23 k·q. Those lanes take the norms' rsqrt, and three shuffles hand out the results.
    const int lane = threadIdx.x % 32;
    float x[4] = {qq, kk, qk, 0.f};
    const float sum = reduce_scatter<4>(x, lane);
    const float f = lane < 16 ? rsqrtf(sum + kL2NormEps) : sum;
    q_scale *= __shfl_sync(0xffffffffu, f, 0);
    k_scale = __shfl_sync(0xffffffffu, f, 8);
    t.kq = __shfl_sync(0xffffffffu, f, 16) * q_scale * k_scale;
  } else {
    t.kq = group_sum<32>(qk) * q_scale;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) t.k[e] *= k_scale, t.dk[e] = t.d[e] * t.k[e], t.dq[e] = t.d[e] * (q[e] * q_scale);
  t.beta = beta_value(p, bits_to_float(r.beta, p.beta_dtype));
  return t;
}

// One token's update of an item's rows (docs/SPEC.md, "The recurrence"); returns the output of row
// sum_row(lane) on the lanes that write it. With the decayed state S_d = S ⊙ d:
// sk = S_d k = S (d ⊙ k), sq = S (d ⊙ q), u = beta (v − sk), S = S_d + u kᵀ, o = sq + u (k·q).
__device__ __forceinline__ float token_update(const Prepared& t, float v, float (&S)[kItemRows][4], int lane) {
  // The 2 kItemRows sums reduced as reduce_scatter<2 kItemRows> would, with its first step (lanes
  // < 16 keep the sk, the others the sq) taken row by row as the sums come, so that kItemRows
  // values stay alive instead of twice as many.
  const bool upper = (lane & 16) != 0;
  float half[kItemRows];
#pragma unroll
  for (int j = 0; j < kItemRows; ++j) {
    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) sk += S[j][e] * t.dk[e], sq += S[j][e] * t.dq[e];
    half[j] = (upper ? sq : sk) + __shfl_xor_sync(0xffffffffu, upper ? sk : sq, 16);
  }
  const float mine = reduce_scatter<kItemRows, 8>(half, lane);  // sk (lanes < 16) or sq of sum_row(lane)
  const float u = t.beta * (v - mine);
  const float out = mine + __shfl_xor_sync(0xffffffffu, u, 16) * t.kq;
#pragma unroll
  for (int j = 0; j < kItemRows; ++j) {
    const float uj = __shfl_sync(0xffffffffu, u, sk_lane(j));
#pragma unroll
    for (int e = 0; e < 4; ++e) S[j][e] = S[j][e] * t.d[e] + t.k[e] * uj;
  }
  return out;
}

// Asks L2 to fetch the 128-byte line at `ptr` (no registers, no wait).
__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr)); }

// The same with the L2 evict-last priority, so that the line stays until its load comes.
__device__ __forceinline__ void prefetch_l2_evict_last(const void* ptr) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(ptr));
}

// kPrefetch: while an item is computed, the state rows of the item kPrefetch strides ahead (0: none)
// are prefetched into L2, one 128-byte line per lane, so that their loads find them there. Measured on
// the H200 (bench/harness/decode_harness.cu, one token per sequence, N = 64 / 256 / 1024): none
// 0.0810 / 0.2910 / 1.1332 ms, one stride 0.0793 / 0.2838 / 1.1012, two strides 0.0826 / 0.2954 /
// 1.1468; 3, one stride with the evict-last priority, 0.0788 / 0.2855 / 1.1188 against one stride's
// 0.0781 / 0.2843 / 1.1107 in the same run. With 2 or 4 tokens per sequence (N = 256) one stride is
// 1-2% slower than none, so run_decode_stream prefetches one stride, only for uniform batches of one
// token.
template <typename Elem, int kPrefetch = 0>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
    decode_step_stream(const RecurrentParams p, const uint32_t num_items) {
  const int lane = threadIdx.x % 32;
  const uint32_t stride = gridDim.x * kWarps;
  const int64_t slot_elems = state_slot_elems(p);
  const float* state_in = static_cast<const float*>(p.state_in);
  float* state_out = static_cast<float*>(p.state_out);

  uint32_t item = blockIdx.x * kWarps + threadIdx.x / 32;
  if (item >= num_items) return;  // never when the block sorts (orders_by_slot)
  // The later rounds take their sequences in slot order (slot_order.cuh): the sort's index loads go
  // out with the first item's, and the sort runs while that item's state loads are in flight.
  __shared__ recurrent::SlotOrder slot_order;
  const bool ordered = recurrent::orders_by_slot(p, num_items, stride);
  int first = ordered ? recurrent::first_sorted_position(stride, uint32_t(p.HV) * kBlocksV) : recurrent::kUnordered;
  recurrent::SlotsOfThread<kWarps * 32> slots;
  if (ordered) slots = recurrent::begin_slot_order<kWarps * 32>(p, first, slot_order);
  Item cur = resolve_item(p, item), next{};  // the first round keeps index order
  recurrent::SettledSlots<kWarps * 32> settled;
  if (ordered) settled = recurrent::settle_slot_order<kWarps * 32>(p, first, slots, slot_order);
  static_assert(kPrefetch >= 0 && kPrefetch <= 3, "prefetch distance: 0, 1 or 2 strides; 3: 1 with evict-last");
  static_assert(kItemRows * D * sizeof(float) == 32 * 128, "an item is one 128-byte line per lane");
  // Line `lane` of an item's state in its read slot, or null when it has none.
  auto item_line = [&](const Item& it) -> const float* {
    return it.read_slot >= 0 ? state_in + int64_t(it.read_slot) * slot_elems + int64_t(it.hv) * D * D +
                                   int64_t(it.v0) * D + 32 * lane
                             : nullptr;
  };
  const float* ahead = nullptr;  // kPrefetch == 2: the line of the item two strides ahead

  // This lane's 16 bytes of row j of an item's state.
  auto offset = [&](const Item& it, int slot, int j) {
    return int64_t(slot) * slot_elems + int64_t(it.hv) * D * D + int64_t(it.v0 + j) * D + kKeysPerLane * lane;
  };
  float S[kItemRows][4];
  TokenRaw<Elem> tok;
  Elem v;  // the token's v at row sum_row(lane)
  // An item's loads: its state rows and its first token.
  auto load_item = [&](const Item& it) {
#pragma unroll
    for (int j = 0; j < kItemRows; ++j) {
      if (it.read_slot >= 0) {
        const float4 x = __ldcs(reinterpret_cast<const float4*>(state_in + offset(it, it.read_slot, j)));
        S[j][0] = x.x, S[j][1] = x.y, S[j][2] = x.z, S[j][3] = x.w;
      } else {
        S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.f;
      }
    }
    if (!it.skip && it.len > 0) tok = load_token<Elem>(p, it, it.bos, lane), v = load_v<Elem>(p, it, it.bos, sum_row(lane));
  };
  load_item(cur);
  if (ordered && !recurrent::finish_slot_order<kWarps * 32>(p, first, settled, slot_order)) first = recurrent::kUnordered;
  const uint16_t* order = slot_order.seq;
  if (item + stride < num_items) next = resolve_item(p, item + stride, order, first);
  if constexpr (kPrefetch == 2) {
    if (item + stride < num_items && next.read_slot >= 0) prefetch_l2(item_line(next));
    if (item + 2 * stride < num_items) ahead = item_line(resolve_item(p, item + 2 * stride, order, first));
  }

  const bool writer = writes_output(lane);
  while (true) {
    if constexpr (kPrefetch == 1) {
      if (item + stride < num_items && next.read_slot >= 0) prefetch_l2(item_line(next));
    } else if constexpr (kPrefetch == 3) {
      if (item + stride < num_items && next.read_slot >= 0) prefetch_l2_evict_last(item_line(next));
    } else if constexpr (kPrefetch == 2) {
      if (ahead != nullptr) prefetch_l2(ahead);
    }
    Elem* o = static_cast<Elem*>(p.o) + cur.batch * p.o_batch_stride + int64_t(cur.hv) * p.o_head_stride + cur.v0 +
              sum_row(lane);
    if (cur.skip) {
      if (writer)
        for (int i = 0; i < cur.len; ++i) o[(cur.bos + i) * p.o_token_stride] = from_float<Elem>(0.f);
    } else {
      for (int i = 0; i < cur.len; ++i) {
        if (i > 0) tok = load_token<Elem>(p, cur, cur.bos + i, lane), v = load_v<Elem>(p, cur, cur.bos + i, sum_row(lane));
        const float out = token_update(prepare_token<Elem>(p, tok), to_float(v), S, lane);
        if (writer) o[(cur.bos + i) * p.o_token_stride] = from_float<Elem>(out);
      }
      if (cur.write_slot >= 0) {
#pragma unroll
        for (int j = 0; j < kItemRows; ++j)
          __stcs(reinterpret_cast<float4*>(state_out + offset(cur, cur.write_slot, j)),
                 make_float4(S[j][0], S[j][1], S[j][2], S[j][3]));
      }
    }

    item += stride;
    if (item >= num_items) break;
    cur = next;
    // The item's loads first, then the next item's slot (index loads and a division by HV that
    // would otherwise stand between the stores above and these loads).
    load_item(cur);
    if (item + stride < num_items) next = resolve_item(p, item + stride, order, first);
    if constexpr (kPrefetch == 2)
      ahead = item + 2 * stride < num_items ? item_line(resolve_item(p, item + 2 * stride, order, first)) : nullptr;
  }
}

// The cases this kernel serves: recurrent::persistent_decode_covers with fp32 states, slots that fit
// Item's 32 bits, and 16-byte aligned token rows (vector loads).
template <typename Elem>
bool covers(const RecurrentParams& p) {
  return recurrent::persistent_decode_covers(p, kBlocksV, DType::kFloat32) && p.num_slots < (int64_t(1) << 31) &&
         recurrent::token_rows_aligned16<Elem>(p);
}

// Whether this device holds resident blocks of the variant that run_decode_stream launches for p.
template <typename Elem>
bool resident(const RecurrentParams& p) {
  return p.cu_seqlens == nullptr && p.T == 1 ? recurrent::resident_blocks<decode_step_stream<Elem, 1>>(kWarps * 32) > 0
                                             : recurrent::resident_blocks<decode_step_stream<Elem, 0>>(kWarps * 32) > 0;
}

template <typename Elem, int kPrefetch = 0>
cudaError_t run(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  launched = false;
  if (!covers<Elem>(p)) return cudaSuccess;
  const uint32_t num_items = uint32_t(int64_t(p.N) * p.HV * kBlocksV);
  return recurrent::launch_persistent<decode_step_stream<Elem, kPrefetch>>(p, kWarps, num_items, stream, launched);
}

}  // namespace decode_stream

template <typename Elem>
bool decode_stream_serves(const RecurrentParams& p) {
  return decode_stream::covers<Elem>(p) && decode_stream::resident<Elem>(p);
}

template <typename Elem>
cudaError_t run_decode_stream(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  if (p.cu_seqlens == nullptr && p.T == 1) return decode_stream::run<Elem, 1>(p, stream, launched);
  return decode_stream::run<Elem, 0>(p, stream, launched);
}

}  // namespace flashkda
