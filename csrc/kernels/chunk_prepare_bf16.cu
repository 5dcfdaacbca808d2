// One kernel per translation unit so that the build runs in parallel: the generic gate here, the
// lower-bound gate in chunk_prepare_bf16_lower_bound.cu.
#include "flashkda/prefill/chunk_prepare.cuh"

extern template cudaError_t
flashkda::chunk::launch_prepare<__nv_bfloat16, flashkda::chunk::PrepareGate::kLowerBound16>(const flashkda::ChunkParams&,
                                                                                        cudaStream_t);
template cudaError_t flashkda::run_chunk_prepare<__nv_bfloat16>(const flashkda::ChunkParams&, cudaStream_t);
