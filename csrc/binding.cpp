// The only file that knows about PyTorch: registers the flashkda ops with TORCH_LIBRARY, turns
// tensors into the framework-free params structs of csrc/flashkda, and launches on the current
// stream under a device guard. The Python layer (flashkda/api.py) validates arguments with
// messages that name them; the checks here are a safety net against memory errors.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>

#include "flashkda/api.h"
#include "flashkda/static_switch.h"

namespace flashkda {
namespace {

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "flashkda: ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

IndexType to_index_type(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "flashkda: ", name,
              " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong ? IndexType::kInt64 : IndexType::kInt32;
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), "flashkda: ", name, " must be on ", ref.device());
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "flashkda: ", name, " must be contiguous in its last dimension");
}

// Process-wide choice of the kernel family (flashkda/_ext.py sets it from
// FLASHKDA_KERNEL_FAMILY at import); read by every recurrent and chunked call.
std::atomic<int32_t> g_kernel_family{int32_t(KernelFamily::kAuto)};

void set_kernel_family(int64_t family) {
  TORCH_CHECK(family == int64_t(KernelFamily::kAuto) || family == int64_t(KernelFamily::kSm80) ||
                  family == int64_t(KernelFamily::kSm90),
              "flashkda: kernel family must be ", int(KernelFamily::kAuto), " (auto), ", int(KernelFamily::kSm80),
              " or ", int(KernelFamily::kSm90), ", got ", family);
  g_kernel_family.store(int32_t(family), std::memory_order_relaxed);
}

int64_t get_kernel_family() { return g_kernel_family.load(std::memory_order_relaxed); }

int num_sms(int device) {
  static int cached[64] = {0};
  if (device < 64 && cached[device] > 0) return cached[device];
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (device < 64) cached[device] = sms;
  return sms;
}

// Every state tensor given: on q's device, contiguous [>= num_slots, HV, D, D], fp32 or bf16.
void check_states(const RecurrentParams& p, const at::Tensor& q, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& final_state) {
  for (const auto* s : {initial_state.has_value() ? &*initial_state : nullptr,
                        final_state.has_value() ? &*final_state : nullptr}) {
    if (s == nullptr) continue;
    check_cuda(*s, q, "state");
    TORCH_CHECK(s->is_contiguous() && s->dim() == 4 && s->size(1) == p.HV && s->size(2) == p.D && s->size(3) == p.D,
                "flashkda: state must be contiguous [slots, HV, D, D]");
    TORCH_CHECK(s->size(0) >= p.num_slots, "flashkda: state has fewer slots than sequences");
    TORCH_CHECK(s->scalar_type() == at::kFloat || s->scalar_type() == at::kBFloat16,
                "flashkda: state must be float32 or bfloat16");
  }
}

