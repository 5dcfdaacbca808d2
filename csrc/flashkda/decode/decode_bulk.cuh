// Decode step for the V-first state layout on sm_90: a persistent, warp-specialised kernel that
// streams state tiles through a ring of shared-memory stages with bulk copies (cp.async.bulk) and
// mbarriers. Same results as decode_step_vfirst (recurrent_kernel.cuh), which serves every case
// this kernel does not cover (run_decode_bulk decides).
//
// Why: a decode step reads and writes the whole state once, so it is bound by HBM bandwidth. In the
// one-block-per-tile kernel each block waits a memory latency for its slot index (and the token
// vectors) before its state load goes out, which leaves too few bytes in flight. Here one producer
// warp resolves the slots of 32 work items at once (one latency for all of them) and keeps the bulk
// loads of several items in flight, while four consumer warps update the tiles that have landed
// and write them back with bulk stores.
//
// Work item: (sequence n, value head hv, block of kRows value rows). In the V-first layout those
// rows are one contiguous range of kRows * D state elements: one bulk copy in, one out (a slice per
// consumer warp). The first token's q, k, gate and dt_bias rows and v slice travel in the same
// stage when they are 16-byte aligned, so a T = 1 step finds everything in shared memory; later
// tokens of longer sequences are read from global memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "flashkda/api.h"
#include "flashkda/common/bulk_sm90.cuh"
#include "flashkda/common/kernel_launch.cuh"
#include "flashkda/common/recurrent_params.h"
#include "flashkda/common/token_math.cuh"
#include "flashkda/decode/recurrent_common.cuh"

// The kernel's device code exists only in sm_90+ compilation passes (FLASHKDA_BULK_COPY); the
// sm_80 pass compiles an empty body, which the host never launches (run_decode_bulk checks the
// binary's architecture).

namespace flashkda {
namespace decode_bulk {

// The kernel's tuning: consumer warps per block, value rows per work item (one contiguous range of
// state), resident blocks per SM (the rest of the shared memory becomes stages).
// bench/harness/run_decode.sh times other choices against these.
template <int kConsumerWarps_, int kItemRows_, int kBlocksPerSm_>
struct Tuning {
  static constexpr int kConsumerWarps = kConsumerWarps_;
  static constexpr int kItemRows = kItemRows_;
  static constexpr int kBlocksPerSm = kBlocksPerSm_;
};
// 16 KB of state per item: 32 rows of fp32, 64 rows of bf16. Measured on the H200 at N = 256
// (bench/harness/run_decode.sh): bf16 with 32-row items (8 KB, 3 blocks/SM) took 0.236 ms against
// 0.188 with 64-row items: a work item has a fixed cost (header, token vectors, stage hand-over),
// so an item should carry as many bytes as with an fp32 state.
template <typename StateT>
using DefaultTuning = Tuning<4, sizeof(StateT) == 4 ? 32 : 64, 2>;

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// What the producer resolved about one work item; lives in its stage.
struct StageHeader {
  int64_t batch, bos, len;  // tokens [bos, bos + len) of batch row `batch`
  int64_t read_slot;        // state slot loaded into the tile, -1: none (zeros)
  int64_t write_slot;       // slot that receives the final state, -1: none
  uint32_t flags;           // StageFlags
  float beta;               // first token's raw beta
  float a;                  // exp(A_log[hv]), 1 without A_log
  float g, bias;            // first token's gate and dt_bias with a scalar gate (GDN)
};

enum StageFlags : uint32_t {
  kSkip = 1,    // padding slot: zero output, no state traffic
  kLoaded = 2,  // the tile holds the state of read_slot (else the state starts at zero)
  kStaged = 4,  // the first token's vectors are in the stage
};

template <typename Elem, typename StateT, typename Tune>
struct Shape {
  static constexpr int D = kDecodeBulkHeadDim;
  static constexpr int kRows = Tune::kItemRows;
  static constexpr int kBlocksV = D / kRows;
  static constexpr int kConsumerWarps = Tune::kConsumerWarps;
  static constexpr int kThreads = 32 * (kConsumerWarps + 1);  // + the producer warp
  static constexpr int kRowsPerWarp = kRows / kConsumerWarps;
  // A row of K spans 8 lanes, 16 bytes of state per shared-memory access: a quarter warp reads 128
  // contiguous bytes of one row, free of bank conflicts, and reductions over K are 3 shuffles.
  static constexpr int kLanesK = 8;
  static constexpr int kVec = 16 / int(sizeof(StateT));  // state elements per access
  static constexpr int kChunks = D / (kVec * kLanesK);   // accesses per lane and row
  static constexpr int kRowsPerPass = 32 / kLanesK;
  static constexpr int kRowsPerThread = kRowsPerWarp / kRowsPerPass;

