// chunk_prepare for the lower-bound gate on a 16-bit per-channel g (chunk_prepare.cuh, PrepareGate).
#include "flashkda/prefill/chunk_prepare.cuh"

template cudaError_t
flashkda::chunk::launch_prepare<__half, flashkda::chunk::PrepareGate::kLowerBound16>(const flashkda::ChunkParams&,
                                                                                        cudaStream_t);
