// Which kernel runs a token-by-token call (decode, speculative verification, short prefill), and
// why: one pure function of the call's facts, so that a reader sees the whole rule in one place and
// a test (tests/cpp/decode_select.cpp, no GPU needed) can check it. recurrent_kernel.cuh gathers the
// facts (api.h's decode_*_serves: the kernels' covers() and the device's answers) and launches the
// choice.
#pragma once

namespace flashkda {

enum class DecodeKernel : int {
  kStreamTc = 0,  // decode_stream_tc.cuh: bf16 V-first pools, one token per sequence
  kStream = 1,    // decode_stream.cuh: fp32 V-first pools
  kBulk = 2,      // decode_bulk.cuh: sm_90 bulk copies, V-first pools either dtype
  kVFirst = 3,    // recurrent_kernel.cuh, decode_step_vfirst: every V-first case
  kKFirst = 4,    // recurrent_kernel.cuh, decode_step_kfirst: every K-first case
};

// What the choice depends on, gathered for one call.
struct DecodeFacts {
  bool v_first;              // state layout [.., V, K]
  bool persistent_head_dim;  // K == V == kDecodeBulkHeadDim (the persistent kernels' head dim)
  bool sm80_family;          // the sm_80 kernel family is forced (set_kernel_family / FLASHKDA_KERNEL_FAMILY)
  bool bf16_state;           // the pool's dtype (else fp32)
  bool stream_serves;        // the streaming kernel of that dtype covers the call and is resident here
  bool bulk_serves;          // decode_bulk covers the call and this device runs its sm_90 image
};

struct DecodeChoice {
  DecodeKernel kernel;
  const char* why;
};

// The streaming kernels first (they keep the state in registers and run on every sm_80+ GPU), then
// the sm_90 bulk kernel for what they do not cover, then the general kernels.
constexpr DecodeChoice select_decode_kernel(const DecodeFacts& f) {
  if (!f.v_first) return {DecodeKernel::kKFirst, "K-first state: the general K-first kernel"};
  if (!f.persistent_head_dim) return {DecodeKernel::kVFirst, "head dim other than the persistent kernels'"};
  if (f.sm80_family) return {DecodeKernel::kVFirst, "the sm_80 kernel family is forced"};
  if (f.stream_serves)
    return f.bf16_state ? DecodeChoice{DecodeKernel::kStreamTc, "bf16 pool, one token per sequence: streamed"}
                        : DecodeChoice{DecodeKernel::kStream, "fp32 pool: streamed"};
  if (f.bulk_serves)
    return {DecodeKernel::kBulk, "not covered by the streaming kernel; the sm_90 bulk kernel covers it"};
  return {DecodeKernel::kVFirst, "not covered by the persistent kernels (tokens per sequence, slots, alignment)"};
}

constexpr const char* decode_kernel_name(DecodeKernel k) {
  switch (k) {
    case DecodeKernel::kStreamTc: return "decode_step_stream_tc";
    case DecodeKernel::kStream: return "decode_step_stream";
    case DecodeKernel::kBulk: return "decode_step_bulk";
    case DecodeKernel::kVFirst: return "decode_step_vfirst";
    case DecodeKernel::kKFirst: return "decode_step_kfirst";
  }
  return "unknown";
}

}  // namespace flashkda
