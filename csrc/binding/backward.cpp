// The chunked backward's kernel pass (chunk_local_grad), after flashkda/autograd.py preprocessed the
// inputs and laid out the chunks; its checks here are a safety net against memory errors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <vector>

#include "binding/binding.h"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda::binding {

namespace {

void check_tokens(const at::Tensor& t, const at::Tensor& q, const char* name, bool per_channel) {
  check_cuda(t, q, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "flashkda: ", name, " must be contiguous float32");
  TORCH_CHECK(per_channel ? (t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) &&
                             t.size(2) == chunk::kHeadDim)
                          : (t.dim() == 2 && t.size(0) == q.size(0) && t.size(1) == q.size(1)),
              "flashkda: ", name, " must be [rows, HV", per_channel ? ", 128]" : "]", " like q");
}

}  // namespace

// Pass 0 (transitions): returns [D, B, Y], each [chunks, HV, D, D] fp32. Pass 1 (gradients, with
// `states` and `dstates` [chunks, HV, D, D] fp32): returns [dq, dk, dv, dg, dbeta] in the token
// layout of the inputs (zeros for tokens in no chunk; `every_token`: the chunks cover every token,
// and nothing is zero-filled). Inputs: chunk_bwd_params.h.
std::vector<at::Tensor> chunk_local_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta, const at::Tensor& dO,
                                         const at::Tensor& chunk_bos, const at::Tensor& chunk_len, int64_t pass,
                                         const std::optional<at::Tensor>& states,
                                         const std::optional<at::Tensor>& dstates, bool every_token) {
  TORCH_CHECK(q.is_cuda(), "flashkda: q must be a CUDA tensor");
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&dO, "dO"}})
    check_tokens(*t, q, name, true);
  check_tokens(beta, q, "beta", false);
  check_cuda(chunk_bos, q, "chunk_bos");
  check_cuda(chunk_len, q, "chunk_len");
  TORCH_CHECK(chunk_bos.scalar_type() == at::kLong && chunk_len.scalar_type() == at::kInt && chunk_bos.dim() == 1 &&
                  chunk_bos.is_contiguous() && chunk_len.is_contiguous() && chunk_len.sizes() == chunk_bos.sizes(),
              "flashkda: chunk_bos (int64) and chunk_len (int32) must be contiguous [chunks] tensors");
  TORCH_CHECK(pass == 0 || pass == 1, "flashkda: pass must be 0 (transitions) or 1 (gradients)");
  const int64_t chunks = chunk_bos.size(0), HV = q.size(1), D = chunk::kHeadDim;
  const auto f32 = q.options();
  ChunkBwdParams p{};
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.g = g.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  p.dO = dO.data_ptr<float>();
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
    for (const auto& [t, name] : {std::pair{&*states, "states"}, {&*dstates, "dstates"}}) {
      check_cuda(*t, q, name);
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 4 && t->size(0) == chunks &&
                      t->size(1) == HV && t->size(2) == D && t->size(3) == D,
                  "flashkda: ", name, " must be contiguous float32 [chunks, HV, 128, 128]");
    }
    p.pass = chunk_bwd::Pass::kGradients;
    p.states = states->data_ptr<float>();
    p.dstates = dstates->data_ptr<float>();
    // Zeros only where some token may lie in no chunk (varlen); else the kernel writes every one.
    const auto make = [every_token](const at::Tensor& like) {
      return every_token ? at::empty_like(like) : at::zeros_like(like);
    };
    for (int i = 0; i < 4; ++i) out.push_back(make(q));
    out.push_back(make(beta));
    p.dq = out[0].data_ptr<float>();
    p.dk = out[1].data_ptr<float>();
    p.dv = out[2].data_ptr<float>();
    p.dg = out[3].data_ptr<float>();
    p.dbeta = out[4].data_ptr<float>();
    err = run_chunk_local_grad<chunk_bwd::Pass::kGradients>(p, stream);
  }
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunked backward kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The scans over chunks on the transitions pass's maps: maps [J, NH, D, D], offsets [J, NH, D, D],
// start [NH, D, D], all contiguous fp32. Returns [out] (forward: the states at chunk starts) or
// [out, first] (reverse: the gradients of the states after chunks, and the initial state's).
std::vector<at::Tensor> chunk_state_scan(const at::Tensor& maps, const at::Tensor& offsets, const at::Tensor& start,
                                         bool reverse) {
  TORCH_CHECK(maps.is_cuda(), "flashkda: maps must be a CUDA tensor");
  const int64_t D = chunk::kHeadDim;
  TORCH_CHECK(maps.dim() == 4 && maps.size(2) == D && maps.size(3) == D, "flashkda: maps must be [J, NH, 128, 128]");
  const int64_t J = maps.size(0), NH = maps.size(1);
  for (const auto& [t, name] : {std::pair{&maps, "maps"}, {&offsets, "offsets"}, {&start, "start"}}) {
    check_cuda(*t, maps, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "flashkda: ", name, " must be contiguous, 16-byte aligned float32");
  }
  TORCH_CHECK(offsets.sizes() == maps.sizes(), "flashkda: offsets must have the shape of maps");
  TORCH_CHECK(start.dim() == 3 && start.size(0) == NH && start.size(1) == D && start.size(2) == D,
              "flashkda: start must be [NH, 128, 128]");
  std::vector<at::Tensor> out{at::empty_like(maps)};
  if (reverse) out.push_back(at::empty_like(start));
  ChunkScanParams p{};
  p.maps = maps.data_ptr<float>();
  p.offsets = offsets.data_ptr<float>();
  p.start = start.data_ptr<float>();
  p.out = out[0].data_ptr<float>();
  p.first = reverse ? out[1].data_ptr<float>() : nullptr;
  p.J = J;
  p.NH = NH;
  p.reverse = reverse;
  const c10::cuda::CUDAGuard guard(maps.device());
  if (reverse && J == 0) out[1].copy_(start);
  const cudaError_t err = run_chunk_state_scan(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashkda: chunk_state_scan launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace flashkda::binding
