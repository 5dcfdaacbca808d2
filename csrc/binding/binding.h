// Declarations shared by the torch binding, which is split by job: params.cpp turns tensors into
// the framework-free params structs of csrc/flashkda (with the safety-net checks), device.cpp keeps
// the per-device facts and the kernel family, ops.cpp holds the general entry points
// (recurrent_fwd, chunk_fwd), fast_entry.cpp the eager fast paths, module.cpp the op and module
// registration. Only these files include torch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashkda/api.h"

namespace flashkda::binding {

// Tensors to params (params.cpp).
bool kernel_head_dim(int64_t d);
bool kernel_elem(at::ScalarType t);
bool index_elem(at::ScalarType t);
bool last_dim_contiguous(const at::Tensor& t);
DType to_dtype(const at::Tensor& t, const char* name);
IndexType to_index_type(const at::Tensor& t, const char* name);
void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name);
void check_last_dim_contiguous(const at::Tensor& t, const char* name);
// Elements between a state tensor's slots (its first stride; a slot's size for one slot), and
// whether its slots are dense [HV, D, D] at least a slot and a multiple of 16 bytes apart (a serving
// engine's pool pitched across layers is a view of that kind).
int64_t slot_stride(const at::Tensor& s);
bool dense_slots(const at::Tensor& s);
void check_serving_state(const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                         const at::Tensor& ssm_state_indices, const at::Tensor& q);
const at::Tensor* opt(const std::optional<at::Tensor>& t);
void check_states(const RecurrentParams& p, const at::Tensor& q, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& final_state);
DType state_dtype(const at::Tensor* s);
void check_token_tensors(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                         const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                         const at::Tensor& o);
void set_token_params(RecurrentParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor* A_log, const at::Tensor* dt_bias,
                      const at::Tensor* cu_seqlens, const at::Tensor& o, double scale, GateMode gate_mode,
                      double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first);
void set_state_params(RecurrentParams& p, const at::Tensor* initial_state, const at::Tensor* final_state,
                      const at::Tensor* indices, const at::Tensor* accepted);
bool has_rows16(const at::Tensor& t);
at::Tensor rows16(const at::Tensor& t);

// Per-device facts and the kernel family (device.cpp).
void set_kernel_family(int64_t family);
KernelFamily kernel_family();
int num_sms(int device);
bool chunk_smem_fits(int64_t optin_bytes);
std::optional<std::string> chunk_smem_reason(int64_t optin_bytes);
bool chunk_local_grad_in_value_halves(int64_t device);
const char* kernel_image_error(int device);
std::optional<std::string> kernel_image_reason(int64_t device);

// Per-device facts are cached for the first kMaxCachedDevices devices and asked every call beyond.
constexpr int kMaxCachedDevices = 64;
inline bool device_cacheable(int device) { return device >= 0 && device < kMaxCachedDevices; }

// cudaDeviceGetAttribute for `device`, asked once per device; 0 when the query fails (not cached).
template <cudaDeviceAttr kAttribute>
int device_attribute(int device) {
  static std::atomic<int> cached[kMaxCachedDevices] = {};  // 0: not asked
  if (device_cacheable(device)) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device_cacheable(device)) cached[device].store(value, std::memory_order_relaxed);
  return value;
}

// The general entry points (ops.cpp).
void launch_recurrent(RecurrentParams& p, at::ScalarType elem, c10::DeviceIndex device);
void recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                   const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                   const std::optional<at::Tensor>& ssm_state_indices,
                   const std::optional<at::Tensor>& num_accepted_tokens, const at::Tensor& o, double scale,
                   int64_t gate_mode, double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                   bool state_v_first);
void chunk_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
               const at::Tensor& beta, const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
               const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& initial_state,
               const std::optional<at::Tensor>& final_state, const at::Tensor& o, double scale, int64_t gate_mode,
               double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first,
               int64_t value_split, int64_t segment_chunks, const std::optional<at::Tensor>& chunk_states,
               const std::optional<at::Tensor>& chunk_state_slots, const std::optional<at::Tensor>& ssm_state_indices,
               const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& records);
// What a chunked forward left behind: its plan and its workspace (the records unless they went to
// `records`), for a pass that reads them after it on the same stream (chunk_state_grad).
struct ChunkForwardRun {
  ChunkParams params;
  at::Tensor workspace;
};
// What chunk_fwd_impl launches: the forward, or, on the records an earlier forward of the same
// inputs left in `records`, only the varlen index that addresses them (a backward's plan).
enum class ChunkLaunch { kForward, kIndexOnly };
void chunk_fwd_impl(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                    const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                    const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& final_state,
                    const at::Tensor& o, double scale, int64_t gate_mode, double lower_bound, bool l2norm,
                    bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first, int64_t value_split,
                    int64_t segment_chunks, const std::optional<at::Tensor>& chunk_states,
                    const std::optional<at::Tensor>& chunk_state_slots,
                    const std::optional<at::Tensor>& ssm_state_indices,
                    const std::optional<at::Tensor>& has_initial_state,
                    const std::optional<at::Tensor>& records, bool checked, ChunkForwardRun* run = nullptr,
                    ChunkLaunch launch = ChunkLaunch::kForward);


// The chunked backward's kernel passes (backward.cpp).
std::vector<at::Tensor> chunk_local_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta, const at::Tensor& dO,
                                         const at::Tensor& chunk_bos, const at::Tensor& chunk_len, int64_t pass,
                                         const std::optional<at::Tensor>& states,
                                         const std::optional<at::Tensor>& dstates, bool every_token,
                                         bool overwrite_inputs, const std::optional<at::Tensor>& qk_rnorm, double scale,
                                         bool l2norm, std::optional<at::ScalarType> qk_dtype);
std::vector<at::Tensor> chunk_state_scan(const at::Tensor& maps, const at::Tensor& offsets, const at::Tensor& start,
                                         const at::Tensor& seq_first, const at::Tensor& seq_chunks, bool reverse);
at::Tensor chunk_state_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                            const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                            const std::optional<at::Tensor>& initial_state, double scale, int64_t gate_mode,
                            double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                            const at::Tensor& dO, const at::Tensor& dht, const at::Tensor& states,
                            const at::Tensor& dstates, const std::optional<at::Tensor>& records);
std::vector<at::Tensor> chunk_bwd_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta,
                                         const std::optional<at::Tensor>& A_log,
                                         const std::optional<at::Tensor>& dt_bias, double scale, int64_t gate_mode,
                                         double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                                         bool qk);
std::vector<at::Tensor> chunk_bwd_input_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& g, const at::Tensor& beta,
                                              const std::optional<at::Tensor>& A_log,
                                              const std::optional<at::Tensor>& dt_bias,
                                              const std::optional<at::Tensor>& dq_hat,
                                              const std::optional<at::Tensor>& dk_hat, const at::Tensor& dg_hat,
                                              const at::Tensor& dbeta_hat, double scale, int64_t gate_mode,
                                              double lower_bound, bool l2norm, bool beta_sigmoid,
                                              bool allow_neg_eigval);

}  // namespace flashkda::binding

// The eager fast paths (fast_entry.cpp): plain CPython functions for the module.
struct PyMethodDef;
namespace flashkda::binding::fast {
extern PyMethodDef fused_recurrent_def;
extern PyMethodDef chunk_def;
}  // namespace flashkda::binding::fast
