// The eager fast paths of the public functions: `fused_recurrent` (fused_recurrent_kda /
// fused_recurrent_gated_delta_rule) and `chunk` (chunk_kda / chunk_gated_delta_rule without states
// at chunk starts). Each takes the arguments as the user gave them, checks all of them (the rules of
// flashkda/api.py, as predicates) and launches when the kernels take the inputs as they are;
// otherwise it returns why not, and flashkda/api.py runs the general path (ops.cpp), which raises
// the documented errors, copies strided inputs, records autograd or runs the reference.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>

#include "flashkda/common/constants.h"

#include "binding/binding.h"

namespace flashkda::binding {

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
// or the slot pool [slots, HV, K, V] when slot indices come with it (K == V in both layouts here),
// whose slots may be pitched wider (dense_slots).
const char* check_initial_state(const Call& c) {
  const at::Tensor* s = c.initial_state;
  if (s == nullptr) return nullptr;
  const int64_t HV = c.v->size(2), K = c.q->size(3);
  if ((s->scalar_type() != at::kFloat && s->scalar_type() != at::kBFloat16) || s->device() != c.q->device() ||
      s->dim() != 4 || s->size(1) != HV || s->size(2) != K || s->size(3) != K ||
      (c.indices == nullptr && s->size(0) != c.N) || !(c.indices == nullptr ? s->is_contiguous() : dense_slots(*s)))
    return "initial_state: not a contiguous float32/bfloat16 [N, HV, K, V] (or a pool with dense slots) beside q";
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
    // check_chunk applied every rule of chunk_fwd's safety net: it does not run again.
    chunk_fwd_impl(q, *c.k, *c.v, *c.g, *c.beta, optional_of(c.A_log), optional_of(c.dt_bias),
                   optional_of(c.cu_seqlens), serving ? std::nullopt : optional_of(c.initial_state),
                   serving ? optional_of(c.initial_state) : optional_of(new_state ? &state_new : nullptr), o, c.scale,
                   int64_t(c.gate_mode), c.lower_bound, c.l2norm, c.beta_sigmoid, c.allow_neg_eigval,
                   c.state_v_first, value_split, segment_chunks, std::nullopt, std::nullopt, optional_of(c.indices),
                   optional_of(c.has_initial_state), /*records=*/std::nullopt, /*checked=*/true);
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

}  // namespace flashkda::binding
