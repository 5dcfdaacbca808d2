// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/prefill/chunk_recurrence.cuh"

template cudaError_t flashkda::run_chunk_recurrence<__nv_bfloat16, 64>(const flashkda::ChunkParams&, cudaStream_t);
