// sm_90 bulk asynchronous copies (global <-> shared through the copy engine, no tensor map) and
// the mbarriers that count their bytes; shared by chunk_recurrence and the decode kernel. Defined
// only when compiling for sm_90 or later (FLASHKDA_BULK_COPY): callers guard their use and keep
// an sm_80 path. CuTe's bulk-copy atoms and CUTLASS's barriers where their instruction is the one
// needed (the kernels compile to the same machine code); inline PTX where the library form lacks
// what these kernels rely on: a memory clobber (the kernels read landed bytes and write bytes for
// the copy engine with ordinary loads and stores, which must not move across the wait, the arrive
// or the proxy fence), or a cache hint (CuTe's bulk copies take none; createpolicy has no wrapper).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "flashkda/common/mma_sm80.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASHKDA_BULK_COPY 1

namespace flashkda {
namespace sm90 {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  cutlass::arch::ClusterBarrier::init(bar, arrivals);
}

// Makes initialised mbarriers visible to the copy engine (before the block-wide barrier that
// publishes them to the other threads).
__device__ __forceinline__ void fence_mbarrier_init() { cutlass::arch::fence_barrier_init(); }

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(sm80::smem_u32(bar)) : "memory");
}

// One arrival that also announces `bytes` of transactions still to complete on this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, bytes);
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
  cute::SM90_BULK_COPY_G2S::copy(src, bar, dst, int32_t(bytes));
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
  cute::SM90_BULK_COPY_S2G::copy(src, dst, int32_t(bytes));
}

__device__ __forceinline__ void bulk_commit() { cute::tma_store_arrive(); }

// Until at most N of this thread's bulk groups are still reading shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  cute::tma_store_wait<N>();
}

// Until all of this thread's bulk groups have completed.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads of them
// (bulk copies, warpgroup MMAs).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace sm90
}  // namespace flashkda
#endif
