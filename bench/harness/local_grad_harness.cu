// Standalone timing of chunk_local_grad's gradients pass without PyTorch: one sequence of T tokens,
// HV heads (argv), the preprocessed fp32 inputs the pass reads (q̂, k̂ of about unit norm, log decays
// in [-0.2, 0], β in [0, 1]), bf16 v, dO and chunk-boundary states. With PHASE_CLOCKS,
// chunk_local_grad.cuh is the copy patched by phase_clocks.py (target local_grad) and thread 0 of
// every block adds the clock cycles of each phase to g_phase_cycles. argv[3]: the gate, `channel`
// (KDA's log decay per key channel, the default) or `scalar` (GDN's one per token and head), with
// `-raw` (e.g. `scalar-raw`) the raw q's and k's gradients written in bf16 through the scale and the
// l2 norm (ChunkBwdParams::dq_raw; 1 / norms in [0.5, 1.5]) instead of fp32 dq̂ and dk̂; with
// `-rawin` (`scalar-rawin`) also from the raw bf16 q and k (ChunkBwdParams::raw_q, N(0, 1) entries),
// which the pass normalises itself.
// argv[4], a path: dq, dk, dv, dg and dβ (fp32, in that order; with `-raw` dq and dk are the raw
// q's and k's bf16 gradients widened) are written there after the timing, for compare_outputs.py.
//   nvcc -std=c++17 -O3 -I<csrc> -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        local_grad_harness.cu -o local_grad_harness && ./local_grad_harness 8192 32 scalar
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef PHASE_CLOCKS
__device__ unsigned long long g_phase_cycles[32];
#endif
#include "flashkda/backward/chunk_local_grad.cuh"
#include "harness.cuh"

// x[i] = lo + (hi - lo) · u, u from the bf16 normal fill's hash through a logistic map to [0, 1].
__global__ void to_range(const __nv_bfloat16* n, float* x, size_t count, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    x[i] = lo + (hi - lo) / (1.f + __expf(-__bfloat162float(n[i])));
}

