// Parameters of the token-by-token (decode) recurrence. Framework-free: raw pointers, element
// strides and small enums; the torch binding fills it in csrc/binding/params.cpp.
#pragma once

#include <cstdint>

namespace flashkda {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };
// How the log decay is obtained from g (docs/SPEC.md, "Per-token preprocessing", step 3).
enum class GateMode : int32_t {
  kPrecomputed = 0,  // g is already the natural-log decay
  kLowerBound = 1,   // lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
  kSoftplus = 2,     // -exp(A_log) * softplus(g + dt_bias)
};

// Which kernel family runs. The sm_90 family (decode_bulk.cuh; chunk_recurrence with bulk-copy
// record loads and warpgroup MMAs) serves the cases it covers on devices with its code; everything
// else runs the sm_80 family (cp.async, mma.sync), which runs everywhere.
enum class KernelFamily : int32_t {
  kAuto = 0,   // sm_90 where it applies, else sm_80
  kSm80 = 80,  // always sm_80
  kSm90 = 90,  // sm_90 where it applies, else sm_80
};

struct RecurrentParams {
  // Token tensors; strides in elements, the last dimension contiguous. q, k, v and o share the
  // element type the kernel is instantiated for; g and beta have their own (g_dtype, beta_dtype).
  const void* q;     // [B, T, H, K]
  const void* k;     // [B, T, H, K]
  const void* v;     // [B, T, HV, V]
  const void* g;     // [B, T, HV, K] (KDA) or [B, T, HV] (GDN, scalar_gate)
  const void* beta;  // [B, T, HV]
  void* o;           // [B, T, HV, V]
  int64_t q_batch_stride, q_token_stride, q_head_stride;
  int64_t k_batch_stride, k_token_stride, k_head_stride;
  int64_t v_batch_stride, v_token_stride, v_head_stride;
  int64_t g_batch_stride, g_token_stride, g_head_stride;
  int64_t beta_batch_stride, beta_token_stride;  // head stride 1
  int64_t o_batch_stride, o_token_stride, o_head_stride;

  // Gate parameters of use_gate_in_kernel, each read in its own dtype (A_log_dtype, dt_bias_dtype)
  // and computed in fp32: a model cast to bf16 keeps them bf16, and a cast per call would cost a
  // launch and an allocation on every decode step.
  const void* A_log;    // [HV] or nullptr (exp(A_log) taken as 1)
  const void* dt_bias;  // [HV * K] (KDA) or [HV] (GDN) or nullptr (zero bias)

  // Varlen: sequence n is tokens [cu_seqlens[n], cu_seqlens[n+1]) of batch row 0 (B == 1).
  // nullptr: sequence n is batch row n, T tokens.
  const void* cu_seqlens;  // [N + 1]

  // Recurrent state: slots of dense [HV, K, V] (key-first) or [HV, V, K] (state_v_first), slot s at
  // element s * state_slot_elems(*this): a serving engine's pool may pitch its slots wider (one slot
  // across all layers, a layer's pool a view into it).
  const void* state_in;  // [*, HV, ...] or nullptr (zero initial state)
  void* state_out;       // [*, HV, ...] or nullptr (no final state); may equal state_in (pool)
  int64_t state_slot_stride;  // elements between slots of state_in and state_out; 0: HV * D * D
  // Serving mode: slot_indices != nullptr. [N] (idx_cols == 0): read and write slot idx[n].
  // [N, idx_cols]: read idx[n, num_accepted[n] - 1] (or idx[n, 0]), write the state after token t
  // to idx[n, t]. A slot outside [0, num_slots) is padding: skipped, zero output, no write.
  // Without slot_indices, sequence n reads and writes slot n.
  const void* slot_indices;
  const void* num_accepted;  // [N] or nullptr
  int64_t idx_row_stride;
  int32_t idx_cols;
  int64_t num_slots;

  int32_t B, T, N, H, HV, D;  // D = K = V
  float scale;                // applied to q after the l2 norm
  float lower_bound;          // kLowerBound only
  float beta_scale;           // 2 with allow_neg_eigval, else 1 (after the sigmoid)
  GateMode gate_mode;
  bool scalar_gate;           // GDN
  bool l2norm;                // use_qk_l2norm_in_kernel
  bool beta_sigmoid;          // use_beta_sigmoid_in_kernel
  bool state_v_first;
  DType g_dtype, beta_dtype;
  DType A_log_dtype, dt_bias_dtype;
  DType state_in_dtype, state_out_dtype;  // float32 or bfloat16
  IndexType cu_type, idx_type, accepted_type;
  int32_t num_sms;            // of the current device, for the block-shape choice
  KernelFamily kernel_family;
};

// Elements between consecutive state slots (RecurrentParams::state_slot_stride, 0: dense).
__host__ __device__ inline int64_t state_slot_elems(const RecurrentParams& p) {
  return p.state_slot_stride != 0 ? p.state_slot_stride : int64_t(p.HV) * p.D * p.D;
}

}  // namespace flashkda
