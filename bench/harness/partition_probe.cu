// How chunk_prepare and chunk_recurrence share the GPU when they run side by side on separate SMs:
// chunk_prepare (T = 8192, H = 96, bf16, the benchmark's gate) on one stream while a long
// chunk_recurrence (R chains of TR / 64 chunks, one block per SM, records prepared beforehand) holds
// R SMs on another. Prints the prepare time alone and beside the recurrence (with the ideal
// 132 / (132 − R) scaling) and the recurrence's time per chunk alone and beside it. No PyTorch:
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG -Icsrc -Ibench/harness \
//        -gencode arch=compute_90a,code=sm_90a bench/harness/partition_probe.cu \
//        csrc/kernels/chunk_prepare_bf16.cu csrc/kernels/chunk_recurrence_bf16_bv128.cu -o partition_probe
//   ./partition_probe R [TR]
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cmath>
#include "flashkda/api.h"
#include "chunk_case.cuh"
#include "harness.cuh"

using Elem = __nv_bfloat16;

int main(int argc, char** argv) {
  const int T = 8192, H = 96, D = flashkda::chunk::kHeadDim, TR = argc > 2 ? std::atoi(argv[2]) : 65536;
  const int R = argc > 1 ? std::atoi(argv[1]) : 24;
  const int HM = H > R ? H : R;
  const size_t n_tok = size_t(TR > T ? TR : T) * HM * D;
  Elem *q, *k, *g, *beta, *o;
  float *A_log, *dt_bias;
  CHECK(cudaMalloc(&q, n_tok * 2)); CHECK(cudaMalloc(&k, n_tok * 2)); CHECK(cudaMalloc(&g, n_tok * 2));
  CHECK(cudaMalloc(&o, n_tok * 2)); CHECK(cudaMalloc(&beta, n_tok / D * 2));
  CHECK(cudaMalloc(&A_log, HM * 4)); CHECK(cudaMalloc(&dt_bias, HM * D * 4));
  fill_normal_bf16<<<1024, 256>>>(q, n_tok, 1, 1.f);
  fill_normal_bf16<<<1024, 256>>>(k, n_tok, 2, 1.f);
  fill_normal_bf16<<<1024, 256>>>(g, n_tok, 3, 1.f);
  fill_normal_bf16<<<1024, 256>>>(beta, n_tok / D, 4, 1.f);
  CHECK(cudaMemset(A_log, 0, HM * 4)); CHECK(cudaMemset(dt_bias, 0, HM * D * 4));
  flashkda::ChunkParams pp = chunk_case_params(T, H, q, k, g, beta, A_log, dt_bias, o);
  flashkda::ChunkParams pr = chunk_case_params(TR, R, q, k, g, beta, A_log, dt_bias, o);
  CHECK(cudaDeviceGetAttribute(&pp.num_sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t rb = flashkda::chunk::WorkspaceLayout::kRecordBytes;
  CHECK(cudaMalloc(&pp.workspace, size_t(pp.num_chunk_slots) * H * rb));
  CHECK(cudaMalloc(&pr.workspace, size_t(pr.num_chunk_slots) * R * rb));
  CHECK(flashkda::run_chunk_prepare<Elem>(pr, 0));
  CHECK(cudaDeviceSynchronize());
  cudaStream_t sa, sb;
  CHECK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  cudaEvent_t a0, a1, b0, b1;
  cudaEventCreate(&a0); cudaEventCreate(&a1); cudaEventCreate(&b0); cudaEventCreate(&b1);
  auto run = [&](bool rec, bool prep, float& tr, float& tp) {
    if (rec) { cudaEventRecord(a0, sa); flashkda::run_chunk_recurrence<Elem, 128>(pr, sa); cudaEventRecord(a1, sa); }
    if (prep) { cudaEventRecord(b0, sb); flashkda::run_chunk_prepare<Elem>(pp, sb); cudaEventRecord(b1, sb); }
    cudaDeviceSynchronize();
    tr = tp = 0;
    if (rec) cudaEventElapsedTime(&tr, a0, a1);
    if (prep) cudaEventElapsedTime(&tp, b0, b1);
  };
  float tr, tp;
  for (int i = 0; i < 3; ++i) run(true, true, tr, tp);
  std::vector<float> pa, ra, pc, rc;
  for (int i = 0; i < 9; ++i) {
    run(false, true, tr, tp); pa.push_back(tp);
    run(true, false, tr, tp); ra.push_back(tr);
    run(true, true, tr, tp); pc.push_back(tp); rc.push_back(tr);
  }
  CHECK(cudaGetLastError());
  auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  const int chunks = pr.chunks_per_seq;
  std::printf("R=%3d: prepare alone %.3f ms, with recurrence %.3f ms (ideal %.3f); recurrence %.2f us/chunk alone, "
              "%.2f us/chunk overall with prepare\n", R, med(pa), med(pc), med(pa) * pp.num_sms / (pp.num_sms - R),
              1e3 * med(ra) / chunks, 1e3 * med(rc) / chunks);
  return 0;
}