int main(int argc, char** argv) {
  const int T = argc > 1 ? std::atoi(argv[1]) : 8192, HV = argc > 2 ? std::atoi(argv[2]) : 32;
  const bool scalar_gate = argc > 3 && std::strncmp(argv[3], "scalar", 6) == 0;
  const bool raw_qk = argc > 3 && std::strstr(argv[3], "-raw") != nullptr;
  const bool raw_in = argc > 3 && std::strstr(argv[3], "-rawin") != nullptr;
  constexpr int D = flashkda::chunk::kHeadDim, C = flashkda::chunk::kChunk;
  const int chunks = (T + C - 1) / C;
  const size_t n_tok = size_t(T) * HV * D, n_state = size_t(chunks) * HV * D * D;
  __nv_bfloat16 *noise, *v, *dO, *states, *dstates;
  float *q, *k, *g, *beta, *dq, *dk, *dv, *dg, *dbeta;
  int64_t* bos;
  int32_t* len;
  CHECK(cudaMalloc(&noise, n_tok * 2));
  for (float** x : {&q, &k, &g, &dq, &dk, &dv, &dg}) CHECK(cudaMalloc(x, n_tok * 4));
  for (float** x : {&beta, &dbeta}) CHECK(cudaMalloc(x, size_t(T) * HV * 4));
  for (__nv_bfloat16** x : {&v, &dO}) CHECK(cudaMalloc(x, n_tok * 2));
  for (__nv_bfloat16** x : {&states, &dstates}) CHECK(cudaMalloc(x, n_state * 2));
  CHECK(cudaMalloc(&bos, chunks * 8));
  CHECK(cudaMalloc(&len, chunks * 4));
  const float unit = 1.f / std::sqrt(float(D));  // q̂, k̂ of about unit norm
  fill_normal_bf16<<<1024, 256>>>(noise, n_tok, 1, 1.f);
  to_range<<<1024, 256>>>(noise, q, n_tok, -3.f * unit, 3.f * unit);
  fill_normal_bf16<<<1024, 256>>>(noise, n_tok, 2, 1.f);
  to_range<<<1024, 256>>>(noise, k, n_tok, -3.f * unit, 3.f * unit);
  fill_normal_bf16<<<1024, 256>>>(noise, n_tok, 3, 1.f);
  to_range<<<1024, 256>>>(noise, g, n_tok, -0.2f, 0.f);
  to_range<<<1024, 256>>>(noise, beta, size_t(T) * HV, 0.f, 1.f);
  fill_normal_bf16<<<1024, 256>>>(v, n_tok, 4, 1.f);
  fill_normal_bf16<<<1024, 256>>>(dO, n_tok, 5, 1.f);
  fill_normal_bf16<<<1024, 256>>>(states, n_state, 6, 0.1f);
  fill_normal_bf16<<<1024, 256>>>(dstates, n_state, 7, 0.1f);
  std::vector<int64_t> h_bos(chunks);
  std::vector<int32_t> h_len(chunks);
  for (int c = 0; c < chunks; ++c) h_bos[c] = int64_t(c) * C, h_len[c] = std::min(C, T - c * C);
  CHECK(cudaMemcpy(bos, h_bos.data(), chunks * 8, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(len, h_len.data(), chunks * 4, cudaMemcpyHostToDevice));

  flashkda::ChunkBwdParams p{};
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.dO = dO;
  p.chunk_bos = bos, p.chunk_len = len, p.chunks = chunks, p.HV = HV;
  p.pass = flashkda::chunk_bwd::Pass::kGradients;
  p.states = states, p.dstates = dstates;
  p.dq = dq, p.dk = dk, p.dv = dv, p.dg = dg, p.dbeta = dbeta;
  float* rnorm = nullptr;
  if (raw_qk) {  // dq, dk of the raw q and k, bf16 (in the first half of the fp32 buffers)
    CHECK(cudaMalloc(&rnorm, size_t(T) * HV * 2 * 4));
    fill_normal_bf16<<<1024, 256>>>(noise, size_t(T) * HV * 2, 8, 1.f);
    to_range<<<1024, 256>>>(noise, rnorm, size_t(T) * HV * 2, 0.5f, 1.5f);
    p.dq = p.dk = nullptr;
    p.dq_raw = dq, p.dk_raw = dk, p.qk_dtype = flashkda::DType::kBFloat16;
    p.qk_rnorm = rnorm, p.scale = 1.f / std::sqrt(float(D)), p.l2norm = true;
  }
  if (raw_in) {  // the raw bf16 q and k in place of q̂ and k̂
    __nv_bfloat16 *raw_q, *raw_k;
    CHECK(cudaMalloc(&raw_q, n_tok * 2));
    CHECK(cudaMalloc(&raw_k, n_tok * 2));
    fill_normal_bf16<<<1024, 256>>>(raw_q, n_tok, 9, 1.f);
    fill_normal_bf16<<<1024, 256>>>(raw_k, n_tok, 10, 1.f);
    p.q = p.k = nullptr;
    p.raw_q = raw_q, p.raw_k = raw_k;
  }
  cudaError_t launch_err = cudaSuccess;
  using flashkda::chunk_bwd::Pass;
  const float med = median_ms([&] {
    launch_err = scalar_gate ? flashkda::run_chunk_local_grad<Pass::kGradients, true>(p, 0)
                             : flashkda::run_chunk_local_grad<Pass::kGradients, false>(p, 0);
  }, 10);
  CHECK(launch_err);
  CHECK(cudaDeviceSynchronize());
  std::printf("chunk_local_grad gradients, %s gate%s, T=%d HV=%d: median %.3f ms (%.1f us per block wave)\n", scalar_gate ? "scalar" : "channel", raw_in ? ", raw q/k in and gradients" : raw_qk ? ", raw q/k gradients" : "", T, HV, med,
              1e3 * med / ((double(chunks) * HV + 131) / 132));
  if (argc > 4) {
    FILE* f = std::fopen(argv[4], "wb");
    bool ok = true;
    const size_t n_gate = scalar_gate ? size_t(T) * HV : n_tok;
    for (float* x : {dq, dk}) {  // the raw gradients (bf16, first half of the buffer) widened on the host
      if (!raw_qk) {
        ok = ok && append_device_bytes(f, x, n_tok * 4);
        continue;
      }
      std::vector<__nv_bfloat16> h(n_tok);
      std::vector<float> wide(n_tok);
      ok = ok && cudaMemcpy(h.data(), x, n_tok * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
      for (size_t i = 0; i < n_tok; ++i) wide[i] = __bfloat162float(h[i]);
      ok = ok && f != nullptr && std::fwrite(wide.data(), 4, n_tok, f) == n_tok;
    }
    for (const auto& [x, n] : {std::pair{dv, n_tok}, {dg, n_gate}, {dbeta, size_t(T) * HV}})
      ok = ok && append_device_bytes(f, x, n * 4);
    if (f != nullptr) std::fclose(f);
    if (!ok) {
      std::fprintf(stderr, "cannot write %s\n", argv[4]);
      return 1;
    }
  }
#ifdef PHASE_CLOCKS
  unsigned long long cyc[32];
  CHECK(cudaMemcpyFromSymbol(cyc, g_phase_cycles, sizeof(cyc)));
  print_phase_cycles(cyc, 32, 13.0, double(chunks) * HV);  // 13 launches: 10 timed, 3 warm-up
#endif
  return 0;
}
