// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/chunk_prepare.cuh"

template cudaError_t flashkda::run_chunk_prepare<__half>(const flashkda::ChunkParams&, cudaStream_t);