DType state_dtype(const std::optional<at::Tensor>& s) {
  return s.has_value() && s->scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

// Token tensors, gate and varlen fields shared by the recurrent and chunked entry points.
void fill_token_params(RecurrentParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                       const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                       const at::Tensor& o, double scale, int64_t gate_mode, double lower_bound, bool l2norm,
                       bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && o.dim() == 4, "flashkda: q, k, v, o must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == o.scalar_type(),
              "flashkda: q, k, v and o must share one dtype");
  for (auto* t : {&k, &v, &g, &beta, &o}) check_cuda(*t, q, "every tensor");
  for (auto* t : {&q, &k, &v, &g, &o}) check_last_dim_contiguous(*t, "q, k, v, g and o");
  TORCH_CHECK(beta.stride(-1) == 1 || beta.size(-1) == 1, "flashkda: beta must be contiguous over heads");
  const int64_t D = q.size(3);
  TORCH_CHECK((D == 64 || D == 128) && v.size(3) == D, "flashkda: kernel head dims are K == V in {64, 128}");

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.g = g.data_ptr();
  p.beta = beta.data_ptr();
  p.o = o.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_token_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_token_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_token_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.g_batch_stride = g.stride(0), p.g_token_stride = g.stride(1), p.g_head_stride = g.stride(2);
  p.beta_batch_stride = beta.stride(0), p.beta_token_stride = beta.stride(1);
  p.o_batch_stride = o.stride(0), p.o_token_stride = o.stride(1), p.o_head_stride = o.stride(2);
  p.scalar_gate = g.dim() == 3;
  p.g_dtype = to_dtype(g, "g");
  p.beta_dtype = to_dtype(beta, "beta");
  p.B = int32_t(q.size(0));
  p.T = int32_t(q.size(1));
  p.H = int32_t(q.size(2));
  p.HV = int32_t(v.size(2));
  p.D = int32_t(D);
  p.scale = float(scale);
  p.lower_bound = float(lower_bound);
  p.beta_scale = allow_neg_eigval ? 2.f : 1.f;
  p.gate_mode = static_cast<GateMode>(gate_mode);
  p.l2norm = l2norm;
  p.beta_sigmoid = beta_sigmoid;
  p.state_v_first = state_v_first;

  if (A_log.has_value()) {
    TORCH_CHECK(A_log->scalar_type() == at::kFloat && A_log->is_contiguous(), "flashkda: A_log must be contiguous float32");
    check_cuda(*A_log, q, "A_log");
    p.A_log = A_log->data_ptr<float>();
  }
  if (dt_bias.has_value()) {
    TORCH_CHECK(dt_bias->scalar_type() == at::kFloat && dt_bias->is_contiguous(), "flashkda: dt_bias must be contiguous float32");
    check_cuda(*dt_bias, q, "dt_bias");
    p.dt_bias = dt_bias->data_ptr<float>();
  }
  if (cu_seqlens.has_value()) {
    check_cuda(*cu_seqlens, q, "cu_seqlens");
    p.cu_seqlens = cu_seqlens->data_ptr();
    p.cu_type = to_index_type(*cu_seqlens, "cu_seqlens");
    p.N = int32_t(cu_seqlens->size(0) - 1);
  } else {
    p.N = p.B;
  }
}

// Token-by-token recurrence. Shapes and semantics: KDA_SPEC, fused_recurrent_kda. In serving mode
// (ssm_state_indices given) `initial_state` is None and `final_state` is the slot pool, read and
// written in place.
void recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                   const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                   const std::optional<at::Tensor>& ssm_state_indices,
                   const std::optional<at::Tensor>& num_accepted_tokens, const at::Tensor& o, double scale,
                   int64_t gate_mode, double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                   bool state_v_first) {
  RecurrentParams p{};
  fill_token_params(p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, o, scale, gate_mode, lower_bound, l2norm,
                    beta_sigmoid, allow_neg_eigval, state_v_first);
  const int64_t D = p.D;

  const at::Tensor* state_ref = nullptr;
  if (ssm_state_indices.has_value()) {
    TORCH_CHECK(final_state.has_value() && !initial_state.has_value(), "flashkda: serving mode takes the pool as final_state");
    check_cuda(*ssm_state_indices, q, "ssm_state_indices");
    TORCH_CHECK(ssm_state_indices->stride(-1) == 1, "flashkda: ssm_state_indices must be contiguous in its last dimension");
    p.slot_indices = ssm_state_indices->data_ptr();
    p.idx_type = to_index_type(*ssm_state_indices, "ssm_state_indices");
    p.idx_cols = ssm_state_indices->dim() == 2 ? int32_t(ssm_state_indices->size(1)) : 0;
    p.idx_row_stride = ssm_state_indices->dim() == 2 ? ssm_state_indices->stride(0) : 1;
    if (num_accepted_tokens.has_value()) {
      check_cuda(*num_accepted_tokens, q, "num_accepted_tokens");
      p.num_accepted = num_accepted_tokens->data_ptr();
      p.accepted_type = to_index_type(*num_accepted_tokens, "num_accepted_tokens");
    }
    p.state_in = final_state->data_ptr();
    p.state_out = final_state->data_ptr();
    p.num_slots = final_state->size(0);
    state_ref = &*final_state;
  } else {
    if (initial_state.has_value()) {
      p.state_in = initial_state->data_ptr();
      state_ref = &*initial_state;
    }
    if (final_state.has_value()) {
      p.state_out = final_state->data_ptr();
      state_ref = &*final_state;
    }
    p.num_slots = p.N;
  }
  if (state_ref != nullptr) {
    check_states(p, q, initial_state, final_state);
    p.state_in_dtype = ssm_state_indices.has_value() ? state_dtype(final_state) : state_dtype(initial_state);
    p.state_out_dtype = state_dtype(final_state);
  }

  const c10::cuda::CUDAGuard guard(q.device());
  p.num_sms = num_sms(q.get_device());
  p.kernel_family = static_cast<KernelFamily>(g_kernel_family.load(std::memory_order_relaxed));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  FLASHKDA_HEAD_DIM_SWITCH(D, kD, [&] {
    switch (q.scalar_type()) {
      case at::kBFloat16: err = run_recurrent<__nv_bfloat16, kD>(p, stream); break;
      case at::kHalf: err = run_recurrent<__half, kD>(p, stream); break;
      case at::kFloat: err = run_recurrent<float, kD>(p, stream); break;
      default: TORCH_CHECK(false, "flashkda: q must be float32, bfloat16 or float16");
    }
  });
  TORCH_CHECK(err == cudaSuccess, "flashkda: recurrent kernel launch failed: ", cudaGetErrorString(err));
}


