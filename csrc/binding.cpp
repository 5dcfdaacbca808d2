// The only file that knows about PyTorch: registers the flashkda ops with TORCH_LIBRARY, turns
// tensors into the framework-free params structs of csrc/flashkda, and launches on the current
// stream of the tensors' device. The recurrence has two ways in:
//
// * `fused_recurrent` (a plain module function): the eager fast path of the public
//   fused_recurrent_* functions. It takes their arguments as the user gave them, checks all of them
//   (the checks of api._validate and api._kernel_unsupported, as predicates) and launches when the
//   kernel takes the inputs as they are; otherwise it returns why not, and flashkda/api.py runs the
//   general path, which raises the documented errors, copies strided inputs or runs the reference.
// * `recurrent_fwd` (the registered op, and the same function unboxed for eager calls): the
//   general path, after flashkda/api.py validated and prepared the arguments; its checks here are
//   a safety net against memory errors.
// The chunked forward has the same two: `chunk` (the eager fast path of chunk_kda and
// chunk_gated_delta_rule, without states at chunk starts) and `chunk_fwd`.

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "flashkda/api.h"
#include "flashkda/common/constants.h"
#include "flashkda/common/static_switch.h"
#include "flashkda/prefill/chunk_plan.h"

namespace flashkda {
namespace {

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


KernelFamily kernel_family() { return static_cast<KernelFamily>(g_kernel_family.load(std::memory_order_relaxed)); }

// Per-device facts are cached for the first kMaxCachedDevices devices and asked every call beyond.
constexpr int kMaxCachedDevices = 64;
bool device_cacheable(int device) { return device >= 0 && device < kMaxCachedDevices; }

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

int num_sms(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Whether a device with `optin_bytes` of shared memory per block (opt-in limit) can run the chunked
// kernels (not sm_86, sm_89: 99 KB).
bool chunk_smem_fits(int64_t optin_bytes) { return optin_bytes >= chunk_smem_bytes(); }

// chunk_smem_fits for Python, which asks the device through torch: the reason, or None.
std::optional<std::string> chunk_smem_reason(int64_t optin_bytes) {
  if (chunk_smem_fits(optin_bytes)) return std::nullopt;
  return std::to_string(optin_bytes) + " bytes of shared memory per block (chunked kernels: " +
         std::to_string(chunk_smem_bytes()) + ")";
}

// Why `device` cannot run this build's kernels (compute capability below kMinComputeMajor, or no
// loadable image: a build without machine code or PTX for it), or nullptr; asked once per device.
// A failed capability query answers nullptr, so that the kernels launch and report the error.
constexpr int kMinComputeMajor = 8;  // flashkda/_ext.py: MIN_COMPUTE_CAPABILITY
const char* kernel_image_error(int device) {
  static std::atomic<int> cached[kMaxCachedDevices] = {};  // 0: not asked; 1: runs; 2: capability; 3: no image
  static const char* const kReasons[] = {nullptr, nullptr, "compute capability too low for this build",
                                         "no kernel image of this build for the GPU (FLASHKDA_CUDA_ARCHS)"};
  const bool cacheable = device_cacheable(device);
  if (cacheable) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return kReasons[known];
  }
  int major = 0, verdict = 1;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (major < kMinComputeMajor) {
    verdict = 2;
  } else {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    if (kernel_image_status() != cudaSuccess) verdict = 3;
  }
  if (cacheable) cached[device].store(verdict, std::memory_order_relaxed);
  return kReasons[verdict];
}

// kernel_image_error for Python: the reason, or None.
std::optional<std::string> kernel_image_reason(int64_t device) {
  const char* reason = kernel_image_error(int(device));
  return reason != nullptr ? std::optional<std::string>(reason) : std::nullopt;
}

const at::Tensor* opt(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// Every state tensor given: on q's device, contiguous [>= num_slots, HV, D, D], fp32 or bf16.
void check_states(const RecurrentParams& p, const at::Tensor& q, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& final_state) {
  for (const auto* s : {opt(initial_state), opt(final_state)}) {
    if (s == nullptr) continue;
    check_cuda(*s, q, "state");
    TORCH_CHECK(s->is_contiguous() && s->dim() == 4 && s->size(1) == p.HV && s->size(2) == p.D && s->size(3) == p.D,
                "flashkda: state must be contiguous [slots, HV, D, D]");
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
  p.state_in_dtype = state_dtype(initial_state);
  p.state_out_dtype = state_dtype(final_state);
}

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

// ---------------------------------------------------------------------------------------------
// Eager fast path of fused_recurrent_kda / fused_recurrent_gated_delta_rule.
// ---------------------------------------------------------------------------------------------

namespace fast {

// Positional arguments of fused_recurrent: the public functions' parameters in their order, then
// whether the gate is scalar (GDN). The signature in fused_recurrent_def's doc names them.
enum Arg : Py_ssize_t {
  kQ, kK, kV, kG, kBeta, kALog, kDtBias, kScale, kInitialState, kOutputFinalState, kL2Norm, kUseGate,
  kBetaSigmoid, kAllowNegEigval, kLowerBound, kStateVFirst, kCuSeqlens, kSlotIndices, kAcceptedTokens, kOut,
  kScalarGate, kNumArgs
};

// Positional arguments of chunk: those of fused_recurrent up to cu_seqlens (the token arguments
// both entries check alike), then the prefill's own. The signature in chunk_def's doc names them.
enum ChunkArg : Py_ssize_t {
  kCuSeqlensCpu = kCuSeqlens + 1, kChunkSlotIndices, kHasInitialState, kValueSplit, kSegmentChunks,
  kChunkScalarGate, kNumChunkArgs
};

// The reason of the last check: a call that gets it passed every other one.
constexpr const char* kNotCuda = "q: not on a CUDA device";

// The tensor behind `o` when it is a plain strided one, else null. Tensor subclasses other than
// Parameter (fake and functional tensors among them) keep their own semantics on the general path.
const at::Tensor* plain_tensor(PyObject* o) {
  if (!THPVariable_CheckExact(o)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  return t.layout() == at::kStrided ? &t : nullptr;
}

// `*t` = the plain tensor `o`, or null for None; false for anything else.
bool optional_tensor(PyObject* o, const at::Tensor** t) {
  *t = o == Py_None ? nullptr : plain_tensor(o);
  return o == Py_None || *t != nullptr;
}

// True or False; anything else (ints, numpy bools) goes the general way, where Python decides.
bool as_flag(PyObject* o, bool* value) {
  *value = o == Py_True;
  return o == Py_True || o == Py_False;
}

// A Python float or int (the general path's isinstance(x, (int, float)) and float(x); subclasses,
// whose float() may run their own code, go the general way).
bool as_number(PyObject* o, double* value) {
  if (PyFloat_CheckExact(o)) {
    *value = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (!PyLong_CheckExact(o)) return false;
  *value = PyLong_AsDouble(o);
  if (*value == -1.0 && PyErr_Occurred()) {  // beyond a double: float() would raise
    PyErr_Clear();
    return false;
  }
  return true;
}

// One call's arguments, checked.
struct Call {
  const at::Tensor *q, *k, *v, *g, *beta, *A_log, *dt_bias, *initial_state, *cu_seqlens, *indices;
  const at::Tensor *accepted = nullptr, *out = nullptr, *has_initial_state = nullptr;
  double scale, lower_bound = 0.0;
  GateMode gate_mode;
  bool output_final_state, l2norm, use_gate, beta_sigmoid, allow_neg_eigval, state_v_first, scalar_gate;
  int64_t N;
};

// The checks both entries share, on the arguments up to cu_seqlens (positions of enum Arg) and the
// flag at `scalar_gate`: null when they pass, else why not, naming the argument first. Sets every
// field of `c` up to N.
const char* check_tokens(PyObject* const* a, Py_ssize_t scalar_gate, Call& c) {
  struct {
    Arg arg;
    const at::Tensor** tensor;
    const char* why;
  } const tensors[] = {{kQ, &c.q, "q: not a plain strided tensor"},
                       {kK, &c.k, "k: not a plain strided tensor"},
                       {kV, &c.v, "v: not a plain strided tensor"},
                       {kG, &c.g, "g: not a plain strided tensor"},
                       {kBeta, &c.beta, "beta: not a plain strided tensor"}};
  for (const auto& t : tensors)
    if ((*t.tensor = plain_tensor(a[t.arg])) == nullptr) return t.why;
  struct {
    Py_ssize_t arg;
    bool* value;
    const char* why;
  } const flags[] = {{kOutputFinalState, &c.output_final_state, "output_final_state: not True or False"},
                     {kL2Norm, &c.l2norm, "use_qk_l2norm_in_kernel: not True or False"},
                     {kUseGate, &c.use_gate, "use_gate_in_kernel: not True or False"},
                     {kBetaSigmoid, &c.beta_sigmoid, "use_beta_sigmoid_in_kernel: not True or False"},
                     {kAllowNegEigval, &c.allow_neg_eigval, "allow_neg_eigval: not True or False"},
                     {kStateVFirst, &c.state_v_first, "state_v_first: not True or False"},
                     {scalar_gate, &c.scalar_gate, "scalar_gate: not True or False"}};
  for (const auto& f : flags)
    if (!as_flag(a[f.arg], f.value)) return f.why;

  const at::Tensor &q = *c.q, &k = *c.k, &v = *c.v, &g = *c.g, &beta = *c.beta;
  if (q.dim() != 4) return "q: not 4-D";
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  if (k.sizes() != q.sizes()) return "k: shape";
  if (v.dim() != 4 || v.size(0) != B || v.size(1) != T) return "v: shape";
  const int64_t HV = v.size(2);
  if (H == 0 || HV == 0 || HV % H != 0) return "v: value heads not a positive multiple of the heads of q";
  const bool g_rank = c.scalar_gate ? g.dim() == 3 : g.dim() == 4 && g.size(3) == K;
  if (!g_rank || g.size(0) != B || g.size(1) != T || g.size(2) != HV) return "g: shape";
  if (beta.dim() != 3 || beta.size(0) != B || beta.size(1) != T || beta.size(2) != HV) return "beta: shape";
  if (v.size(3) != K || !kernel_head_dim(K)) return "v: head dims K, V without a kernel";
  const at::ScalarType elem = q.scalar_type();
  if (!kernel_elem(elem) || k.scalar_type() != elem || v.scalar_type() != elem) return "q: dtype of q, k, v";
  if (!kernel_elem(g.scalar_type())) return "g: dtype";
  if (!kernel_elem(beta.scalar_type())) return "beta: dtype";
  const at::Device dev = q.device();
  if (k.device() != dev || v.device() != dev || g.device() != dev || beta.device() != dev)
    return "k: device of k, v, g, beta";
  if (!last_dim_contiguous(q) || !last_dim_contiguous(k) || !last_dim_contiguous(v) || !last_dim_contiguous(g) ||
      !last_dim_contiguous(beta))
    return "q: strided last dimension of q, k, v, g or beta";

  c.scale = std::pow(double(K), -0.5);  // Python's K ** -0.5
  if (a[kScale] != Py_None && !as_number(a[kScale], &c.scale)) return "scale: not a float or int";
  if (c.allow_neg_eigval && !c.beta_sigmoid) return "allow_neg_eigval: without use_beta_sigmoid_in_kernel";
  const bool has_lower_bound = a[kLowerBound] != Py_None;
  double lower_bound = 0.0;
  if (has_lower_bound &&
      !(as_number(a[kLowerBound], &lower_bound) && lower_bound >= kLowerBoundMin && lower_bound < 0.0))
    return "lower_bound: not a number in [-5, 0)";

  if (!optional_tensor(a[kALog], &c.A_log)) return "A_log: not a plain strided tensor";
  if (!optional_tensor(a[kDtBias], &c.dt_bias)) return "dt_bias: not a plain strided tensor";
  if (c.use_gate) {
    if (const at::Tensor* t = c.A_log) {
      if (!kernel_elem(t->scalar_type()) || t->numel() != HV || t->device() != dev || !t->is_contiguous())
        return "A_log: not a contiguous float32/bfloat16/float16 tensor of HV elements beside q";
    }
    if (const at::Tensor* t = c.dt_bias) {
      const bool shape = c.scalar_gate ? t->numel() == HV
                                       : t->dim() == 1 ? t->size(0) == HV * K
                                                       : t->dim() == 2 && t->size(0) == HV && t->size(1) == K;
      if (!kernel_elem(t->scalar_type()) || !shape || t->device() != dev || !t->is_contiguous())
        return "dt_bias: not a contiguous float32/bfloat16/float16 [HV*K], [HV, K] (KDA) or HV values (GDN) beside q";
    }
    c.gate_mode = has_lower_bound ? GateMode::kLowerBound : GateMode::kSoftplus;
    c.lower_bound = lower_bound;
  } else {
    // The general path ignores them then; it also has the last word on ones that are not float32.
    if (c.A_log != nullptr || c.dt_bias != nullptr) return "A_log: given without use_gate_in_kernel";
    c.gate_mode = GateMode::kPrecomputed;
  }

  if (!optional_tensor(a[kCuSeqlens], &c.cu_seqlens)) return "cu_seqlens: not a plain strided tensor";
  c.N = B;
  if (const at::Tensor* t = c.cu_seqlens) {
    if (t->dim() != 1 || t->size(0) < 1 || !index_elem(t->scalar_type()) || t->device() != dev ||
        !t->is_contiguous() || B != 1)
      return "cu_seqlens: not a contiguous int32/int64 [N + 1] beside q with B == 1";
    c.N = t->size(0) - 1;
  }
  return nullptr;
}

// initial_state, when given: a contiguous, 16-byte aligned float32/bfloat16 [N, HV, K, V] beside q,
// or the slot pool [slots, HV, K, V] when slot indices come with it (K == V in both layouts here).
const char* check_initial_state(const Call& c) {
  const at::Tensor* s = c.initial_state;
  if (s == nullptr) return nullptr;
  const int64_t HV = c.v->size(2), K = c.q->size(3);
  if ((s->scalar_type() != at::kFloat && s->scalar_type() != at::kBFloat16) || s->device() != c.q->device() ||
      s->dim() != 4 || s->size(1) != HV || s->size(2) != K || s->size(3) != K ||
      (c.indices == nullptr && s->size(0) != c.N) || !s->is_contiguous())
    return "initial_state: not a contiguous float32/bfloat16 [N or slots, HV, K, V] beside q";
  if (reinterpret_cast<uintptr_t>(s->data_ptr()) % 16 != 0) return "initial_state: not 16-byte aligned";
  return nullptr;
}

// Under autograd, inputs that require grad take the general path: the prefill records a graph
// there, decode raises. Both entries ask once every tensor is bound.
const char* check_no_grad(const Call& c) {
  if (!at::GradMode::is_enabled()) return nullptr;
  for (const at::Tensor* t : {c.q, c.k, c.v, c.g, c.beta, c.A_log, c.dt_bias, c.initial_state})
    if (t != nullptr && t->requires_grad()) return "q: an input requires grad under autograd";
  return nullptr;
}

// The last checks of both entries: a CUDA device this build has kernels for.
const char* check_device(const at::Tensor& q) {
  if (!q.is_cuda()) return kNotCuda;
  if (kernel_image_error(q.get_device()) != nullptr) return "q: on a GPU without a kernel image of this build";
  return nullptr;
}

// Null when the kernel takes the call as given; else why not, naming the argument first. Every
// rule of api._validate and api._kernel_unsupported is here, and so are the conditions under
// which api._run_recurrent_kernel would copy an input; the general path words the errors.
const char* check(PyObject* const* a, Call& c) {
  if (const char* why = check_tokens(a, kScalarGate, c)) return why;
  const at::Tensor& q = *c.q;
  const at::Device dev = q.device();
  const int64_t T = q.size(1);
  if (!optional_tensor(a[kInitialState], &c.initial_state)) return "initial_state: not a plain strided tensor";
  if (!optional_tensor(a[kSlotIndices], &c.indices)) return "ssm_state_indices: not a plain strided tensor";
  if (!optional_tensor(a[kAcceptedTokens], &c.accepted)) return "num_accepted_tokens: not a plain strided tensor";
  if (const at::Tensor* t = c.indices) {
    if (c.initial_state == nullptr) return "ssm_state_indices: without initial_state";
    if (!index_elem(t->scalar_type()) || t->device() != dev || (t->dim() != 1 && t->dim() != 2) ||
        t->size(0) != c.N || !last_dim_contiguous(*t))
      return "ssm_state_indices: not an int32/int64 [N] or [N, T_max] beside q, contiguous rows";
    if (t->dim() == 2 && c.cu_seqlens == nullptr && t->size(1) < T) return "ssm_state_indices: T_max < T";
    if (const at::Tensor* n = c.accepted) {
      if (t->dim() != 2 || !index_elem(n->scalar_type()) || n->dim() != 1 || n->size(0) != c.N ||
          n->device() != dev || !n->is_contiguous())
        return "num_accepted_tokens: not a contiguous int32/int64 [N] beside q with [N, T_max] indices";
    }
  } else if (c.accepted != nullptr) {
    return "num_accepted_tokens: without ssm_state_indices";
  }
  if (const char* why = check_initial_state(c)) return why;

  if (!optional_tensor(a[kOut], &c.out)) return "out: not a plain strided tensor";
  if (const at::Tensor* o = c.out) {
    if (o->sizes() != c.v->sizes() || o->scalar_type() != q.scalar_type() || o->device() != dev ||
        !o->is_contiguous())
      return "out: not a contiguous tensor like v";
  }
  if (const char* why = check_no_grad(c)) return why;
  return check_device(q);
}

PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

// The tuple (first, second), taking over both references; null with the Python error set when
// either is null (a failed wrap) or the tuple cannot be made.
PyObject* pair(PyObject* first, PyObject* second) {
  PyObject* result = first != nullptr && second != nullptr ? PyTuple_New(2) : nullptr;
  if (result == nullptr) {
    Py_XDECREF(first);
    Py_XDECREF(second);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, first);
  PyTuple_SET_ITEM(result, 1, second);
  return result;
}

// The arguments of fused_recurrent, checked: null when they cannot be
// checked (a wrong count; the Python error is set), else why the kernel cannot take them as given
// (the empty string: it can).
const char* checked_call(const char* fn, PyObject* const* args, Py_ssize_t nargs, Call& c) {
  if (nargs != kNumArgs) {
    PyErr_Format(PyExc_TypeError, "flashkda: %s takes %d positional arguments, got %zd", fn, int(kNumArgs), nargs);
    return nullptr;
  }
  const char* why = check(args, c);
  return why != nullptr ? why : "";
}

// The module function fused_recurrent (signature and doc: fused_recurrent_def). A plain CPython
// function (METH_FASTCALL): no argument conversion layer, and the outputs that the caller passed in
// come back as the same Python objects.
PyObject* fused_recurrent(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  try {
    Call c;
    const char* why = checked_call("fused_recurrent", args, nargs, c);
    if (why == nullptr) return nullptr;
    if (*why != '\0') return PyUnicode_FromString(why);

    const at::Tensor& q = *c.q;
    const bool serving = c.indices != nullptr;
    const bool new_state = !serving && c.output_final_state;
    at::Tensor o_new, state_new;
    if (c.out == nullptr) o_new = at::empty(c.v->sizes(), c.v->options());
    if (new_state) state_new = at::empty({c.N, c.v->size(2), q.size(3), q.size(3)}, q.options().dtype(at::kFloat));

    RecurrentParams p{};
    set_token_params(p, q, *c.k, *c.v, *c.g, *c.beta, c.A_log, c.dt_bias, c.cu_seqlens,
                     c.out != nullptr ? *c.out : o_new, c.scale, c.gate_mode, c.lower_bound, c.l2norm,
                     c.beta_sigmoid, c.allow_neg_eigval, c.state_v_first);
    set_state_params(p, serving ? nullptr : c.initial_state,
                     serving ? c.initial_state : new_state ? &state_new : nullptr, c.indices, c.accepted);
    launch_recurrent(p, q.scalar_type(), q.get_device());

    return pair(c.out != nullptr ? new_ref(args[kOut]) : THPVariable_Wrap(std::move(o_new)),
                serving     ? new_ref(args[kInitialState])
                : new_state ? THPVariable_Wrap(std::move(state_new))
                            : new_ref(Py_None));
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

// The doc's first line is the signature Python reports (inspect.signature); its parameter order is
// that of enum Arg, and tests/test_api.py checks that it is the public functions' order.
PyMethodDef fused_recurrent_def = {
    "fused_recurrent", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fused_recurrent)), METH_FASTCALL,
    "fused_recurrent(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, "
    "use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, "
    "state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, out, scalar_gate, /)\n--\n\n"
    "Eager fast path of flashkda.fused_recurrent_kda (scalar_gate=False) and "
    "fused_recurrent_gated_delta_rule (scalar_gate=True), whose arguments it takes as given: returns "
    "(o, final_state) after launching the kernel, or a str saying why the call needs the general path."};

}  // namespace fast

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

// Chunked forward (prefill). Shapes and semantics: docs/SPEC.md, chunk_kda / chunk_gated_delta_rule;
// K == V == chunk::kHeadDim, bf16 or fp16 token tensors. Planned and run by chunk_plan.h
// (value_split and segment_chunks as plan_chunk takes them); the workspace comes from PyTorch's
// caching allocator, so under CUDA-graph capture it lives in the graph's private pool. Serving mode (ssm_state_indices [N] given): `initial_state` is None and
// `final_state` is the slot pool, read at idx[n] (zeros where has_initial_state[n] is false) and
// written there in place.
void chunk_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
               const at::Tensor& beta, const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
               const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& initial_state,
               const std::optional<at::Tensor>& final_state, const at::Tensor& o, double scale, int64_t gate_mode,
               double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool state_v_first,
               int64_t value_split, int64_t segment_chunks, const std::optional<at::Tensor>& chunk_states,
               const std::optional<at::Tensor>& chunk_state_slots, const std::optional<at::Tensor>& ssm_state_indices,
               const std::optional<at::Tensor>& has_initial_state) {
  const at::Tensor q = rows16(q_in), k = rows16(k_in), v = rows16(v_in);
  const at::Tensor g = g_in.dim() == 4 ? rows16(g_in) : g_in;  // the scalar gate is read element by element
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
  // chunk_prepare reads fp32 gate parameters (fp32_a_log in chunk_prepare.cuh says why).
  auto fp32 = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    return t.has_value() && t->scalar_type() != at::kFloat ? std::optional<at::Tensor>(t->to(at::kFloat)) : t;
  };
  const std::optional<at::Tensor> A_log32 = fp32(A_log), dt_bias32 = fp32(dt_bias);
  ChunkParams p{};
  set_token_params(p, q, k, v, g, beta, opt(A_log32), opt(dt_bias32), opt(cu_seqlens), o, scale,
                   static_cast<GateMode>(gate_mode), lower_bound, l2norm, beta_sigmoid, allow_neg_eigval,
                   state_v_first);
  TORCH_CHECK(p.D == chunk::kHeadDim, "flashkda: the chunked kernels take K == V == ", chunk::kHeadDim);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "flashkda: the chunked kernels take bfloat16 or float16 q, k, v");
  TORCH_CHECK(has_rows16(o), "flashkda: o must be 16-byte aligned with 16-byte strides");
  set_state_params(p, opt(initial_state), opt(final_state), opt(ssm_state_indices), nullptr);
  check_states(p, q, initial_state, final_state);
  if (ssm_state_indices.has_value())
    TORCH_CHECK(ssm_state_indices->size(0) == p.N, "flashkda: ssm_state_indices must have N = ", p.N, " entries");
  if (has_initial_state.has_value()) {
    TORCH_CHECK(has_initial_state->size(0) == p.N, "flashkda: has_initial_state must have N = ", p.N, " entries");
    p.has_initial_state = has_initial_state->data_ptr<bool>();
  }
  // States at chunk starts (ChunkParams::chunk_states): dense [entries, HV, D, D], or a pool of
  // slots named by chunk_state_slots [N, cols].
  if (chunk_states.has_value()) {
    const at::Tensor& h = *chunk_states;
    check_cuda(h, q, "chunk_states");
    const int64_t per_entry = int64_t(p.HV) * p.D * p.D;
    TORCH_CHECK(h.is_contiguous() && h.dim() >= 3 && h.size(-1) == p.D && h.size(-2) == p.D && h.size(-3) == p.HV &&
                    reinterpret_cast<uintptr_t>(h.data_ptr()) % 16 == 0,
                "flashkda: chunk_states must be a contiguous, 16-byte aligned [..., HV, D, D] tensor");
    p.chunk_states = h.data_ptr();
    p.chunk_states_dtype = to_dtype(h, "chunk_states");
    p.chunk_state_entries = h.numel() / per_entry;
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
  const at::Tensor workspace = at::empty({ws.total()}, q.options().dtype(at::kByte));
  carve_chunk_workspace(p, ws, workspace.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = q.scalar_type() == at::kBFloat16 ? run_chunk_forward<__nv_bfloat16>(p, stream)
                                                           : run_chunk_forward<__half>(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunked kernel launch failed: ", cudaGetErrorString(err));
}

// ---------------------------------------------------------------------------------------------
// Eager fast path of chunk_kda / chunk_gated_delta_rule.
// ---------------------------------------------------------------------------------------------

namespace fast {

constexpr const char* kChunkSmem = "q: on a GPU with too little shared memory per block for the chunked kernels";

// Why `device` cannot run the chunked kernels, or nullptr; a failed query answers nullptr, so that
// the kernels launch and report the error.
const char* chunk_smem_error(int device) {
  const int optin = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
  return optin > 0 && !chunk_smem_fits(optin) ? kChunkSmem : nullptr;
}

// A Python int (exactly; the caller passes flashkda's own config values).
bool as_int(PyObject* o, int64_t* value) {
  if (!PyLong_CheckExact(o)) return false;
  *value = PyLong_AsLongLong(o);
  if (*value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// api._check_offsets on a host copy of cu_seqlens: N + 1 entries from 0 to T, non-decreasing.
template <typename Index>
bool offsets_valid(const Index* offsets, int64_t N, int64_t T) {
  if (offsets[0] != 0 || offsets[N] != T) return false;
  for (int64_t n = 0; n < N; ++n)
    if (offsets[n + 1] < offsets[n]) return false;
  return true;
}

// Null when the chunked kernels take the call as given; else why not, naming the argument first.
// The rules of api._validate, api._kernel_unsupported and api._chunk_kernel_unsupported for the
// calls that reach this entry (no states at chunk starts; flashkda/api.py sends those the general
// way), and the conditions under which api._chunk would copy an input or run another kernel.
const char* check_chunk(PyObject* const* a, Call& c, int64_t* value_split, int64_t* segment_chunks) {
  if (const char* why = check_tokens(a, kChunkScalarGate, c)) return why;
  const at::Tensor& q = *c.q;
  const at::Device dev = q.device();
  if (q.size(3) != chunk::kHeadDim) return "v: head dims without a chunked kernel";
  if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)
    return "q: dtype without a chunked kernel (bfloat16, float16)";
  if (c.cu_seqlens != nullptr && a[kCuSeqlensCpu] != Py_None) {
    const at::Tensor* host = plain_tensor(a[kCuSeqlensCpu]);
    if (host == nullptr || !host->is_cpu() || !index_elem(host->scalar_type()) || host->dim() != 1 ||
        host->size(0) != c.N + 1 || !host->is_contiguous())
      return "cu_seqlens_cpu: not a contiguous int32/int64 CPU tensor of N + 1 entries";
    const bool valid = host->scalar_type() == at::kInt
                           ? offsets_valid(host->data_ptr<int32_t>(), c.N, q.size(1))
                           : offsets_valid(host->data_ptr<int64_t>(), c.N, q.size(1));
    if (!valid) return "cu_seqlens_cpu: not offsets from 0 to T, non-decreasing";
  }
  if (!optional_tensor(a[kInitialState], &c.initial_state)) return "initial_state: not a plain strided tensor";
  if (!optional_tensor(a[kChunkSlotIndices], &c.indices)) return "ssm_state_indices: not a plain strided tensor";
  if (!optional_tensor(a[kHasInitialState], &c.has_initial_state)) return "has_initial_state: not a plain strided tensor";
  if (const at::Tensor* t = c.indices) {
    if (c.initial_state == nullptr) return "ssm_state_indices: without initial_state";
    if (!index_elem(t->scalar_type()) || t->device() != dev || t->dim() != 1 || t->size(0) != c.N ||
        !t->is_contiguous())
      return "ssm_state_indices: not a contiguous int32/int64 [N] beside q";
  }
  if (const at::Tensor* t = c.has_initial_state) {
    if (c.indices == nullptr) return "has_initial_state: without ssm_state_indices";
    if (t->scalar_type() != at::kBool || t->device() != dev || t->dim() != 1 || t->size(0) != c.N ||
        !t->is_contiguous())
      return "has_initial_state: not a contiguous bool [N] beside q";
  }
  if (const char* why = check_initial_state(c)) return why;
  if (!as_int(a[kValueSplit], value_split)) return "value_split: not an int";
  if (!as_int(a[kSegmentChunks], segment_chunks)) return "segment_chunks: not an int";
  if (const char* why = check_no_grad(c)) return why;
  if (const char* why = check_device(q)) return why;
  return chunk_smem_error(q.get_device());
}

std::optional<at::Tensor> optional_of(const at::Tensor* t) {
  return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt;
}

// The module function chunk (signature and doc: chunk_def), as fused_recurrent: returns (o,
// final_state) after launching the chunked kernels, or a str saying why the call needs the general
// path. A malformed value_split or segment_chunks raises from chunk_fwd as on the general path.
PyObject* chunk(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != kNumChunkArgs) {
      PyErr_Format(PyExc_TypeError, "flashkda: chunk takes %d positional arguments, got %zd", int(kNumChunkArgs),
                   nargs);
      return nullptr;
    }
    Call c;
    int64_t value_split = 0, segment_chunks = 0;
    if (const char* why = check_chunk(args, c, &value_split, &segment_chunks)) return PyUnicode_FromString(why);

    const at::Tensor& q = *c.q;
    const bool serving = c.indices != nullptr;
    const bool new_state = !serving && c.output_final_state;
    at::Tensor o = at::empty(c.v->sizes(), c.v->options());
    at::Tensor state_new;
    if (new_state) state_new = at::empty({c.N, c.v->size(2), q.size(3), q.size(3)}, q.options().dtype(at::kFloat));
    chunk_fwd(q, *c.k, *c.v, *c.g, *c.beta, optional_of(c.A_log), optional_of(c.dt_bias), optional_of(c.cu_seqlens),
              serving ? std::nullopt : optional_of(c.initial_state),
              serving ? optional_of(c.initial_state) : optional_of(new_state ? &state_new : nullptr), o, c.scale,
              int64_t(c.gate_mode), c.lower_bound, c.l2norm, c.beta_sigmoid, c.allow_neg_eigval, c.state_v_first,
              value_split, segment_chunks, std::nullopt, std::nullopt, optional_of(c.indices),
              optional_of(c.has_initial_state));
    return pair(THPVariable_Wrap(std::move(o)), serving     ? new_ref(args[kInitialState])
                                                : new_state ? THPVariable_Wrap(std::move(state_new))
                                                            : new_ref(Py_None));
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

PyMethodDef chunk_def = {
    "chunk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&chunk)), METH_FASTCALL,
    "chunk(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, "
    "use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, "
    "cu_seqlens_cpu, ssm_state_indices, has_initial_state, value_split, segment_chunks, scalar_gate, /)\n--\n\n"
    "Eager fast path of flashkda.chunk_kda (scalar_gate=False) and chunk_gated_delta_rule (scalar_gate=True) "
    "without states at chunk starts; value_split and segment_chunks as chunk_fwd takes them: returns "
    "(o, final_state) after launching the kernels, or a str saying why the call needs the general path."};

}  // namespace fast

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
      "bool state_v_first, int value_split, int segment_chunks, Tensor(c!)? chunk_states=None, "
      "Tensor? chunk_state_slots=None, Tensor? ssm_state_indices=None, Tensor? has_initial_state=None) -> ()");
}

TORCH_LIBRARY_IMPL(flashkda, CUDA, m) {
  m.impl("recurrent_fwd", &flashkda::recurrent_fwd);
  m.impl("chunk_fwd", &flashkda::chunk_fwd);
}

// `import flashkda._C` runs the registrations above. The module also exposes the entry points as
// plain functions, which skip the dispatcher's boxing (a few microseconds per decode step): eager
// calls take them; traced code (torch.compile) uses the torch.ops.flashkda ops.
PYBIND11_MODULE(_C, m) {
  m.def("recurrent_fwd", &flashkda::recurrent_fwd, "token-by-token recurrence (see binding.cpp)");
  m.def("chunk_fwd", &flashkda::chunk_fwd, "chunked forward (see binding.cpp)");
  m.def("set_kernel_family", &flashkda::set_kernel_family,
        "kernel family for every later call in this process: 0 auto, 80 sm_80 kernels, 90 sm_90 kernels where "
        "they apply");
  m.def("kernel_image_reason", &flashkda::kernel_image_reason,
        "why CUDA device `device` cannot run this build's kernels, or None (asked once per device)");
  m.def("chunk_smem_bytes", &flashkda::chunk_smem_bytes,
        "dynamic shared memory per block (bytes) that the chunked kernels need (no CUDA call)");
  m.def("chunk_smem_reason", &flashkda::chunk_smem_reason,
        "why a device with this opt-in shared memory per block (bytes) cannot run the chunked kernels, or None");
  PyObject* fused_recurrent =
      PyCFunction_NewEx(&flashkda::fast::fused_recurrent_def, nullptr, m.attr("__name__").ptr());
  if (fused_recurrent == nullptr) throw pybind11::error_already_set();
  m.add_object("fused_recurrent", pybind11::reinterpret_steal<pybind11::object>(fused_recurrent));
  PyObject* chunk = PyCFunction_NewEx(&flashkda::fast::chunk_def, nullptr, m.attr("__name__").ptr());
  if (chunk == nullptr) throw pybind11::error_already_set();
  m.add_object("chunk", pybind11::reinterpret_steal<pybind11::object>(chunk));
}
