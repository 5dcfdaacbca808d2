// The general entry points, after flashkda/api.py validated and prepared the arguments: the
// token-by-token recurrence and the chunked forward; their checks here are a safety net against
// memory errors.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "flashkda/common/static_switch.h"
#include "flashkda/prefill/chunk_plan.h"

#include "binding/binding.h"

namespace flashkda::binding {

// Launches the recurrence for element type `elem` on the current stream of `device`. The device is
// made current only when it is not already: a guard that always switches costs driver calls on
// every decode step.
void launch_recurrent(RecurrentParams& p, at::ScalarType elem, c10::DeviceIndex device) {
  c10::cuda::OptionalCUDAGuard guard;
  if (c10::cuda::current_device() != device) guard.set_index(device);
  p.num_sms = num_sms(device);
  p.kernel_family = kernel_family();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaError_t err = cudaSuccess;
  FLASHKDA_HEAD_DIM_SWITCH(p.D, kD, [&] {
    switch (elem) {
      case at::kBFloat16: err = run_recurrent<__nv_bfloat16, kD>(p, stream); break;
      case at::kHalf: err = run_recurrent<__half, kD>(p, stream); break;
      case at::kFloat: err = run_recurrent<float, kD>(p, stream); break;
      default: TORCH_CHECK(false, "flashkda: q must be float32, bfloat16 or float16");
    }
  });
  TORCH_CHECK(err == cudaSuccess, "flashkda: recurrent kernel launch failed: ", cudaGetErrorString(err));
}

// Token-by-token recurrence, general path. Shapes and semantics: docs/SPEC.md, fused_recurrent_kda. In
// serving mode (ssm_state_indices given) `initial_state` is None and `final_state` is the slot pool,
// read and written in place.
void recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                   const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                   const std::optional<at::Tensor>& ssm_state_indices,
                   const std::optional<at::Tensor>& num_accepted_tokens, const at::Tensor& o, double scale,
                   int64_t gate_mode, double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                   bool state_v_first) {
  check_token_tensors(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, o);
  if (ssm_state_indices.has_value()) {
    check_serving_state(initial_state, final_state, *ssm_state_indices, q);
    check_last_dim_contiguous(*ssm_state_indices, "ssm_state_indices");
    if (num_accepted_tokens.has_value()) {
      check_cuda(*num_accepted_tokens, q, "num_accepted_tokens");
      TORCH_CHECK(num_accepted_tokens->is_contiguous(), "flashkda: num_accepted_tokens must be contiguous");
    }
  }
  RecurrentParams p{};
  set_token_params(p, q, k, v, g, beta, opt(A_log), opt(dt_bias), opt(cu_seqlens), o, scale,
                   static_cast<GateMode>(gate_mode), lower_bound, l2norm, beta_sigmoid, allow_neg_eigval,
                   state_v_first);
  set_state_params(p, opt(initial_state), opt(final_state), opt(ssm_state_indices),
                   ssm_state_indices.has_value() ? opt(num_accepted_tokens) : nullptr);
  check_states(p, q, initial_state, final_state);
  launch_recurrent(p, q.scalar_type(), q.get_device());
}

// Chunked forward (prefill). Shapes and semantics: docs/SPEC.md, chunk_kda / chunk_gated_delta_rule;
// K == V == chunk::kHeadDim, bf16 or fp16 token tensors. Planned and run by chunk_plan.h
// (value_split and segment_chunks as plan_chunk takes them); the workspace comes from PyTorch's
// caching allocator, so under CUDA-graph capture it lives in the graph's private pool. Serving mode
// (ssm_state_indices [N] given): `initial_state` is None and `final_state` is the slot pool, read at
// idx[n] (zeros where has_initial_state[n] is false) and written there in place. `records` (any
// dtype, contiguous, at least [chunk entries, HV] records of chunk_record_bytes): chunk_prepare's
// records go there instead of the temporary workspace, kept for chunk_state_grad.
void chunk_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
               const at::Tensor& beta, const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
               const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& initial_state,
               const std::optional<at::Tensor>& final_state, const at::Tensor& o, double scale, int64_t gate_mode,
               double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first,
               int64_t value_split, int64_t segment_chunks, const std::optional<at::Tensor>& chunk_states,
               const std::optional<at::Tensor>& chunk_state_slots, const std::optional<at::Tensor>& ssm_state_indices,
               const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& records) {
  chunk_fwd_impl(q_in, k_in, v_in, g_in, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state, o, scale,
                 gate_mode, lower_bound, l2norm, beta_sigmoid, allow_neg_eigval, state_v_first, value_split,
                 segment_chunks, chunk_states, chunk_state_slots, ssm_state_indices, has_initial_state, records,
                 /*checked=*/false);
}

