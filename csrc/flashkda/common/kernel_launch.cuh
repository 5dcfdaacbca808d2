// Launch helpers shared by the kernel families (framework-free): whether a kernel's image on this
// device holds its sm_90 code, and programmatic dependent launch (sm_90). A kernel launched with
// programmatic stream serialization (launch_overlapped) is set up while the kernel before it in the
// stream drains. It calls wait_prior_grid() before it writes global memory and before it reads
// anything the kernel before it writes: the wait returns once every earlier grid has completed and
// its writes are visible, so nothing it reads can be stale and nothing it writes can race a reader,
// whatever ran before it. allow_next_grid() lets the next grid be scheduled (as SMs free up) before
// this one ends. A kernel that calls allow_next_grid() only after its own wait_prior_grid() lets
// the next grid read, before its wait, what the grids before this one wrote: they have completed
// by the time any of its blocks runs (chunk_recurrence reads the initial state so). Without the
// launch attribute, or below sm_90, both are no-ops.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashkda {

__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether this device runs sm_90 code of `kernel`: SASS for sm_90 or later, compiled from sm_90 or
// later PTX. (A build with only compute_80 PTX runs on an H100 through the JIT: its SASS is sm_90,
// its code that of __CUDA_ARCH__ 800, without the sm_90 paths and without the grid wait.)
template <typename Kernel>
bool has_sm90_image(Kernel kernel) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `overlapped` (only for kernels that call wait_prior_grid() as above, and only for sm_90 images).
template <typename... Params, typename... Args>
cudaError_t launch_overlapped(bool overlapped, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = overlapped ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashkda
