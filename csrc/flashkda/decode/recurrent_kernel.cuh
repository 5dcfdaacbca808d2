// Token-by-token KDA / GDN recurrence (docs/SPEC.md, "The recurrence"), one pass over the state per call.
//
// Decode reads and writes the whole state once per call and does a few FLOPs per state element, so
// it is bound by memory: the state stays in fp32 registers for all tokens of a sequence, each
// element is loaded and stored exactly once (V-first: 16-byte fp32 or 8-byte bf16 accesses; K-first:
// coalesced words), and a block owns a slice of value rows/columns so that nothing crosses blocks.
//
// Both state layouts use the identity  o_t = S_dᵀ q_t + u_t (k_t · q_t),  with S_d the decayed state
// and u_t = beta_t (v_t − S_dᵀ k_t), so S_dᵀ k and S_dᵀ q come from one sweep over the registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/constants.h"
#include "flashkda/common/recurrent_params.h"
#include "flashkda/common/token_math.cuh"
#include "flashkda/decode/decode_select.h"
#include "flashkda/decode/recurrent_common.cuh"

namespace flashkda {
namespace recurrent {

// State tiles are streamed: read once, written once. The .cs (evict-first) loads and stores keep
// them from displacing the small per-token vectors in the caches (3-19% faster on the H200, N = 1024-64).
__device__ __forceinline__ void load4_state(const void* base, DType dt, int64_t i, float (&out)[4]) {
  if (dt == DType::kBFloat16) {
    const uint2* ptr = reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + i);
    const uint2 raw = __ldcs(ptr);
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = __bfloat162float(h[e]);
  } else {
    const float4* ptr = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 x = __ldcs(ptr);
    out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
  }
}

__device__ __forceinline__ void store4_state(void* base, DType dt, int64_t i, const float (&in)[4]) {
  if (dt == DType::kBFloat16) {
    uint2 raw;
    __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) h[e] = __float2bfloat16(in[e]);
    uint2* ptr = reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(base) + i);
    __stcs(ptr, raw);
  } else {
    const float4 x = make_float4(in[0], in[1], in[2], in[3]);
    float4* ptr = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    __stcs(ptr, x);
  }
}

// Blocks are numbered value block fastest, then head, then sequence: the blocks of one state slot
// (HV * D * D contiguous elements) run together.
struct BlockCoords {
  int n, hv, vblock;
};

__device__ __forceinline__ BlockCoords block_coords(const RecurrentParams& p, int blocks_v) {
  const unsigned x = blockIdx.x, per_seq = unsigned(blocks_v) * unsigned(p.HV);
  BlockCoords c;
  c.n = int(x / per_seq);
  c.hv = int((x % per_seq) / unsigned(blocks_v));
  c.vblock = int(x % unsigned(blocks_v));
  return c;
}

template <int D>
struct VFirstShape {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRows = 32;  // value rows per block
  // Register cap of 64: eight blocks (32 warps) per SM keep more state loads in flight. Measured on
  // the H200 (DESIGN.md): faster than caps of 80 and 128, than 16- or 64-row blocks, and than a
  // persistent variant that streams tiles through shared memory with cp.async.
  static constexpr int kMinBlocks = 8;
  static constexpr int kLanesK = 8;                        // lanes along K
  static constexpr int kChunks = D / (4 * kLanesK);        // 16-byte chunks per lane and row
  static constexpr int kRowsPerPass = kThreads / kLanesK;  // rows covered by the block at once
  static constexpr int kRowsPerThread = kRows / kRowsPerPass;
  static_assert(D % (4 * kLanesK) == 0, "head dim must be a multiple of 32");
  static_assert(kRows % kRowsPerPass == 0 && D % kRows == 0, "bad value block");
};