  // Stage: state tile, then the first token's vectors, then the header (byte offsets).
  static constexpr int kTileBytes = kRows * D * int(sizeof(StateT));
  static constexpr int kWarpTileBytes = kTileBytes / kConsumerWarps;
  static constexpr int kQ = kTileBytes;
  static constexpr int kK = kQ + D * int(sizeof(Elem));
  static constexpr int kG = kK + D * int(sizeof(Elem));
  static constexpr int kBias = kG + D * int(sizeof(float));  // room for an fp32 gate row (and dt_bias row)
  static constexpr int kV = kBias + D * int(sizeof(float));
  static constexpr int kHeader = round_up(kV + kRows * int(sizeof(Elem)), 16);
  static constexpr int kStageBytes = round_up(kHeader + int(sizeof(StageHeader)), 128);

  // Block: barriers, the consumer warps' token scratch, the stages.
  static constexpr int kBarrierBytes = 256;
  static constexpr int kScratch = kBarrierBytes;
  static constexpr int kStagesAt = round_up(kScratch + kConsumerWarps * int(sizeof(recurrent::TokenScratch<D>)), 128);
  // The rest of the shared memory goes to stages, so that several loads per block are in flight.
  static constexpr int kBlocksPerSm = Tune::kBlocksPerSm;
  static constexpr int kStages = (kSm90SmemPerSm / kBlocksPerSm - kSmemReservedPerBlock - kStagesAt) / kStageBytes;
  static constexpr int kSmemBytes = kStagesAt + kStages * kStageBytes;

