// The chunked backward's kernel pass (chunk_local_grad), after flashkda/autograd.py preprocessed the
// inputs and laid out the chunks; its checks here are a safety net against memory errors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <vector>

#include "binding/binding.h"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda::binding {

namespace {

void check_tokens(const at::Tensor& t, const at::Tensor& q, const char* name, bool per_channel,
                  bool any_float = false) {
  check_cuda(t, q, name);
  TORCH_CHECK((t.scalar_type() == at::kFloat || (any_float && at::isFloatingType(t.scalar_type()))) &&
                  t.is_contiguous(),
              "flashkda: ", name, any_float ? " must be a contiguous floating tensor" : " must be contiguous float32");
  TORCH_CHECK(per_channel ? (t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) &&
                             t.size(2) == chunk::kHeadDim)
                          : (t.dim() == 2 && t.size(0) == q.size(0) && t.size(1) == q.size(1)),
              "flashkda: ", name, " must be [rows, HV", per_channel ? ", 128]" : "]", " like q");
}

}  // namespace

// Pass 0 (transitions): returns [D, B, Y], each [chunks, HV, D, D] fp32. Pass 1 (gradients, with
// `states` and `dstates` [chunks, HV, D, D] fp32 or bf16): returns [dq, dk, dv, dg, dbeta] in the token
// layout of the inputs, fp32 but dv in v's dtype where that is bf16 or fp16 (zeros for tokens in no
// chunk; `every_token`: the chunks cover every token, and nothing is zero-filled but the outputs
// that the pass in value halves sums into). Inputs:
// chunk_bwd_params.h; g [rows, HV] is a scalar gate (dg then [rows, HV] too). `overwrite_inputs`
// (gradients pass, every_token, the whole pass): dq, dk, dg and dbeta are written over q, k, g and
// beta, which the caller owns and reads no more (each block reads its own chunk's rows of them, all
// before it writes its gradients there; the pass in value halves adds two blocks' shares into
// zeros, so it cannot): at T = 8192, H = 32, 268 MB fewer (KDA's per-channel gate: 403).
// `qk_dtype` (gradients pass, the whole pass, HV == H: no group to sum): dq and dk are those of the
// raw q and k, back through `scale` and, with `l2norm`, the l2 norm whose rows' 1 / norms
// `qk_rnorm` [rows, HV, 2] holds (chunk_bwd_inputs), in qk_dtype; q and k are then not written.
// With qk_dtype, a scalar gate's q and k may also be the raw inputs themselves ([rows, HV, 128] in
// qk_dtype, bfloat16 or float16, instead of fp32 q̂ and k̂): the pass takes them through the l2 norm
// and the scale as chunk_bwd_inputs does, and qk_rnorm is not needed.
std::vector<at::Tensor> chunk_local_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta, const at::Tensor& dO,
                                         const at::Tensor& chunk_bos, const at::Tensor& chunk_len, int64_t pass,
                                         const std::optional<at::Tensor>& states,
                                         const std::optional<at::Tensor>& dstates, bool every_token,
                                         bool overwrite_inputs, const std::optional<at::Tensor>& qk_rnorm, double scale,
                                         bool l2norm, std::optional<at::ScalarType> qk_dtype) {
  TORCH_CHECK(q.is_cuda(), "flashkda: q must be a CUDA tensor");
  const bool raw_in = q.scalar_type() != at::kFloat;  // the raw q and k (see above)
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}}) check_tokens(*t, q, name, true, raw_in);
  const bool scalar_gate = g.dim() == 2;  // [rows, HV]: one log decay for every key channel
  TORCH_CHECK(!raw_in || (pass == 1 && scalar_gate && qk_dtype.has_value() && q.scalar_type() == *qk_dtype &&
                          k.scalar_type() == *qk_dtype && (*qk_dtype == at::kBFloat16 || *qk_dtype == at::kHalf)),
              "flashkda: q and k other than float32 (the raw inputs) need the gradients pass of a scalar gate and "
              "qk_dtype of their dtype, bfloat16 or float16");
  check_tokens(g, q, "g", !scalar_gate);
  // The transitions pass reads a gate per key channel: a scalar one is spread over them here.
  const at::Tensor g_read =
      scalar_gate && pass == 0 ? g.unsqueeze(-1).expand({g.size(0), g.size(1), chunk::kHeadDim}).contiguous() : g;
  // v and dO: any float dtype; the kernel reads bf16, its operand type (others rounded here).
  check_tokens(v, q, "v", true, true);
  check_tokens(dO, q, "dO", true, true);
  const at::Tensor v16 = v.to(at::kBFloat16), dO16 = dO.to(at::kBFloat16);
  check_tokens(beta, q, "beta", false);
  check_cuda(chunk_bos, q, "chunk_bos");
  check_cuda(chunk_len, q, "chunk_len");
  TORCH_CHECK(chunk_bos.scalar_type() == at::kLong && chunk_len.scalar_type() == at::kInt && chunk_bos.dim() == 1 &&
                  chunk_bos.is_contiguous() && chunk_len.is_contiguous() && chunk_len.sizes() == chunk_bos.sizes(),
              "flashkda: chunk_bos (int64) and chunk_len (int32) must be contiguous [chunks] tensors");
  TORCH_CHECK(pass == 0 || pass == 1, "flashkda: pass must be 0 (transitions) or 1 (gradients)");
  TORCH_CHECK(pass == 1 || !qk_dtype.has_value(), "flashkda: qk_dtype is an option of the gradients pass (pass 1)");
  const int64_t chunks = chunk_bos.size(0), HV = q.size(1), D = chunk::kHeadDim;
  const auto f32 = q.options();
  ChunkBwdParams p{};
  if (raw_in) {
    p.raw_q = q.data_ptr();
    p.raw_k = k.data_ptr();
  } else {
    p.q = q.data_ptr<float>();
    p.k = k.data_ptr<float>();
  }
  p.v = reinterpret_cast<const __nv_bfloat16*>(v16.data_ptr());
  p.g = g_read.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  p.dO = reinterpret_cast<const __nv_bfloat16*>(dO16.data_ptr());
  p.chunk_bos = chunk_bos.data_ptr<int64_t>();
  p.chunk_len = chunk_len.data_ptr<int32_t>();
  p.chunks = chunks;
  p.HV = int32_t(HV);
  std::vector<at::Tensor> out;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  if (pass == 0) {
    p.pass = chunk_bwd::Pass::kTransitions;
    for (int i = 0; i < 3; ++i) out.push_back(at::empty({chunks, HV, D, D}, f32));
    p.trans_D = out[0].data_ptr<float>();
    p.trans_B = out[1].data_ptr<float>();
    p.trans_Y = out[2].data_ptr<float>();
    err = run_chunk_local_grad<chunk_bwd::Pass::kTransitions>(p, stream);
  } else {
    TORCH_CHECK(states.has_value() && dstates.has_value(), "flashkda: the gradient pass needs states and dstates");
    // The kernel reads bf16 (its products' operand type); fp32 ones (from the scans) are rounded here.
    at::Tensor bf16[2];
    int i = 0;
    for (const auto& [t, name] : {std::pair{&*states, "states"}, {&*dstates, "dstates"}}) {
      check_cuda(*t, q, name);
      TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) && t->is_contiguous() &&
                      t->dim() == 4 && t->size(0) == chunks && t->size(1) == HV && t->size(2) == D && t->size(3) == D,
                  "flashkda: ", name, " must be contiguous float32 or bfloat16 [chunks, HV, 128, 128]");
      bf16[i++] = t->to(at::kBFloat16);
    }
    p.pass = chunk_bwd::Pass::kGradients;
    p.states = reinterpret_cast<const __nv_bfloat16*>(bf16[0].data_ptr());
    p.dstates = reinterpret_cast<const __nv_bfloat16*>(bf16[1].data_ptr());
    // The pass in value halves adds its two blocks' shares of dq, dk, dg and dbeta into zeros.
    const bool split = chunk_local_grad_in_value_halves(q.get_device());
    // Zeros where some token may lie in no chunk (varlen), and for the halves' sums; else the kernel
    // writes every one.
    const auto make = [every_token](const at::Tensor& like, at::ScalarType type, bool sum) {
      return every_token && !sum ? at::empty(like.sizes(), like.options().dtype(type))
                                 : at::zeros(like.sizes(), like.options().dtype(type));
    };
    const bool dv16 = v.scalar_type() == at::kBFloat16 || v.scalar_type() == at::kHalf;
    TORCH_CHECK(!overwrite_inputs || (every_token && !split),
                "flashkda: overwrite_inputs needs every_token and the whole gradients pass (not the value halves)");
    const bool raw_qk = qk_dtype.has_value();
    TORCH_CHECK(!raw_qk || !split, "flashkda: qk_dtype needs the whole gradients pass (not the value halves)");
    TORCH_CHECK(!raw_qk || *qk_dtype == at::kFloat || *qk_dtype == at::kBFloat16 || *qk_dtype == at::kHalf,
                "flashkda: qk_dtype must be float32, bfloat16 or float16");
    if (raw_qk && l2norm && !raw_in) {
      TORCH_CHECK(qk_rnorm.has_value(), "flashkda: qk_dtype with l2norm needs qk_rnorm");
      check_cuda(*qk_rnorm, q, "qk_rnorm");
      TORCH_CHECK(qk_rnorm->scalar_type() == at::kFloat && qk_rnorm->is_contiguous() &&
                      qk_rnorm->numel() == q.size(0) * HV * 2,
                  "flashkda: qk_rnorm must be contiguous float32 [rows, HV, 2]");
      p.qk_rnorm = qk_rnorm->data_ptr<float>();
    }
    const auto make_or_reuse = [&](const at::Tensor& input, at::ScalarType type, bool sum) {
      return overwrite_inputs && !raw_qk ? input : make(input, type, sum);
    };
    out.push_back(make_or_reuse(q, raw_qk ? *qk_dtype : at::kFloat, split));
    out.push_back(make_or_reuse(k, raw_qk ? *qk_dtype : at::kFloat, split));
    out.push_back(make(q, dv16 ? v.scalar_type() : at::kFloat, false));
    out.push_back(make_or_reuse(g, at::kFloat, split));  // dg: g's shape
    out.push_back(make_or_reuse(beta, at::kFloat, split));
    if (raw_qk) {
      p.dq_raw = out[0].data_ptr();
      p.dk_raw = out[1].data_ptr();
      p.qk_dtype = to_dtype(out[0], "dq");
      p.scale = float(scale);
      p.l2norm = l2norm;
    } else {
      p.dq = out[0].data_ptr<float>();
      p.dk = out[1].data_ptr<float>();
    }
    p.dv = out[2].data_ptr();
    p.dv_dtype = to_dtype(out[2], "dv");
    p.dg = out[3].data_ptr<float>();
    p.dbeta = out[4].data_ptr<float>();
    if (split)
      err = scalar_gate ? run_chunk_local_grad_split<true>(p, stream) : run_chunk_local_grad_split<false>(p, stream);
    else
      err = scalar_gate ? run_chunk_local_grad<chunk_bwd::Pass::kGradients, true>(p, stream)
                        : run_chunk_local_grad<chunk_bwd::Pass::kGradients, false>(p, stream);
  }
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunked backward kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The scans over chunks on the transitions pass's maps (chunk_bwd_params.h, ChunkScanParams): maps
// and offsets [chunks, HV, D, D], start [N, HV, D, D], all contiguous fp32; seq_first (int64) and
// seq_chunks (int32) [N]. Returns [out] (forward: the states at chunk starts) or [out, first]
// (reverse: the gradients of the states after chunks, and the initial states'); entries of out
// that no sequence's chunk names are left as allocated.
std::vector<at::Tensor> chunk_state_scan(const at::Tensor& maps, const at::Tensor& offsets, const at::Tensor& start,
                                         const at::Tensor& seq_first, const at::Tensor& seq_chunks, bool reverse) {
  TORCH_CHECK(maps.is_cuda(), "flashkda: maps must be a CUDA tensor");
  const int64_t D = chunk::kHeadDim;
  TORCH_CHECK(maps.dim() == 4 && maps.size(2) == D && maps.size(3) == D, "flashkda: maps must be [chunks, HV, 128, 128]");
  const int64_t HV = maps.size(1), N = seq_first.numel();
  for (const auto& [t, name] : {std::pair{&maps, "maps"}, {&offsets, "offsets"}, {&start, "start"}}) {
    check_cuda(*t, maps, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "flashkda: ", name, " must be contiguous, 16-byte aligned float32");
  }
  TORCH_CHECK(offsets.sizes() == maps.sizes(), "flashkda: offsets must have the shape of maps");
  TORCH_CHECK(start.dim() == 4 && start.size(0) == N && start.size(1) == HV && start.size(2) == D && start.size(3) == D,
              "flashkda: start must be [N, HV, 128, 128] with N = seq_first's length");
  check_cuda(seq_first, maps, "seq_first");
  check_cuda(seq_chunks, maps, "seq_chunks");
  TORCH_CHECK(seq_first.scalar_type() == at::kLong && seq_chunks.scalar_type() == at::kInt && seq_first.dim() == 1 &&
                  seq_first.is_contiguous() && seq_chunks.is_contiguous() && seq_chunks.sizes() == seq_first.sizes(),
              "flashkda: seq_first (int64) and seq_chunks (int32) must be contiguous [N] tensors");
  std::vector<at::Tensor> out{at::empty_like(maps)};
  if (reverse) out.push_back(at::empty_like(start));
  ChunkScanParams p{};
  p.maps = maps.data_ptr<float>();
  p.offsets = offsets.data_ptr<float>();
  p.start = start.data_ptr<float>();
  p.out = out[0].data_ptr<float>();
  p.first = reverse ? out[1].data_ptr<float>() : nullptr;
  p.seq_first = seq_first.data_ptr<int64_t>();
  p.seq_chunks = seq_chunks.data_ptr<int32_t>();
  p.N = N;
  p.HV = int32_t(HV);
  p.reverse = reverse;
  const c10::cuda::CUDAGuard guard(maps.device());
  const cudaError_t err = run_chunk_state_scan(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunk_state_scan launch failed: ", cudaGetErrorString(err));
  return out;
}

// The states at chunk starts and the gradients of the states after chunks, from the chunked forward
// kernels: the forward (its output dropped) writes the state before chunk j of sequence n into
// entry Σ_{m<n} ceil(len_m / 64) + j of `states` (its dense chunk states), then chunk_state_grad
// walks the forward's records backwards from `dht` and writes the gradient of the state after that
// chunk into the same entry of `dstates`. Returns the initial state's gradient [N, HV, D, D] fp32.
// The token inputs and options are chunk_fwd's; initial_state and dht key-first fp32 [N, HV, D, D];
// states and dstates key-first contiguous [entries, HV, D, D] of one dtype, fp32 or bf16 (entries
// past the last chunk are not written); dO [B, T, HV, D] in q's dtype. With `records` (chunk_fwd's,
// from a forward of the same inputs that wrote `states` key-first), that forward does not run
// again: chunk_state_grad walks its records.
at::Tensor chunk_state_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                            const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                            const std::optional<at::Tensor>& initial_state, double scale, int64_t gate_mode,
                            double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                            const at::Tensor& dO_in, const at::Tensor& dht, const at::Tensor& states,
                            const at::Tensor& dstates, const std::optional<at::Tensor>& records) {
  TORCH_CHECK(q.is_cuda(), "flashkda: q must be a CUDA tensor");
  const at::Tensor dO = rows16(dO_in);
  check_cuda(dO, q, "dO");
  TORCH_CHECK(dO.scalar_type() == q.scalar_type() && dO.sizes() == v.sizes(),
              "flashkda: dO must have v's shape and q's dtype");
  for (const auto& [t, name] : {std::pair{&states, "states"}, {&dstates, "dstates"}})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) && t->is_contiguous(), "flashkda: ",
                name, " must be contiguous float32 or bfloat16");
  TORCH_CHECK(dstates.sizes() == states.sizes() && dstates.scalar_type() == states.scalar_type(),
              "flashkda: dstates must have the shape and dtype of states");
  // On saved records nothing writes o (v stands in for it).
  const at::Tensor o = records.has_value() ? v : at::empty_like(v, at::MemoryFormat::Contiguous);
  ChunkForwardRun run;
  chunk_fwd_impl(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, std::nullopt, o, scale, gate_mode,
                 lower_bound, l2norm, beta_sigmoid, allow_neg_eigval, /*state_v_first=*/false, /*value_split=*/0,
                 /*segment_chunks=*/-1, states, std::nullopt, std::nullopt, std::nullopt, records, /*checked=*/false,
                 &run, records.has_value() ? ChunkLaunch::kIndexOnly : ChunkLaunch::kForward);
  ChunkParams p = run.params;
  const int64_t D = chunk::kHeadDim;
  check_cuda(dht, q, "dht");
  TORCH_CHECK(dht.scalar_type() == at::kFloat && dht.is_contiguous() && dht.dim() == 4 && dht.size(0) == p.N &&
                  dht.size(1) == p.HV && dht.size(2) == D && dht.size(3) == D,
              "flashkda: dht must be a contiguous float32 [N, HV, 128, 128] tensor");
  at::Tensor dS0 = at::empty_like(dht);
  p.v = dO.data_ptr();
  p.v_batch_stride = dO.stride(0), p.v_token_stride = dO.stride(1), p.v_head_stride = dO.stride(2);
  p.state_in = dht.data_ptr(), p.state_in_dtype = DType::kFloat32;
  p.state_out = dS0.data_ptr(), p.state_out_dtype = DType::kFloat32;
  p.state_slot_stride = int64_t(p.HV) * D * D;
  p.chunk_states = dstates.data_ptr();  // chunk_states_dtype, entries and stride: as states'
  p.has_initial_state = nullptr;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (q.scalar_type() == at::kBFloat16)
    err = p.value_split == 1 ? run_chunk_state_grad<__nv_bfloat16, chunk::kHeadDim>(p, stream)
                             : run_chunk_state_grad<__nv_bfloat16, chunk::kHeadDim / 2>(p, stream);
  else
    err = p.value_split == 1 ? run_chunk_state_grad<__half, chunk::kHeadDim>(p, stream)
                             : run_chunk_state_grad<__half, chunk::kHeadDim / 2>(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunk_state_grad launch failed: ", cudaGetErrorString(err));
  return dS0;
}

