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

int num_sms(int device) {
  static int cached[64] = {0};
  if (device < 64 && cached[device] > 0) return cached[device];
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (device < 64) cached[device] = sms;
  return sms;
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
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && o.dim() == 4, "flashkda: q, k, v, o must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == o.scalar_type(),
              "flashkda: q, k, v and o must share one dtype");
  for (auto* t : {&k, &v, &g, &beta, &o}) check_cuda(*t, q, "every tensor");
  for (auto* t : {&q, &k, &v, &g, &o}) check_last_dim_contiguous(*t, "q, k, v, g and o");
  TORCH_CHECK(beta.stride(-1) == 1 || beta.size(-1) == 1, "flashkda: beta must be contiguous over heads");
  const int64_t D = q.size(3);
  TORCH_CHECK((D == 64 || D == 128) && v.size(3) == D, "flashkda: kernel head dims are K == V in {64, 128}");

  RecurrentParams p{};
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
    for (const auto* s : {initial_state.has_value() ? &*initial_state : nullptr,
                          final_state.has_value() ? &*final_state : nullptr}) {
      if (s == nullptr) continue;
      check_cuda(*s, q, "state");
      TORCH_CHECK(s->is_contiguous() && s->dim() == 4 && s->size(1) == p.HV && s->size(2) == D && s->size(3) == D,
                  "flashkda: state must be contiguous [slots, HV, D, D]");
      TORCH_CHECK(s->size(0) >= p.num_slots, "flashkda: state has fewer slots than sequences");
      TORCH_CHECK(s->scalar_type() == at::kFloat || s->scalar_type() == at::kBFloat16,
                  "flashkda: state must be float32 or bfloat16");
    }
    auto state_dtype = [](const std::optional<at::Tensor>& s) {
      return s.has_value() && s->scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
    };
    p.state_in_dtype = ssm_state_indices.has_value() ? state_dtype(final_state) : state_dtype(initial_state);
    p.state_out_dtype = state_dtype(final_state);
  }

  const c10::cuda::CUDAGuard guard(q.device());
  p.num_sms = num_sms(q.get_device());
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

}  // namespace
}  // namespace flashkda

TORCH_LIBRARY(flashkda, m) {
  m.def(
      "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? cu_seqlens, Tensor? initial_state, Tensor(a!)? final_state, Tensor? ssm_state_indices, "
      "Tensor? num_accepted_tokens, Tensor(b!) o, float scale, int gate_mode, float lower_bound, bool l2norm, "
      "bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first) -> ()");
}

TORCH_LIBRARY_IMPL(flashkda, CUDA, m) { m.impl("recurrent_fwd", &flashkda::recurrent_fwd); }

// `import flashkda._C` runs the registrations above. The module also exposes the same entry point
// as a plain function: eager calls take it to skip the dispatcher's boxing (a few microseconds per
// decode step); traced code (torch.compile) uses torch.ops.flashkda.recurrent_fwd.
PYBIND11_MODULE(_C, m) { m.def("recurrent_fwd", &flashkda::recurrent_fwd, "token-by-token recurrence (see binding.cpp)"); }