  static_assert(std::is_same<StateT, float>::value || std::is_same<StateT, __nv_bfloat16>::value, "state: fp32 or bf16");
  static_assert(kRowsPerThread * kRowsPerPass == kRowsPerWarp && kChunks * kVec * kLanesK == D, "bad tiling");
  static_assert(kWarpTileBytes % 16 == 0 && kQ % 16 == 0 && kV % 16 == 0, "bulk copies move 16-byte units");
  static_assert(2 * kStages * int(sizeof(uint64_t)) <= kBarrierBytes, "barrier region too small");
  // The consumer releases a stage one item late (after its next store), so two stages are always
  // held; fewer than four would leave at most one load in flight.
  static_assert(kStages >= 4, "too few stages");
};

// Run-time facts of one launch.
struct Plan {
  uint32_t num_items;  // N * HV * kBlocksV
  bool stage_tokens;   // the token rows are 16-byte aligned: the first token travels by bulk copy
};

struct ItemCoords {
  int n, hv, vblock;
};

// Items are numbered value block fastest, then head, then sequence.
template <int kBlocksV>
__device__ __forceinline__ ItemCoords item_coords(const RecurrentParams& p, uint32_t item) {
  ItemCoords c;
  c.vblock = int(item % kBlocksV);
  const uint32_t rest = item / kBlocksV;
  c.hv = int(rest % uint32_t(p.HV));
  c.n = int(rest / uint32_t(p.HV));
  return c;
}

#ifdef FLASHKDA_BULK_COPY

// 16 bytes of state in shared memory <-> fp32.
template <int kVec>
__device__ __forceinline__ void load16(const float* src, float (&x)[kVec]) {
  load_floats(src, x);
}
template <int kVec>
__device__ __forceinline__ void load16(const __nv_bfloat16* src, float (&x)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int e = 0; e < kVec / 2; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    x[2 * e] = f.x, x[2 * e + 1] = f.y;
  }
}
template <int kVec>
__device__ __forceinline__ void store16(float* dst, const float (&x)[kVec]) {
  *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
}
template <int kVec>
__device__ __forceinline__ void store16(__nv_bfloat16* dst, const float (&x)[kVec]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int e = 0; e < kVec / 2; ++e) h[e] = __floats2bfloat162_rn(x[2 * e], x[2 * e + 1]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

template <typename Elem, typename StateT, typename Tune>
__device__ __forceinline__ StageHeader plan_item(const RecurrentParams& p, const Plan& plan, uint32_t item) {
  using S = Shape<Elem, StateT, Tune>;
  const ItemCoords c = item_coords<S::kBlocksV>(p, item);
  const recurrent::Sequence seq = recurrent::resolve_sequence(p, c.n);
  StageHeader h;
  h.batch = seq.batch;
  h.bos = seq.bos;
  h.len = seq.len;
  h.write_slot = recurrent::final_slot(p, c.n, seq);
  // A zero-length sequence passes its state through: nothing moves when it stays in place.
  if (seq.len == 0 && p.state_in == p.state_out && seq.read_slot == h.write_slot) h.write_slot = -1;
  const bool needs_state = !seq.skip && (seq.len > 0 || h.write_slot >= 0);
  h.read_slot = needs_state ? seq.read_slot : -1;
  const bool has_tokens = !seq.skip && seq.len > 0;
  h.flags = (seq.skip ? kSkip : 0u) | (h.read_slot >= 0 ? kLoaded : 0u) | (plan.stage_tokens && has_tokens ? kStaged : 0u);
  h.a = gate_scale(p, c.hv);
  h.beta = h.g = h.bias = 0.f;
  if (has_tokens) {
    h.beta = load_any(p.beta, p.beta_dtype, seq.batch * p.beta_batch_stride + seq.bos * p.beta_token_stride + c.hv);
    if (p.scalar_gate) {
      h.g = load_any(p.g, p.g_dtype, seq.batch * p.g_batch_stride + seq.bos * p.g_token_stride + c.hv * p.g_head_stride);
      h.bias = p.dt_bias != nullptr ? load_any(p.dt_bias, p.dt_bias_dtype, c.hv) : 0.f;
    }
  }
  return h;
}

__device__ __forceinline__ StageHeader shfl_header(const StageHeader& h, int src) {
  constexpr unsigned kAll = 0xffffffffu;
  StageHeader r;
  r.batch = __shfl_sync(kAll, h.batch, src);
  r.bos = __shfl_sync(kAll, h.bos, src);
  r.len = __shfl_sync(kAll, h.len, src);
  r.read_slot = __shfl_sync(kAll, h.read_slot, src);
  r.write_slot = __shfl_sync(kAll, h.write_slot, src);
  r.flags = __shfl_sync(kAll, h.flags, src);
  r.beta = __shfl_sync(kAll, h.beta, src);
  r.a = __shfl_sync(kAll, h.a, src);
  r.g = __shfl_sync(kAll, h.g, src);
  r.bias = __shfl_sync(kAll, h.bias, src);
  return r;
}

// Producer warp: the lanes resolve 32 items at once, then lane 0 hands them to the stages in order,
// issuing each item's bulk loads as soon as its stage is free.
template <typename Elem, typename StateT, typename Tune>
__device__ __forceinline__ void produce(const RecurrentParams& p, const Plan& plan, unsigned char* smem, uint64_t* full,
                                        uint64_t* empty, int lane) {
  using S = Shape<Elem, StateT, Tune>;
  constexpr int D = S::D;
  const uint64_t evict_first = sm90::evict_first_policy();
  // Bytes of the first token's staged vectors; zero-sized rows are not staged.
  const uint32_t qk_row = D * sizeof(Elem), v_slice = S::kRows * sizeof(Elem);
  const uint32_t g_row = p.scalar_gate ? 0 : D * dtype_bytes(p.g_dtype);
  const uint32_t bias_row = p.scalar_gate || p.dt_bias == nullptr ? 0 : D * dtype_bytes(p.dt_bias_dtype);
  const uint32_t token_bytes = 2 * qk_row + v_slice + g_row + bias_row;
  const int64_t slot_elems = state_slot_elems(p);
  const uint32_t grid = gridDim.x;

  int stage = 0;
  uint32_t phase = 0;
  for (uint32_t base = blockIdx.x; base < plan.num_items; base += 32 * grid) {
    const uint32_t mine = base + lane * grid;
    StageHeader own{};
    if (mine < plan.num_items) own = plan_item<Elem, StateT, Tune>(p, plan, mine);
    const int count = int(std::min<uint32_t>(32, (plan.num_items - base + grid - 1) / grid));
    for (int j = 0; j < count; ++j) {
      const StageHeader h = shfl_header(own, j);
      if (lane == 0) {
        const ItemCoords c = item_coords<S::kBlocksV>(p, base + j * grid);
        unsigned char* st = smem + S::kStagesAt + stage * S::kStageBytes;
        sm90::mbarrier_wait(&empty[stage], phase ^ 1);
        *reinterpret_cast<StageHeader*>(st + S::kHeader) = h;
        const uint32_t bytes = (h.flags & kLoaded ? S::kTileBytes : 0) + (h.flags & kStaged ? token_bytes : 0);
        if (bytes == 0) {
          sm90::mbarrier_arrive(&full[stage]);
        } else {
          sm90::mbarrier_arrive_expect_tx(&full[stage], bytes);
          if (h.flags & kLoaded) {
            const StateT* src = static_cast<const StateT*>(p.state_in) + h.read_slot * slot_elems +
                                int64_t(c.hv) * D * D + int64_t(c.vblock) * S::kRows * D;
            sm90::bulk_copy_to_shared(st, src, S::kTileBytes, &full[stage], evict_first);
          }
          if (h.flags & kStaged) {
            const int hk = key_head(p, c.hv);
            const recurrent::TokenSrc<Elem> tok = recurrent::global_token<Elem, D>(p, h.batch, h.bos, hk, c.hv);
            const Elem* v = static_cast<const Elem*>(p.v) + h.batch * p.v_batch_stride + h.bos * p.v_token_stride +
                            int64_t(c.hv) * p.v_head_stride + c.vblock * S::kRows;
            sm90::bulk_copy_to_shared(st + S::kQ, tok.q, qk_row, &full[stage]);
            sm90::bulk_copy_to_shared(st + S::kK, tok.k, qk_row, &full[stage]);
            sm90::bulk_copy_to_shared(st + S::kV, v, v_slice, &full[stage]);
            if (g_row != 0) sm90::bulk_copy_to_shared(st + S::kG, tok.g, g_row, &full[stage]);
            if (bias_row != 0) sm90::bulk_copy_to_shared(st + S::kBias, tok.bias, bias_row, &full[stage]);
          }
        }
      }
      if (++stage == S::kStages) stage = 0, phase ^= 1;
    }
  }
}

// Consumer warps: warp w owns rows [w * kRowsPerWarp, (w + 1) * kRowsPerWarp) of every tile and
// stores them itself, so the consumers never wait for each other.
template <typename Elem, typename StateT, typename Tune>
__device__ __forceinline__ void consume(const RecurrentParams& p, const Plan& plan, unsigned char* smem, uint64_t* full,
                                        uint64_t* empty, int warp, int lane) {
  using S = Shape<Elem, StateT, Tune>;
  constexpr int D = S::D, TK = S::kLanesK, VEC = S::kVec, CH = S::kChunks, RPT = S::kRowsPerThread;
  recurrent::TokenScratch<D>& sc = reinterpret_cast<recurrent::TokenScratch<D>*>(smem + S::kScratch)[warp];
  const int lane_k = lane % TK;
  const int row0 = warp * S::kRowsPerWarp + lane / TK;  // this thread's rows of a tile: row0 + j * kRowsPerPass
  const uint64_t evict_first = sm90::evict_first_policy();
  const int64_t slot_elems = state_slot_elems(p);

  int stage = 0, pending = -1;  // pending: stage whose bulk store may still be reading shared memory
  uint32_t phase = 0;
  for (uint32_t item = blockIdx.x; item < plan.num_items; item += gridDim.x) {
    unsigned char* st = smem + S::kStagesAt + stage * S::kStageBytes;
    StateT* tile = reinterpret_cast<StateT*>(st);
    const StageHeader* hdr = reinterpret_cast<const StageHeader*>(st + S::kHeader);
    sm90::mbarrier_wait(&full[stage], phase);
    const StageHeader h = *hdr;
    const ItemCoords c = item_coords<S::kBlocksV>(p, item);
    const int hv = c.hv, hk = key_head(p, hv), v0 = c.vblock * S::kRows;
    Elem* o_rows = static_cast<Elem*>(p.o) + h.batch * p.o_batch_stride + int64_t(hv) * p.o_head_stride + v0 + row0;
    bool stored = false;

    if (h.flags & kSkip) {
      if (lane_k == 0)
        for (int64_t i = 0; i < h.len; ++i)
#pragma unroll
          for (int j = 0; j < RPT; ++j) o_rows[(h.bos + i) * p.o_token_stride + j * S::kRowsPerPass] = from_float<Elem>(0.f);
    } else {
      float Sr[RPT][CH][VEC];
#pragma unroll
      for (int j = 0; j < RPT; ++j)
#pragma unroll
        for (int ci = 0; ci < CH; ++ci) {
          if (h.flags & kLoaded) {
            load16<VEC>(tile + (row0 + j * S::kRowsPerPass) * D + ci * VEC * TK + lane_k * VEC, Sr[j][ci]);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) Sr[j][ci][e] = 0.f;
          }
        }

      float o_last[RPT];  // the last token's output, written after the tile store is issued
      for (int64_t i = 0; i < h.len; ++i) {
        const int64_t t = h.bos + i;
        recurrent::TokenSrc<Elem> src = recurrent::global_token<Elem, D>(p, h.batch, t, hk, hv);
        const Elem* v_rows = static_cast<const Elem*>(p.v) + h.batch * p.v_batch_stride + t * p.v_token_stride +
                             int64_t(hv) * p.v_head_stride + v0 + row0;
        float beta_raw;
        if (i == 0) {  // the producer fetched the first token's scalars, and its vectors when staged
          beta_raw = h.beta;
          if (p.scalar_gate) {
            src.g = &hdr->g;
            src.g_dtype = DType::kFloat32;
            src.bias = &hdr->bias;
            src.bias_dtype = DType::kFloat32;
          }
          if (h.flags & kStaged) {
            src.q = reinterpret_cast<const Elem*>(st + S::kQ);
            src.k = reinterpret_cast<const Elem*>(st + S::kK);
            v_rows = reinterpret_cast<const Elem*>(st + S::kV) + row0;
            if (!p.scalar_gate) {
              src.g = st + S::kG;
              if (src.bias != nullptr) src.bias = st + S::kBias;
            }
          }
        } else {
          beta_raw = load_any(p.beta, p.beta_dtype, h.batch * p.beta_batch_stride + t * p.beta_token_stride + hv);
        }
        float vv[RPT];
#pragma unroll
        for (int j = 0; j < RPT; ++j) vv[j] = to_float(v_rows[j * S::kRowsPerPass]);
        const float beta = beta_value(p, beta_raw);
        const float kq = recurrent::stage_token<Elem, D>(p, src, h.a, sc, lane);

        float u[RPT], sq[RPT];
        recurrent::vfirst_token_update<TK>(Sr, sc, lane_k, beta, vv, u, sq);
#pragma unroll
        for (int j = 0; j < RPT; ++j) {
          o_last[j] = sq[j] + u[j] * kq;
          if (lane_k == 0 && i + 1 < h.len) o_rows[t * p.o_token_stride + j * S::kRowsPerPass] = from_float<Elem>(o_last[j]);
        }
      }

      if (h.write_slot >= 0) {
#pragma unroll
        for (int j = 0; j < RPT; ++j)
#pragma unroll
          for (int ci = 0; ci < CH; ++ci)
            store16<VEC>(tile + (row0 + j * S::kRowsPerPass) * D + ci * VEC * TK + lane_k * VEC, Sr[j][ci]);
        sm90::fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
          StateT* dst = static_cast<StateT*>(p.state_out) + h.write_slot * slot_elems + int64_t(hv) * D * D +
                        int64_t(v0 + warp * S::kRowsPerWarp) * D;
          sm90::bulk_copy_to_global(dst, tile + warp * S::kRowsPerWarp * D, S::kWarpTileBytes, evict_first);
        }
        stored = true;
      }
      // After the proxy fence, which then need not wait for these stores.
      if (lane_k == 0 && h.len > 0)
#pragma unroll
        for (int j = 0; j < RPT; ++j)
          o_rows[(h.bos + h.len - 1) * p.o_token_stride + j * S::kRowsPerPass] = from_float<Elem>(o_last[j]);
    }

    // The stage goes back to the producer once every lane is done with it (each lane arrives for its
    // own accesses, so the producer's next copy into the stage is ordered after all of them) and no
    // store reads it (lane 0, which issued the store, arrives after waiting for that). A stored
    // stage is released one item late, so that waiting for its store costs nothing.
    if (stored) {
      if (lane == 0) sm90::bulk_commit(), sm90::bulk_wait_read<1>();
      if (pending >= 0) sm90::mbarrier_arrive(&empty[pending]);
      pending = stage;
    } else {
      if (pending >= 0) {
        if (lane == 0) sm90::bulk_wait_read<0>();
        sm90::mbarrier_arrive(&empty[pending]);
        pending = -1;
      }
      sm90::mbarrier_arrive(&empty[stage]);
    }
    if (++stage == S::kStages) stage = 0, phase ^= 1;
  }
  if (lane == 0) sm90::bulk_wait_all();
}
#endif  // FLASHKDA_BULK_COPY