// Chunked forward (prefill). Shapes and semantics: KDA_SPEC, chunk_kda / chunk_gated_delta_rule;
// K == V == chunk::kHeadDim, bf16 or fp16 token tensors. The workspace (one record per chunk and
// value head, plus the varlen chunk index) comes from PyTorch's caching allocator, so under
// CUDA-graph capture it lives in the graph's private pool. value_split: blocks per (sequence,
// head) in chunk_recurrence, 1, 2 or 4; 0 picks by the number of (sequence, head) chains.
void chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
               const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& initial_state,
               const std::optional<at::Tensor>& final_state, const at::Tensor& o, double scale, int64_t gate_mode,
               double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first,
               int64_t value_split) {
  ChunkParams p{};
  fill_token_params(p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, o, scale, gate_mode, lower_bound, l2norm,
                    beta_sigmoid, allow_neg_eigval, state_v_first);
  TORCH_CHECK(p.D == chunk::kHeadDim, "flashkda: the chunked kernels take K == V == ", chunk::kHeadDim);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "flashkda: the chunked kernels take bfloat16 or float16 q, k, v");
  // q, k, v, o and the per-channel gate move in 16-byte pieces.
  auto aligned16 = [](const at::Tensor& t) {
    const int64_t per16 = 16 / t.element_size();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % per16 == 0 &&
           t.stride(1) % per16 == 0 && t.stride(2) % per16 == 0;
  };
  for (const auto* t : {&q, &k, &v, &o})
    TORCH_CHECK(aligned16(*t), "flashkda: q, k, v and o must be 16-byte aligned with 16-byte strides");
  TORCH_CHECK(p.scalar_gate || aligned16(g), "flashkda: g must be 16-byte aligned with 16-byte strides");
  p.num_slots = p.N;
  check_states(p, q, initial_state, final_state);
  if (initial_state.has_value()) p.state_in = initial_state->data_ptr();
  if (final_state.has_value()) p.state_out = final_state->data_ptr();
  p.state_in_dtype = state_dtype(initial_state);
  p.state_out_dtype = state_dtype(final_state);

  const int64_t chunk = chunk::kChunk;
  int64_t slots = 0;
  if (p.cu_seqlens != nullptr) {
    slots = (int64_t(p.T) + (chunk - 1) * p.N) / chunk;  // >= Σ ceil(len_n / kChunk) for any split of T
  } else {
    p.chunks_per_seq = int32_t((p.T + chunk - 1) / chunk);
    slots = int64_t(p.B) * p.chunks_per_seq;
  }
  TORCH_CHECK(slots < (int64_t(1) << 31), "flashkda: too many chunks");
  p.num_chunk_slots = int32_t(slots);
  const int64_t record_bytes = slots * p.HV * chunk::WorkspaceLayout::kRecordBytes;
  const int64_t index_bytes = p.cu_seqlens != nullptr ? (int64_t(p.N) + 1) * 4 : 0;
  const at::Tensor workspace = at::empty({record_bytes + index_bytes}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  if (p.cu_seqlens != nullptr)
    p.chunk_offsets = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(workspace.data_ptr()) + record_bytes);

  const c10::cuda::CUDAGuard guard(q.device());
  p.num_sms = num_sms(q.get_device());
  p.kernel_family = static_cast<KernelFamily>(g_kernel_family.load(std::memory_order_relaxed));
  // chunk_recurrence runs one block per SM (its shared memory): split a chain's value columns over
  // two blocks only while all blocks still fit in one wave (measured on the H200: H = 64 split 0.29
  // ms vs 0.49 unsplit; H = 96 split 0.57 ms, two waves, vs 0.50 unsplit). Split 4 (four blocks,
  // and the key columns over four warps per row group) measured slower than split 2 on every row
  // (BENCHMARK_H200.md): only on request.
  if (value_split == 0) value_split = 2 * int64_t(p.N) * p.HV <= p.num_sms ? 2 : 1;
  TORCH_CHECK(value_split == 1 || value_split == 2 || value_split == 4, "flashkda: value_split must be 0, 1, 2 or 4");
  p.value_split = int32_t(value_split);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  auto run = [&](auto elem) {
    using Elem = decltype(elem);
    if (p.cu_seqlens != nullptr && err == cudaSuccess) err = run_chunk_index(p, stream);
    if (err == cudaSuccess) err = run_chunk_prepare<Elem>(p, stream);
    if (err == cudaSuccess)
      err = value_split == 1   ? run_chunk_recurrence<Elem, chunk::kHeadDim, 1>(p, stream)
            : value_split == 2 ? run_chunk_recurrence<Elem, chunk::kHeadDim / 2, 1>(p, stream)
                               : run_chunk_recurrence<Elem, chunk::kHeadDim / 4, 4>(p, stream);
  };
  if (q.scalar_type() == at::kBFloat16) run(__nv_bfloat16{}); else run(__half{});
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunked kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace flashkda

