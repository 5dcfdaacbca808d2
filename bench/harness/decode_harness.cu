// Standalone timing of the sm_90 decode kernel (decode_bulk.cuh) for one tuning, and of the
// persistent streaming kernel for the same state type (decode_stream.cuh for an fp32 state,
// decode_stream_tc.cuh for a bf16 one, which takes one token per sequence), without PyTorch:
// bench/test_decode.py's case (H = 32, K = V = 128, bf16 tokens, V-first pool of N + 8 slots with
// shuffled int32 slot indices, lower-bound gate with A_log / dt_bias, l2norm, beta sigmoid), fp32 or
// bf16 pool, T tokens per sequence (argv[2], default 1). Prints the median kernel time of
// back-to-back launches and the fraction of the floor (state read and written once plus the token
// tensors, at the measured copy bandwidth), and how far the streaming kernel's output and state are from
// decode_bulk's after one step from the same pool. argv[3]: see the grid sweep at the end.
//   nvcc -std=c++17 -O3 -Icsrc -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -DCONSUMER_WARPS=4 -DITEM_ROWS=32 -DBLOCKS_PER_SM=2 -DSTATE=float bench/harness/decode_harness.cu \
//        -o dh && ./dh 1024 [T]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "decode_case.cuh"
#include "flashkda/decode/decode_bulk.cuh"
#include "flashkda/decode/decode_stream.cuh"
#include "flashkda/decode/decode_stream_tc.cuh"

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