namespace {

// Safety net of the per-token passes: the raw inputs as set_token_params reads them, four
// channels per access (16-byte aligned rows, strides of whole 4-element groups).
void check_raw_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                      const std::optional<at::Tensor>& dt_bias) {
  TORCH_CHECK(q.is_cuda(), "flashkda: q must be a CUDA tensor");
  check_token_tensors(q, k, v, g, beta, A_log, dt_bias, std::nullopt, v);  // the forward's (v stands for o)
  const int64_t D = chunk::kHeadDim;
  TORCH_CHECK(q.sizes() == k.sizes() && q.size(3) == D && v.size(0) == q.size(0) && v.size(1) == q.size(1) &&
                  v.size(2) % q.size(2) == 0,
              "flashkda: q, k must be [B, T, H, 128] and v [B, T, HV, 128]");
  const bool scalar_gate = g.dim() == 3;
  TORCH_CHECK((scalar_gate || (g.dim() == 4 && g.size(3) == D)) && g.size(0) == q.size(0) && g.size(1) == q.size(1) &&
                  g.size(2) == v.size(2),
              "flashkda: g must be [B, T, HV, 128] or [B, T, HV]");
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == q.size(0) && beta.size(1) == q.size(1) && beta.size(2) == v.size(2),
              "flashkda: beta must be [B, T, HV]");
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&g, "g"}}) {
    if (t == &g && scalar_gate) continue;
    TORCH_CHECK(t->stride(0) % 4 == 0 && t->stride(1) % 4 == 0 && t->stride(2) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "flashkda: ", name, " must have 16-byte aligned rows of 128 contiguous elements");
  }
  TORCH_CHECK(!A_log.has_value() || A_log->numel() == v.size(2), "flashkda: A_log must have HV elements");
  TORCH_CHECK(!dt_bias.has_value() || dt_bias->numel() == v.size(2) * (scalar_gate ? 1 : D),
              "flashkda: dt_bias must have HV * 128 elements (HV with a scalar gate)");
}

