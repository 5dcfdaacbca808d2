// The chunked backward's gradients pass in value halves (blocks of 153 KB: sm_80), for a gate per
// key channel (one instantiation).
#include "flashkda/api.h"
#include "flashkda/backward/chunk_local_grad_split.cuh"

template cudaError_t flashkda::run_chunk_local_grad_split<false>(const flashkda::ChunkBwdParams&, cudaStream_t);
int flashkda::chunk_local_grad_split_smem_bytes() { return flashkda::chunk_bwd::kSplitSmemBytes; }
