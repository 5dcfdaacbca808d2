// The persistent decode kernels (decode_stream.cuh for an fp32 pool, decode_stream_tc.cuh for a bf16
// one) on bench/test_decode.py's case, fed the benchmark's shuffled slot indices and the same indices
// sorted: how much the place of the slots in the pool costs, and what the kernels' own slot order
// (slot_order.cuh) recovers. Prints, per pool dtype and N, three rounds of median ms of each, and a
// hash of the output and pool after one step from the same start (run twice: a step must be
// deterministic; compare two builds' hashes: any slot order gives the same bits). With `order` as
// argument it instead checks the sort itself in 264 blocks of 256 and 128 threads: every block a
// permutation of the sequences, all blocks the same order, sorted by slot (ranges wider than one
// slot are in index order inside, counted as "out of order"), crowded ranges refused.
//   nvcc -std=c++17 -O3 -Icsrc -Ibench/harness -gencode arch=compute_90a,code=sm_90a \
//        --expt-relaxed-constexpr bench/harness/slot_order_probe.cu -o sop && ./sop [order]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "decode_case.cuh"
#include "flashkda/decode_stream.cuh"
#include "flashkda/decode_stream_tc.cuh"
#include "flashkda/slot_order.cuh"

// A hash of `bytes` bytes of device memory (read back to the host).
inline bool hash_device(const void* ptr, size_t bytes, uint64_t& h) {
  std::vector<unsigned char> host(bytes);
  if (cudaMemcpy(host.data(), ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, host.data() + i, 8);
    h = h * 1000003u + w;
  }
  return true;
}

template <typename StateT>
int time_case(int N) {
  using bf16 = __nv_bfloat16;
  DecodeCase<StateT> c;
  if (!c.init(N, true)) return 1;
  std::vector<int32_t> shuffled(N), sorted;
  CHECK(cudaMemcpy(shuffled.data(), c.idx, N * 4, cudaMemcpyDeviceToHost));
  sorted = shuffled;
  std::sort(sorted.begin(), sorted.end());
  bool launched = false;
  auto launch = [&] {
    if constexpr (sizeof(StateT) == 4) flashkda::decode_stream::run<bf16, 1>(c.p, 0, launched);
    else flashkda::decode_stream_tc::run<bf16>(c.p, 0, launched);
  };
  StateT* pool0 = nullptr;
  CHECK(cudaMalloc(&pool0, c.state * sizeof(StateT)));
  CHECK(cudaMemcpy(pool0, c.pool, c.state * sizeof(StateT), cudaMemcpyDeviceToDevice));
  uint64_t hash[2] = {0, 0};
  for (uint64_t& h : hash) {
    CHECK(cudaMemcpy(c.pool, pool0, c.state * sizeof(StateT), cudaMemcpyDeviceToDevice));
    CHECK(cudaMemset(c.o, 0xff, c.tok * 2));
    launch();
    CHECK(cudaDeviceSynchronize());
    if (!hash_device(c.o, c.tok * 2, h) || !hash_device(c.pool, c.state * sizeof(StateT), h)) return 1;
  }
  CHECK(cudaFree(pool0));
  float t[2][3];
  for (int r = 0; r < 3; ++r)
    for (int s = 0; s < 2; ++s) {
      CHECK(cudaMemcpy(c.idx, (s ? sorted : shuffled).data(), N * 4, cudaMemcpyHostToDevice));
      t[s][r] = median_ms(launch, 60);
      CHECK(cudaGetLastError());
    }
  std::printf("%s pool N=%4d: shuffled %.4f %.4f %.4f | sorted %.4f %.4f %.4f ms | launched %d | hash %016llx %016llx\n",
              sizeof(StateT) == 4 ? "fp32" : "bf16", N, t[0][0], t[0][1], t[0][2], t[1][0], t[1][1], t[1][2], int(launched),
              static_cast<unsigned long long>(hash[0]), static_cast<unsigned long long>(hash[1]));
  return 0;
}

constexpr int kBlocks = 264;

template <int kThreads>
__global__ void sort_slots(const flashkda::RecurrentParams p, int first, uint16_t* order, int* sorted) {
  namespace r = flashkda::recurrent;
  __shared__ r::SlotOrder o;
  const r::SlotsOfThread<kThreads> s = r::begin_slot_order<kThreads>(p, first, o);
  const bool done = r::finish_slot_order<kThreads>(p, first, r::settle_slot_order<kThreads>(p, first, s, o), o);
  if (threadIdx.x == 0) sorted[blockIdx.x] = done;
  if (done)
    for (int i = threadIdx.x; i < p.N - first; i += kThreads) order[blockIdx.x * r::kMaxOrderedSeqs + i] = o.seq[i];
}

// Slot indices: 0 shuffled, 1 every 7th padding, 2 three sequences per slot, 3 all one slot.
template <int kThreads>
int check_order(int N, int first, int mode) {
  constexpr int M = flashkda::recurrent::kMaxOrderedSeqs;
  DecodeCase<float> c;
  if (!c.init(N, true)) return 1;
  std::vector<int32_t> idx(N);
  CHECK(cudaMemcpy(idx.data(), c.idx, N * 4, cudaMemcpyDeviceToHost));
  for (int n = 0; n < N; ++n) {
    if (mode == 1 && n % 7 == 3) idx[n] = -1;
    if (mode == 2) idx[n] = n / 3 * 3;
    if (mode == 3) idx[n] = 5;
  }
  CHECK(cudaMemcpy(c.idx, idx.data(), N * 4, cudaMemcpyHostToDevice));
  uint16_t* order = nullptr;
  int* sorted = nullptr;
  CHECK(cudaMalloc(&order, kBlocks * M * 2));
  CHECK(cudaMalloc(&sorted, kBlocks * 4));
  sort_slots<kThreads><<<kBlocks, kThreads>>>(c.p, first, order, sorted);
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> h(kBlocks * M);
  std::vector<int> hs(kBlocks);
  CHECK(cudaMemcpy(h.data(), order, h.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hs.data(), sorted, kBlocks * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(order));
  CHECK(cudaFree(sorted));
  auto key = [&](int n) { return std::max(idx[n], -1); };
  int blocks = 0, not_permutation = 0, differ = 0, out_of_order = 0;
  for (int b = 0; b < kBlocks; ++b) {
    if (!hs[b]) continue;
    ++blocks;
    std::vector<int> seen(N, 0);
    for (int i = 0; i < N - first; ++i) {
      const int n = h[b * M + i];
      if (n < first || n >= N || seen[n]++) ++not_permutation;
      if (n != h[i]) ++differ;
      const int m = i > 0 ? h[b * M + i - 1] : -1;
      if (i > 0 && (key(m) > key(n) || (key(m) == key(n) && m > n))) ++out_of_order;
    }
  }
  std::printf("sort, %d threads, N=%4d, first %d, indices %d: sorted in %d blocks; not a permutation %d, differ "
              "from block 0 %d, out of order %d\n",
              kThreads, N, first, mode, blocks, not_permutation, differ, out_of_order);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "order") == 0) {
    for (int n : {64, 256, 1000, 1024})
      for (int first : {0, 5})
        for (int mode : {0, 1, 2, 3})
          if (check_order<256>(n, first, mode) || check_order<128>(n, first, mode)) return 1;
    return 0;
  }
  for (int n : {16, 64, 256, 1024})
    if (time_case<float>(n)) return 1;
  for (int n : {16, 64, 256, 1024})
    if (time_case<__nv_bfloat16>(n)) return 1;
  return 0;
}
