// Standalone timing of chunk_prepare without PyTorch: T tokens, H heads (argv), bf16 inputs, the
// benchmark's lower-bound gate with A_log / dt_bias, l2norm and beta sigmoid. argv[3], a path: the
// records are written there after the timing (variants that only reorder work must write the
// same bytes: compare two builds' files with cmp). With PHASE_CLOCKS,
// chunk_prepare.cuh is the copy patched by phase_clocks.py and thread 0 of every block adds the
// clock cycles of each phase to g_phase_cycles.
//   nvcc -std=c++17 -O3 -I<csrc> -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        prepare_harness.cu -o prepare_harness && ./prepare_harness 8192 96
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifdef PHASE_CLOCKS
__device__ unsigned long long g_phase_cycles[16];
#endif
#include "chunk_case.cuh"
#include "flashkda/prefill/chunk_prepare.cuh"
#include "harness.cuh"

int main(int argc, char** argv) {
  const int T = argc > 1 ? std::atoi(argv[1]) : 8192, H = argc > 2 ? std::atoi(argv[2]) : 96;
  const int D = flashkda::chunk::kHeadDim;
  const size_t n_tok = size_t(T) * H * D;
  __nv_bfloat16 *q, *k, *g, *beta;
  float *A_log, *dt_bias;
  CHECK(cudaMalloc(&q, n_tok * 2)); CHECK(cudaMalloc(&k, n_tok * 2)); CHECK(cudaMalloc(&g, n_tok * 2));
  CHECK(cudaMalloc(&beta, size_t(T) * H * 2));
  CHECK(cudaMalloc(&A_log, H * 4)); CHECK(cudaMalloc(&dt_bias, H * D * 4));
  fill_normal_bf16<<<1024, 256>>>(q, n_tok, 1, 1.f);
  fill_normal_bf16<<<1024, 256>>>(k, n_tok, 2, 1.f);
  fill_normal_bf16<<<1024, 256>>>(g, n_tok, 3, 1.f);
  fill_normal_bf16<<<1024, 256>>>(beta, size_t(T) * H, 4, 1.f);
  CHECK(cudaMemset(A_log, 0, H * 4)); CHECK(cudaMemset(dt_bias, 0, H * D * 4));

  flashkda::ChunkParams p = chunk_case_params(T, H, q, k, g, beta, A_log, dt_bias);
  CHECK(cudaMalloc(&p.workspace, size_t(p.num_chunk_slots) * H * flashkda::chunk::WorkspaceLayout::kRecordBytes));

  cudaError_t launch_err = cudaSuccess;
  const float med = median_ms([&] { launch_err = flashkda::run_chunk_prepare<__nv_bfloat16>(p, 0); }, 20);
  CHECK(launch_err);
  CHECK(cudaDeviceSynchronize());
  const double bytes = double(n_tok) * 6 + double(p.num_chunk_slots) * H * flashkda::chunk::WorkspaceLayout::kRecordBytes;
  std::printf("chunk_prepare T=%d H=%d: median %.3f ms (%.2f TB/s of inputs + records)\n", T, H, med,
              bytes / (med * 1e-3) / 1e12);
  if (argc > 3) {
    FILE* f = std::fopen(argv[3], "wb");
    const bool ok = append_device_bytes(f, p.workspace,
                                        size_t(p.num_chunk_slots) * H * flashkda::chunk::WorkspaceLayout::kRecordBytes);
    if (f != nullptr) std::fclose(f);
    if (!ok) {
      std::fprintf(stderr, "cannot write %s\n", argv[3]);
      return 1;
    }
  }
#ifdef PHASE_CLOCKS
  unsigned long long cyc[16];
  CHECK(cudaMemcpyFromSymbol(cyc, g_phase_cycles, sizeof(cyc)));
  print_phase_cycles(cyc, 16, 23.0, double(p.num_chunk_slots) * H);  // 23 launches: 20 timed, 3 warm-up
#endif
  return 0;
}
