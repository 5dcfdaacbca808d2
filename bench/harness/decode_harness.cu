// Standalone timing of the sm_90 decode kernel (decode_bulk.cuh) for one tuning, without PyTorch:
// bench/test_decode.py's case (H = 32, K = V = 128, bf16 tokens, V-first pool of N + 8 slots with
// shuffled int32 slot indices, lower-bound gate with A_log / dt_bias, l2norm, beta sigmoid), fp32 or
// bf16 pool. Prints the median kernel time of back-to-back launches and the fraction of the floor
// (state read and written once plus the token tensors, at the measured copy bandwidth).
//   nvcc -std=c++17 -O3 -Icsrc -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -DCONSUMER_WARPS=4 -DITEM_ROWS=32 -DBLOCKS_PER_SM=2 -DSTATE=float bench/harness/decode_harness.cu \
//        -o dh && ./dh 1024
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "flashkda/decode_bulk.cuh"
#include "harness.cuh"

#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 4
#endif
#ifndef ITEM_ROWS
#define ITEM_ROWS 32
#endif
#ifndef BLOCKS_PER_SM
#define BLOCKS_PER_SM 2
#endif
#ifndef STATE
#define STATE float
#endif
using Tune = flashkda::decode_bulk::Tuning<CONSUMER_WARPS, ITEM_ROWS, BLOCKS_PER_SM>;
using StateT = STATE;

template <typename T>
__global__ void fill_state(T* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = T(0.01f * float(int(i % 199) - 99) / 99.f);
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? std::atoi(argv[1]) : 1024, H = 32, D = 128, slots = N + 8;
  const size_t tok = size_t(N) * H * D, state = size_t(slots) * H * D * D;
  __nv_bfloat16 *q, *k, *v, *g, *beta, *o;
  StateT* pool;
  float *A_log, *dt_bias;
  int32_t* idx;
  for (auto** p : {&q, &k, &v, &g, &o}) CHECK(cudaMalloc(p, tok * 2));
  CHECK(cudaMalloc(&beta, size_t(N) * H * 2));
  CHECK(cudaMalloc(&pool, state * sizeof(StateT)));
  CHECK(cudaMalloc(&A_log, H * 4)); CHECK(cudaMalloc(&dt_bias, H * D * 4)); CHECK(cudaMalloc(&idx, N * 4));
  fill_normal_bf16<<<512, 256>>>(q, tok, 1, 1.f); fill_normal_bf16<<<512, 256>>>(k, tok, 2, 1.f);
  fill_normal_bf16<<<512, 256>>>(v, tok, 3, 1.f);
  fill_normal_bf16<<<512, 256>>>(g, tok, 4, 1.f); fill_normal_bf16<<<512, 256>>>(beta, size_t(N) * H, 5, 1.f);
  fill_state<<<1024, 256>>>(pool, state);
  CHECK(cudaMemset(A_log, 0, H * 4)); CHECK(cudaMemset(dt_bias, 0, H * D * 4));
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(0));
  CHECK(cudaMemcpy(idx, perm.data(), N * 4, cudaMemcpyHostToDevice));

  flashkda::RecurrentParams p{};
  p.q = q; p.k = k; p.v = v; p.g = g; p.beta = beta; p.o = o;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.g_batch_stride = p.o_batch_stride = int64_t(H) * D;
  p.q_token_stride = p.k_token_stride = p.v_token_stride = p.g_token_stride = p.o_token_stride = int64_t(H) * D;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.g_head_stride = p.o_head_stride = D;
  p.beta_batch_stride = H; p.beta_token_stride = H;
  p.A_log = A_log; p.dt_bias = dt_bias;
  p.state_in = pool; p.state_out = pool; p.slot_indices = idx; p.idx_row_stride = 1; p.num_slots = slots;
  p.B = N; p.T = 1; p.N = N; p.H = H; p.HV = H; p.D = D;
  p.scale = 1.f / sqrtf(float(D)); p.lower_bound = -5.f; p.beta_scale = 1.f;
  p.gate_mode = flashkda::GateMode::kLowerBound; p.l2norm = true; p.beta_sigmoid = true; p.state_v_first = true;
  p.g_dtype = p.beta_dtype = flashkda::DType::kBFloat16;
  p.state_in_dtype = p.state_out_dtype = sizeof(StateT) == 4 ? flashkda::DType::kFloat32 : flashkda::DType::kBFloat16;
  p.idx_type = flashkda::IndexType::kInt32;
  int dev = 0;
  CHECK(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, dev));

  // Copy bandwidth (read + write) for the floor.
  const size_t cbytes = size_t(1) << 31;
  void *x, *y;
  CHECK(cudaMalloc(&x, cbytes)); CHECK(cudaMalloc(&y, cbytes));
  const float copy_ms = median_ms([&] { cudaMemcpyAsync(y, x, cbytes, cudaMemcpyDeviceToDevice); }, 10);
  const double bw = 2.0 * cbytes / (copy_ms * 1e-3);
  CHECK(cudaFree(x)); CHECK(cudaFree(y));

  bool launched = false;
  CHECK((flashkda::run_decode_bulk_tuned<__nv_bfloat16, StateT, Tune>(p, 0, launched)));
  CHECK(cudaDeviceSynchronize());
  if (!launched) {
    std::printf("tuning not launched (no sm_90 image or case not covered)\n");
    return 1;
  }
  const float ms = median_ms([&] { flashkda::run_decode_bulk_tuned<__nv_bfloat16, StateT, Tune>(p, 0, launched); }, 50);
  CHECK(cudaGetLastError());
  const double bytes = 2.0 * N * H * D * D * sizeof(StateT) + double(tok) * 2 * 5 + N * H * 2;
  const double floor_ms = bytes / bw * 1e3;
  using S = flashkda::decode_bulk::Shape<__nv_bfloat16, StateT, Tune>;
  std::printf("state %-5s tuning (consumers %d, rows %2d, blocks/SM %d, stages %d) N=%4d: %.4f ms, floor %.4f ms "
              "(%.0f%%), copy %.2f TB/s\n",
              sizeof(StateT) == 4 ? "fp32" : "bf16", Tune::kConsumerWarps, Tune::kItemRows, Tune::kBlocksPerSm,
              S::kStages, N, ms, floor_ms, 100.0 * floor_ms / ms, bw / 1e12);
  return 0;
}
