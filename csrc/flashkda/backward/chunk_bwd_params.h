// Parameters of the chunked backward's per-chunk kernel (chunk_local_grad.cuh). Framework-free;
// filled in csrc/binding/backward.cpp.
//
// The backward splits the recurrence at chunks of chunk::kChunk tokens: the state is the only
// coupling between chunks. Per chunk (docs/SPEC.md, "Gradients"), with q̂, k̂ the preprocessed
// q (l2 norm, scale) and k, Γ the log decay summed from the chunk start and
// M = tril(q̂ k̂ᵀ ⊙ e^{Γi−Γj}), A = strict_tril(k̂ k̂ᵀ ⊙ e^{Γi−Γj}), T = (I + diag(β) A)⁻¹ diag(β),
// w = T (k̂ e^Γ), u = T v, kd = k̂ e^{Γ_C−Γ}:
//   state map   S' = D S + B,      D = diag(e^{Γ_C}) − kdᵀ w,  B = kdᵀ u
//   output      O = P S + M u,     P = q̂ e^Γ − M w
// Pass kTransitions writes D, B and Y = Pᵀ dO for the two scans over chunks (the states at chunk
// starts, and the gradients of the states after chunks); pass kGradients takes both and writes
// the gradients of the chunk's preprocessed inputs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "flashkda/common/recurrent_params.h"

