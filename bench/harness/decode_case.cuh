// The decode benchmark's case for the standalone harnesses (bench/test_decode.py's rows): H = 32,
// K = V = 128, bf16 q / k / v / g / beta, a V-first pool of N + 8 slots of StateT with int32 slot
// indices (shuffled unless asked otherwise), lower-bound gate -5 with A_log / dt_bias, l2norm and
// beta sigmoid, T tokens per sequence (one by default; more: speculative-decoding verification).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "flashkda/common/recurrent_params.h"
#include "harness.cuh"
#include "token_case.cuh"

template <typename T>
__global__ void fill_state(T* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = T(0.01f * float(int(i % 199) - 99) / 99.f);
}

template <typename StateT>
struct DecodeCase {
  static constexpr int H = 32, D = 128;
  int N = 0, T = 1, slots = 0;
  size_t tok = 0, state = 0;  // elements of a token tensor [N, T, H, D], of the pool
  __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *o = nullptr;
  StateT* pool = nullptr;
  float *A_log = nullptr, *dt_bias = nullptr;
  int32_t* idx = nullptr;
  flashkda::RecurrentParams p{};

  // Allocates and fills everything; returns false (after printing the failing call) on an error.
  bool init(int n, bool shuffled, int tokens = 1) {
    N = n, T = tokens, slots = n + 8;
    tok = size_t(N) * T * H * D, state = size_t(slots) * H * D * D;
    auto ok = [](cudaError_t e) {
      if (e != cudaSuccess) std::fprintf(stderr, "decode case: %s\n", cudaGetErrorString(e));
      return e == cudaSuccess;
    };
    for (auto** ptr : {&q, &k, &v, &g, &o})
      if (!ok(cudaMalloc(ptr, tok * 2))) return false;
    if (!ok(cudaMalloc(&beta, size_t(N) * T * H * 2)) || !ok(cudaMalloc(&pool, state * sizeof(StateT))) ||
        !ok(cudaMalloc(&A_log, H * 4)) || !ok(cudaMalloc(&dt_bias, H * D * 4)) || !ok(cudaMalloc(&idx, N * 4)))
      return false;
    fill_normal_bf16<<<512, 256>>>(q, tok, 1, 1.f);
    fill_normal_bf16<<<512, 256>>>(k, tok, 2, 1.f);
    fill_normal_bf16<<<512, 256>>>(v, tok, 3, 1.f);
    fill_normal_bf16<<<512, 256>>>(g, tok, 4, 1.f);
    fill_normal_bf16<<<512, 256>>>(beta, size_t(N) * T * H, 5, 1.f);
    fill_state<<<1024, 256>>>(pool, state);
    if (!ok(cudaMemset(A_log, 0, H * 4)) || !ok(cudaMemset(dt_bias, 0, H * D * 4))) return false;
    std::vector<int32_t> perm(slots);
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffled) std::shuffle(perm.begin(), perm.end(), std::mt19937(0));
    if (!ok(cudaMemcpy(idx, perm.data(), N * 4, cudaMemcpyHostToDevice))) return false;

    set_benchmark_tokens(p, N, T, H, q, k, v, g, beta, o, A_log, dt_bias);
    p.state_in = pool; p.state_out = pool; p.slot_indices = idx; p.idx_row_stride = 1; p.num_slots = slots;
    p.state_in_dtype = p.state_out_dtype = sizeof(StateT) == 4 ? flashkda::DType::kFloat32 : flashkda::DType::kBFloat16;
    p.idx_type = flashkda::IndexType::kInt32;
    return ok(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
  }

  // Bytes a step must move: the state read and written once, the token tensors, beta.
  double floor_bytes() const { return 2.0 * N * H * D * D * sizeof(StateT) + double(tok) * 2 * 5 + double(N) * T * H * 2; }
};

// Copy bandwidth (read + write, bytes/s) of cudaMemcpy on 2 GiB, for the floors.
inline double copy_bandwidth() {
  const size_t bytes = size_t(1) << 31;
  void *x = nullptr, *y = nullptr;
  if (cudaMalloc(&x, bytes) != cudaSuccess || cudaMalloc(&y, bytes) != cudaSuccess) return 0.0;
  const float ms = median_ms([&] { cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice); }, 10);
  cudaFree(x);
  cudaFree(y);
  return 2.0 * bytes / (ms * 1e-3);
}
