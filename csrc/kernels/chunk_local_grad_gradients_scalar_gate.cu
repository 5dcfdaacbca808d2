// The chunked backward's per-chunk pass that writes the tokens' gradients, for a scalar gate (GDN):
// one log decay per token and head (one instantiation).
#include "flashkda/api.h"
#include "flashkda/backward/chunk_local_grad.cuh"

template cudaError_t flashkda::run_chunk_local_grad<flashkda::chunk_bwd::Pass::kGradients, true>(
    const flashkda::ChunkBwdParams&, cudaStream_t);