namespace flashkda {
namespace chunk_bwd {

enum class Pass : int32_t {
  kTransitions = 0,  // D [K][K], B [K][V], Y [K][V] per (chunk, head)
  kGradients = 1,    // dq̂, dk̂, dv, dg, dβ of every token
};

}  // namespace chunk_bwd

struct ChunkBwdParams {
  // Token tensors, contiguous, rows = B * T tokens, HV heads (q̂ and k̂ already repeated over the
  // heads of a group): the preprocessed ones fp32, v and dO bf16 (the products' operand type, which
  // is all the kernel makes of them). D = chunk::kHeadDim.
  const float* q;              // [rows, HV, D] q̂ = scale · l2norm(q)  (nullptr with raw_q)
  const float* k;              // [rows, HV, D] k̂                      (nullptr with raw_k)
  const __nv_bfloat16* v;      // [rows, HV, D]
  const float* g;              // [rows, HV, D] log decay of every token and key channel (≤ 0), or
                               // [rows, HV] for a scalar gate (the kernel's kScalarGate): one for all
  const float* beta;           // [rows, HV]
  const __nv_bfloat16* dO;     // [rows, HV, D] gradient of the output
  // Chunks: chunk c holds tokens chunk_bos[c] .. chunk_bos[c] + chunk_len[c] - 1 (len 0: an empty
  // chunk of a shorter sequence, whose map is the identity).
  const int64_t* chunk_bos;  // [chunks]
  const int32_t* chunk_len;  // [chunks]
  int64_t chunks;
  int32_t HV;
  chunk_bwd::Pass pass;
  // kTransitions: outputs, [chunks, HV, D, D] fp32 each (row = key channel of the new state).
  float* trans_D;
  float* trans_B;
  float* trans_Y;
  // kGradients: inputs, [chunks, HV, D, D] bf16 (key rows, value columns): the state at the chunk's
  // start and the gradient of the state after it (the products take them as bf16 operands).
  const __nv_bfloat16* states;
  const __nv_bfloat16* dstates;
  // kGradients: outputs, token rows as the inputs (rows of other tokens untouched); fp32 but dv, which
  // nothing downstream transforms: it is written in its final dtype (v's), rounded once. dq, dk, dg
  // and dbeta may be q, k, g and beta themselves: the whole pass's block reads its chunk's rows of
  // them before it writes its gradients there (the pass in value halves may not: its two blocks
  // add their shares into zeros).
  float* dq;        // [rows, HV, D]
  float* dk;        // [rows, HV, D]
  void* dv;         // [rows, HV, D] in dv_dtype
  DType dv_dtype;
  float* dg;        // [rows, HV, D] (a scalar gate: [rows, HV], the sum over the key channels)
  float* dbeta;     // [rows, HV]
  // kGradients, the whole pass, optional (nullptr: dq̂ and dk̂ into dq and dk): the gradients of the
  // raw q and k instead, back through the scale and the l2 norm (dx = r (dy − y (y · dy)), y the
  // normalised row, r its 1 / norm), written in qk_dtype, with the value heads as key heads (no group
  // to sum: the caller's HV == H). dq and dk are then not written.
  void* dq_raw;             // [rows, HV, D] in qk_dtype
  void* dk_raw;             // [rows, HV, D] in qk_dtype
  DType qk_dtype;
  const float* qk_rnorm;    // [rows, HV, 2] 1 / norm of each row of q and k (chunk_bwd_inputs), with l2norm
  float scale;              // q̂ = scale · l2norm(q)
  bool l2norm;
  // With dq_raw, a scalar gate's whole pass, optional (nullptr: q and k hold q̂ and k̂): the raw q
  // and k themselves, which the pass takes through the l2 norm and the scale as chunk_bwd_inputs
  // does (the same lanes, sums and roundings, so the same q̂, k̂ and 1 / norms); qk_rnorm is not read.
  const void* raw_q;        // [rows, HV, D] in qk_dtype (bfloat16 or float16)
  const void* raw_k;        // [rows, HV, D] in qk_dtype
};

// The two scans over chunks (chunk_state_scan.cuh), on the transitions pass's maps, for N
// sequences of HV value heads: sequence n's chunks are seq_chunks[n] consecutive entries from
// seq_first[n], chunk c of head hv at matrix c * HV + hv (entries of no sequence are not read or
// written).
struct ChunkScanParams {
  const float* maps;     // [chunks, HV, D, D] D_c (D = chunk::kHeadDim)
  const float* offsets;  // [chunks, HV, D, D] B_c (forward) or Y_c (reverse)
  const float* start;    // [N, HV, D, D] S_0 (forward) or the final state's gradient (reverse)
  float* out;            // [chunks, HV, D, D] forward: the state at each chunk's start; reverse: the
                         // gradient of the state after each chunk
  float* first;          // reverse: [N, HV, D, D] the initial state's gradient D_0ᵀ G_0 + Y_0 (the
                         // final state's gradient for a sequence without chunks)
  const int64_t* seq_first;   // [N]
  const int32_t* seq_chunks;  // [N]
  int64_t N;
  int32_t HV;
  bool reverse;
};

// The per-token work around the per-chunk passes (chunk_bwd_tokens.cuh).
enum class ChunkBwdTokenPass : int32_t {
  kInputs = 0,  // q̂, k̂, ĝ, β̂ (and the rows' 1 / norms) from the raw inputs
  kGrads = 1,   // dq, dk, dg, dβ and the gate parameters' sums per tile from dq̂, dk̂, dĝ, dβ̂
};
// Tokens per tile of the gate parameters' sums (ChunkBwdTokenParams::dA_log_part, ddt_bias_part).
constexpr int kBwdTokenTileRows = 64;

struct ChunkBwdTokenParams {
  // The raw inputs and their preprocessing, as the forward kernels take them (q, k, g, beta with
  // their strides, A_log, dt_bias, gate mode, scale, l2norm, beta sigmoid; B, T, H, HV, D);
  // cu_seqlens, the states and v are not read.
  RecurrentParams tok;
  DType qk_dtype;  // of q and k
  int64_t rows;    // B * T
  // kInputs: outputs, fp32, [rows, HV, D] (β̂, and ĝ of a scalar gate: [rows, HV]); q̂ and k̂ per
  // value head; with l2norm, the rows' 1 / norms (q's, k's) per value head. q_hat nullptr: q̂, k̂ and
  // the 1 / norms are not written (the gradients pass takes the raw q and k: ChunkBwdParams::raw_q).
  float* q_hat;
  float* k_hat;
  float* g_hat;
  float* beta_hat;
  float* qk_rnorm;  // [rows, HV, 2]
  // kGrads: inputs, fp32, the layout of kInputs' outputs (dq_hat and dk_hat nullptr: dq and dk were
  // written by the gradients pass, ChunkBwdParams::dq_raw, and are not computed here).
  const float* dq_hat;
  const float* dk_hat;
  const float* dg_hat;
  const float* dbeta_hat;
  // kGrads: outputs, contiguous in the raw inputs' shapes and dtypes: dq, dk [B, T, H, D] (qk_dtype),
  // dg [B, T, HV, D] or [B, T, HV] (g's), dbeta [B, T, HV] (beta's).
  void* dq;
  void* dk;
  void* dg;
  void* dbeta;
  // kGrads: fp32 sums over each tile of kBwdTokenTileRows tokens, or nullptr (not wanted).
  float* dA_log_part;    // [tiles, HV]
  float* ddt_bias_part;  // [tiles, HV, D] (KDA) or [tiles, HV] (scalar gate)
};

// Largest |Σ g| over the tokens of one sub-chunk that the kernel takes: its pivoted operands stay
// within e^{±kMaxSubchunkSpan / 2} and their products finite in fp32. Wider spans take the PyTorch
// backward (flashkda/autograd.py checks).
constexpr float kBwdMaxSubchunkSpan = 80.0f;

}  // namespace flashkda