int main(int argc, char** argv) {
  // argv: N [T tokens per sequence [block counts for the grid sweep]]
  DecodeCase<StateT> c;
  if (!c.init(argc > 1 ? std::atoi(argv[1]) : 1024, true, argc > 2 ? std::atoi(argv[2]) : 1)) return 1;
  const int N = c.N;
  flashkda::RecurrentParams& p = c.p;
  const double bw = copy_bandwidth();
  using bf16 = __nv_bfloat16;

  // One step of each kernel from the same pool: outputs and updated states must agree.
  StateT *pool0 = nullptr, *pool_bulk = nullptr;
  bf16* o_bulk = nullptr;
  CHECK(cudaMalloc(&pool0, c.state * sizeof(StateT)));
  CHECK(cudaMalloc(&pool_bulk, c.state * sizeof(StateT)));
  CHECK(cudaMalloc(&o_bulk, c.tok * 2));
  CHECK(cudaMemcpy(pool0, c.pool, c.state * sizeof(StateT), cudaMemcpyDeviceToDevice));
  bool launched = false;
  CHECK((flashkda::run_decode_bulk_tuned<bf16, StateT, Tune>(p, 0, launched)));
  CHECK(cudaDeviceSynchronize());
  if (!launched) {
    std::printf("tuning not launched (no sm_90 image or case not covered)\n");
    return 1;
  }
  CHECK(cudaMemcpy(pool_bulk, c.pool, c.state * sizeof(StateT), cudaMemcpyDeviceToDevice));
  CHECK(cudaMemcpy(o_bulk, c.o, c.tok * 2, cudaMemcpyDeviceToDevice));
  CHECK(cudaMemcpy(c.pool, pool0, c.state * sizeof(StateT), cudaMemcpyDeviceToDevice));
  // The streaming kernel of this state type: decode_stream with L2 prefetch distance kVariant
  // (fp32), decode_stream_tc (bf16; every variant the library's).
  auto run_stream = [&](auto variant, bool& launched_) {
    constexpr int kVariant = decltype(variant)::value;
    if constexpr (sizeof(StateT) == 4) return flashkda::decode_stream::run<bf16, kVariant>(p, 0, launched_);
    else return flashkda::decode_stream_tc::run<bf16>(p, 0, launched_);
  };
  using P0 = std::integral_constant<int, 0>;
  using P1 = std::integral_constant<int, 1>;
  using P2 = std::integral_constant<int, 2>;
  bool stream_launched = false;
  CHECK(run_stream(P0{}, stream_launched));
  CHECK(cudaDeviceSynchronize());
  const double o_diff = rel_diff(o_bulk, c.o, c.tok), s_diff = rel_diff(pool_bulk, c.pool, c.state);

  const float ms = median_ms([&] { flashkda::run_decode_bulk_tuned<bf16, StateT, Tune>(p, 0, launched); }, 50);
  CHECK(cudaGetLastError());
  float ms_stream = 0.f, ms_prefetch[3] = {0.f, 0.f, 0.f};
  if (stream_launched) {
    ms_stream = median_ms([&] { run_stream(P0{}, stream_launched); }, 50);
    ms_prefetch[0] = median_ms([&] { run_stream(P1{}, stream_launched); }, 50);
    if constexpr (sizeof(StateT) == 4) {
      ms_prefetch[1] = median_ms([&] { run_stream(P2{}, stream_launched); }, 50);
      ms_prefetch[2] = median_ms([&] { run_stream(std::integral_constant<int, 3>{}, stream_launched); }, 50);
    } else {  // more rounds
      ms_prefetch[1] = median_ms([&] { run_stream(P0{}, stream_launched); }, 50);
      ms_prefetch[2] = median_ms([&] { run_stream(P0{}, stream_launched); }, 50);
    }
    CHECK(cudaGetLastError());
  }
  const double floor_ms = c.floor_bytes() / bw * 1e3;
  using S = flashkda::decode_bulk::Shape<bf16, StateT, Tune>;
  std::printf("state %-5s tuning (consumers %d, rows %2d, blocks/SM %d, stages %d) N=%4d T=%d: %.4f ms, floor %.4f ms "
              "(%.0f%%), copy %.2f TB/s\n",
              sizeof(StateT) == 4 ? "fp32" : "bf16", Tune::kConsumerWarps, Tune::kItemRows, Tune::kBlocksPerSm,
              S::kStages, N, c.T, ms, floor_ms, 100.0 * floor_ms / ms, bw / 1e12);
  if (stream_launched && sizeof(StateT) == 4)
    std::printf("state fp32  decode_stream    N=%4d T=%d: %.4f ms (%.0f%% of the floor); L2 prefetch 1 / 2 ahead %.4f / %.4f ms, "
                "1 ahead evict-last %.4f ms | vs bulk: rel diff o %.1e, state %.1e\n",
                N, c.T, ms_stream, 100.0 * floor_ms / ms_stream, ms_prefetch[0], ms_prefetch[1], ms_prefetch[2], o_diff, s_diff);
  if (stream_launched && sizeof(StateT) == 2)
    std::printf("state bf16  decode_stream_tc N=%4d T=%d: %.4f / %.4f / %.4f / %.4f ms (four rounds; %.0f%% of the floor) "
                "| vs bulk: rel diff o %.1e, state %.1e\n",
                N, c.T, ms_stream, ms_prefetch[0], ms_prefetch[1], ms_prefetch[2], 100.0 * floor_ms / ms_prefetch[2], o_diff,
                s_diff);
  // argv[3] (optional): comma-separated block counts for the streaming kernel as the library runs it
  // (bf16: with 4-item units, which the library takes only below 4 grid rounds of them),
  // e.g. 264,256,248: whether a grid whose warps divide the work units evenly (no partial last round)
  // is faster.
  if (argc > 3 && stream_launched) {
    constexpr bool kFp32 = sizeof(StateT) == 4;
    namespace tc = flashkda::decode_stream_tc;
    const int tc_unit = tc::items_per_unit(p);  // the library's choice
    const uint32_t units = kFp32 ? uint32_t(int64_t(N) * p.HV * flashkda::decode_stream::kBlocksV)
                                 : uint32_t(int64_t(N) * p.HV * (tc::kBlocksV / tc_unit));
    const int warps = kFp32 ? flashkda::decode_stream::kWarps : flashkda::decode_stream_tc::kWarps;
    for (const char* s = argv[3]; *s;) {
      char* end = nullptr;
      const unsigned grid = unsigned(std::strtoul(s, &end, 10));
      if (end == s || grid == 0) break;
      s = *end == ',' ? end + 1 : end;
      const float t = median_ms([&] {
        if constexpr (kFp32)
          flashkda::decode_stream::decode_step_stream<bf16, 1><<<grid, warps * 32>>>(p, units);
        else if (tc_unit == tc::kLargeUnit)
          tc::decode_step_stream_tc<bf16, false, tc::kLargeUnit><<<grid, warps * 32>>>(p, units);
        else
          tc::decode_step_stream_tc<bf16, false, tc::kSmallUnit><<<grid, warps * 32>>>(p, units);
      }, 100);
      CHECK(cudaGetLastError());
      std::printf("  grid %4u blocks (%.2f rounds of work units): %.4f ms\n", grid, double(units) / (grid * warps), t);
    }
  }
  if constexpr (sizeof(StateT) == 2) {  // the 32-bit tile stores of the sm_80 image, on this device, checked
    namespace tc = flashkda::decode_stream_tc;
    bool la = false;
    CHECK(cudaMemcpy(c.pool, pool0, c.state * sizeof(StateT), cudaMemcpyDeviceToDevice));
    CHECK((tc::run<bf16, true>(p, 0, la)));
    CHECK(cudaDeviceSynchronize());
    const double od = rel_diff(o_bulk, c.o, c.tok), sd = rel_diff(pool_bulk, c.pool, c.state);
    const float tw = median_ms([&] { tc::run<bf16, true>(p, 0, la); }, 100);
    CHECK(cudaGetLastError());
    std::printf("state bf16  decode_stream_tc N=%4d, 32-bit tile stores: %.4f ms | vs bulk: rel diff o %.1e, state %.1e\n", N,
                tw, od, sd);
  }
  return 0;
}