template <typename Elem, int D>
__global__ void __launch_bounds__(VFirstShape<D>::kThreads, VFirstShape<D>::kMinBlocks)
    decode_step_vfirst(const RecurrentParams p) {
  using Shape = VFirstShape<D>;
  constexpr int TK = Shape::kLanesK, CH = Shape::kChunks, RPT = Shape::kRowsPerThread;
  constexpr int kBlocksV = D / Shape::kRows;
  __shared__ __align__(16) TokenScratch<D> scratch[Shape::kWarps];
  const BlockCoords bc = block_coords(p, kBlocksV);
  const int n = bc.n, hv = bc.hv;
  const int v0 = bc.vblock * Shape::kRows;
  const int h = key_head(p, hv);
  const int lane = threadIdx.x % 32;
  const int lane_k = threadIdx.x % TK;
  const int row0 = v0 + threadIdx.x / TK;  // rows row0 + j * kRowsPerPass
  TokenScratch<D>& sc = scratch[threadIdx.x / 32];

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

  const int64_t slot_elems = state_slot_elems(p);
  auto state_offset = [&](int64_t slot, int j, int c) {
    return slot * slot_elems + int64_t(hv) * D * D + int64_t(row0 + j * Shape::kRowsPerPass) * D +
           c * 4 * TK + lane_k * 4;
  };
  auto store_state = [&](int64_t slot, const float (&S)[RPT][CH][4]) {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
#pragma unroll
      for (int c = 0; c < CH; ++c) store4_state(p.state_out, p.state_out_dtype, state_offset(slot, j, c), S[j][c]);
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

  const float a = gate_scale(p, hv);
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
    const Elem* v_ptr = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + t * p.v_token_stride + hv * p.v_head_stride;
    float vv[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) vv[j] = to_float(v_ptr[row0 + j * Shape::kRowsPerPass]);
    const float beta = beta_value(p, load_any(p.beta, p.beta_dtype, seq.batch * p.beta_batch_stride + t * p.beta_token_stride + hv));
    const float kq = stage_token<Elem, D>(p, global_token<Elem, D>(p, seq.batch, t, h, hv), a, sc, lane);

    float u[RPT], sq[RPT];
    vfirst_token_update<TK>(S, sc, lane_k, beta, vv, u, sq);
    if (lane_k == 0)
#pragma unroll
      for (int j = 0; j < RPT; ++j)
        o_base[t * p.o_token_stride + row0 + j * Shape::kRowsPerPass] = from_float<Elem>(sq[j] + u[j] * kq);
    if (write_slot >= 0) store_state(write_slot, S);
  }

  if (!per_token_slots) {
    const int64_t slot = final_slot(p, n, seq);
    if (slot >= 0) store_state(slot, S);
  }
}

// ---------------------------------------------------------------------------------------------
// K-first state ([HV, K, V]): a row of V contiguous values per key index. A block owns 32 value
// columns; each lane owns one column and half of the K rows (the other half sits 16 lanes away),
// so a reduction over K is a register sweep plus one shuffle.
// ---------------------------------------------------------------------------------------------

template <int D>
struct KFirstShape {
  static constexpr int kThreads = 64;
  static constexpr int kCols = 32;      // value columns per block
  static constexpr int kRows = D / 2;   // key rows per thread
  static constexpr int kMinBlocks = 1;  // the D/2 state registers per lane decide occupancy
  static_assert(D % kThreads == 0, "head dim must be a multiple of 64");
};

