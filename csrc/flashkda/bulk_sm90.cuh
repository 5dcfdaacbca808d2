// sm_90 bulk asynchronous copies (global <-> shared through the copy engine, no tensor map) and
// the mbarriers that count their bytes; shared by chunk_recurrence and the decode kernel. Defined
// only when compiling for sm_90 or later (FLASHKDA_BULK_COPY): callers guard their use and keep
// an sm_80 path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mma_sm80.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASHKDA_BULK_COPY 1

namespace flashkda {
namespace sm90 {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(sm80::smem_u32(bar)), "r"(arrivals) : "memory");
}

// Makes initialised mbarriers visible to the copy engine (before the block-wide barrier that
// publishes them to the other threads).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(sm80::smem_u32(bar)) : "memory");
}

// One arrival that also announces `bytes` of transactions still to complete on this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(sm80::smem_u32(bar)), "r"(bytes)
               : "memory");
}

// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(sm80::smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

// An L2 policy for data read or written once (streamed state): it does not displace what is reused.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Global -> shared. bytes: a multiple of 16; both addresses 16-byte aligned. Completion is
// counted on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   sm80::smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(sm80::smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                                    uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
          "r"(sm80::smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(sm80::smem_u32(bar)), "l"(policy)
      : "memory");
}

// Shared -> global, in this thread's current bulk group (bulk_commit, bulk_wait_*).
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, uint32_t bytes, uint64_t policy) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;\n" ::"l"(dst),
               "r"(sm80::smem_u32(src)), "r"(bytes), "l"(policy)
               : "memory");
}

// Shared -> global without a cache hint (data that a later kernel reads soon).
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(sm80::smem_u32(src)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Until at most N of this thread's bulk groups are still reading shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// Until all of this thread's bulk groups have completed.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later bulk copies read them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace sm90
}  // namespace flashkda
#endif
