// The decode kernel selector (csrc/flashkda/decode/decode_select.h) on its own: host-only, no GPU.
// Built by CMake as flashkda_decode_select and run by CI; prints each case and exits 1 on a
// mismatch.
#include <cstdio>
#include <cstring>

#include "flashkda/decode/decode_select.h"

namespace {

using flashkda::DecodeFacts;
using flashkda::DecodeKernel;

struct Case {
  const char* name;
  DecodeFacts facts;  // v_first, persistent_head_dim, sm80_family, bf16_state, stream_serves, bulk_serves
  DecodeKernel want;
};

constexpr Case kCases[] = {
    {"K-first state", {false, true, false, false, true, true}, DecodeKernel::kKFirst},
    {"head dim 64", {true, false, false, false, false, false}, DecodeKernel::kVFirst},
    {"sm_80 family forced", {true, true, true, true, true, true}, DecodeKernel::kVFirst},
    {"fp32 pool, streamed", {true, true, false, false, true, true}, DecodeKernel::kStream},
    {"bf16 pool, one token, streamed", {true, true, false, true, true, true}, DecodeKernel::kStreamTc},
    {"bf16 pool, two tokens: bulk", {true, true, false, true, false, true}, DecodeKernel::kBulk},
    {"fp32 pool, no streaming residency: bulk", {true, true, false, false, false, true}, DecodeKernel::kBulk},
    {"long sequences: general", {true, true, false, false, false, false}, DecodeKernel::kVFirst},
};

// The selector is constexpr: the rule holds at compile time too.
static_assert(flashkda::select_decode_kernel(kCases[4].facts).kernel == DecodeKernel::kStreamTc, "bf16 one token");

}  // namespace

int main() {
  int failures = 0;
  for (const Case& c : kCases) {
    const flashkda::DecodeChoice got = flashkda::select_decode_kernel(c.facts);
    const bool ok = got.kernel == c.want && got.why != nullptr && std::strlen(got.why) > 0;
    std::printf("%-42s %-22s %s (%s)\n", c.name, flashkda::decode_kernel_name(got.kernel), ok ? "ok" : "MISMATCH",
                got.why);
    failures += !ok;
  }
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