template <typename Elem, int D>
__global__ void __launch_bounds__(KFirstShape<D>::kThreads, KFirstShape<D>::kMinBlocks)
    decode_step_kfirst(const RecurrentParams p) {
  using Shape = KFirstShape<D>;
  constexpr int R = Shape::kRows;
  constexpr int kBlocksV = D / Shape::kCols;
  __shared__ TokenScratch<D> scratch[Shape::kThreads / 32];

  const BlockCoords bc = block_coords(p, kBlocksV);
  const int n = bc.n, hv = bc.hv;
  const int h = key_head(p, hv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = bc.vblock * Shape::kCols + warp * 16 + lane % 16;
  const int r0 = (lane / 16) * R;  // this lane's key rows: r0 .. r0 + R - 1
  TokenScratch<D>& sc = scratch[warp];

  const Sequence seq = resolve_sequence(p, n);
  Elem* o_base = static_cast<Elem*>(p.o) + seq.batch * p.o_batch_stride + hv * p.o_head_stride;
  if (seq.skip) {
    if (lane < 16)
      for (int64_t i = 0; i < seq.len; ++i) o_base[(seq.bos + i) * p.o_token_stride + col] = from_float<Elem>(0.f);
    return;
  }

  const int64_t slot_elems = state_slot_elems(p);
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

  const float a = gate_scale(p, hv);
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
    const float kq = stage_token<Elem, D>(p, global_token<Elem, D>(p, seq.batch, t, h, hv), a, sc, lane);

    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      S[r] *= sc.decay[r0 + r];
      sk += S[r] * sc.k[r0 + r];
      sq += S[r] * sc.q[r0 + r];
    }
    sk += __shfl_xor_sync(0xffffffffu, sk, 16);
    sq += __shfl_xor_sync(0xffffffffu, sq, 16);
    const float beta = beta_value(p, load_any(p.beta, p.beta_dtype, seq.batch * p.beta_batch_stride + t * p.beta_token_stride + hv));
    const Elem* v_ptr = static_cast<const Elem*>(p.v) + seq.batch * p.v_batch_stride + t * p.v_token_stride + hv * p.v_head_stride;
    const float u = beta * (to_float(v_ptr[col]) - sk);
#pragma unroll
    for (int r = 0; r < R; ++r) S[r] += sc.k[r0 + r] * u;
    if (lane < 16) o_base[t * p.o_token_stride + col] = from_float<Elem>(sq + u * kq);
    if (write_slot >= 0) store_state(write_slot, S);
  }

  if (!per_token_slots) {
    const int64_t slot = final_slot(p, n, seq);
    if (slot >= 0) store_state(slot, S);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

// The facts select_decode_kernel (decode_select.h) decides on, gathered in its order: the bulk
// kernel's are asked only when the streaming kernel does not take the call (the host path of a
// decode step is part of its latency).
template <typename Elem, int D>
DecodeFacts decode_facts(const RecurrentParams& p) {
  DecodeFacts f{};
  f.v_first = p.state_v_first;
  f.persistent_head_dim = D == kDecodeBulkHeadDim;
  f.sm80_family = p.kernel_family == KernelFamily::kSm80;
  if constexpr (D == kDecodeBulkHeadDim) {
    if (!f.v_first || f.sm80_family) return f;
    const DType state = p.state_in != nullptr ? p.state_in_dtype : p.state_out_dtype;
    f.bf16_state = state == DType::kBFloat16;
    f.stream_serves = f.bf16_state ? decode_stream_tc_serves<Elem>(p) : decode_stream_serves<Elem>(p);
    if (f.stream_serves) return f;
    f.bulk_serves = f.bf16_state ? decode_bulk_serves<Elem, __nv_bfloat16>(p) : decode_bulk_serves<Elem, float>(p);
  }
  return f;
}

template <typename Elem, int D>
cudaError_t launch(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  bool launched = true;  // the persistent kernels confirm what decode_facts found
  switch (select_decode_kernel(decode_facts<Elem, D>(p)).kernel) {
    case DecodeKernel::kStreamTc: return run_decode_stream_tc<Elem>(p, stream, launched);
    case DecodeKernel::kStream: return run_decode_stream<Elem>(p, stream, launched);
    case DecodeKernel::kBulk:
      return (p.state_in != nullptr ? p.state_in_dtype : p.state_out_dtype) == DType::kBFloat16
                 ? run_decode_bulk<Elem, __nv_bfloat16>(p, stream, launched)
                 : run_decode_bulk<Elem, float>(p, stream, launched);
    case DecodeKernel::kVFirst: {
      const dim3 grid(unsigned(int64_t(p.N) * p.HV * (D / VFirstShape<D>::kRows)));
      decode_step_vfirst<Elem, D><<<grid, VFirstShape<D>::kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    }
    case DecodeKernel::kKFirst: {
      const dim3 grid(unsigned(int64_t(p.N) * p.HV * (D / KFirstShape<D>::kCols)));
      decode_step_kfirst<Elem, D><<<grid, KFirstShape<D>::kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace recurrent

template <typename Elem, int D>
cudaError_t run_recurrent(const RecurrentParams& params, cudaStream_t stream) {
  return recurrent::launch<Elem, D>(params, stream);
}

}  // namespace flashkda
