// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/chunk_prepare.cuh"

template cudaError_t flashkda::run_chunk_prepare<__nv_bfloat16>(const flashkda::ChunkParams&, cudaStream_t);