template <typename Elem, typename StateT, typename Tune>
__global__ void __launch_bounds__(Shape<Elem, StateT, Tune>::kThreads, Shape<Elem, StateT, Tune>::kBlocksPerSm)
    decode_step_bulk(const RecurrentParams p, const Plan plan) {
#ifdef FLASHKDA_BULK_COPY
  using S = Shape<Elem, StateT, Tune>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // tile and token bytes landed
  uint64_t* empty = full + S::kStages;                 // every consumer lane is done with the stage
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      sm90::mbarrier_init(&full[s], 1);
      sm90::mbarrier_init(&empty[s], 32 * S::kConsumerWarps);
    }
    sm90::fence_mbarrier_init();
  }
  __syncthreads();
  if (warp == S::kConsumerWarps) {
    produce<Elem, StateT, Tune>(p, plan, smem, full, empty, lane);
  } else {
    consume<Elem, StateT, Tune>(p, plan, smem, full, empty, warp, lane);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

template <typename StateT>
constexpr DType state_dtype() {
  return std::is_same<StateT, float>::value ? DType::kFloat32 : DType::kBFloat16;
}

// The cases this kernel serves (recurrent::persistent_decode_covers, one state dtype; the bulk
// copies need its 16-byte alignment).
template <typename StateT>
bool covers(const RecurrentParams& p, int blocks_v) {
  return recurrent::persistent_decode_covers(p, blocks_v, state_dtype<StateT>());
}

// Resident blocks per SM on the current device, or 0 when the device has no sm_90 code of the
// kernel (an sm_80-only build, or an older GPU). Queried once per device, which also sets the
// kernel's shared-memory attributes there.
template <typename Elem, typename StateT, typename Tune>
int blocks_per_sm() {
  using S = Shape<Elem, StateT, Tune>;
  static std::atomic<int> known[recurrent::kMaxCachedDevices];
  return recurrent::cached_per_device(known, [] {
    const auto kernel = decode_step_bulk<Elem, StateT, Tune>;
    int blocks = 0;
    const bool ok = has_sm90_image(kernel) &&
                    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes) == cudaSuccess &&
                    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)) == cudaSuccess &&
                    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, S::kThreads, S::kSmemBytes) == cudaSuccess;
    if (!ok) {
      (void)cudaGetLastError();  // no usable image: the caller runs the sm_80 kernel instead
      blocks = 0;
    }
    return blocks;
  });
}

}  // namespace decode_bulk