ChunkBwdTokenParams token_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                                 const std::optional<at::Tensor>& dt_bias, double scale, int64_t gate_mode,
                                 double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval) {
  check_raw_tokens(q, k, v, g, beta, A_log, dt_bias);
  TORCH_CHECK(gate_mode >= 0 && gate_mode <= 2, "flashkda: gate_mode must be 0, 1 or 2");
  ChunkBwdTokenParams p{};
  const bool gated = gate_mode != int64_t(GateMode::kPrecomputed);
  set_token_params(p.tok, q, k, v, g, beta, gated ? opt(A_log) : nullptr, gated ? opt(dt_bias) : nullptr, nullptr, v,
                   scale, GateMode(gate_mode), lower_bound, l2norm, beta_sigmoid, allow_neg_eigval, false);
  p.qk_dtype = to_dtype(q, "q");
  p.rows = q.size(0) * q.size(1);
  return p;
}

}  // namespace

// The preprocessed inputs of the per-chunk passes: [q̂, k̂, ĝ, β̂, r], fp32, q̂ k̂ ĝ [B, T, HV, 128]
// (q̂ and k̂ per value head; ĝ of every key channel, or of a scalar gate [B, T, HV]), β̂ [B, T, HV],
// and with l2norm the 1 / norms of q's and k's rows per value head, r [B, T, HV, 2] (without it, r
// is not written) (chunk_bwd_params.h, ChunkBwdTokenParams). Without `qk` (the gradients pass takes
// the raw q and k), q̂, k̂ and r are empty [0] tensors and only ĝ and β̂ are computed.
std::vector<at::Tensor> chunk_bwd_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta,
                                         const std::optional<at::Tensor>& A_log,
                                         const std::optional<at::Tensor>& dt_bias, double scale, int64_t gate_mode,
                                         double lower_bound, bool l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                                         bool qk) {
  ChunkBwdTokenParams p =
      token_params(q, k, v, g, beta, A_log, dt_bias, scale, gate_mode, lower_bound, l2norm, beta_sigmoid, allow_neg_eigval);
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t B = q.size(0), T = q.size(1), HV = v.size(2), D = chunk::kHeadDim;
  const auto qk_sized = [&](std::initializer_list<int64_t> shape) {
    return qk ? at::empty(shape, f32) : at::empty({0}, f32);
  };
  std::vector<at::Tensor> out{qk_sized({B, T, HV, D}), qk_sized({B, T, HV, D}),
                              p.tok.scalar_gate ? at::empty({B, T, HV}, f32) : at::empty({B, T, HV, D}, f32),
                              at::empty({B, T, HV}, f32), qk_sized({B, T, HV, 2})};
  if (qk) {
    p.q_hat = out[0].data_ptr<float>();
    p.k_hat = out[1].data_ptr<float>();
    p.qk_rnorm = out[4].data_ptr<float>();
  }
  p.g_hat = out[2].data_ptr<float>();
  p.beta_hat = out[3].data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaError_t err = run_chunk_bwd_tokens(p, ChunkBwdTokenPass::kInputs, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunk_bwd_inputs launch failed: ", cudaGetErrorString(err));
  return out;
}

// The gradients of the raw inputs from those of chunk_bwd_inputs' outputs (fp32, its layouts):
// [dq, dk, dg, dbeta] contiguous in the shapes and dtypes of q, k, g, beta, then the per-tile sums
// [tiles, HV] of dA_log and [tiles, HV, 128] (a scalar gate: [tiles, HV]) of ddt_bias, fp32, empty
// where the gate does not use that parameter. Without dq_hat and dk_hat (the gradients pass wrote
// dq and dk: chunk_local_grad's qk_dtype), dq and dk are empty [0] tensors.
std::vector<at::Tensor> chunk_bwd_input_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& g, const at::Tensor& beta,
                                              const std::optional<at::Tensor>& A_log,
                                              const std::optional<at::Tensor>& dt_bias,
                                              const std::optional<at::Tensor>& dq_hat,
                                              const std::optional<at::Tensor>& dk_hat, const at::Tensor& dg_hat,
                                              const at::Tensor& dbeta_hat, double scale, int64_t gate_mode,
                                              double lower_bound, bool l2norm, bool beta_sigmoid,
                                              bool allow_neg_eigval) {
  ChunkBwdTokenParams p =
      token_params(q, k, v, g, beta, A_log, dt_bias, scale, gate_mode, lower_bound, l2norm, beta_sigmoid, allow_neg_eigval);
  const int64_t HV = v.size(2), D = chunk::kHeadDim;
  const bool qk = dq_hat.has_value();
  TORCH_CHECK(qk == dk_hat.has_value(), "flashkda: dq_hat and dk_hat come together");
  for (const auto& [t, name, per_channel] :
       {std::tuple{qk ? &*dq_hat : nullptr, "dq_hat", true}, {qk ? &*dk_hat : nullptr, "dk_hat", true},
        {&dg_hat, "dg_hat", !p.tok.scalar_gate}, {&dbeta_hat, "dbeta_hat", false}}) {
    if (t == nullptr) continue;
    check_cuda(*t, q, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == p.rows * HV * (per_channel ? D : 1) &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "flashkda: ", name, " must be contiguous float32 of ", per_channel ? "[B, T, HV, 128]" : "[B, T, HV]");
  }
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t tiles = (p.rows + kBwdTokenTileRows - 1) / kBwdTokenTileRows;
  std::vector<at::Tensor> out{qk ? at::empty(q.sizes(), q.options()) : at::empty({0}, q.options()),
                              qk ? at::empty(k.sizes(), k.options()) : at::empty({0}, k.options()),
                              at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous)),
                              at::empty(beta.sizes(), beta.options().memory_format(at::MemoryFormat::Contiguous)),
                              at::empty({p.tok.A_log != nullptr ? tiles : 0, HV}, f32),
                              at::empty({p.tok.dt_bias != nullptr ? tiles : 0, HV * (p.tok.scalar_gate ? 1 : D)}, f32)};
  p.dq_hat = qk ? dq_hat->data_ptr<float>() : nullptr;
  p.dk_hat = qk ? dk_hat->data_ptr<float>() : nullptr;
  p.dg_hat = dg_hat.data_ptr<float>();
  p.dbeta_hat = dbeta_hat.data_ptr<float>();
  p.dq = qk ? out[0].data_ptr() : nullptr;
  p.dk = qk ? out[1].data_ptr() : nullptr;
  p.dg = out[2].data_ptr();
  p.dbeta = out[3].data_ptr();
  p.dA_log_part = p.tok.A_log != nullptr ? out[4].data_ptr<float>() : nullptr;
  p.ddt_bias_part = p.tok.dt_bias != nullptr ? out[5].data_ptr<float>() : nullptr;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaError_t err = run_chunk_bwd_tokens(p, ChunkBwdTokenPass::kGrads, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunk_bwd_input_grads launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace flashkda::binding
