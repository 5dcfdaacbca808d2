// The chunked backward's per-chunk pass that writes the chunks' state maps (one instantiation).
#include "flashkda/api.h"
#include "flashkda/backward/chunk_local_grad.cuh"

template cudaError_t flashkda::run_chunk_local_grad<flashkda::chunk_bwd::Pass::kTransitions, false>(
    const flashkda::ChunkBwdParams&, cudaStream_t);

int flashkda::chunk_local_grad_smem_bytes() { return flashkda::chunk_bwd::SmemLayout::kBytes; }