TORCH_LIBRARY(flashkda, m) {
  m.def(
      "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? cu_seqlens, Tensor? initial_state, Tensor(a!)? final_state, Tensor? ssm_state_indices, "
      "Tensor? num_accepted_tokens, Tensor(b!) o, float scale, int gate_mode, float lower_bound, bool l2norm, "
      "bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first) -> ()");
  m.def(
      "chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? cu_seqlens, Tensor? initial_state, Tensor(a!)? final_state, Tensor(b!) o, float scale, "
      "int gate_mode, float lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, "
      "bool state_v_first, int value_split) -> ()");
}

TORCH_LIBRARY_IMPL(flashkda, CUDA, m) {
  m.impl("recurrent_fwd", &flashkda::recurrent_fwd);
  m.impl("chunk_fwd", &flashkda::chunk_fwd);
}

// `import flashkda._C` runs the registrations above. The module also exposes the same entry point
// as a plain function: eager calls take it to skip the dispatcher's boxing (a few microseconds per
// decode step); traced code (torch.compile) uses torch.ops.flashkda.recurrent_fwd.
PYBIND11_MODULE(_C, m) {
  m.def("recurrent_fwd", &flashkda::recurrent_fwd, "token-by-token recurrence (see binding.cpp)");
  m.def("chunk_fwd", &flashkda::chunk_fwd, "chunked forward (see binding.cpp)");
  m.def("set_kernel_family", &flashkda::set_kernel_family,
        "kernel family for every later call in this process: 0 auto, 80 sm_80 kernel, 90 sm_90 kernel "
        "where it applies");
  m.def("get_kernel_family", &flashkda::get_kernel_family, "the kernel family set last (0, 80 or 90)");
}