// `checked`: the caller (the eager fast entry, whose check_chunk covers this function's safety net)
// has checked every argument, which then is not checked a second time.
void chunk_fwd_impl(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                    const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                    const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                    const at::Tensor& o, double scale, int64_t gate_mode, double lower_bound, bool l2norm,
                    bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first, int64_t value_split,
                    int64_t segment_chunks, const std::optional<at::Tensor>& chunk_states,
                    const std::optional<at::Tensor>& chunk_state_slots,
                    const std::optional<at::Tensor>& ssm_state_indices,
                    const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& records,
                    bool checked, ChunkForwardRun* run, ChunkLaunch launch) {
  const at::Tensor q = rows16(q_in), k = rows16(k_in), v = rows16(v_in);
  const at::Tensor g = g_in.dim() == 4 ? rows16(g_in) : g_in;  // the scalar gate is read element by element
  if (!checked) {
    check_token_tensors(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, o);
    if (ssm_state_indices.has_value()) {
      check_serving_state(initial_state, final_state, *ssm_state_indices, q);
      TORCH_CHECK(ssm_state_indices->dim() == 1 && ssm_state_indices->is_contiguous(),
                  "flashkda: the prefill's ssm_state_indices must be a contiguous [N] tensor");
    }
    if (has_initial_state.has_value()) {
      TORCH_CHECK(ssm_state_indices.has_value(), "flashkda: has_initial_state needs ssm_state_indices");
      check_cuda(*has_initial_state, q, "has_initial_state");
      TORCH_CHECK(has_initial_state->scalar_type() == at::kBool && has_initial_state->dim() == 1 &&
                      has_initial_state->is_contiguous(),
                  "flashkda: has_initial_state must be a contiguous bool [N] tensor");
    }
  }
  // chunk_prepare reads fp32 gate parameters (fp32_a_log in chunk_prepare.cuh says why).
  auto fp32 = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    return t.has_value() && t->scalar_type() != at::kFloat ? std::optional<at::Tensor>(t->to(at::kFloat)) : t;
  };
  const std::optional<at::Tensor> A_log32 = fp32(A_log), dt_bias32 = fp32(dt_bias);
  ChunkParams p{};
  set_token_params(p, q, k, v, g, beta, opt(A_log32), opt(dt_bias32), opt(cu_seqlens), o, scale,
                   static_cast<GateMode>(gate_mode), lower_bound, l2norm, beta_sigmoid, allow_neg_eigval,
                   state_v_first);
  set_state_params(p, opt(initial_state), opt(final_state), opt(ssm_state_indices), nullptr);
  if (!checked) {
    TORCH_CHECK(p.D == chunk::kHeadDim, "flashkda: the chunked kernels take K == V == ", chunk::kHeadDim);
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                "flashkda: the chunked kernels take bfloat16 or float16 q, k, v");
    TORCH_CHECK(has_rows16(o), "flashkda: o must be 16-byte aligned with 16-byte strides");
    check_states(p, q, initial_state, final_state);
    if (ssm_state_indices.has_value())
      TORCH_CHECK(ssm_state_indices->size(0) == p.N, "flashkda: ssm_state_indices must have N = ", p.N, " entries");
    if (has_initial_state.has_value())
      TORCH_CHECK(has_initial_state->size(0) == p.N, "flashkda: has_initial_state must have N = ", p.N, " entries");
  }
  if (has_initial_state.has_value()) p.has_initial_state = has_initial_state->data_ptr<bool>();
  // States at chunk starts (ChunkParams::chunk_states): dense [entries, HV, D, D], or a pool of
  // slots named by chunk_state_slots [N, cols].
  if (chunk_states.has_value()) {
    const at::Tensor& h = *chunk_states;
    check_cuda(h, q, "chunk_states");
    const int64_t per_entry = int64_t(p.HV) * p.D * p.D;
    // Dense entries: contiguous; a pool (chunk_state_slots): dense slots, possibly pitched wider.
    const bool layout_ok = chunk_state_slots.has_value() ? dense_slots(h) : h.is_contiguous();
    TORCH_CHECK(layout_ok && h.dim() >= 3 && h.size(-1) == p.D && h.size(-2) == p.D && h.size(-3) == p.HV &&
                    reinterpret_cast<uintptr_t>(h.data_ptr()) % 16 == 0,
                "flashkda: chunk_states must be a 16-byte aligned [..., HV, D, D] tensor, contiguous (or a pool with "
                "dense slots)");
    p.chunk_states = h.data_ptr();
    p.chunk_states_dtype = to_dtype(h, "chunk_states");
    p.chunk_state_entries = chunk_state_slots.has_value() ? h.size(0) : h.numel() / per_entry;
    p.chunk_state_stride = chunk_state_slots.has_value() ? slot_stride(h) : 0;
    if (chunk_state_slots.has_value()) {
      const at::Tensor& s = *chunk_state_slots;
      check_cuda(s, q, "chunk_state_slots");
      TORCH_CHECK(s.dim() == 2 && s.size(0) == p.N && last_dim_contiguous(s),
                  "flashkda: chunk_state_slots must be [N, chunk columns] with contiguous rows");
      p.chunk_state_slots = s.data_ptr();
      p.chunk_slot_type = to_index_type(s, "chunk_state_slots");
      p.chunk_slot_row_stride = s.stride(0);
      p.chunk_slot_cols = int32_t(std::min<int64_t>(s.size(1), INT32_MAX));
    }
  } else {
    TORCH_CHECK(!chunk_state_slots.has_value(), "flashkda: chunk_state_slots needs chunk_states");
  }

  const c10::cuda::CUDAGuard guard(q.device());
  p.num_sms = num_sms(q.get_device());
  p.kernel_family = kernel_family();
  ChunkWorkspace ws;
  const std::string why = plan_chunk(p, value_split, segment_chunks, ws);
  TORCH_CHECK(why.empty(), "flashkda: ", why);
  if (records.has_value()) {
    check_cuda(*records, q, "records");
    TORCH_CHECK(records->is_contiguous() && reinterpret_cast<uintptr_t>(records->data_ptr()) % 16 == 0 &&
                    int64_t(records->nbytes()) >= ws.record_bytes,
                "flashkda: records must be a contiguous, 16-byte aligned tensor of at least ", ws.record_bytes,
                " bytes");
  }
  TORCH_CHECK(launch == ChunkLaunch::kForward || records.has_value(), "flashkda: an index-only launch needs records");
  const at::Tensor workspace = at::empty({ws.total(records.has_value())}, q.options().dtype(at::kByte));
  carve_chunk_workspace(p, ws, workspace.data_ptr(), records.has_value() ? records->data_ptr() : nullptr);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  if (launch == ChunkLaunch::kForward)
    err = q.scalar_type() == at::kBFloat16 ? run_chunk_forward<__nv_bfloat16>(p, stream)
                                           : run_chunk_forward<__half>(p, stream);
  else if (p.cu_seqlens != nullptr)
    err = run_chunk_index(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunked kernel launch failed: ", cudaGetErrorString(err));
  if (run != nullptr) *run = ChunkForwardRun{p, workspace};
}

}  // namespace flashkda::binding
