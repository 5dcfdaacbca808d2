// Tensors to the framework-free params structs of csrc/flashkda, and the safety-net checks of the
// general entry points (the eager fast paths check in fast_entry.cpp).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "binding/binding.h"

namespace flashkda::binding {

// Head dims with compiled kernels: the cases of FLASHKDA_HEAD_DIM_SWITCH.
bool kernel_head_dim(int64_t d) { return d == 64 || d == 128; }

bool kernel_elem(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

bool index_elem(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

bool last_dim_contiguous(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1; }

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "flashkda: ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

IndexType to_index_type(const at::Tensor& t, const char* name) {
  TORCH_CHECK(index_elem(t.scalar_type()), "flashkda: ", name, " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong ? IndexType::kInt64 : IndexType::kInt32;
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), "flashkda: ", name, " must be on ", ref.device());
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(last_dim_contiguous(t), "flashkda: ", name, " must be contiguous in its last dimension");
}

// Serving mode of recurrent_fwd and chunk_fwd: the pool comes as final_state (read at and written
// back to the slots), the slot indices beside q.
void check_serving_state(const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                         const at::Tensor& ssm_state_indices, const at::Tensor& q) {
  TORCH_CHECK(final_state.has_value() && !initial_state.has_value(),
              "flashkda: serving mode takes the pool as final_state");
  check_cuda(ssm_state_indices, q, "ssm_state_indices");
}

const at::Tensor* opt(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

int64_t slot_stride(const at::Tensor& s) {
  return s.size(0) > 1 ? s.stride(0) : s.size(1) * s.size(2) * s.size(3);
}

bool dense_slots(const at::Tensor& s) {
  if (s.dim() != 4) return false;
  const int64_t slot = s.size(1) * s.size(2) * s.size(3);
  const bool inner = (s.size(3) <= 1 || s.stride(3) == 1) && (s.size(2) <= 1 || s.stride(2) == s.size(3)) &&
                     (s.size(1) <= 1 || s.stride(1) == s.size(2) * s.size(3));
  return inner && slot_stride(s) >= slot && (slot_stride(s) * s.element_size()) % 16 == 0;
}

// Every state tensor given: on q's device, [>= num_slots, HV, D, D] with dense slots (dense_slots),
// fp32 or bf16; the initial and the final state one slot stride.
void check_states(const RecurrentParams& p, const at::Tensor& q, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& final_state) {
  if (initial_state.has_value() && final_state.has_value())
    TORCH_CHECK(slot_stride(*initial_state) == slot_stride(*final_state),
                "flashkda: initial_state and final_state must have one slot stride");
  for (const auto* s : {opt(initial_state), opt(final_state)}) {
    if (s == nullptr) continue;
    check_cuda(*s, q, "state");
    TORCH_CHECK(dense_slots(*s) && s->size(1) == p.HV && s->size(2) == p.D && s->size(3) == p.D,
                "flashkda: state must be [slots, HV, D, D] with dense slots, a slot stride of at least one slot and "
                "a multiple of 16 bytes");
    TORCH_CHECK(s->size(0) >= p.num_slots, "flashkda: state has fewer slots than sequences");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(s->data_ptr()) % 16 == 0,
                "flashkda: state must be 16-byte aligned (the kernels move it in 16-byte pieces)");
    TORCH_CHECK(s->scalar_type() == at::kFloat || s->scalar_type() == at::kBFloat16,
                "flashkda: state must be float32 or bfloat16");
  }
}

DType state_dtype(const at::Tensor* s) {
  return s != nullptr && s->scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

// Safety net of the general entry points: the token tensors, gate parameters and offsets are on q's
// device, with the dtypes and strides the kernels read.
void check_token_tensors(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                         const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                         const at::Tensor& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && o.dim() == 4, "flashkda: q, k, v, o must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == o.scalar_type(),
              "flashkda: q, k, v and o must share one dtype");
  for (auto* t : {&k, &v, &g, &beta, &o}) check_cuda(*t, q, "every tensor");
  for (auto* t : {&q, &k, &v, &g, &o}) check_last_dim_contiguous(*t, "q, k, v, g and o");
  TORCH_CHECK(last_dim_contiguous(beta), "flashkda: beta must be contiguous over heads");
  TORCH_CHECK(kernel_head_dim(q.size(3)) && v.size(3) == q.size(3),
              "flashkda: kernel head dims are K == V in {64, 128}");
  for (const auto& [t, name] : {std::pair{opt(A_log), "A_log"}, std::pair{opt(dt_bias), "dt_bias"}}) {
    if (t == nullptr) continue;
    TORCH_CHECK(kernel_elem(t->scalar_type()) && t->is_contiguous(), "flashkda: ", name,
                " must be contiguous float32, bfloat16 or float16");
    check_cuda(*t, q, name);
  }
  if (cu_seqlens.has_value()) {
    check_cuda(*cu_seqlens, q, "cu_seqlens");
    TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 1 && cu_seqlens->is_contiguous(),
                "flashkda: cu_seqlens must be contiguous [N + 1]");
  }
}

// Token tensors, gate and varlen fields shared by every entry point. The callers have checked the
// tensors (shapes, dtypes, devices, last-dimension strides).
void set_token_params(RecurrentParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor* A_log, const at::Tensor* dt_bias,
                      const at::Tensor* cu_seqlens, const at::Tensor& o, double scale, GateMode gate_mode,
                      double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first) {
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
  p.D = int32_t(q.size(3));
  p.scale = float(scale);
  p.lower_bound = float(lower_bound);
  p.beta_scale = allow_neg_eigval ? 2.f : 1.f;
  p.gate_mode = gate_mode;
  p.l2norm = l2norm;
  p.beta_sigmoid = beta_sigmoid;
  p.state_v_first = state_v_first;
  if (A_log != nullptr) p.A_log = A_log->data_ptr(), p.A_log_dtype = to_dtype(*A_log, "A_log");
  if (dt_bias != nullptr) p.dt_bias = dt_bias->data_ptr(), p.dt_bias_dtype = to_dtype(*dt_bias, "dt_bias");
  if (cu_seqlens != nullptr) {
    p.cu_seqlens = cu_seqlens->data_ptr();
    p.cu_type = to_index_type(*cu_seqlens, "cu_seqlens");
    p.N = int32_t(cu_seqlens->size(0) - 1);
  } else {
    p.N = p.B;
  }
}

// State fields of the recurrence. Serving mode (`indices` given): `final_state` is the slot pool,
// read and written in place, and `initial_state` is null. Otherwise sequence n reads
// initial_state[n] and writes final_state[n] (either may be null).
void set_state_params(RecurrentParams& p, const at::Tensor* initial_state, const at::Tensor* final_state,
                      const at::Tensor* indices, const at::Tensor* accepted) {
  if (indices != nullptr) {
    p.slot_indices = indices->data_ptr();
    p.idx_type = to_index_type(*indices, "ssm_state_indices");
    p.idx_cols = indices->dim() == 2 ? int32_t(indices->size(1)) : 0;
    p.idx_row_stride = indices->dim() == 2 ? indices->stride(0) : 1;
    if (accepted != nullptr) {
      p.num_accepted = accepted->data_ptr();
      p.accepted_type = to_index_type(*accepted, "num_accepted_tokens");
    }
    initial_state = final_state;
    p.num_slots = final_state->size(0);
  } else {
    p.num_slots = p.N;
  }
  if (initial_state != nullptr) p.state_in = initial_state->data_ptr();
  if (final_state != nullptr) p.state_out = final_state->data_ptr();
  const at::Tensor* given = initial_state != nullptr ? initial_state : final_state;
  p.state_slot_stride = given != nullptr ? slot_stride(*given) : 0;
  p.state_in_dtype = state_dtype(initial_state);
  p.state_out_dtype = state_dtype(final_state);
}

// The chunked kernels move q, k, v, o and the per-channel gate in 16-byte pieces: every row must
// start on 16 bytes (unit last stride, other strides and the address multiples of 16 bytes).
bool has_rows16(const at::Tensor& t) {
  const int64_t per16 = 16 / t.element_size();
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; ok && d + 1 < t.dim(); ++d) ok = t.stride(d) % per16 == 0;
  return ok;
}

// t itself when its rows start on 16 bytes, else a contiguous copy (a view at an odd offset, the
// q of a fused projection with an odd row stride). A contiguous view at an odd offset is not
// aligned either, hence clone and not contiguous().
at::Tensor rows16(const at::Tensor& t) {
  return t.dim() == 0 || has_rows16(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

}  // namespace flashkda::binding
