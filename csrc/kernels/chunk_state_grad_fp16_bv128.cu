// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/backward/chunk_state_grad.cuh"

template cudaError_t flashkda::run_chunk_state_grad<__half, 128>(const flashkda::ChunkParams&, cudaStream_t);
