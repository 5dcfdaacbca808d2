// The torch binding, split by job: params.cpp turns tensors into the framework-free params structs
// of csrc/flashkda (with the safety-net checks), device.cpp keeps the per-device facts and the
// kernel family, ops.cpp holds the general entry points, fast_entry.cpp the eager fast paths,
// backward.cpp the chunked backward's kernel passes (called by flashkda/autograd.py), and this file
// registers the ops and the module. Only these files include torch.
//
// Each forward has two ways in: an eager fast path (`fused_recurrent`, `chunk`: plain module
// functions that take the public arguments as given and launch, or say why not) and the general
// path (`recurrent_fwd`, `chunk_fwd`: the registered ops, also exposed unboxed for eager calls, run
// after flashkda/api.py validated and prepared the arguments).

#include <torch/extension.h>
#include <torch/library.h>

#include "binding/binding.h"

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
      "bool state_v_first, int value_split, int segment_chunks, Tensor(c!)? chunk_states=None, "
      "Tensor? chunk_state_slots=None, Tensor? ssm_state_indices=None, Tensor? has_initial_state=None, "
      "Tensor(d!)? records=None) -> ()");
  m.def(
      "chunk_local_grad(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor(c!) g, Tensor(d!) beta, Tensor dO, "
      "Tensor chunk_bos, Tensor chunk_len, int pass_, Tensor? states=None, Tensor? dstates=None, "
      "bool every_token=False, bool overwrite_inputs=False, Tensor? qk_rnorm=None, float scale=1.0, "
      "bool l2norm=False, ScalarType? qk_dtype=None) -> Tensor[]");
  m.def(
      "chunk_state_scan(Tensor maps, Tensor offsets, Tensor start, Tensor seq_first, Tensor seq_chunks, "
      "bool reverse) -> Tensor[]");
  m.def(
      "chunk_state_grad(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? cu_seqlens, Tensor? initial_state, float scale, int gate_mode, float lower_bound, bool l2norm, "
      "bool beta_sigmoid, bool allow_neg_eigval, Tensor dO, Tensor dht, Tensor(a!) states, Tensor(b!) dstates, "
      "Tensor? records=None) -> Tensor");
  m.def(
      "chunk_bwd_inputs(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "float scale, int gate_mode, float lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, "
      "bool qk=True) -> Tensor[]");
  m.def(
      "chunk_bwd_input_grads(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? dq_hat, Tensor? dk_hat, Tensor dg_hat, Tensor dbeta_hat, float scale, int gate_mode, "
      "float lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(flashkda, CUDA, m) {
  m.impl("recurrent_fwd", &flashkda::binding::recurrent_fwd);
  m.impl("chunk_fwd", &flashkda::binding::chunk_fwd);
  m.impl("chunk_local_grad", &flashkda::binding::chunk_local_grad);
  m.impl("chunk_state_scan", &flashkda::binding::chunk_state_scan);
  m.impl("chunk_state_grad", &flashkda::binding::chunk_state_grad);
  m.impl("chunk_bwd_inputs", &flashkda::binding::chunk_bwd_inputs);
  m.impl("chunk_bwd_input_grads", &flashkda::binding::chunk_bwd_input_grads);
}

// `import flashkda._C` runs the registrations above. The module also exposes the entry points as
// plain functions, which skip the dispatcher's boxing (a few microseconds per decode step): eager
// calls take them; traced code (torch.compile) uses the torch.ops.flashkda ops.
PYBIND11_MODULE(_C, m) {
  m.def("recurrent_fwd", &flashkda::binding::recurrent_fwd, "token-by-token recurrence (see csrc/binding/ops.cpp)");
  m.def("chunk_fwd", &flashkda::binding::chunk_fwd, "chunked forward (see csrc/binding/ops.cpp)");
  m.def("set_kernel_family", &flashkda::binding::set_kernel_family,
        "kernel family for every later call in this process: 0 auto, 80 sm_80 kernels, 90 sm_90 kernels where "
        "they apply");
  m.def("kernel_image_reason", &flashkda::binding::kernel_image_reason,
        "why CUDA device `device` cannot run this build's kernels, or None (asked once per device)");
  m.def("chunk_smem_bytes", &flashkda::chunk_smem_bytes,
        "dynamic shared memory per block (bytes) that the chunked kernels need (no CUDA call)");
  m.def("chunk_record_bytes", [] { return flashkda::chunk::WorkspaceLayout::kRecordBytes; },
        "bytes of one chunk record (per chunk entry and value head) that chunk_fwd's `records` holds");
  m.def("chunk_local_grad_smem_bytes", &flashkda::chunk_local_grad_smem_bytes,
        "dynamic shared memory per block (bytes) of the chunked backward's kernel (no CUDA call)");
  m.def("chunk_local_grad_split_smem_bytes", &flashkda::chunk_local_grad_split_smem_bytes,
        "dynamic shared memory per block (bytes) of the chunked backward's gradients pass in value halves");
  m.def("chunk_local_grad_in_value_halves", &flashkda::binding::chunk_local_grad_in_value_halves,
        "whether the chunked backward's gradients pass runs in value halves on this device (sm_80 family or room)");
  m.def("chunk_bwd_max_subchunk_span", [] { return double(flashkda::kBwdMaxSubchunkSpan); },
        "largest |sum of log decays| over 16 tokens that the chunked backward's kernel takes");
  m.def("chunk_smem_reason", &flashkda::binding::chunk_smem_reason,
        "why a device with this opt-in shared memory per block (bytes) cannot run the chunked kernels, or None");
  PyObject* fused_recurrent =
      PyCFunction_NewEx(&flashkda::binding::fast::fused_recurrent_def, nullptr, m.attr("__name__").ptr());
  if (fused_recurrent == nullptr) throw pybind11::error_already_set();
  m.add_object("fused_recurrent", pybind11::reinterpret_steal<pybind11::object>(fused_recurrent));
  PyObject* chunk = PyCFunction_NewEx(&flashkda::binding::fast::chunk_def, nullptr, m.attr("__name__").ptr());
  if (chunk == nullptr) throw pybind11::error_already_set();
  m.add_object("chunk", pybind11::reinterpret_steal<pybind11::object>(chunk));
}