template <typename Elem, typename StateT, typename Tune>
cudaError_t run_decode_bulk_tuned(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  using S = decode_bulk::Shape<Elem, StateT, Tune>;
  launched = false;
  if (!decode_bulk::covers<StateT>(p, S::kBlocksV)) return cudaSuccess;
  const int per_sm = decode_bulk::blocks_per_sm<Elem, StateT, Tune>();
  if (per_sm == 0) return cudaSuccess;
  launched = true;
  if (p.N == 0) return cudaSuccess;
  int sms = 0;
  if (const cudaError_t err = recurrent::sm_count(p, sms); err != cudaSuccess) return err;
  decode_bulk::Plan plan;
  plan.num_items = uint32_t(int64_t(p.N) * p.HV * S::kBlocksV);
  plan.stage_tokens = recurrent::token_rows_aligned16<Elem>(p);
  const unsigned grid = unsigned(std::min<int64_t>(plan.num_items, int64_t(sms) * per_sm));
  decode_bulk::decode_step_bulk<Elem, StateT, Tune><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p, plan);
  return cudaGetLastError();
}

template <typename Elem, typename StateT>
bool decode_bulk_serves(const RecurrentParams& p) {
  using Tune = decode_bulk::DefaultTuning<StateT>;
  return decode_bulk::covers<StateT>(p, decode_bulk::Shape<Elem, StateT, Tune>::kBlocksV) &&
         decode_bulk::blocks_per_sm<Elem, StateT, Tune>() > 0;
}

template <typename Elem, typename StateT>
cudaError_t run_decode_bulk(const RecurrentParams& p, cudaStream_t stream, bool& launched) {
  return run_decode_bulk_tuned<Elem, StateT, decode_bulk::DefaultTuning<StateT>>(p, stream, launched);
}

}  // namespace flashkda
