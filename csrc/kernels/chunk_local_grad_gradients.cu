// The chunked backward's per-chunk pass that writes the tokens' gradients, for a gate per key channel
// (one instantiation).
#include "flashkda/api.h"
#include "flashkda/backward/chunk_local_grad.cuh"

template cudaError_t flashkda::run_chunk_local_grad<flashkda::chunk_bwd::Pass::kGradients, false>(
    const flashkda::ChunkBwdParams&, cudaStream_t);
